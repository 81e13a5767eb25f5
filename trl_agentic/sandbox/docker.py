"""The container backend: each command of an episode runs as a fresh container (the `docker` SDK,
`pip install 'trl-agentic[docker]'`), so that every process it started ends with it.

The episode's `work/` and `home/` are bind-mounted read-write at its own path (the daemon runs on this machine),
the `binds` read-only; the container has no network (`network_mode="none"`): `init.py` (the local sandbox's, run by the
image's `python3`) listens on 127.0.0.1 at the endpoint's port inside and forwards to a Unix socket mounted from the
trainer's side, which connects it to the endpoint. Limits: `mem_limit`, `pids_limit`, `ulimits` (CPU, file size). It
runs as the trainer's uid:gid (the workspace stays the trainer's to read and remove).

The image (`image=`, per task suite or per task) must have `python3` and what the agent needs; it is not pulled here.

Remote backends (Modal, E2B, Daytona) follow the same shape through their SDKs: create a sandbox with the workspace's
files, run a command with a timeout, read files back, terminate; the endpoint must then be reachable from their cloud
(a tunnel), which this project does not provide.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .base import LocalDirectories, Sandbox, SandboxLimits, SandboxResult
from .bwrap import INIT_SCRIPT, INSIDE_CONTROL, INSIDE_SOCKETS
from .netns import Forwarder


def docker_unavailable() -> str | None:
    """`None` when a Docker daemon answers through the `docker` SDK, else why not."""
    try:
        import docker
    except ImportError:
        return "the `docker` SDK is not installed (pip install 'trl-agentic[docker]')"
    try:
        docker.from_env().ping()
    except Exception as error:  # noqa: BLE001 - any failure to reach the daemon is the reason
        return f"no Docker daemon answers ({type(error).__name__}: {str(error)[:200]})"
    return None


class DockerSandbox(LocalDirectories, Sandbox):
    """A container per command over the episode's directory.

    Args:
        prefix: the name prefix of its directory under the system's temporary directory.
        binds: host paths mounted read-only at the same path.
        limits: resource limits of each command.
        image: the image the commands run in (needs `python3`).
    """

    kind = "docker"

    def __init__(
        self,
        prefix: str = "trl-agentic-",
        binds: Sequence[str] = (),
        limits: SandboxLimits | None = None,
        image: str | None = None,
    ):
        if not image:
            raise ValueError("sandbox='docker' needs an image (with python3): set the agent's sandbox_image=.")
        reason = docker_unavailable()
        if reason is not None:
            raise RuntimeError(f"sandbox='docker': {reason}.")
        import docker

        self.client = docker.from_env()
        self.image, self.binds, self.limits = image, tuple(binds), limits or SandboxLimits()
        self._make_directories(prefix)
        self.control = self.root / "control"  # init.py, the command's stdin
        self.control.mkdir()
        # The endpoint's socket: a folder of its own under /tmp (a Unix socket's path has at most 107 bytes).
        self.sockets = Path(tempfile.mkdtemp(prefix="trl-agentic-", dir="/tmp" if os.path.isdir("/tmp") else None))
        shutil.copyfile(INIT_SCRIPT, self.control / "init.py")
        self._target: tuple[str, int] | None = None
        self._port: int | None = None

    def endpoint_url(self, url: str) -> str:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        self._target, self._port = (parts.hostname or "127.0.0.1", port), port
        return urlunsplit((parts.scheme, f"127.0.0.1:{port}", parts.path, parts.query, parts.fragment))

    def _container_kwargs(self, argv: Sequence[str], env: dict[str, str], cwd: Any) -> dict[str, Any]:
        volumes = {str(f): {"bind": str(f), "mode": "rw"} for f in (self.workspace, self.home)}
        volumes[str(self.control)] = {"bind": INSIDE_CONTROL, "mode": "ro"}
        volumes[str(self.sockets)] = {"bind": INSIDE_SOCKETS, "mode": "ro"}
        volumes.update({b: {"bind": b, "mode": "ro"} for b in self.binds})
        port = str(self._port) if self._target is not None else "-"
        command = ["python3", "-I", "-S", f"{INSIDE_CONTROL}/init.py", port, f"{INSIDE_SOCKETS}/endpoint.sock", "--"]
        from docker.types import Ulimit

        ulimits = []
        if self.limits.cpu_seconds is not None:
            ulimits.append(Ulimit(name="cpu", soft=self.limits.cpu_seconds, hard=self.limits.cpu_seconds))
        if self.limits.file_size_bytes is not None:
            ulimits.append(Ulimit(name="fsize", soft=self.limits.file_size_bytes, hard=self.limits.file_size_bytes))
        return dict(
            image=self.image,
            command=[*command, *argv],
            environment=env,
            working_dir=str(cwd if cwd is not None else self.workspace),
            volumes=volumes,
            network_mode="none",
            user=f"{os.getuid()}:{os.getgid()}",
            mem_limit=self.limits.memory_bytes,
            pids_limit=self.limits.processes,
            ulimits=ulimits,
            detach=True,
        )

    async def run(self, argv, env, *, cwd=None, stdin=None, timeout=None, merge_stderr=False) -> SandboxResult:
        if stdin is not None:
            (self.control / "stdin").write_bytes(stdin)
            argv = ["sh", "-c", f'exec "$@" < {INSIDE_CONTROL}/stdin', "sh", *argv]
        server, forwarder = None, Forwarder(self._target) if self._target is not None else None
        if forwarder is not None:
            (self.sockets / "endpoint.sock").unlink(missing_ok=True)
            server = await asyncio.start_unix_server(forwarder, path=str(self.sockets / "endpoint.sock"))
        container = await asyncio.to_thread(self.client.containers.run, **self._container_kwargs(argv, env, cwd))
        try:
            status = await asyncio.wait_for(asyncio.to_thread(container.wait), timeout)
            stdout = await asyncio.to_thread(container.logs, stdout=True, stderr=merge_stderr)
            stderr = b"" if merge_stderr else await asyncio.to_thread(container.logs, stdout=False, stderr=True)
        finally:
            await asyncio.to_thread(container.remove, force=True)  # every process of the command with it
            if server is not None:
                server.close()
            if forwarder is not None:
                await forwarder.close()  # connections the command left open
        return SandboxResult(status["StatusCode"], stdout.decode(errors="replace"), stderr.decode(errors="replace"))

    def destroy(self) -> None:
        self._remove_directories()
        shutil.rmtree(self.sockets, ignore_errors=True)
