"""MCP servers for [`MCPAgent`](mcp.py): where a server is (`ServerSpec` -> `_ServerConfig`), the event loop every MCP
connection of this process lives on, and one connection (the server process it started, its stderr, its shutdown).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import socket
import tempfile
import threading
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from ..rollout.agents import AgentCrash, command_environment


# A server as `MCPAgent(servers={name: spec})` takes it:
# - `"https://host/mcp"`: a streamable HTTP server at that URL (`http://` or `https://`);
# - `"python server.py"` or `["python", "server.py"]`: a stdio server, the command run per episode (or once, shared);
# - a mapping in the `mcpServers` format of MCP client configs: `{"command", "args", "env", "cwd"}` (stdio), or
#   `{"url", "headers"}` (streamable HTTP), or `{"url": "http://127.0.0.1:{port}/mcp", "command", "args"}`: a command
#   serving streamable HTTP on the free loopback port put in place of `{port}` (in its arguments and the URL);
# - an `mcp.StdioServerParameters`.
ServerSpec = Any

HTTP_TRANSPORTS = ("http", "streamable-http", "streamable_http", "streamableHttp")
STDIO_TRANSPORTS = ("stdio",)
STDERR_TAIL = 2000  # characters of a server's stderr kept in an episode's error
CLOSE_TIMEOUT_S = 10.0  # the SDK's stdio shutdown is bounded by ~6 s; this bounds a shared server's close()


@dataclass(frozen=True)
class _ServerConfig:
    name: str
    transport: str  # "stdio" | "http"
    command: tuple[str, ...] = ()  # stdio: the server; http: what serves the URL (empty: the URL is already served)
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


def _server_config(name: str, spec: ServerSpec) -> _ServerConfig:
    where = f"MCPAgent(servers={{{name!r}: ...}})"
    if not isinstance(name, str) or not name:
        raise ValueError(f"MCPAgent(servers=...): server names must be non-empty strings, got {name!r}.")
    if type(spec).__name__ == "StdioServerParameters":  # the SDK's own type, without importing it here
        return _server_config(
            name,
            {
                "command": spec.command,
                "args": list(spec.args),
                "env": spec.env or {},
                "cwd": None if spec.cwd is None else str(spec.cwd),
            },
        )
    if isinstance(spec, str):
        if spec.startswith(("http://", "https://")):
            return _ServerConfig(name, "http", url=spec)
        command = shlex.split(spec)
        if not command:
            raise ValueError(f"{where}: the command is empty; give a command, a list of arguments or a URL.")
        return _ServerConfig(name, "stdio", command=tuple(command))
    if isinstance(spec, Sequence):
        if not spec or not all(isinstance(part, str) for part in spec):
            raise ValueError(f"{where}: a command must be a non-empty list of strings, got {spec!r}.")
        return _ServerConfig(name, "stdio", command=tuple(spec))
    if not isinstance(spec, Mapping):
        raise ValueError(
            f"{where}: expected a URL, a command (string or list), a mapping "
            f"{{'command', 'args', 'env'}} / {{'url', 'headers'}}, or StdioServerParameters; got "
            f"{type(spec).__name__}."
        )
    known = {"command", "args", "env", "cwd", "url", "headers", "type", "transport"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; a server takes {sorted(known)}.")
    transport = spec.get("type", spec.get("transport"))
    if transport == "sse":
        raise ValueError(
            f"{where}: the legacy SSE transport is not supported; serve the server over streamable "
            "HTTP (a 'url') or stdio (a 'command')."
        )
    if transport is not None and transport not in HTTP_TRANSPORTS + STDIO_TRANSPORTS:
        raise ValueError(f"{where}: unknown transport {transport!r}; use 'stdio' or 'http'.")
    command = spec.get("command")
    if isinstance(command, str):
        command = [command] if "args" in spec else shlex.split(command)
    command = tuple(command or ()) + tuple(spec.get("args") or ())
    env = dict(spec.get("env") or {})
    url = spec.get("url")
    if url is not None or transport in HTTP_TRANSPORTS:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(
                f"{where}: a streamable HTTP server needs a 'url' starting with http:// or https://, got {url!r}."
            )
        if command and "{port}" not in url:
            raise ValueError(
                f"{where}: a 'command' serving the URL needs '{{port}}' in the URL (and in its "
                "arguments), so that each server gets a free port; without a command, the URL must "
                "already be served."
            )
        if "{port}" in url and not command:
            raise ValueError(
                f"{where}: the URL has '{{port}}' but no 'command' serves it; add the command, or give "
                "the URL of a running server."
            )
        return _ServerConfig(
            name,
            "http",
            command=command,
            env=env,
            cwd=spec.get("cwd"),
            url=url,
            headers=dict(spec.get("headers") or {}),
        )
    if not command:
        raise ValueError(f"{where}: give a 'command' (stdio) or a 'url' (streamable HTTP).")
    return _ServerConfig(name, "stdio", command=command, env=env, cwd=spec.get("cwd"))


class _MCPLoop:
    """The event loop, in a daemon thread of its own, on which every MCP connection of this process lives.

    Episodes run on the rollout's loops (a fresh one per `run_rollout`); a shared server's connection must outlive
    them, and a fresh one's shutdown must finish even after the episode that opened it was abandoned on a timeout. The
    SDK's anyio scopes must also be entered and left by one task: each connection is one task here.
    """

    _lock = threading.Lock()
    _instance: _MCPLoop | None = None

    def __init__(self):
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(started.set)
            self.loop.run_forever()

        threading.Thread(target=run, name="trl-agentic-mcp", daemon=True).start()
        started.wait()

    @classmethod
    def get(cls) -> _MCPLoop:
        with cls._lock:
            if cls._instance is None or cls._instance.pid != os.getpid():  # a forked child has no such thread
                cls._instance = _MCPLoop()
            return cls._instance

    def run(self, coroutine) -> asyncio.Future:
        """Run `coroutine` here; a future of the caller's loop (cancelling it cancels the coroutine)."""
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self.loop))

    def run_sync(self, coroutine, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)


