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
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..endpoint import SERVED_MODEL_NAME
from ..rollout.agents import AgentCrash, EpisodeContext
from ..rollout.tool_loop import ToolLoop
from .mcp_servers import (
    _LIVE_GROUPS,
    CLOSE_TIMEOUT_S,
    HTTP_TRANSPORTS,
    STDIO_TRANSPORTS,
    ServerSpec,
    _close_all,
    _Connection,
    _describe,
    _kill_group,
    _MCPLoop,
    _server_config,
    _ServerConfig,
)
from .mcp_tools import OPENAI_TOOL_NAME, openai_tool_names, tool_result_text


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


__all__ = [
    "CLOSE_TIMEOUT_S",
    "HTTP_TRANSPORTS",
    "OPENAI_TOOL_NAME",
    "STDIO_TRANSPORTS",
    "MCPAgent",
    "ServerSpec",
    "openai_tool_names",
    "tool_result_text",
]
