"""The `Sandbox` interface every agent process runs through, the unsandboxed backend, and how a setting picks one."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from .process import run_process


SNAPSHOT_FILE_LIMIT = 64 << 10  # bytes: larger files are listed with their size, not their text
SNAPSHOT_TOTAL_LIMIT = 1 << 20


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed command (`None`: no limit). Applied as rlimits to every process of the
    sandbox; `processes` also as a pids cgroup where one can be created (rlimits on processes are per user, and not
    enforced at all for root).

    Args:
        cpu_seconds: CPU time of each process, in seconds.
        memory_bytes: memory each process may allocate (`RLIMIT_DATA`: its heap and private writable mappings, not
            the address space it only reserves, which a JavaScript engine's WebAssembly needs by the gigabyte), in bytes.
        processes: processes (threads included) of the sandbox at once.
        file_size_bytes: size of any file a process writes, in bytes.
    """

    cpu_seconds: int | None = 3600
    memory_bytes: int | None = 16 << 30
    processes: int | None = 512
    file_size_bytes: int | None = 1 << 30


@dataclass
class SandboxResult:
    """What a command run in a sandbox did."""

    exit_code: int
    stdout: str
    stderr: str
    left_processes: bool = False  # something it started outlived it (and was killed)


class Sandbox(ABC):
    """Where one episode's agent runs: a private `workspace` (its files, the end state a checker reads) and `home`,
    commands run with a deadline, files read back, everything destroyed at the end.

    Backends: [`NoSandbox`] (the trainer's machine and user, unconfined), [`BwrapSandbox`] (Linux namespaces through
    bubblewrap), [`DockerSandbox`] (a container per episode). A remote backend (Modal, E2B, Daytona) implements the same
    five members over its SDK: create with files, `run`, `read_file`, `destroy`, and `endpoint_url`.

    Paths: `workspace` and `home` are the trainer's paths of the episode's directories; `inside(path)` is where the
    command sees one (the same path, but under a bubblewrap sandbox's `inside_root`).
    """

    kind: str = ""
    workspace: Path
    home: Path

    @abstractmethod
    def endpoint_url(self, url: str) -> str:
        """The base URL at which the command reaches the endpoint served at `url` on the trainer's side; calling it
        opens that way in (for the next `run`)."""

    @abstractmethod
    async def run(
        self,
        argv: Sequence[str],
        env: dict[str, str],
        *,
        cwd: str | Path | None = None,
        stdin: bytes | None = None,
        timeout: float | None = None,
        merge_stderr: bool = False,
    ) -> SandboxResult:
        """Run `argv` to its end (its whole process tree killed then, or when `timeout` passes or this is cancelled:
        `TimeoutError`)."""

    def read_file(self, path: str) -> bytes:
        """A file of the workspace (`path` relative to it), as it is now; never one outside it (a symlink out is
        refused)."""
        return self._resolve(path).read_bytes()

    def read_files(self) -> dict[str, Any]:
        """The workspace's files: `{relative path: text}` for small UTF-8 files, `{"size": n}` for the others."""
        return snapshot(self.workspace)

    def inside(self, path: str | Path) -> str:
        """Where the command sees `path` (a path under the episode's directories, or any text starting with one: the
        rest is kept); other text unchanged."""
        return str(path)

    @abstractmethod
    def destroy(self) -> None:
        """Kill what still runs and remove the sandbox's files."""

    def spec(self) -> dict[str, Any]:
        """What [`open_sandbox`] needs to run a checker's commands in this sandbox later (JSON)."""
        return {"kind": self.kind, "workspace": str(self.workspace)}

    def _resolve(self, path: str) -> Path:
        relative = PurePosixPath(path)
        if relative.is_absolute() or ".." in relative.parts:
            raise ValueError(f"{path!r} must be a relative path inside the workspace.")
        target = self.workspace.joinpath(*relative.parts)
        if not target.resolve().is_relative_to(self.workspace.resolve()):
            raise ValueError(f"{path!r} leads outside the workspace (a symlink).")
        return target

    def write_files(self, files: dict[str, str] | str | None) -> None:
        """Fill the workspace from `{relative path: text}` (or that as JSON)."""
        if files is None:
            return
        if isinstance(files, str):
            files = json.loads(files)
        for relative, text in files.items():
            path = PurePosixPath(relative)
            if path.is_absolute() or ".." in path.parts:
                raise ValueError(f"Workspace file {relative!r} must be a relative path inside the workspace.")
            target = self.workspace.joinpath(*path.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)


def snapshot(work: Path) -> dict[str, Any]:
    """The files under `work`: `{relative path: text}` for small UTF-8 files, `{"size": n}` for the others."""
    files: dict[str, Any] = {}
    total = 0
    for path in sorted(p for p in work.rglob("*") if p.is_file() and not p.is_symlink()):
        relative = path.relative_to(work).as_posix()
        size = path.stat().st_size
        if size <= SNAPSHOT_FILE_LIMIT and total + size <= SNAPSHOT_TOTAL_LIMIT:
            try:
                files[relative] = path.read_text(encoding="utf-8")
                total += size
                continue
            except UnicodeDecodeError:
                pass
        files[relative] = {"size": size}
    return files


class LocalDirectories:
    """A fresh `root/` with `work/` (the workspace) and `home/` under the system's temporary directory (`tmpdir`: the
    command's TMPDIR)."""

    tmpdir = "/tmp"

    def _make_directories(self, prefix: str, root: Path | None = None) -> None:
        self.root = root or Path(tempfile.mkdtemp(prefix=prefix))
        self.workspace, self.home = self.root / "work", self.root / "home"
        self.workspace.mkdir(exist_ok=True)
        self.home.mkdir(exist_ok=True)

    def _remove_directories(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


_warned_unsandboxed = False


class NoSandbox(LocalDirectories, Sandbox):
    """No isolation: the command runs as the trainer's user on the trainer's machine, in its own process group (killed
    at its end), with the environment it is given. It can read and write whatever the trainer can. An explicit opt-in
    (`sandbox="none"`), which warns once per process.
    """

    kind = "none"

    def __init__(self, prefix: str = "trl-agentic-", root: Path | None = None, warn: bool = True):
        global _warned_unsandboxed
        if warn and not _warned_unsandboxed:
            _warned_unsandboxed = True
            warnings.warn(
                "sandbox='none': agent commands run unsandboxed, as this user on this machine; they can read the "
                "trainer's files and secrets and reach the network. Use sandbox='bwrap' (Linux, bubblewrap) or "
                "sandbox='docker' to isolate them (docs/trust_model.md).",
                stacklevel=3,
            )
        self._make_directories(prefix, root)
        self.tmpdir = str(self.root)

    def endpoint_url(self, url: str) -> str:
        return url

    async def run(self, argv, env, *, cwd=None, stdin=None, timeout=None, merge_stderr=False) -> SandboxResult:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT if merge_stderr else asyncio.subprocess.PIPE,
            env=env,
            cwd=cwd if cwd is not None else self.workspace,
            start_new_session=True,  # own process group, so everything it started can be killed
        )
        code, out, err, held = await asyncio.wait_for(run_process(process, stdin), timeout)
        return SandboxResult(code, out, err, held)

    def destroy(self) -> None:
        self._remove_directories()

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "root": str(self.root)}
