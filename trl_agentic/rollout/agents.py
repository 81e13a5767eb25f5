"""Agents: the part we do not own. Adapters that run one episode of an agent against its episode endpoint.

Contracts (see DESIGN.md):
- `async def agent(client: openai.AsyncOpenAI, task: dict) -> Any`: `client` already points at the episode.
- `def agent(client: openai.OpenAI, task: dict) -> Any`: run in a thread.
- `CommandAgent("python my_agent.py")`: a shell command per episode, with `OPENAI_BASE_URL`, `OPENAI_API_KEY` (the
  episode key), `OPENAI_MODEL` and `TRL_AGENTIC_TASK` (the task as JSON, also on stdin) in its environment. Its exit
  status and the last JSON line of its stdout are recorded; a timeout kills its whole process group.
The return value reaches the reward functions as `episodes[i].result`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import openai


@dataclass
class EpisodeContext:
    """Where an agent's episode lives: what a black-box agent is handed."""

    base_url: str
    api_key: str
    model: str
    timeout: float
    # Shared by the episodes of one rollout (connection reuse); agents must not close it.
    http_client: httpx.AsyncClient | None = None


class EpisodeAgent(Protocol):
    async def run(self, context: EpisodeContext, task: dict[str, Any]) -> Any: ...


class AgentCrash(Exception):
    """The agent failed; `metadata` carries what was observed (exit code, stderr tail)."""

    def __init__(self, message: str, metadata: dict[str, Any] | None = None):
        super().__init__(message)
        self.metadata = metadata or {}


@dataclass
class CallableAgent:
    """An `async def agent(client, task)` or a plain `def agent(client, task)` (run in a thread)."""

    fn: Any

    async def run(self, context: EpisodeContext, task: dict[str, Any]) -> Any:
        kwargs = dict(base_url=context.base_url, api_key=context.api_key, max_retries=0, timeout=context.timeout)
        if inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(getattr(self.fn, "__call__", None)):
            if context.http_client is not None:
                return await self.fn(openai.AsyncOpenAI(**kwargs, http_client=context.http_client), task)
            async with openai.AsyncOpenAI(**kwargs) as client:
                return await self.fn(client, task)
        client = openai.OpenAI(**kwargs)
        try:
            return await asyncio.to_thread(self.fn, client, task)
        finally:
            client.close()


@dataclass
class CommandAgent:
    """A shell command run once per episode (any language, any framework that reads `OPENAI_BASE_URL`).

    Example:

    ```python
    >>> agent = CommandAgent("python examples/my_agent.py", env={"AGENT_MAX_STEPS": "8"})
    ```
    """

    command: str
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None

    async def run(self, context: EpisodeContext, task: dict[str, Any]) -> Any:
        task_json = json.dumps(task, default=str)
        env = {
            **os.environ,
            **self.env,
            "OPENAI_BASE_URL": context.base_url,
            "OPENAI_API_KEY": context.api_key,
            "OPENAI_MODEL": context.model,
            "TRL_AGENTIC_TASK": task_json,
        }
        process = await asyncio.create_subprocess_shell(
            self.command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=self.cwd,
            start_new_session=True,  # own process group, so a timeout can kill everything it started
        )
        try:
            stdout, stderr = await process.communicate(task_json.encode())
        except asyncio.CancelledError:
            _kill_group(process)
            await process.wait()
            raise
        out, err = stdout.decode(errors="replace"), stderr.decode(errors="replace")
        metadata = {"exit_code": process.returncode, "stderr_tail": err[-2000:]}
        if process.returncode != 0:
            raise AgentCrash(f"command exited with status {process.returncode}", metadata)
        return {"result": _last_json_line(out), **metadata}


def _kill_group(process: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _last_json_line(text: str) -> Any:
    for line in reversed(text.strip().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return None


def resolve_agent(agent: Any) -> EpisodeAgent:
    """Normalize what a user passes as `agent=` into an `EpisodeAgent`."""
    if hasattr(agent, "run") and inspect.iscoroutinefunction(agent.run):
        return agent
    if isinstance(agent, str):
        raise ValueError(
            f"agent={agent!r} is a string. For a shell command use `CommandAgent({agent!r})`; for a Python agent "
            "pass the function itself (or its dotted path through the recipe's `agent:` key)."
        )
    if callable(agent):
        parameters = inspect.signature(agent).parameters
        if len(parameters) < 2:
            raise ValueError(
                f"The agent {getattr(agent, '__name__', agent)!r} must accept (client, task); it takes "
                f"{list(parameters)}."
            )
        return CallableAgent(agent)
    raise ValueError(f"Unsupported agent {agent!r}: pass an (async) function (client, task) or a CommandAgent.")