class _Connection:
    """One MCP client connection (and the server process it started, if any). Methods run on the MCP loop."""

    def __init__(self, config: _ServerConfig, agent: Any):  # agent: the MCPAgent (its timeouts, inherit_env)
        self.config, self.agent = config, agent
        self.client: Any = None
        self.tools: list[Any] = []
        self.task: asyncio.Task | None = None
        self.ready: asyncio.Future | None = None
        self.closing: asyncio.Event | None = None
        self.scope: Any = None  # the anyio cancel scope around the connection
        self.stderr: Any = None  # the server's stderr: a temporary file, appended to by the server
        self.last_stderr = ""  # its tail, kept when the file is gone
        self.broken = False  # a call found the connection gone: a shared server is started again for the next episode

    async def open(self) -> None:
        if self.task is None:
            self.ready = asyncio.get_running_loop().create_future()
            self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, even if nobody waits
            self.closing = asyncio.Event()
            self.task = asyncio.ensure_future(self._serve())
        try:
            await asyncio.wait_for(asyncio.shield(self.ready), self.agent.startup_timeout)
        except asyncio.TimeoutError:
            self._stop_starting()
            raise AgentCrash(
                f"MCP server {self.config.name!r} did not start and list its tools within "
                f"{self.agent.startup_timeout:.0f}s (MCPAgent(startup_timeout=...)).",
                self.metadata(),
            ) from None
        except (asyncio.CancelledError, AgentCrash):
            raise  # a cancelled episode closes its fresh servers itself; a shared one stays for the others
        except Exception as error:
            raise AgentCrash(
                f"MCP server {self.config.name!r} could not start or be reached: {_describe(error)}", self.metadata()
            ) from None

    async def close(self) -> None:
        if self.task is None:
            return
        self.closing.set()
        if not self.ready.done():
            self._stop_starting()  # the episode ended first
        await asyncio.wait({self.task}, timeout=CLOSE_TIMEOUT_S)

    def _stop_starting(self) -> None:
        if self.scope is not None:
            self.scope.cancel()

    async def call(self, name: str, arguments: dict[str, Any]) -> Any:
        return await self.client.call_tool(name, arguments, read_timeout_seconds=self.agent.tool_timeout)

    def metadata(self) -> dict[str, Any]:
        metadata = {"mcp_server": self.config.name}
        tail = self._stderr_tail()
        if tail:
            metadata["stderr_tail"] = tail
        return metadata

    def _stderr_tail(self) -> str:
        if self.stderr is not None and not self.stderr.closed:
            with contextlib.suppress(OSError, ValueError):
                self.stderr.seek(0)
                self.last_stderr = self.stderr.read()[-STDERR_TAIL:]
        return self.last_stderr

    async def _serve(self) -> None:
        import anyio
        from mcp import Client

        try:
            # An anyio scope, not `task.cancel()`, stops a server stuck starting: the SDK's shutdown of what it started
            # is shielded from the first, not from the second.
            with anyio.CancelScope() as self.scope:
                async with AsyncExitStack() as stack:
                    self.stderr = stack.enter_context(_stderr_file())
                    stack.callback(self._stderr_tail)  # kept once the server has exited, before the file goes
                    if self.config.transport == "stdio":
                        self.client = await stack.enter_async_context(Client(self._stdio_transport()))
                    else:
                        self.client = await self._connect_http(stack)
                    self.tools = await _list_tools(self.client)
                    self.ready.set_result(None)
                    await self.closing.wait()
        except Exception as error:
            if not self.ready.done():
                self.ready.set_exception(error)
        finally:
            if not self.ready.done():
                self.ready.set_exception(AgentCrash(f"MCP server {self.config.name!r} was stopped while starting"))

    def _environment(self) -> dict[str, str]:
        return {**command_environment(self.agent.inherit_env), **self.config.env}

    def _stdio_transport(self):
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client

        # The SDK starts it in a new session (process group) with `env` over its own minimal default (HOME, LOGNAME,
        # PATH, SHELL, TERM, USER), never the trainer's whole environment.
        command, *args = self.config.command
        parameters = StdioServerParameters(command=command, args=args, env=self._environment(), cwd=self.config.cwd)
        return stdio_client(parameters, errlog=self.stderr)

    async def _connect_http(self, stack: AsyncExitStack) -> Any:
        import httpx2
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        url, process = self.config.url, None
        if self.config.command:
            port = _free_port()
            url = url.replace("{port}", str(port))
            argv = [part.replace("{port}", str(port)) for part in self.config.command]
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=self.stderr,
                stderr=self.stderr,
                env=self._environment(),
                cwd=self.config.cwd,
                start_new_session=True,
            )
            _LIVE_GROUPS.add(process.pid)
            stack.callback(_kill_group, process.pid)
        delay = 0.02
        while True:  # a server it started needs a moment before it listens
            attempt = AsyncExitStack()
            try:
                # The SDK's default timeouts for MCP (30 s to connect, 300 s to read a held-open stream).
                http_client = await attempt.enter_async_context(
                    httpx2.AsyncClient(headers=dict(self.config.headers), timeout=httpx2.Timeout(30.0, read=300.0))
                )
                transport = streamable_http_client(url, http_client=http_client)
                client = await attempt.enter_async_context(Client(transport))
            except Exception as error:
                await attempt.aclose()
                if process is None or not _is_connection_refused(error, httpx2):
                    raise
                if process.returncode is not None:
                    raise AgentCrash(
                        f"MCP server {self.config.name!r} exited with status {process.returncode} "
                        "before serving its URL",
                        self.metadata(),
                    ) from None
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.2)
                continue
            stack.push_async_exit(attempt)
            return client


