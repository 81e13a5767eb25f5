"""Agents: the part we do not own. Adapters that run one episode of an agent against its episode endpoint.

Contracts (see DESIGN.md):
- `async def agent(client: openai.AsyncOpenAI, task: dict) -> Any`: `client` already points at the episode.
- `def agent(client: openai.OpenAI, task: dict) -> Any`: run in a thread.
- `async def agent(client: anthropic.AsyncAnthropic, task: dict)` (or `anthropic.Anthropic`, sync): an agent whose
  first parameter is annotated with an `anthropic` client gets one, pointed at the episode's `/v1/messages`
  (`CallableAgent(fn, client="anthropic")` says so explicitly). Needs `pip install trl-agentic[anthropic]`.
- `CommandAgent("python my_agent.py")`: a shell command per episode, with `OPENAI_BASE_URL`, `OPENAI_API_KEY` (the
  episode key), `OPENAI_MODEL`, `ANTHROPIC_BASE_URL`, `ANTHROPIC_API_KEY`, `ANTHROPIC_MODEL` and `TRL_AGENTIC_TASK`
  (the task as JSON, also on stdin) in a minimal environment (no trainer secrets), in a sandbox (`sandbox="auto"`:
  bubblewrap; `trl_agentic.sandbox`). Its exit status and the last JSON line of its stdout are recorded; when it
  exits, or times out, everything it started is killed.
The return value reaches the reward functions as `episodes[i].result`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import openai

from ..sandbox import SandboxLimits, create_sandbox
from ..sandbox.binds import command_binds
from ..sandbox.factory import check_sandbox
from ..sandbox.process import run_process  # noqa: F401 - its import path before the sandbox package


@dataclass
class EpisodeContext:
    """Where an agent's episode lives: what a black-box agent is handed."""

    base_url: str
    api_key: str
    model: str
    timeout: float
    # The episode's connection pool on its agent's event loop (or one shared by the episodes of a rollout run on one
    # loop, `run_episodes(http_client=...)`); agents must not close it.
    http_client: httpx.AsyncClient | None = None
    # The episode's id: its path route, `path_base_url`, names the episode by URL alone (no key), for clients whose
    # key is one per process (an environment variable) rather than one per episode.
    episode_id: str | None = None

    @property
    def path_base_url(self) -> str:
        """The episode's own `/v1` base URL, `<server>/episodes/<episode id>/v1`: the endpoint admits a call there
        by its path, whatever key it sends (a placeholder such as `EMPTY` is fine; another episode's key is refused).
        """
        if self.episode_id is None:
            raise ValueError("This EpisodeContext has no episode_id, so it has no path route.")
        return f"{self.base_url.rstrip('/').removesuffix('/v1')}/episodes/{self.episode_id}/v1"

    @property
    def anthropic_base_url(self) -> str:
        """The base URL for the `anthropic` SDK, which appends `/v1/messages` itself: `base_url` without `/v1`."""
        return self.base_url.rstrip("/").removesuffix("/v1")


class EpisodeAgent(Protocol):
    async def run(self, context: EpisodeContext, task: dict[str, Any]) -> Any: ...


class AgentCrash(Exception):
    """The agent failed; `metadata` carries what was observed (exit code, stderr tail)."""

    def __init__(self, message: str, metadata: dict[str, Any] | None = None):
        super().__init__(message)
        self.metadata = metadata or {}


AGENT_CLIENTS = ("openai", "anthropic")


