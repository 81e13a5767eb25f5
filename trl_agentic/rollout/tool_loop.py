"""The one multi-turn tool-calling loop of the package's agents: call the model, send its message back as returned,
answer it (run its tool calls, step an environment), repeat until a stop condition.

An agent varies the loop through hooks, as an environment of verifiers' `MultiTurnEnv` does (`setup_state`,
`env_response`, `is_completed`), never by writing another loop. A [`ToolLoop`] subclass says where the tools come from
and how the episode ends:

- `request()`: the keyword arguments of the next model call besides `messages` (`model`, `tools`, a `max_tokens` cap);
- `is_completed()`, before each model call: the episode is over already (an environment said `done`);
- `is_final(message)`, after each reply: the reply ends the episode (default: it calls no tool);
- `env_response(message, response)`: the messages that answer the reply (tool results, an observation), appended
  before the next call; `None` ends the episode with nothing appended;
- `max_turns`: most model calls (`None`: no limit of the loop's; the endpoint's `max_turns` still applies).

One hooks instance plays one episode (it holds that episode's state, as verifiers' `state` dict does). The users:
`ToolAgent` (Python functions, `tasks/agent_loop.py`), `EnvironmentAgent` (a TRL `environment_factory` instance),
`MCPAgent` (MCP sessions) and `OpenEnvAgent` (an OpenEnv client), in `envs/`.

Replay (a branch episode, `docs/tree_rollouts.md`): while the endpoint replays the parent's first model calls, the
loop answers each replayed reply with the parent's recorded answer to it (`ToolReplay`, by call index) instead of
running `env_response`, so tools with side effects are not run again and the branch's requests stay the parent's,
token for token. A loop whose later steps need the state its tools built (an environment object stepped by them) sets
`replay_tool_results = False`: its tools run again during the replayed prefix (on the branch's own fresh instance).

This module imports nothing of the package: `tasks/` and `envs/` both build on it, neither imports the other for it.
"""

from __future__ import annotations

import copy
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolReplay:
    """What a branch episode's tool loop replays: the parent's replies and the answers they got, by call index.

    Args:
        replies: the parent's assistant messages (chat shape, as the endpoint returned them), call by call.
        answers: the messages that answered reply `j` (appended before call `j + 1`); `None` where not recorded.
        until: replies `0 .. until - 1` are replayed by the endpoint; their answers come from the record.
        replayed: answers returned from the record so far (counted by the loop).
    """

    replies: list[dict[str, Any]]
    answers: list[list[dict[str, Any]] | None]
    until: int
    replayed: int = field(default=0)


# The episode's tool replay, set by the runner for the agent of a branch episode (`rollout/replay.py`); the first
# `ToolLoop.run` of the episode takes it (a nested loop, a sub-agent's, does not).
TOOL_REPLAY: ContextVar[ToolReplay | None] = ContextVar("trl_agentic_tool_replay", default=None)


def _same_reply(message: Any, recorded: dict[str, Any]) -> bool:
    """Whether the client's `message` is the recorded reply: same text, same tool calls (ids, names, arguments)."""
    calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or ()]
    expected = [
        (c.get("id"), c["function"]["name"], c["function"]["arguments"]) for c in recorded.get("tool_calls") or ()
    ]
    return (message.content or "") == (recorded.get("content") or "") and calls == expected


@dataclass
class LoopResult:
    """How a [`ToolLoop`] episode ended.

    Args:
        message: the last assistant message (the client's object), `None` when no model call was made.
        turns: model calls made.
        finish: `"answered"` (`is_final` ended it), `"stopped"` (`env_response` returned `None`), `"done"`
            (`is_completed` ended it) or `"max_turns"`.
    """

    message: Any
    turns: int
    finish: str

    @property
    def text(self) -> str:
        """The text content of the last assistant message (`""` if it had none, or there was none)."""
        return (self.message.content or "") if self.message is not None else ""


class ToolLoop:
    """The hooks of one episode's tool loop and the loop itself ([`ToolLoop.run`]); subclass it and override the hooks.

    Example:

    ```python
    >>> class Echo(ToolLoop):
    ...     max_turns = 4
    ...     def request(self):
    ...         return {"model": "policy", "tools": ECHO_TOOLS}
    ...     async def env_response(self, message, response):
    ...         return [{"role": "tool", "tool_call_id": c.id, "content": c.function.arguments}
    ...                 for c in message.tool_calls]
    >>> messages = [{"role": "user", "content": "Echo 'hi'."}]
    >>> end = await Echo().run(client, messages)
    >>> end.finish, end.text
    ('answered', 'hi')
    ```
    """

    max_turns: int | None = None
    replay_tool_results: bool = True  # False: during a branch's replayed prefix the tools run again (see module doc)

    def request(self) -> dict[str, Any]:
        """The keyword arguments of the next `chat.completions.create` besides `messages`."""
        raise NotImplementedError

    def is_completed(self) -> bool:
        """Checked before each model call: `True` ends the episode without calling the model again."""
        return False

    def is_final(self, message: Any) -> bool:
        """Checked after each reply is appended: `True` ends the episode with it (default: it calls no tool)."""
        return not message.tool_calls

    async def env_response(self, message: Any, response: Any) -> list[dict[str, Any]] | None:
        """The messages that answer `message` (the reply; `response` the whole completion), appended in order before
        the next model call; `None` ends the episode, nothing appended. Errors the model should read are messages,
        not exceptions: an exception ends the episode (the runner records it)."""
        raise NotImplementedError

    async def run(self, client: Any, messages: list[dict[str, Any]]) -> LoopResult:
        """Chat until a stop condition; `messages` is extended in place with every reply and every answer.

        Errors of the *client* (the endpoint refused the call, the episode's limit was reached) propagate: they end
        the episode and the runner records them.

        Args:
            client: an `openai.AsyncOpenAI` (or anything with an async `chat.completions.create`).
            messages: the conversation so far (typically the task's prompt).
        """
        turns, message = 0, None
        replay = TOOL_REPLAY.get()
        if replay is not None:
            TOOL_REPLAY.set(None)  # this episode's loop takes it; a nested loop (a sub-agent's) replays nothing
            if not self.replay_tool_results:
                replay = None
        while True:
            if self.is_completed():
                return LoopResult(message, turns, "done")
            if self.max_turns is not None and turns >= self.max_turns:
                return LoopResult(message, turns, "max_turns")
            response = await client.chat.completions.create(messages=messages, **self.request())
            turns += 1
            message = response.choices[0].message
            # Send the message back exactly as returned: the fields the server sent (ids, tool_calls, `content: null`,
            # extra fields) and nothing else, as agents do that append `response.choices[0].message` to their history.
            messages.append(message.model_dump(exclude_unset=True))
            if self.is_final(message):
                return LoopResult(message, turns, "answered")
            j = turns - 1
            if replay is not None and j < replay.until and j < len(replay.answers):
                recorded = replay.answers[j]
                if recorded is not None and _same_reply(message, replay.replies[j]):
                    replay.replayed += 1
                    messages.extend(copy.deepcopy(recorded))
                    continue
                replay = None  # the reply is not the parent's (the endpoint stopped replaying): run the tools
            answer = await self.env_response(message, response)
            if answer is None:
                return LoopResult(message, turns, "stopped")
            messages.extend(answer)


__all__ = ["TOOL_REPLAY", "LoopResult", "ToolLoop", "ToolReplay"]
