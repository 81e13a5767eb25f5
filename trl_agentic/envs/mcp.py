"""MCP tool servers as an episode's tools: `MCPAgent(servers={...})`, a reference agent over the `mcp` SDK.

For each episode [`MCPAgent`]:

1. connects to its MCP servers: a stdio server is a command it spawns (the SDK's `stdio_client`: its own process group,
   a minimal environment); a streamable HTTP server is a URL, or a command that serves one on a port chosen for it;
2. lists their tools and offers them to the model as OpenAI function tools (a name two servers share is prefixed
   with its server's name, `kv__get`);
3. chats through the episode's OpenAI client (Chat Completions), calls the tools the model asks for and answers each
   call with a tool message (a tool's error, a bad argument or an unknown tool is text the model reads), until the
   model answers without tool calls or `max_turns` model calls were made (the package's one tool loop,
   `rollout/tool_loop.py`, with the hooks of `_MCPTools`);
4. closes the servers it started for the episode: a stdio server's stdin is closed and its process group killed if it
   does not exit (the SDK's shutdown: SIGTERM after 2 s, SIGKILL after 2 s more), at the episode's end or its timeout.

A fresh server per episode is the default, so no state leaks from one episode to another (a GRPO group's episodes
must start from the same state for their rewards to compare). `shared=True` (or a list of server names) keeps one
connection, and one server process, for every episode of the agent instead, until `agent.close()` or exit.

The return value reaches the reward functions as `episode.result`:
`{"text": final answer, "tool_calls": [{"tool", "server", "mcp_tool", "arguments", "content", "is_error"}, ...],
"turns": model calls, "finish": "answered" | "max_turns"}`.

Needs `pip install 'trl-agentic[mcp]'` (the `mcp` SDK, 2.x). Trust model: docs/envs_mcp.md.

Example:

```python
>>> agent = MCPAgent(servers={"kv": [sys.executable, "kv_server.py"], "search": "http://127.0.0.1:8000/mcp"})
>>> trainer = AgenticGRPOTrainer(model, agent=agent, reward_funcs=[checker], args=config, train_dataset=dataset)
```
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import tempfile
import threading
import weakref
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from ..endpoint import SERVED_MODEL_NAME
from ..rollout.agents import AgentCrash, EpisodeContext, command_environment
from ..rollout.tool_loop import ToolLoop


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
OPENAI_TOOL_NAME = re.compile(r"[^A-Za-z0-9_-]")
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

    def __init__(self, config: _ServerConfig, agent: MCPAgent):
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


def openai_tool_names(servers: Sequence[tuple[str, Sequence[str]]]) -> list[list[str]]:
    """The function names the model sees for each server's tools, in order.

    A tool keeps its name unless another server has a tool of the same name: then every tool of that name is called
    `<server>__<tool>`. Characters OpenAI function names do not allow become `_`, names are cut to 64 characters, and
    a name still taken gets a `_2`, `_3`, ... suffix.

    Example:

    ```python
    >>> openai_tool_names([("kv", ["get", "put"]), ("files", ["get", "read.text"])])
    [['kv__get', 'put'], ['files__get', 'read_text']]
    ```
    """
    counts: dict[str, int] = {}
    for _, tools in servers:
        for tool in set(tools):
            counts[tool] = counts.get(tool, 0) + 1
    taken: set[str] = set()
    names = []
    for server, tools in servers:
        names.append([])
        for tool in tools:
            name = f"{server}__{tool}" if counts[tool] > 1 else tool
            name = OPENAI_TOOL_NAME.sub("_", name)[:64] or "tool"
            unique, k = name, 2
            while unique in taken:
                suffix = f"_{k}"
                unique, k = name[: 64 - len(suffix)] + suffix, k + 1
            taken.add(unique)
            names[-1].append(unique)
    return names


def tool_result_text(result: Any, limit: int | None = None) -> str:
    """The text of the tool message answering an MCP `CallToolResult`: its text blocks (a placeholder for images,
    audio and binary resources), or its structured content as JSON when it has no content; `"Error: "` first when the
    tool failed and its text does not say so already; cut to `limit` characters."""
    parts = []
    for block in result.content:
        if block.type == "text":
            parts.append(block.text)
        elif block.type in ("image", "audio"):
            parts.append(f"[{block.type}: {block.mime_type}, {len(block.data) * 3 // 4} bytes]")
        elif block.type == "resource_link":
            parts.append(f"[resource: {block.uri}]")
        elif block.type == "resource":
            text = getattr(block.resource, "text", None)
            parts.append(text if text is not None else f"[resource: {block.resource.uri}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    text = "\n".join(parts)
    if result.is_error and not text.lower().startswith("error"):  # the model must see that it failed
        text = f"Error: {text}" if text else "Error: the tool failed."
    if limit is not None and len(text) > limit:
        text = text[:limit] + f"\n[... {len(text) - limit} more characters]"
    return text


def _require_mcp() -> None:
    try:
        from mcp import Client  # noqa: F401 - the 2.x client
    except ImportError:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = f"mcp {version('mcp')} is installed"
        except PackageNotFoundError:
            found = "mcp is not installed"
        raise ImportError(f"MCPAgent needs the MCP SDK 2.x ({found}): pip install 'trl-agentic[mcp]'.") from None


_LIVE_AGENTS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live_agents() -> None:
    for agent in list(_LIVE_AGENTS):
        with contextlib.suppress(Exception):
            agent.close()
    for pid in list(_LIVE_GROUPS):
        _kill_group(pid)


@dataclass(eq=False)  # hashable by identity: the live agents are tracked to close their shared servers at exit
class MCPAgent:
    """A reference agent whose tools are those of MCP servers: the model calls them until it answers.

    Args:
        servers: server name -> where the server is (see `ServerSpec`): a URL (streamable HTTP), a command (stdio),
            a `{"command", "args", "env", "cwd"}` / `{"url", "headers"}` mapping as in MCP client configs, or
            `mcp.StdioServerParameters`. Names prefix colliding tool names and label the tool call log.
        shared: `False` (default): every episode gets fresh servers (a new process per stdio server, a new connection
            per URL), closed at its end. `True`, or a list of server names: those servers are started once and kept
            for every episode of this agent (their state carries over) until `close()` or exit.
        max_turns: most model calls in an episode.
        system_prompt: a system message put before the task's prompt.
        prompt_column: the task column with the prompt: a conversation (list of messages) or a text.
        model: the model name sent with every request (default: the name the episode's endpoint answers to).
        tool_timeout: seconds a tool call may take before its tool message says it timed out (`None`: the episode's
            timeout bounds it).
        startup_timeout: seconds a server has to start and list its tools.
        max_tool_output_chars: tool messages are cut to this many characters (`None`: never).
        inherit_env: names of the trainer's environment variables the servers it starts also get (`True`: all). By
            default they get a minimal environment (PATH, HOME, locale; `rollout.agents.INHERITED_ENV`) plus their own
            `env`, never the trainer's secrets.

    Example:

    ```python
    >>> agent = MCPAgent(servers={"kv": {"command": "python", "args": ["kv_server.py"], "env": {"KV_SIZE": "8"}}},
    ...                  system_prompt="Use the tools.", max_turns=6)
    >>> text = (await agent(client, {"prompt": [{"role": "user", "content": "Store 3 under 'a'."}]}))["text"]
    ```
    """

    servers: Mapping[str, ServerSpec]
    shared: bool | Sequence[str] = False
    max_turns: int = 10
    system_prompt: str | None = None
    prompt_column: str = "prompt"
    model: str | None = None
    tool_timeout: float | None = 60.0
    startup_timeout: float = 60.0
    max_tool_output_chars: int | None = 16_000
    inherit_env: bool | Sequence[str] = ()

    def __post_init__(self):
        _require_mcp()
        if not isinstance(self.servers, Mapping) or not self.servers:
            raise ValueError("MCPAgent(servers=...) needs at least one server: {name: URL, command or mapping}.")
        self._configs = [_server_config(name, spec) for name, spec in self.servers.items()]
        if self.shared is True or self.shared is False:
            self._shared_names = {c.name for c in self._configs} if self.shared else set()
        else:
            if isinstance(self.shared, str):
                raise ValueError(
                    f"MCPAgent(shared={self.shared!r}): give a list of server names, e.g. "
                    f"shared=[{self.shared!r}], or True for all."
                )
            self._shared_names = set(self.shared)
            unknown = sorted(self._shared_names - set(self.servers))
            if unknown:
                raise ValueError(
                    f"MCPAgent(shared={list(self.shared)!r}): {unknown} are not servers; the servers "
                    f"are {list(self.servers)}."
                )
        if self.max_turns < 1:
            raise ValueError(f"MCPAgent(max_turns={self.max_turns}): an episode needs at least 1 model call.")
        for knob in ("tool_timeout", "startup_timeout", "max_tool_output_chars"):
            value = getattr(self, knob)
            if value is not None and value <= 0:
                raise ValueError(
                    f"MCPAgent({knob}={value}) must be > 0"
                    + (" (or None: no limit)." if knob != "startup_timeout" else ".")
                )
        self._shared_connections: dict[str, _Connection] = {}
        self._lock = threading.Lock()

    def __getstate__(self):  # live connections stay with the process that opened them
        state = dict(self.__dict__)
        state.pop("_shared_connections")
        state.pop("_lock")
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._shared_connections, self._lock = {}, threading.Lock()

    async def run(self, context: EpisodeContext, task: dict[str, Any]) -> dict[str, Any]:
        """Run one episode (the runner's `EpisodeAgent` contract): an `openai.AsyncOpenAI` client pointed at it, on the
        rollout's connection pool when it has one, as `CallableAgent` builds it."""
        import openai

        kwargs = dict(base_url=context.base_url, api_key=context.api_key, max_retries=0, timeout=context.timeout)
        if context.http_client is not None:
            return await self(openai.AsyncOpenAI(**kwargs, http_client=context.http_client), task, context.model)
        async with openai.AsyncOpenAI(**kwargs, http_client=openai.DefaultAsyncHttpxClient(trust_env=False)) as client:
            return await self(client, task, context.model)

    async def __call__(self, client, task: dict[str, Any], model: str = SERVED_MODEL_NAME) -> dict[str, Any]:
        """Run one episode with `client`, an `openai.AsyncOpenAI` pointed at it; `task` is its row (the agent's
        columns), `model` the model name to send unless `MCPAgent(model=...)` says otherwise."""
        mcp_loop = _MCPLoop.get()
        fresh: list[_Connection] = []
        try:
            connections = []
            for config in self._configs:
                if config.name in self._shared_names:
                    connections.append(self._shared_connection(config, mcp_loop))
                else:
                    connections.append(_Connection(config, self))
                    fresh.append(connections[-1])
            await asyncio.gather(*[mcp_loop.run(connection.open()) for connection in connections])
            return await self._tool_loop(client, task, connections, mcp_loop, self.model or model)
        finally:
            if fresh:
                # Shielded: a timed-out episode is cancelled; the servers it started are closed all the same (the
                # close runs on the MCP loop, whatever happens to this one).
                closing = mcp_loop.run(_close_all(fresh))
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(closing)

    def _shared_connection(self, config: _ServerConfig, mcp_loop: _MCPLoop) -> _Connection:
        with self._lock:
            connection = self._shared_connections.get(config.name)
            if connection is None or connection.broken or (connection.task is not None and connection.task.done()):
                # First use, or the server died (or never started): the next episode starts it again.
                connection = self._shared_connections[config.name] = _Connection(config, self)
                _LIVE_AGENTS.add(self)
            return connection

    def close(self) -> None:
        """Close the shared servers (a later episode starts them again). Fresh servers close with their episode."""
        with self._lock:
            connections, self._shared_connections = list(self._shared_connections.values()), {}
        if connections:
            _MCPLoop.get().run_sync(_close_all(connections), timeout=CLOSE_TIMEOUT_S + 5)

    async def _tool_loop(
        self, client, task: dict[str, Any], connections: list[_Connection], mcp_loop: _MCPLoop, model: str
    ) -> dict[str, Any]:
        names = openai_tool_names([(c.config.name, [tool.name for tool in c.tools]) for c in connections])
        routes: dict[str, tuple[_Connection, str]] = {}
        schemas = []
        for connection, exposed in zip(connections, names):
            for tool, name in zip(connection.tools, exposed):
                routes[name] = (connection, tool.name)
                function = {"name": name, "parameters": tool.input_schema or {"type": "object", "properties": {}}}
                if tool.description:
                    function["description"] = tool.description
                schemas.append({"type": "function", "function": function})

        hooks = _MCPTools(self, routes, schemas, mcp_loop, model)
        end = await hooks.run(client, self._prompt(task))  # the one tool loop (`rollout/tool_loop.py`)
        return {"text": end.text, "tool_calls": hooks.log, "turns": end.turns, "finish": end.finish}

    def _prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        if self.prompt_column not in task:
            raise ValueError(
                f"The task has no {self.prompt_column!r} column (it has {sorted(task)}); set "
                "MCPAgent(prompt_column=...) and list that column in AgenticGRPOConfig.agent_columns."
            )
        prompt = task[self.prompt_column]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    async def _call(self, call: Any, routes: dict[str, tuple[_Connection, str]], mcp_loop: _MCPLoop) -> dict:
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED

        name = call.function.name if call.type == "function" else None
        entry: dict[str, Any] = {
            "tool": name,
            "server": None,
            "mcp_tool": None,
            "arguments": None,
            "content": "",
            "is_error": True,
        }
        if call.type != "function":
            entry["content"] = f"Error: unsupported tool call type {call.type!r}; call one of the provided functions."
            return entry
        raw = call.function.arguments
        entry["arguments"] = raw
        if name not in routes:
            entry["content"] = f"Error: unknown tool {name!r}. Available tools: {', '.join(sorted(routes))}."
            return entry
        connection, tool = routes[name]
        entry.update(server=connection.config.name, mcp_tool=tool)
        try:
            arguments = json.loads(raw) if raw and raw.strip() else {}
        except json.JSONDecodeError as error:
            entry["content"] = f"Error: the arguments of {name!r} are not valid JSON ({error.msg}). Send a JSON object."
            return entry
        if not isinstance(arguments, dict):
            entry["content"] = (
                f"Error: the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}."
            )
            return entry
        entry["arguments"] = arguments
        try:
            result = await mcp_loop.run(connection.call(tool, arguments))
        except MCPError as error:
            if error.code == CONNECTION_CLOSED:
                connection.broken = True
                raise AgentCrash(
                    f"MCP server {connection.config.name!r} closed the connection during a call of {tool!r}",
                    connection.metadata(),
                ) from None
            entry["content"] = f"Error: {error.message}"  # a JSON-RPC error (invalid params, a timeout): text
            return entry
        except Exception as error:  # noqa: BLE001 - the transport failed: the server is gone, so is the episode
            connection.broken = True
            raise AgentCrash(
                f"MCP server {connection.config.name!r} failed during a call of {tool!r}: {_describe(error)}",
                connection.metadata(),
            ) from None
        entry["content"] = tool_result_text(result, self.max_tool_output_chars)
        entry["is_error"] = bool(result.is_error)
        if result.structured_content is not None:
            entry["structured_content"] = result.structured_content
        return entry


class _MCPTools(ToolLoop):
    """The tool loop's hooks for MCP sessions: the servers' tools offered (when there are any), each call routed to its
    server in call order and logged; the episode ends when the model answers without tool calls or after
    `max_turns` model calls."""

    def __init__(
        self,
        agent: MCPAgent,
        routes: dict[str, tuple[_Connection, str]],
        schemas: list[dict[str, Any]],
        mcp_loop: _MCPLoop,
        model: str,
    ):
        self.agent, self.routes, self.schemas, self.mcp_loop, self.model = agent, routes, schemas, mcp_loop, model
        self.max_turns = agent.max_turns
        self.log: list[dict[str, Any]] = []

    def request(self) -> dict[str, Any]:
        return {"model": self.model, **({"tools": self.schemas} if self.schemas else {})}

    async def env_response(self, message: Any, response: Any) -> list[dict[str, Any]]:
        answer = []
        for call in message.tool_calls:
            entry = await self.agent._call(call, self.routes, self.mcp_loop)
            self.log.append(entry)
            answer.append({"role": "tool", "tool_call_id": call.id, "content": entry["content"]})
        return answer


async def _close_all(connections: Sequence[_Connection]) -> None:
    await asyncio.gather(*[connection.close() for connection in connections], return_exceptions=True)


__all__ = ["MCPAgent", "openai_tool_names", "tool_result_text"]
