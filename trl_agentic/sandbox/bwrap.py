"""The local sandbox: Linux namespaces through bubblewrap (`bwrap`), no daemon, no root.

Each command runs as `bwrap ... -- COMMAND` (with the endpoint and no `setns`: `bwrap ... -- python init.py PORT SOCKET
-- COMMAND`) with:
- the system's directories read-only (`/usr`, `/bin`, `/lib*`, a few files of `/etc`), the Python that runs `init.py`
  and the `binds` (the agent's program and interpreter) read-only at their own paths; nothing else of the host;
- the episode's `work/` (the workspace) and `home/` (its HOME) writable at their own paths, or at `inside_root/work`
  and `inside_root/home` (the same paths in every episode: a harness that writes its working directory or home into
  its prompt then sends the same prompt in each, which branching by replay needs), a private `/tmp`, its own `/proc`
  and `/dev`;
- its own PID namespace (its first process's exit, bwrap's or `init.py`'s, ends it: the kernel kills every process
  left, `setsid` and double-forked ones included; `--die-with-parent`: it also ends when the trainer does), IPC and UTS
  namespaces;
- its own network namespace, where loopback is the only interface and the endpoint's port the only one served: the
  trainer enters the namespace (`setns`, root or `CAP_SYS_ADMIN`: `netns.py`), listens on the port there before the
  command starts and connects each connection to the endpoint; where it may not, `init.py` starts first inside,
  listens there and forwards each connection through a Unix socket (bound read-only) to the trainer's side. No other
  address is reachable;
- rlimits (CPU time, data memory, file size) on every process; its processes counted, and their memory summed, by
  cgroups of its own where they can be made (`cgroups.py`: pids and memory; else `RLIMIT_NPROC`, per user, and
  `RLIMIT_DATA`, per process; `limited_by` says which held the last run).
"""

from __future__ import annotations

import asyncio
import functools
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .base import LocalDirectories, Sandbox, SandboxLimits, SandboxResult
from .binds import SYSTEM_DIRS, under
from .cgroups import EpisodeCgroups, cgroup_limits, make_cgroups, release
from .netns import Forwarder, listen_in_netns, read_child_pid, setns_unavailable
from .process import kill_group, run_process


# What programs need of /etc: users and groups (names, `~`), name resolution of localhost, the loader's cache, TLS
# roots, alternatives (`python3`, `editor`), the time zone. Not the rest (shadow, the host's ssh or cloud config).
ETC_FILES = (
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/hosts",
    "/etc/host.conf",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/pki",
    "/etc/alternatives",
    "/etc/localtime",
    "/etc/mime.types",
)
INIT_SCRIPT = Path(__file__).with_name("init.py")
INSIDE_CONTROL = "/run/trl-agentic"
INSIDE_SOCKETS = "/run/trl-agentic-endpoint"


@functools.cache
def bwrap_unavailable() -> str | None:
    """`None` when bubblewrap can make a sandbox here (tried once per process), else why not."""
    binary = shutil.which("bwrap")
    if binary is None:
        return "bubblewrap (`bwrap`) is not installed"
    probe = [binary, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc", "true"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"`bwrap` failed to start ({error})"
    if done.returncode != 0:
        return f"`bwrap` cannot create namespaces here (user namespaces refused?): {done.stderr.strip()[:300]}"
    return None


def _python_binds() -> list[str]:
    """What the running Python needs to run `init.py` inside (`python -I -S`: the standard library only)."""
    paths = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}
    return sorted(p for p in paths if not any(under(p, d) for d in SYSTEM_DIRS))


def _user_tasks() -> int:
    """Processes and threads of this user now (what `RLIMIT_NPROC` counts)."""
    uid, count = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                continue
    return count


def _limited(argv: list[str], limits: SandboxLimits, cgroups: EpisodeCgroups) -> tuple[list[str], Any]:
    """`argv` wrapped to join the episode's cgroups (`sh`: writes its pid, then `exec`s) and take the rlimits
    (`prlimit`, util-linux), inherited by every process of the sandbox; without `prlimit`, a function run between fork
    and exec (slower: a process started with one cannot be spawned with `vfork`). Returns `(argv, preexec_fn)`."""
    rlimits = {"cpu": limits.cpu_seconds, "data": limits.memory_bytes, "fsize": limits.file_size_bytes}
    if "pids" not in cgroups.bound and limits.processes is not None and os.getuid() != 0:  # root: exempt from NPROC
        rlimits["nproc"] = _user_tasks() + limits.processes
    rlimits = {name: value for name, value in rlimits.items() if value is not None}
    preexec = None
    prlimit = shutil.which("prlimit")
    if prlimit is not None and rlimits:
        argv = [prlimit, *(f"--{name}={value}" for name, value in rlimits.items()), "--", *argv]
    elif rlimits:
        resources = {"cpu": resource.RLIMIT_CPU, "data": resource.RLIMIT_DATA, "fsize": resource.RLIMIT_FSIZE}
        resources["nproc"] = resource.RLIMIT_NPROC
        pairs = [(resources[name], value) for name, value in rlimits.items()]

        def preexec() -> None:
            for which, value in pairs:
                resource.setrlimit(which, (value, value))

    if cgroups.groups:
        argv = ["/bin/sh", "-c", cgroups.join_command(), "sh", *argv]
    return argv, preexec