@dataclass
class CallableAgent:
    """An `async def agent(client, task)` or a plain `def agent(client, task)` (run in a thread of its own).

    Args:
        fn: the agent function.
        client: the SDK client it receives, `"openai"` or `"anthropic"`; `None` (default) reads it from the annotation
            of its first parameter (`anthropic.AsyncAnthropic` / `anthropic.Anthropic`: anthropic, otherwise openai).

    Example:

    ```python
    >>> async def agent(client: anthropic.AsyncAnthropic, task):
    ...     message = await client.messages.create(model="policy", max_tokens=256, messages=task["prompt"])
    ...     return message.content[0].text
    >>> CallableAgent(agent).client
    'anthropic'
    ```
    """

    fn: Any
    client: str | None = None
    # One connection pool for the sync clients of all episodes: building an `openai.OpenAI` with its own pool costs
    # ~85 ms of CPU (its TLS context), paid while the episode's clock runs.
    _sync_http_client: httpx.Client | None = field(default=None, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.client is None:
            self.client = agent_client(self.fn)
        if self.client not in AGENT_CLIENTS:
            raise ValueError(f"CallableAgent(client={self.client!r}): use one of {list(AGENT_CLIENTS)}.")

    def __getstate__(self) -> dict[str, Any]:  # to a rollout process: the function and its client, not the pool
        return {"fn": self.fn, "client": self.client}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.fn, self.client = state["fn"], state["client"]
        self._sync_http_client, self._lock = None, threading.Lock()

    async def run(self, context: EpisodeContext, task: dict[str, Any]) -> Any:
        if self.client == "anthropic":
            return await self._run_anthropic(context, task)
        kwargs = dict(base_url=context.base_url, api_key=context.api_key, max_retries=0, timeout=context.timeout)
        if inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(getattr(self.fn, "__call__", None)):
            if context.http_client is not None:
                return await self.fn(openai.AsyncOpenAI(**kwargs, http_client=context.http_client), task)
            async with openai.AsyncOpenAI(
                **kwargs, http_client=openai.DefaultAsyncHttpxClient(trust_env=False)
            ) as client:
                return await self.fn(client, task)
        with self._lock:
            if self._sync_http_client is None:
                # trust_env=False (as every client this module builds for the endpoint): the endpoint is ours; a proxy
                # set in the environment for the agent's other traffic must not carry its model calls.
                self._sync_http_client = httpx.Client(
                    limits=httpx.Limits(max_connections=None), timeout=None, trust_env=False
                )
        client = openai.OpenAI(**kwargs, http_client=self._sync_http_client)  # not closed: the pool is shared
        return await run_in_daemon_thread(lambda: self.fn(client, task))

    async def _run_anthropic(self, context: EpisodeContext, task: dict[str, Any]) -> Any:
        # A client per episode: the `anthropic` SDK runs on its own HTTP stack (not httpx), so it cannot share the
        # rollout's connection pool.
        try:
            import anthropic
        except ImportError:
            raise ImportError("This agent takes an anthropic client: pip install 'trl-agentic[anthropic]'.") from None
        kwargs = dict(
            base_url=context.anthropic_base_url, api_key=context.api_key, max_retries=0, timeout=context.timeout
        )
        if inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(getattr(self.fn, "__call__", None)):
            http_client = anthropic.DefaultAsyncHttpxClient(trust_env=False)
            async with anthropic.AsyncAnthropic(**kwargs, http_client=http_client) as client:
                return await self.fn(client, task)

        def run_sync():
            with anthropic.Anthropic(**kwargs, http_client=anthropic.DefaultHttpxClient(trust_env=False)) as client:
                return self.fn(client, task)

        return await run_in_daemon_thread(run_sync)


def agent_client(fn: Any) -> str:
    """`"anthropic"` when the first parameter of `fn` is annotated with an `anthropic` client class, else `"openai"`.

    Example:

    ```python
    >>> def agent(client: "anthropic.AsyncAnthropic", task): ...
    >>> agent_client(agent), agent_client(lambda client, task: None)
    ('anthropic', 'openai')
    ```
    """
    parameters = list(inspect.signature(fn).parameters.values())
    if not parameters:
        return "openai"
    annotation = parameters[0].annotation
    # A class, or its name as a string under `from __future__ import annotations`.
    name = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    return "anthropic" if name.rsplit(".", 1)[-1] in ("Anthropic", "AsyncAnthropic") else "openai"


def run_in_daemon_thread(fn) -> asyncio.Future:
    """Run `fn()` in a new daemon thread and return a future of its result, on the running loop.

    Sync agents get a thread each (the runner's semaphore bounds them to `max_concurrent` episodes), never the loop's
    default pool: its min(32, cpus + 4) threads queued agents while their episode clocks ran, and `asyncio.run` joined
    it at exit, so a blocked agent held the rollout (issue #9). A thread whose episode timed out is abandoned: nothing
    awaits it, and being a daemon it does not hold the interpreter's exit either.
    """
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def target() -> None:
        result, error = None, None
        try:
            result = fn()
        except Exception as exception:  # noqa: BLE001 - handed to the awaiting episode
            error = exception
        except BaseException as exception:  # noqa: BLE001 - sys.exit() in an agent ends its episode, not the run
            error = AgentCrash(f"the agent raised {type(exception).__name__}: {exception}")
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the rollout's loop is gone: nobody is waiting any more
            pass

    threading.Thread(target=target, name="trl-agentic-sync-agent", daemon=True).start()
    return future


# What a command agent inherits from the trainer's environment unless told otherwise: enough to run programs, nothing
# secret (an agent executing model-written shell commands could read HF_TOKEN or cloud keys, issue #9). Plus LC_*.
INHERITED_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "TMPDIR", "TZ", "LANG", "LANGUAGE", "TERM")


