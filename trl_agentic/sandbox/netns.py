"""The endpoint forwarded into a bubblewrap sandbox's network namespace from the trainer's side, with no process of
its own inside (the fast way in; `init.py` is the fallback).

bubblewrap is started with `--info-fd` (it writes its child's pid, the sandbox's first process) and `--block-fd` (the
child waits before it runs the command). A short-lived thread of the trainer enters the child's network namespace
(`setns`), makes a TCP socket listening on the endpoint's port there, and returns to its own namespace; the trainer's
event loop serves that socket, connecting each connection straight to the endpoint. Then the command is let go.

Entering a network namespace needs `CAP_SYS_ADMIN` over it: root (bubblewrap then makes no user namespace of its own)
can, an unprivileged user cannot (the sandbox's namespace belongs to bubblewrap's user namespace), and neither can a
container without that capability. [`setns_unavailable`] tries it once per process.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import json
import os
import shutil
import socket
import subprocess
import threading


CLONE_NEWNET = 0x40000000


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc().setns(fd, CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"setns into a network namespace: {os.strerror(error)}")


def listen_in_netns(pid: int, port: int) -> socket.socket:
    """A non-blocking TCP socket listening on `port` of every address of process `pid`'s network namespace (a
    sandbox's: loopback alone), made by a thread of its own that enters that namespace and leaves it again."""
    made: dict[str, object] = {}

    def work() -> None:
        listener = None
        try:
            original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
            try:
                target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
                try:
                    _setns(target)
                finally:
                    os.close(target)
                try:
                    # Every address, not 127.0.0.1: the sandbox's loopback may not be up yet (bubblewrap's child
                    # raises it while this runs); loopback is the namespace's only interface either way.
                    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    listener.bind(("0.0.0.0", port))
                    listener.listen(128)
                    listener.setblocking(False)
                finally:
                    _setns(original)  # should it fail, this thread ends here: nothing else runs in that namespace
            finally:
                os.close(original)
            made["listener"] = listener
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            if listener is not None:
                listener.close()
            made["error"] = error

    thread = threading.Thread(target=work, name="trl-agentic-netns", daemon=True)
    thread.start()
    thread.join()
    if "error" in made:
        raise made["error"]
    return made["listener"]


def read_child_pid(fd: int) -> int:
    """The `child-pid` of what bubblewrap writes to its `--info-fd` (read to its end, then closed)."""
    data = bytearray()
    try:
        while chunk := os.read(fd, 4096):
            data += chunk
    finally:
        os.close(fd)
    try:
        return int(json.loads(data)["child-pid"])
    except (ValueError, KeyError) as error:
        raise RuntimeError(f"bubblewrap wrote no child pid to its --info-fd ({bytes(data)[:200]!r})") from error


@functools.cache
def setns_unavailable() -> str | None:
    """`None` when this process can put a listening socket into a bubblewrap sandbox's network namespace (tried once
    per process, on a sandbox made the way [`BwrapSandbox`] makes them), else why not."""
    binary = shutil.which("bwrap")
    if binary is None:
        return "bubblewrap (`bwrap`) is not installed"
    info_read, info_write = os.pipe()
    block_read, block_write = os.pipe()
    argv = [binary, "--unshare-net", "--unshare-pid", "--die-with-parent"]
    argv += ["--unshare-user"] if os.getuid() != 0 else []
    argv += ["--info-fd", str(info_write), "--block-fd", str(block_read), "--ro-bind", "/", "/", "--proc", "/proc"]
    try:
        process = subprocess.Popen([*argv, "true"], pass_fds=(info_write, block_read), stderr=subprocess.PIPE)
    except OSError as error:
        for fd in (info_read, info_write, block_read, block_write):
            os.close(fd)
        return f"`bwrap` failed to start ({error})"
    os.close(info_write)
    os.close(block_read)
    try:
        listen_in_netns(read_child_pid(info_read), 0).close()
    except (OSError, RuntimeError) as error:
        return f"cannot enter the sandbox's network namespace ({error})"
    finally:
        os.close(block_write)
        process.communicate(timeout=30)
    return None


class Forwarder:
    """Connections from inside sandboxes carried to `target` (the endpoint), both ways; `close()` ends those still
    open (the command that made them has exited)."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.tasks: set[asyncio.Task] = set()

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.tasks.add(task)
        try:
            await forward_to(self.target, reader, writer)
        finally:
            self.tasks.discard(task)

    async def close(self) -> None:
        tasks = [task for task in self.tasks if not task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def forward_to(target: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Carry one connection from inside a sandbox to `target` (the endpoint), both ways."""
    try:
        upstream_reader, upstream_writer = await asyncio.open_connection(*target)
    except OSError:
        writer.close()
        return

    async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(1 << 16):
                sink.write(data)
                await sink.drain()
            if sink.can_write_eof():
                sink.write_eof()
        except (ConnectionError, OSError):
            pass

    try:
        await asyncio.gather(pump(reader, upstream_writer), pump(upstream_reader, writer))
    finally:
        writer.close()
        upstream_writer.close()