class BwrapSandbox(LocalDirectories, Sandbox):
    """A bubblewrap sandbox (see the module's docstring for what it isolates).

    Args:
        prefix: the name prefix of its directory under the system's temporary directory.
        binds: host paths the commands see read-only at the same path (a harness's install, an agent's script).
        limits: resource limits of each command.
        cgroups: `False`: no cgroups, the rlimits alone (per process), as where none can be made (tests compare).
        inside_root: where the command sees the episode's directory (`work/`, `home/` under it; default: its own
            path, a new one per episode), e.g. `"/tmp/trl-agentic-episode"`: a path under the private `/tmp` or
            another one the system directories do not hold.
        forwarder: how the endpoint reaches inside: `"setns"` (the trainer listens in the sandbox's network namespace:
            no process inside, ~40 ms less per episode; needs root or `CAP_SYS_ADMIN`), `"init"` (`init.py` inside,
            through a Unix socket: works unprivileged), `"auto"` (default: `"setns"` where it works here).
    """

    kind = "bwrap"
    FORWARDERS = ("auto", "setns", "init")

    def __init__(
        self,
        prefix: str = "trl-agentic-",
        binds: Sequence[str] = (),
        limits: SandboxLimits | None = None,
        root: Path | None = None,
        forwarder: str = "auto",
        cgroups: bool = True,
        inside_root: str | None = None,
    ):
        reason = bwrap_unavailable()
        if reason is not None:
            raise RuntimeError(f"sandbox='bwrap': {reason}.")
        if forwarder not in self.FORWARDERS:
            raise ValueError(f"forwarder={forwarder!r}: use one of {list(self.FORWARDERS)}.")
        if forwarder == "setns" and setns_unavailable() is not None:
            raise RuntimeError(f"forwarder='setns': {setns_unavailable()}; use forwarder='init' (or 'auto').")
        if forwarder == "auto":
            forwarder = "setns" if setns_unavailable() is None else "init"
        if inside_root is not None and (
            not inside_root.startswith("/") or any(under(inside_root, d) for d in SYSTEM_DIRS)
        ):
            raise ValueError(
                f"inside_root={inside_root!r}: an absolute path outside the system directories, e.g. under /tmp."
            )
        self.forwarder = forwarder
        self.cgroups = cgroups
        self.inside_root = inside_root
        self.limited_by: dict[str, str] = {}  # after a run: what held its processes and its memory (cgroup, rlimit)
        self.limits = limits or SandboxLimits()
        self.binds = tuple(str(Path(b).absolute()) for b in binds)
        self._make_directories(prefix, root)
        # init.py and the endpoint's socket, read-only inside (out of the agent's reach: a checker's run uses init.py)
        self.control = self.root / "control"
        self.control.mkdir(exist_ok=True)
        shutil.copyfile(INIT_SCRIPT, self.control / "init.py")
        self._target: tuple[str, int] | None = None
        self._port: int | None = None
        self._cgroups: list[Path] = []
        self._sockets: Path | None = None

    @staticmethod
    def unavailable() -> str | None:
        """`None` when bubblewrap can make a sandbox here, else why not."""
        return bwrap_unavailable()

    @classmethod
    def reopen(cls, spec: dict[str, Any]) -> BwrapSandbox:
        limits = SandboxLimits(**spec.get("limits", {}))
        return cls(
            binds=spec.get("binds", ()),
            limits=limits,
            root=Path(spec["root"]),
            cgroups=spec.get("cgroups", True),
            inside_root=spec.get("inside_root"),
        )

    def spec(self) -> dict[str, Any]:
        limits = dict(vars(self.limits))
        return {
            "kind": self.kind,
            "root": str(self.root),
            "binds": list(self.binds),
            "limits": limits,
            "cgroups": self.cgroups,
            **({"inside_root": self.inside_root} if self.inside_root is not None else {}),
        }

    def inside(self, path: str | Path) -> str:
        text, root = str(path), str(self.root)
        if self.inside_root is None or not (text == root or text.startswith(root + "/")):
            return text
        return self.inside_root + text[len(root) :]

    def endpoint_url(self, url: str) -> str:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        self._target, self._port = (parts.hostname or "127.0.0.1", port), port
        return urlunsplit((parts.scheme, f"127.0.0.1:{port}", parts.path, parts.query, parts.fragment))

    def command(
        self,
        argv: Sequence[str],
        cwd: str | Path | None = None,
        info_fd: int | None = None,
        block_fd: int | None = None,
    ) -> list[str]:
        """The `bwrap` command line that runs `argv` in this sandbox; with the endpoint forwarded by `setns`, the
        descriptors bubblewrap writes its child's pid to and waits on before it runs `argv`."""
        args = ["bwrap", "--die-with-parent", "--new-session"]
        args += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net", "--unshare-cgroup-try"]
        if os.getuid() != 0:
            args += ["--unshare-user"]
        for folder in SYSTEM_DIRS:
            if os.path.islink(folder):
                args += ["--symlink", os.readlink(folder), folder]
            elif os.path.isdir(folder):
                args += ["--ro-bind", folder, folder]
        for path in ETC_FILES:
            args += ["--ro-bind-try", path, path]
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        for path in sorted({*_python_binds(), *self.binds}, key=lambda p: p.count("/")):
            if not any(under(path, d) for d in SYSTEM_DIRS) and os.path.exists(path):
                args += ["--ro-bind", path, path]
        for folder in (self.workspace, self.home):
            args += ["--bind", str(folder), self.inside(folder)]
        args += ["--ro-bind", str(self.control), INSIDE_CONTROL]
        if self._sockets is not None:
            args += ["--ro-bind", str(self._sockets), INSIDE_SOCKETS]
        args += ["--chdir", self.inside(cwd if cwd is not None else self.workspace)]
        if self._target is None:  # no endpoint to forward: bwrap's own PID 1 ends the namespace with the command
            return [*args, "--", *argv]
        if self.forwarder == "setns":  # the trainer listens inside before bwrap runs `argv` (`run`)
            return [*args, "--info-fd", str(info_fd), "--block-fd", str(block_fd), "--", *argv]
        socket_path = f"{INSIDE_SOCKETS}/endpoint.sock"
        python = os.path.realpath(sys.executable)
        init = [python, "-I", "-S", f"{INSIDE_CONTROL}/init.py", str(self._port), socket_path, "--"]
        return [*args, "--", *init, *argv]

    async def run(self, argv, env, *, cwd=None, stdin=None, timeout=None, merge_stderr=False) -> SandboxResult:
        forwarder = Forwarder(self._target) if self._target is not None else None
        server, self._sockets, info, block = None, None, (None, None), (None, None)
        if forwarder is not None and self.forwarder == "init":
            # A folder of its own under /tmp: a Unix socket's path has at most 107 bytes, the episode's may be longer.
            self._sockets = Path(tempfile.mkdtemp(prefix="trl-agentic-", dir="/tmp" if os.path.isdir("/tmp") else None))
            server = await asyncio.start_unix_server(forwarder, path=str(self._sockets / "endpoint.sock"))
        elif forwarder is not None:
            info, block = os.pipe(), os.pipe()
        wanted = {"pids": self.limits.processes, "memory": self.limits.memory_bytes} if self.cgroups else {}
        cgroups = make_cgroups({name: limit for name, limit in wanted.items() if limit is not None})
        self._cgroups += cgroups.groups
        self.limited_by = {
            "processes": "cgroup" if "pids" in cgroups.bound else "rlimit" if os.getuid() != 0 else "none",
            "memory": "cgroup" if "memory" in cgroups.bound else "rlimit (per process)",
        }
        try:
            command, preexec = _limited(self.command(argv, cwd, info[1], block[0]), self.limits, cgroups)
            process = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT if merge_stderr else asyncio.subprocess.PIPE,
                env=env,
                start_new_session=True,
                preexec_fn=preexec,
                pass_fds=(info[1], block[0]) if block[0] is not None else (),
            )
            if block[0] is not None:  # the child's ends are the child's now; `_listen_inside` closes the others
                os.close(info[1])
                os.close(block[0])
                (info_read, _), (_, block_write), info, block = info, block, (None, None), (None, None)
                server = await self._listen_inside(process, forwarder, info_read, block_write)
            code, out, err, held = await asyncio.wait_for(run_process(process, stdin), timeout)
        finally:
            for fd in (*info, *block):
                if fd is not None:
                    os.close(fd)
            if server is not None:
                server.close()
            if forwarder is not None:
                await forwarder.close()
            if self._sockets is not None:
                shutil.rmtree(self._sockets, ignore_errors=True)
            self._release_cgroups()
        return SandboxResult(code, out, err, held)

    async def _listen_inside(self, process, forwarder: Forwarder, info_fd: int, block_fd: int) -> asyncio.Server:
        """Listen on the endpoint's port in the sandbox's network namespace (bubblewrap's child, blocked before it
        runs the command), then let the command go; closes both descriptors. On failure the sandbox is killed before
        it runs anything."""
        try:
            pid = await asyncio.to_thread(read_child_pid, info_fd)  # closes it
            server = await asyncio.start_server(forwarder, sock=listen_in_netns(pid, self._port))
        except BaseException:
            kill_group(process.pid)
            os.close(block_fd)
            await run_process(process)  # reaped, its pipes closed
            raise
        os.write(block_fd, b"1")
        os.close(block_fd)
        return server

    def _release_cgroups(self) -> None:
        for group in list(self._cgroups):
            try:
                release(group)  # nothing should be left in it: the PID namespace ended with the command
                self._cgroups.remove(group)
            except OSError:
                pass

    def destroy(self) -> None:
        self._release_cgroups()
        self._remove_directories()


def processes_limited() -> bool:
    """Whether `SandboxLimits.processes` binds here: a pids cgroup can be created, or this user is not root (root is
    exempt from `RLIMIT_NPROC`)."""
    return "pids" in cgroup_limits() or os.getuid() != 0
