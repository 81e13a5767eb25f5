"""Running one process tree and reading its output: shared by every sandbox backend (and through them by the command
agents and the harnesses). It imports nothing of the package."""

from __future__ import annotations

import asyncio
import os
import signal


STDOUT_LIMIT = 1 << 20  # bytes of stdout kept (the tail: a command agent's result is its last JSON line)
STDERR_LIMIT = 64 << 10
OUTPUT_GRACE_S = 0.5  # after the command exits, how long its pipes are read before what holds them is killed


async def run_process(process: asyncio.subprocess.Process, stdin: bytes | None = None) -> tuple[int, str, str, bool]:
    """Wait for a process started in its own session (`start_new_session=True`) and read its output:
    `(returncode, stdout tail, stderr tail, whether something it left running held its pipes)`. Its whole process
    group is killed when it exits, and when this is cancelled (the episode's timeout)."""
    stdout, stderr = bytearray(), bytearray()
    readers = [asyncio.ensure_future(_read_tail(process.stdout, stdout, STDOUT_LIMIT))]
    if process.stderr is not None:
        readers.append(asyncio.ensure_future(_read_tail(process.stderr, stderr, STDERR_LIMIT)))
    writers = [asyncio.ensure_future(_feed(process.stdin, stdin))] if process.stdin is not None and stdin else []
    try:
        # The command's own exit ends the episode, not the end of its output: a background child holding stdout
        # used to hide the result until the timeout (issue #9). What it printed before exiting is in the pipe.
        await _exited(process)
        _, held = await asyncio.wait(readers, timeout=OUTPUT_GRACE_S)
    finally:
        kill_group(process.pid)  # what it left running, or everything on a timeout
        for task_ in (*readers, *writers):
            task_.cancel()
        await _exited(process)
        # Its pipes closed now, on this loop: each agent's loop closes when its episode ends, and a transport left to
        # the garbage collector (it and its protocol hold each other) would close them on a closed loop.
        process._transport.close()
    return process.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace"), bool(held)


async def _exited(process: asyncio.subprocess.Process) -> int:
    # Not `process.wait()`: it also waits for the pipes to close, which a background child can hold open for ever.
    delay = 0.005
    while process.returncode is None:
        await asyncio.sleep(delay)
        delay = min(2 * delay, 0.05)
    return process.returncode


async def _read_tail(stream: asyncio.StreamReader, buffer: bytearray, limit: int) -> None:
    while chunk := await stream.read(1 << 16):
        buffer += chunk
        if len(buffer) > limit:
            del buffer[: len(buffer) - limit]


async def _feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    try:
        stream.write(data)
        await stream.drain()
        stream.close()
    except (BrokenPipeError, ConnectionResetError):  # the command does not read its stdin
        pass


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