def _leaves(error: BaseException) -> list[BaseException]:
    # The exceptions inside (nested) exception groups, which anyio's task groups raise.
    inner = getattr(error, "exceptions", None)
    if isinstance(inner, tuple):
        return [leaf for e in inner for leaf in _leaves(e)]
    return [error]


def _describe(error: BaseException) -> str:
    return "; ".join(f"{type(e).__name__}: {e}" for e in _leaves(error))


def _is_connection_refused(error: BaseException, httpx2) -> bool:
    return all(
        isinstance(e, (httpx2.ConnectError, ConnectionRefusedError))
        or (e.__cause__ is not None and _is_connection_refused(e.__cause__, httpx2))
        for e in _leaves(error)
    )


@contextlib.contextmanager
def _stderr_file():
    # Opened for appending (O_APPEND), so the server's writes never land at the offset we read from.
    fd, path = tempfile.mkstemp(prefix="trl-agentic-mcp-", suffix=".log")
    os.close(fd)
    try:
        with open(path, "a+", encoding="utf-8", errors="replace") as file:
            os.unlink(path)
            path = None
            yield file
    finally:
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The process groups of the HTTP servers started here and not yet killed: killed at exit too (a stdio server ends
# when its stdin, this process's pipe, closes; an HTTP server would not).
_LIVE_GROUPS: set[int] = set()


def _kill_group(pid: int) -> None:
    _LIVE_GROUPS.discard(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def _list_tools(client: Any) -> list[Any]:
    tools, cursor = [], None
    while True:
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            return tools


async def _close_all(connections: Sequence[_Connection]) -> None:
    await asyncio.gather(*[connection.close() for connection in connections], return_exceptions=True)
