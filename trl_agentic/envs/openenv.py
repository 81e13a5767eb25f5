"""OpenEnv environments as episodes: `from_openenv(server, ...)`, a built-in agent over the real `openenv` client.

An OpenEnv environment is an HTTP/WebSocket server (a Docker container or a Hugging Face Space in production) with
`reset(**kwargs)` and `step(action)`, each answered by an observation, a reward and a `done` flag. For each episode
the agent [`from_openenv`] returns:

1. opens a session on the environment server with OpenEnv's own client (`GenericEnvClient`, or the environment's
   typed `EnvClient` subclass passed as `client=`): one WebSocket, one environment instance on the server;
2. resets it with the task's columns (every agent column but `prompt`, or those named in `reset_columns`), and puts
   the observation after the task's `prompt` as a user message;
3. asks the policy what to do through the episode's OpenAI client (Chat Completions), turns the reply into the
   environment's action, steps the environment and puts the observation in the conversation, until the environment
   says `done`, the model stops acting, or `max_turns` model calls were made (the package's one tool loop,
   `rollout/tool_loop.py`, with the hooks of `_OpenEnvTurns`);
4. closes the session (and the server, when it started one for this episode).

How a reply becomes an action, and an observation a message (`action_format`, default from the action's JSON
schema, which the server publishes at `/schema`):

- `"text"` (an action with one required string field, e.g. `EchoAction(message: str)`): the assistant message's text
  is that field; each observation comes back as a user message.
- `"tool"` (any other action, e.g. `GuessAction(guess: int)`): the action's schema is offered to the model as one
  function tool (named after the action class: `guess`); the first tool call of a reply is the action (one action per
  model call; a further call is answered with an error), and its observation is that call's tool message. A reply
  without a tool call ends the episode (`finish: "answered"`). Arguments the action's schema rejects are an error the
  model reads in the tool message; the environment is not stepped.
- An observation becomes the text of its single field when it has one (`{"prompt": "Guess a number"}` -> `Guess a
  number`), else its fields as a JSON object; `done`, `reward` and `metadata` are not shown to the model.

Both are hooks: `observation_to_message(observation) -> str | dict` and `reply_to_action(message) -> action | None`
(`message` is the assistant message as a dict; raise `ValueError` to answer the model with the error instead of
stepping; return `None` to end the episode).

Where the environment runs (`server=`):

- `"http://host:port"` (or `ws://`, `https://`): a server already running (`docker run`, a Space, a cluster);
- `"package.module:app"`: the environment's FastAPI app, served by `python -m uvicorn` on a free loopback port in a
  process of its own (the OpenEnv way without Docker), started on the first episode and shared by all episodes (each
  has its own session, so its own environment instance), or started per episode with `per_episode=True` (for an
  environment whose instances share process state);
- a command with `{port}` in its arguments (`["python", "-m", "my_env.server.app", "--port", "{port}"]`): the same
  for a server started some other way.

The episode's reward is the environment's: [`openenv_reward`] reads `episode.result["reward"]`, the sum of the step
rewards (`reward="last"`: the last step's), unless `reward_funcs=` are given. The agent's return value (the reward
functions' `episode.result`) is `{"reward", "rewards" (one per step), "done", "steps", "turns", "finish"
("done" | "answered" | "max_turns" | "stopped"), "observations" (the reset's, then one per step, as dicts),
"actions" (as dicts), "server" (the base URL)}`.

Needs `pip install 'trl-agentic[openenv]'` (OpenEnv 0.10) or `'trl-agentic[openenv-core]'` (its 0.3 distribution).
Trust model and tested versions: docs/envs_openenv.md.

Example:

```python
>>> env = from_openenv("my_env.server.app:app", max_turns=8)   # or "http://127.0.0.1:8000"
>>> trainer = AgenticGRPOTrainer(model, agent=env, reward_funcs=env.reward_funcs, train_dataset=dataset,
...                              args=AgenticGRPOConfig(..., max_turns=8, agent_columns=["prompt", "seed"]))
```
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
import openai

from ..endpoint import SERVED_MODEL_NAME
from ..rollout.agents import AgentCrash, EpisodeContext, command_environment, run_in_daemon_thread
from ..rollout.tool_loop import ToolLoop
from .openenv_protocol import (
    ACTION_BASE_FIELDS,
    ACTION_FORMATS,
    OBSERVATION_BASE_FIELDS,
    _as_dict,
    _decode_arguments,
    _Protocol,
    _protocol_from_schema,
    default_observation_to_message,
)
from .openenv_server import (
    SERVER_INHERITED_ENV,
    SERVER_STOP_GRACE_S,
    STDERR_TAIL,
    _environment_error,
    _error_code,
    _http_url,
    _LocalServer,
    _parse_server,
    _server_inherited,
)


REWARD_MODES = ("sum", "last")


def openenv_reward(prompts, completions, episodes=None, **kwargs) -> list[float | None]:
    """The environment's reward for each episode: `episode.result["reward"]` (the sum of its step rewards, by
    default). `None` (unscorable) for an episode that did not end `"ok"`, or whose environment gave no reward.

    Example:

    ```python
    >>> from trl_agentic.trace import Episode
    >>> openenv_reward([[]], [[]], episodes=[Episode(id="a", status="ok", result={"reward": 1.0})])
    [1.0]
    ```
    """
    rewards = []
    for episode in episodes:
        if episode.status != "ok" or not isinstance(episode.result, dict):
            rewards.append(None)
        else:
            rewards.append(episode.result.get("reward"))
    return rewards


def from_openenv(
    server: str | Sequence[str],
    *,
    client: type | None = None,
    action: type | None = None,
    action_format: str | None = None,
    tool_name: str | None = None,
    observation_to_message: Callable[[Any], str | dict[str, Any]] | None = None,
    reply_to_action: Callable[[dict[str, Any]], Any] | None = None,
    max_turns: int = 16,
    reset_columns: Sequence[str] | None = None,
    reset_kwargs: Mapping[str, Any] | None = None,
    reward: str = "sum",
    reward_funcs: Sequence[Callable] | None = None,
    per_episode: bool = False,
    app_dir: str | None = None,
    env: Mapping[str, str] | None = None,
    inherit_env: bool | Sequence[str] = (),
    startup_timeout: float = 120.0,
    message_timeout: float = 60.0,
    model: str = SERVED_MODEL_NAME,
) -> OpenEnvAgent:
    """An agent that plays an OpenEnv environment through the episode's endpoint (see the module's docstring).

    Args:
        server: `"http://host:port"` of a running server; `"package.module:app"`, the environment's FastAPI app,
            served by uvicorn in a local process; or a command (list, or string split on spaces) with `{port}` in its
            arguments that serves the environment on that loopback port.
        client: the environment's `EnvClient` subclass (its observations are then its typed `Observation`s);
            default OpenEnv's `GenericEnvClient` (plain dicts: no environment code is needed on the trainer's side).
        action: the environment's `Action` class; actions are then validated here (errors are text the model reads)
            and its JSON schema replaces the server's `/schema`.
        action_format: `"text"` or `"tool"`; default `"text"` when the action has exactly one required field and it
            is a string, else `"tool"`.
        tool_name: the tool's name in `"tool"` format; default the action class's name without `Action`, in
            snake case (`GuessAction` -> `guess`).
        observation_to_message: `f(observation) -> str | dict`: the content of the message that shows an observation
            to the model (or, in `"text"` format, the whole message). `observation` is a dict, or the typed
            observation of `client`.
        reply_to_action: `f(assistant_message: dict) -> action | None`: the action for a reply (an `Action`, or a dict
            of its fields). Raise `ValueError` to answer the model with the error; return `None` to end the episode.
        max_turns: most model calls per episode.
        reset_columns: the task columns passed to `reset(**kwargs)`; default every column the agent receives
            (`AgenticGRPOConfig.agent_columns`) except `prompt`. A named column missing from the task fails the
            episode. Give the rows a `seed` column, and list it in `agent_columns`, so that a GRPO group's episodes
            start from the same environment state.
        reset_kwargs: fixed keyword arguments of every `reset` (task columns take precedence).
        reward: the episode reward from the step rewards: `"sum"` (default) or `"last"`.
        reward_funcs: the reward functions to train with instead of the environment's reward ([`openenv_reward`]).
        per_episode: start a local server per episode instead of one shared by all (not for a URL).
        app_dir: the directory uvicorn imports a `"module:app"` from (default: the working directory).
        env: extra environment variables of a local server.
        inherit_env: trainer environment variables a local server also gets (`True`: all); by default only
            `PATH`, `HOME`, locale, `PYTHONPATH`, `VIRTUAL_ENV` and the like (`command_environment`).
        startup_timeout: seconds a local server has to answer `/health`.
        message_timeout: seconds the environment has to answer one `reset` or `step`.
        model: the model name sent to the endpoint.

    Example:

    ```python
    >>> env = from_openenv("guess_env:app", app_dir="envs/", max_turns=6)
    >>> env.reward_funcs
    [<function openenv_reward at ...>]
    ```
    """
    return OpenEnvAgent(
        server=server,
        client=client,
        action=action,
        action_format=action_format,
        tool_name=tool_name,
        observation_to_message=observation_to_message,
        reply_to_action=reply_to_action,
        max_turns=max_turns,
        reset_columns=reset_columns,
        reset_kwargs=reset_kwargs,
        reward=reward,
        reward_funcs=reward_funcs,
        per_episode=per_episode,
        app_dir=app_dir,
        env=env,
        inherit_env=inherit_env,
        startup_timeout=startup_timeout,
        message_timeout=message_timeout,
        model=model,
    )


class OpenEnvAgent:
    """The episode agent [`from_openenv`] builds (an `EpisodeAgent`: `AgenticGRPOTrainer(agent=...)` takes it).

    `reward_funcs` holds the reward functions to train with; `server_url` the shared local server's base URL once it
    runs; `close()` stops a shared local server (also done at exit).
    """

    def __init__(
        self,
        *,
        server,
        client,
        action,
        action_format,
        tool_name,
        observation_to_message,
        reply_to_action,
        max_turns,
        reset_columns,
        reset_kwargs,
        reward,
        reward_funcs,
        per_episode,
        app_dir,
        env,
        inherit_env,
        startup_timeout,
        message_timeout,
        model,
    ):
        # Where the environment runs
        self._url, self._command = _parse_server(server, app_dir)
        if per_episode and self._url is not None:
            raise ValueError(
                f"per_episode=True starts a server per episode, but server={server!r} is a URL of a "
                "running one. Pass the environment's app ('package.module:app') or a command with "
                "'{port}' instead, or drop per_episode."
            )
        self.per_episode = per_episode
        self._server_env = {**command_environment(_server_inherited(inherit_env)), **(env or {})}
        self._startup_timeout = startup_timeout
        self._message_timeout = message_timeout
        self._shared: _LocalServer | None = None
        self._shared_lock = threading.Lock()

        # Actions and observations
        if action_format is not None and action_format not in ACTION_FORMATS:
            raise ValueError(
                f"action_format={action_format!r}: use one of {list(ACTION_FORMATS)} (or None to "
                "decide from the action's schema)."
            )
        if action is not None and not hasattr(action, "model_json_schema"):
            raise ValueError(
                f"action={action!r} is not an OpenEnv Action class (a pydantic model); pass the class "
                "the environment's server was created with, or leave it out."
            )
        self.client_cls = client
        self.action_cls = action
        self._action_format = action_format
        self._tool_name = tool_name
        self._protocol: _Protocol | None = None
        self.observation_to_message = observation_to_message or default_observation_to_message
        self.reply_to_action = reply_to_action

        # Episodes
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns}: an episode needs at least 1 model call.")
        if reward not in REWARD_MODES:
            raise ValueError(
                f"reward={reward!r}: use one of {list(REWARD_MODES)}, or pass reward_funcs= to score episodes yourself."
            )
        self.max_turns = max_turns
        self.reset_columns = None if reset_columns is None else tuple(reset_columns)
        self.reset_kwargs = dict(reset_kwargs or {})
        self.reward = reward
        self.reward_funcs = list(reward_funcs) if reward_funcs is not None else [openenv_reward]
        self.model = model
        _LIVE_AGENTS.add(self)

    # --- servers ---------------------------------------------------------------------------------------------------

    @property
    def server_url(self) -> str | None:
        """The base URL episodes connect to: the given URL, or the shared local server's once started."""
        if self._url is not None:
            return self._url
        return self._shared.url if self._shared is not None else None

    def _shared_server(self) -> str:
        with self._shared_lock:  # a thread lock: episodes of successive rollouts run on different event loops
            if self._shared is None or not self._shared.alive():
                if self._shared is not None:
                    self._shared.stop()
                self._shared = _LocalServer(self._command, self._server_env).start(self._startup_timeout)
            return self._shared.url

    def start(self) -> str:
        """Start the shared local server now (else the first episode starts it) and return its base URL: a server
        that cannot start then fails here, before any training. A URL server is returned as is."""
        if self._url is not None:
            return self._url
        if self.per_episode:
            raise ValueError("per_episode=True: each episode starts its own server; there is none to start now.")
        return self._shared_server()

    def close(self) -> None:
        """Stop the shared local server, if one runs (a later episode starts a new one)."""
        with self._shared_lock:
            if self._shared is not None:
                self._shared.stop()
                self._shared = None

    # --- the episode -----------------------------------------------------------------------------------------------

    async def run(self, context: EpisodeContext, task: dict[str, Any]) -> dict[str, Any]:
        reset = self._reset_kwargs_for(task)
        local = None
        try:
            if self._url is not None:
                url = self._url
            elif self.per_episode:
                local = _LocalServer(self._command, self._server_env)
                url = (await run_in_daemon_thread(lambda: local.start(self._startup_timeout))).url
            else:
                # A thread each, never the loop's small default pool: episodes waiting for a server to start must not
                # queue others behind them while their clocks run.
                url = await run_in_daemon_thread(self._shared_server)
            protocol = self._protocol or await run_in_daemon_thread(lambda: self._decide_protocol(url))
            kwargs = dict(base_url=context.base_url, api_key=context.api_key, max_retries=0, timeout=context.timeout)
            if context.http_client is not None:
                policy = openai.AsyncOpenAI(**kwargs, http_client=context.http_client)  # shared pool: not closed
                return await self._play(policy, url, protocol, task, reset)
            http_client = openai.DefaultAsyncHttpxClient(trust_env=False)  # the endpoint is ours: no proxy
            async with openai.AsyncOpenAI(**kwargs, http_client=http_client) as policy:
                return await self._play(policy, url, protocol, task, reset)
        finally:
            if local is not None:
                local.stop()  # also on the episode's timeout (a cancellation)

    async def _play(
        self, policy, url: str, protocol: _Protocol, task: dict[str, Any], reset: dict[str, Any]
    ) -> dict[str, Any]:
        prompt = task.get("prompt") or []
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        record = {
            "reward": None,
            "rewards": [],
            "done": False,
            "steps": 0,
            "turns": 0,
            "finish": "max_turns",
            "observations": [],
            "actions": [],
            "server": url,
        }
        env = self._env_client(url)
        try:
            try:
                await env.connect()
                result = await env.reset(**reset)
            except Exception as error:
                raise _environment_error("reset", url, error) from error
            record["observations"].append(_as_dict(result.observation))
            messages.append(self._user_message(result.observation))
            record["done"] = bool(result.done)
            end = await _OpenEnvTurns(self, env, url, protocol, record).run(policy, messages)  # the one tool loop
            record["turns"] = end.turns
            if record["done"]:
                record["finish"] = "done"
        finally:
            with contextlib.suppress(Exception):
                await env.close()
        rewards = [r for r in record["rewards"] if r is not None]
        if rewards:
            record["reward"] = float(sum(rewards)) if self.reward == "sum" else float(rewards[-1])
        return record

    async def _act(
        self, env, url: str, protocol: _Protocol, messages: list[dict[str, Any]], reply, record: dict[str, Any]
    ) -> bool:
        """Turn one reply into an action and step the environment; answer the model (appended to `messages`, the
        loop's answer to this reply). False: the episode ends."""
        message = reply.model_dump(exclude_none=True)
        calls = list(reply.tool_calls or []) if protocol.format == "tool" else []
        try:
            if self.reply_to_action is not None:
                action = self.reply_to_action(message)
            elif protocol.format == "text":
                action = {protocol.text_field: reply.content or ""}
            elif not calls:
                action = None
            elif calls[0].type != "function" or calls[0].function.name != protocol.tools[0]["function"]["name"]:
                name = calls[0].function.name if calls[0].type == "function" else calls[0].type
                raise ValueError(f"unknown tool {name!r}; call {protocol.tools[0]['function']['name']!r}.")
            else:
                action = _decode_arguments(calls[0].function.arguments)
            if action is None:
                record["finish"] = "answered" if protocol.format == "tool" else "stopped"
                return False
            action = self._validated(action, protocol)
        except ValueError as error:
            self._answer(messages, protocol, calls, f"Error: {error}")
            return True
        try:
            result = await env.step(action)
        except Exception as error:
            code = _error_code(error)
            if code in ("VALIDATION_ERROR", "EXECUTION_ERROR"):  # the session stays open: the model reads it
                self._answer(messages, protocol, calls, f"Error: the environment rejected the action: {error}")
                return True
            raise _environment_error("step", url, error) from error
        record["steps"] += 1
        record["actions"].append(_as_dict(action))
        record["observations"].append(_as_dict(result.observation))
        record["rewards"].append(None if result.reward is None else float(result.reward))
        record["done"] = bool(result.done)
        shown = self.observation_to_message(result.observation)
        if protocol.format == "tool" and calls:
            self._answer(messages, protocol, calls, shown if isinstance(shown, str) else shown.get("content", ""))
        else:
            messages.append(shown if isinstance(shown, dict) else {"role": "user", "content": shown})
        return True

    @staticmethod
    def _answer(messages: list[dict[str, Any]], protocol: _Protocol, calls: list, content: str) -> None:
        """Put text in front of the model: the first call's tool message (the others: one action per turn), or a
        user message in text format."""
        if protocol.format == "tool" and calls:
            messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": content})
            for call in calls[1:]:
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "content": "Error: not run; one action per turn, this one was the first call's.",
                    }
                )
        else:
            messages.append({"role": "user", "content": content})

    def _user_message(self, observation: Any) -> dict[str, Any]:
        shown = self.observation_to_message(observation)
        return shown if isinstance(shown, dict) else {"role": "user", "content": shown}

    def _validated(self, action: Any, protocol: _Protocol) -> Any:
        """The action as the client sends it; a ValueError (shown to the model) when its fields are wrong."""
        if hasattr(action, "model_dump"):
            return action
        if not isinstance(action, dict):
            raise ValueError(f"the action must be a JSON object of the action's fields, got {type(action).__name__}.")
        if self.action_cls is not None:
            from pydantic import ValidationError

            try:
                return self.action_cls.model_validate(action)
            except ValidationError as error:
                problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'action'}: {e['msg']}" for e in error.errors())
                raise ValueError(f"invalid action ({problems}).") from None
        unknown = sorted(set(action) - set(protocol.fields or action) - set(ACTION_BASE_FIELDS))
        if unknown:
            raise ValueError(f"unknown fields {unknown}; the action's fields are {list(protocol.fields)}.")
        return action

    def _env_client(self, url: str):
        if self.client_cls is not None:
            return self.client_cls(base_url=url, message_timeout_s=self._message_timeout)
        from openenv.core.generic_client import GenericEnvClient

        return GenericEnvClient(base_url=url, message_timeout_s=self._message_timeout)

    def _reset_kwargs_for(self, task: dict[str, Any]) -> dict[str, Any]:
        if self.reset_columns is None:
            columns = {k: v for k, v in task.items() if k != "prompt"}
        else:
            missing = [c for c in self.reset_columns if c not in task]
            if missing:
                raise AgentCrash(
                    f"reset_columns {missing} are not in the agent's task (its columns: {sorted(task)});"
                    " add them to AgenticGRPOConfig.agent_columns (or the suite's agent_columns)."
                )
            columns = {c: task[c] for c in self.reset_columns}
        return {**self.reset_kwargs, **columns}

    def _decide_protocol(self, url: str) -> _Protocol:
        """The action format from the action's JSON schema (the class's, else the server's `/schema`), once."""
        if self.action_cls is not None:
            schema = self.action_cls.model_json_schema()
        elif self._action_format == "text" and self.reply_to_action is not None:
            self._protocol = _Protocol("text", None, None, None)  # the hook builds every action: no schema needed
            return self._protocol
        else:
            try:
                response = httpx.get(f"{_http_url(url)}/schema", timeout=self._message_timeout, trust_env=False)
                response.raise_for_status()
                schema = response.json()["action"]
            except Exception as error:  # noqa: BLE001 - reported with what to do instead
                raise AgentCrash(
                    f"could not read the action schema from {_http_url(url)}/schema ({error}); pass "
                    "action=<the environment's Action class>, or action_format= and reply_to_action=."
                )
        self._protocol = _protocol_from_schema(
            schema, self._action_format, self._tool_name, custom_reply=self.reply_to_action is not None
        )
        return self._protocol