def command_environment(inherit_env: bool | Sequence[str] = ()) -> dict[str, str]:
    """The part of this process's environment a command agent gets: `INHERITED_ENV` and `LC_*`, plus the names in
    `inherit_env` (`True`: everything, an explicit opt-in).

    Example:

    ```python
    >>> "HF_TOKEN" in command_environment(), "PATH" in command_environment()
    (False, True)
    ```
    """
    if inherit_env is True:
        return dict(os.environ)
    names = set(INHERITED_ENV) | set(inherit_env or ())
    return {k: v for k, v in os.environ.items() if k in names or k.startswith("LC_")}


@dataclass
class CommandAgent:
    """A shell command run once per episode (any language, any framework that reads `OPENAI_BASE_URL` or
    `ANTHROPIC_BASE_URL`), in a sandbox of its own (`trl_agentic.sandbox`, docs/trust_model.md).

    The command gets a minimal environment: `INHERITED_ENV` (PATH, locale, ...), the endpoint variables, `env`, and the
    trainer's variables named in `inherit_env` (`True`: all of them). When it exits, whatever it left running is killed
    and its result is read; when its episode times out, everything it started is killed.

    Args:
        command: the shell command line.
        env: extra environment variables.
        cwd: its working directory (default: the sandbox's empty workspace; unsandboxed, the trainer's). In a sandbox
            it is seen read-only.
        inherit_env: names of the trainer's environment variables it also gets (`True`: all, an opt-in).
        sandbox: `"auto"` (default: bubblewrap where it works here, else an error saying what to install or opt into),
            `"bwrap"`, `"docker"`, `"none"` (unsandboxed: it can read what the trainer can; warns once), or a
            sandbox factory (`trl_agentic.sandbox.create_sandbox`).
        binds: host paths it sees read-only (its program's folder, data it reads). Added on their own: this Python's
            environment, the command's program and the absolute paths the command line names, and `cwd`.
        limits: its resource limits (`trl_agentic.sandbox.SandboxLimits`: CPU time, memory, processes, file size).
        sandbox_image: the container image, for `sandbox="docker"`.

    Example:

    ```python
    >>> agent = CommandAgent("python /opt/agents/my_agent.py", env={"AGENT_MAX_STEPS": "8"}, binds=["/opt/agents"])
    ```
    """

    command: str
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    inherit_env: bool | Sequence[str] = ()
    sandbox: Any = "auto"
    binds: Sequence[str] = ()
    limits: SandboxLimits | None = None
    sandbox_image: str | None = None

    def __post_init__(self):
        check_sandbox(self.sandbox)

    async def run(self, context: EpisodeContext, task: dict[str, Any]) -> Any:
        task_json = json.dumps(task, default=str)
        binds = [*command_binds(self.command), *self.binds, *([self.cwd] if self.cwd else [])]
        sandbox = create_sandbox(
            self.sandbox, prefix="trl-agentic-command-", binds=binds, limits=self.limits, image=self.sandbox_image
        )
        try:
            base_url = sandbox.endpoint_url(context.base_url)
            anthropic_base_url = base_url.rstrip("/").removesuffix("/v1")
            env = {
                **command_environment(self.inherit_env),
                **({} if sandbox.kind == "none" else {"HOME": str(sandbox.home), "TMPDIR": sandbox.tmpdir}),
                **self.env,
                "OPENAI_BASE_URL": base_url,
                "OPENAI_API_KEY": context.api_key,
                "OPENAI_MODEL": context.model,
                "ANTHROPIC_BASE_URL": anthropic_base_url,
                "ANTHROPIC_API_KEY": context.api_key,
                "ANTHROPIC_MODEL": context.model,
                "TRL_AGENTIC_TASK": task_json,
            }
            cwd = self.cwd if self.cwd is not None else (os.getcwd() if sandbox.kind == "none" else None)
            done = await sandbox.run(["/bin/sh", "-c", self.command], env, cwd=cwd, stdin=task_json.encode())
        finally:
            sandbox.destroy()
        metadata = {"exit_code": done.exit_code, "stderr_tail": done.stderr[-2000:]}
        if done.left_processes:
            metadata["left_processes_killed"] = True
        if done.exit_code != 0:
            raise AgentCrash(f"command exited with status {done.exit_code}", metadata)
        return {"result": _last_json_line(done.stdout), **metadata}


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
