"""Run the endpoint app with uvicorn on a loopback port in a background thread (in-process use and tests)."""

from __future__ import annotations

import asyncio
import copy
import logging
import re
import socket
import threading
import time
from concurrent.futures import Future

import httpx
import uvicorn
from fastapi import FastAPI

from ..trace import ReplaySpec
from .sessions import EpisodeLimits, EpisodeSession, redact_episode_ids


def _sent(char: str) -> str:
    """A pattern for `char` as a client may send it in a URL: as is, or percent-encoded (any case of hex digits)."""
    return f"(?:{re.escape(char)}|%(?i:{ord(char):02x}))"


# What the server decodes to a secret, in the raw URL uvicorn's access log prints (issue 40: `?%6Bey=<key>` and
# `/episodes/%65p-<id>/...` authenticate, and were printed as sent). A key in a query string (`?key=...`, as the Gemini
# API accepts it), and an episode id (`sessions.redact_episode_ids` catches it as decoded).
_QUERY_KEY = re.compile(f"([?&]{_sent('k')}{_sent('e')}{_sent('y')}=)" + r"[^&\s\"']+")
_HEX_DIGIT = "|".join(_sent(c) for c in "0123456789abcdef")
_EPISODE_ID = re.compile(f"{_sent('e')}{_sent('p')}{_sent('-')}(?:{_HEX_DIGIT}){{32}}")


def redact_secrets(text: str) -> str:
    """`text` with episode ids and query-string keys redacted, percent-encoded or not.

    Example:

    ```python
    >>> redact_secrets("POST /v1beta/models/policy:generateContent?alt=sse&key=sk-ep-abc HTTP/1.1")
    'POST /v1beta/models/policy:generateContent?alt=sse&key=<redacted> HTTP/1.1'
    >>> redact_secrets("POST /v1beta/models/policy:generateContent?%6Bey=sk-ep-abc HTTP/1.1")
    'POST /v1beta/models/policy:generateContent?%6Bey=<redacted> HTTP/1.1'
    ```
    """
    return _QUERY_KEY.sub(r"\1<redacted>", _EPISODE_ID.sub("ep-<redacted>", redact_episode_ids(text)))


class RedactEpisodeIds(logging.Filter):
    """Logging filter: episode ids in a record's arguments (paths of uvicorn's access log) become `ep-<redacted>`, and
    keys sent in a query string (`?key=`, the Gemini API's way) `key=<redacted>`.

    The id in `/episodes/{id}/v1/...` is the secret of the path route (a capability URL), the key that of the key
    route: neither must end up in logs.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_secrets(a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = redact_secrets(record.msg)
        return True


def uvicorn_log_config() -> dict:
    """uvicorn's default logging configuration, with episode ids redacted from the access log."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["redact_episode_ids"] = {"()": RedactEpisodeIds}
    for handler in config["handlers"].values():
        handler.setdefault("filters", []).append("redact_episode_ids")
    return config


class EndpointServer:
    """A real uvicorn server for `app`, bound before `start()` returns (port 0 picks a free port).

    Example:

    ```python
    >>> server = EndpointServer(app).start()
    >>> session = server.open_episode()
    >>> client = openai.OpenAI(base_url=server.base_url, api_key=session.key)
    >>> episode = server.close_episode(session.episode.id)
    >>> server.stop()
    ```
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.app = app
        self.host = host
        # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose proto says TCP. Without
        # it every response waits for the client's delayed ACK (Nagle): ~40 ms per call on Linux.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socket.bind((host, port))
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, timeout_keep_alive=30, access_log=False)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def served_model_name(self) -> str:
        """The `model` agents send (the first of the app's `served_model_names`)."""
        return self.app.state.settings.served_model_names[0]

    @property
    def registry(self):
        return self.app.state.registry

    @property
    def admin_token(self) -> str:
        return self.app.state.settings.admin_token

    def start(self, timeout: float = 30.0) -> EndpointServer:
        def run():
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self._server.serve(sockets=[self._socket]))
            finally:
                self.loop.close()

        self._thread = threading.Thread(target=run, name="trl-agentic-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError("The endpoint server exited during startup; see the log above.")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        raise TimeoutError(f"The endpoint did not answer /health within {timeout}s.")

    def call(self, coroutine, timeout: float | None = None):
        """Run a coroutine on the server's event loop from another thread and wait for it."""
        future: Future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        return future.result(timeout)

    def open_episode(
        self,
        task_index=0,
        group_index=0,
        metadata=None,
        limits: EpisodeLimits | None = None,
        seed: int | None = None,
        replay: ReplaySpec | None = None,
    ) -> EpisodeSession:
        """Open an episode (`EpisodeRegistry.open`); with a `seed`, its calls sample from seeds derived from it; with
        a `replay`, a branch episode that replays its parent's first calls (`trl_agentic.trace.ReplaySpec`)."""
        return self.registry.open(
            task_index, group_index, metadata, limits or self.app.state.settings.default_limits, seed, replay
        )

    def episode_base_url(self, session: EpisodeSession) -> str:
        return f"{self.url}/episodes/{session.episode.id}/v1"

    def close_episode(self, episode_id: str, status=None, result=None, error=None):
        return self.registry.close(episode_id, status, result, error)

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._socket.close()

    def __enter__(self) -> EndpointServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