class _OpenEnvTurns(ToolLoop):
    """The tool loop's hooks for an OpenEnv client: each reply becomes an action that steps the environment
    (`OpenEnvAgent._act`), its observation the answer; the episode ends when the environment says `done`, the model
    stops acting, or after `max_turns` model calls (`record["finish"]` says which)."""

    # A branch replays the model calls; the tools run again on its fresh environment, whose state they build.
    replay_tool_results = False

    def __init__(self, agent: OpenEnvAgent, env: Any, url: str, protocol: _Protocol, record: dict[str, Any]):
        self.agent, self.env, self.url, self.protocol, self.record = agent, env, url, protocol, record
        self.max_turns = agent.max_turns

    def request(self) -> dict[str, Any]:
        return {"model": self.agent.model, **({"tools": self.protocol.tools} if self.protocol.tools else {})}

    def is_completed(self) -> bool:
        return self.record["done"]

    def is_final(self, message: Any) -> bool:
        return False  # a reply without a tool call is an action too (text format); `_act` decides

    async def env_response(self, message: Any, response: Any) -> list[dict[str, Any]] | None:
        answer: list[dict[str, Any]] = []
        if not await self.agent._act(self.env, self.url, self.protocol, answer, message, self.record):
            return None
        return answer


# Shared local servers are stopped at exit, like the MCP agent's shared servers.
_LIVE_AGENTS: weakref.WeakSet[OpenEnvAgent] = weakref.WeakSet()


@atexit.register
def _stop_shared_servers() -> None:
    for agent in list(_LIVE_AGENTS):
        with contextlib.suppress(Exception):
            agent.close()


__all__ = [
    "ACTION_BASE_FIELDS",
    "ACTION_FORMATS",
    "OBSERVATION_BASE_FIELDS",
    "REWARD_MODES",
    "SERVER_INHERITED_ENV",
    "SERVER_STOP_GRACE_S",
    "STDERR_TAIL",
    "OpenEnvAgent",
    "default_observation_to_message",
    "from_openenv",
    "openenv_reward",
]
