"""OpenEnv environment servers for [`OpenEnvAgent`](openenv.py): where the environment runs (a URL, an app served by
uvicorn, a command), a local server process on a free loopback port, and the errors an environment fails with."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from ..rollout.agents import AgentCrash


# What a local server inherits beyond `command_environment()`: where to find the environment's code, nothing secret.
SERVER_INHERITED_ENV = ("PYTHONPATH", "VIRTUAL_ENV")
STDERR_TAIL = 2000  # characters of a local server's stderr kept in an error
SERVER_STOP_GRACE_S = 3.0  # after SIGTERM, before SIGKILL
_ERROR_CODE = re.compile(r"\(code: ([A-Z_]+)\)\s*$")


class _LocalServer:
    """An environment server process on a free loopback port: its own process group, a minimal environment."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str]):
        self.command, self.env = list(command), dict(env)
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self._stderr = None
        self._stopped = threading.Event()  # once: a reaped process's group id may be reused by another

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> _LocalServer:
        self.port = _free_port()
        command = [part.replace("{port}", str(self.port)) for part in self.command]
        self._stderr = tempfile.TemporaryFile()  # a file, not a pipe: a chatty server must never block on it
        try:
            self.process = subprocess.Popen(
                command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self._stderr,
                start_new_session=True,
            )
        except OSError as error:
            raise AgentCrash(f"could not start the environment server {command}: {error}") from error
        deadline = time.monotonic() + timeout
        with httpx.Client(trust_env=False, timeout=2.0) as http:
            while not self._stopped.is_set():  # stopped meanwhile: the episode ended (its timeout)
                if self.process.poll() is not None:
                    tail = self.stderr_tail()
                    self.stop()
                    raise AgentCrash(
                        f"the environment server {command} exited with status "
                        f"{self.process.returncode} before answering /health",
                        {"stderr_tail": tail},
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(f"{self.url}/health").status_code == 200:
                        return self
                if time.monotonic() > deadline:
                    tail = self.stderr_tail()
                    self.stop()
                    raise AgentCrash(
                        f"the environment server {command} did not answer {self.url}/health within "
                        f"{timeout:g} s (startup_timeout)",
                        {"stderr_tail": tail},
                    )
                time.sleep(0.1)
        raise AgentCrash(f"the environment server {command} was stopped while starting")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, self._stderr.tell() - STDERR_TAIL))
        return self._stderr.read().decode(errors="replace")

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after `SERVER_STOP_GRACE_S`; what it left in its group is
        killed too. Only the first call acts."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(SERVER_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # the group outlives its leader until its last member exits
        process.wait()


def _parse_server(server: Any, app_dir: str | None) -> tuple[str | None, list[str] | None]:
    """(URL, None) for a running server, (None, command) for one started here."""
    if isinstance(server, str) and re.match(r"^(https?|wss?)://", server):
        return server.rstrip("/"), None
    if isinstance(server, str) and re.fullmatch(r"[\w.]+:[\w.]+", server):
        command = [
            sys.executable,
            "-m",
            "uvicorn",
            server,
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            "--app-dir",
            os.path.abspath(app_dir or os.getcwd()),
            "--log-level",
            "warning",
        ]
        return None, command
    if app_dir is not None:
        raise ValueError(f"app_dir={app_dir!r} is for server='package.module:app'; server={server!r} is not one.")
    command = server.split() if isinstance(server, str) else list(server) if isinstance(server, Sequence) else None
    if not command or not all(isinstance(part, str) for part in command):
        raise ValueError(
            f"server={server!r}: pass the URL of a running environment server ('http://host:port'), "
            "its FastAPI app ('package.module:app'), or a command serving it on '{port}'."
        )
    if not any("{port}" in part for part in command):
        raise ValueError(
            f"The server command {command} needs '{{port}}' in its arguments (the free loopback port "
            "it is to serve on), e.g. ['python', '-m', 'my_env.server.app', '--port', '{port}']."
        )
    return None, command


def _server_inherited(inherit_env: bool | Sequence[str]) -> bool | list[str]:
    return True if inherit_env is True else [*SERVER_INHERITED_ENV, *(inherit_env or ())]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _http_url(url: str) -> str:
    return re.sub(r"^ws", "http", url)


def _error_code(error: Exception) -> str | None:
    # OpenEnv's client raises RuntimeError("Server error: <message> (code: <WSErrorCode>)") for an error frame.
    match = _ERROR_CODE.search(str(error)) if isinstance(error, RuntimeError) else None
    return match.group(1) if match else None


def _environment_error(what: str, url: str, error: Exception) -> AgentCrash:
    message = f"the OpenEnv environment at {url} failed on {what}: {type(error).__name__}: {error}"
    # A session refused for capacity is an error frame, then the server closes the socket; OpenEnv's client before
    # 0.4 often sees only the close (ConnectionClosedOK) when it comes before the frame is read.
    closed_at_once = what == "reset" and type(error).__name__.startswith("ConnectionClosed")
    if _error_code(error) == "CAPACITY_REACHED" or closed_at_once:
        message += (
            ". OpenEnv refuses a session when its server already runs max_concurrent_envs of them: serve "
            "it with create_app(..., max_concurrent_envs=N) for N >= the episodes run at once (an environment "
            "with SUPPORTS_CONCURRENT_SESSIONS = True), or start a server per episode (per_episode=True)."
        )
    return AgentCrash(message, {"environment_error": str(error)})
