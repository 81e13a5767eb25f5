"""Turn and Episode: the records of what the model saw and sampled. Pure data with a JSON round-trip."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal


# How the prompt of a turn was built:
# - "continued": prompt_ids = previous turn's prompt_ids + completion_ids (+ glue) + ids of the newly rendered messages.
# - "rendered": the chat template was applied to the whole request (first call, or the history was rewritten).
PromptSource = Literal["continued", "rendered"]

EPISODE_STATUSES = ("running", "ok", "agent_error", "timeout", "context_overflow", "limit_exceeded", "cancelled")


@dataclass
class Turn:
    """One model call of an episode: the atomic record.

    Args:
        index: position of the call in the episode (0-based).
        prompt_ids: exact token ids the model was conditioned on.
        completion_ids: token ids the model sampled (including its stop token when it stopped).
        logprobs: one logprob per completion token, under the distribution it was sampled from.
        finish_reason: `"stop"`, `"length"` or `"tool_calls"` (as returned to the client).
        policy_version: the trainer's global step when the tokens were sampled.
        request_messages: the messages of the request, as the agent sent them (normalized JSON).
        request_tools: the tools of the request, as the agent sent them.
        response_message: the assistant message returned to the agent.
        prompt_source: `"continued"` or `"rendered"` (see `PromptSource`).
        parent_turn: index of the turn this one continued from, or `None`.
        drift: when `prompt_source == "rendered"` but an earlier turn existed, the number of tokens by which a fresh
            render of the request diverges from the token-exact history (0 = a fresh render would have agreed).
        fork_reason: why the turn was not a continuation (e.g. `"history_rewritten"`), `None` for continuations.
        malformed_tool_call: the completion looked like a tool call but could not be parsed; it was returned as text.
        forced_tokens: how many tokens at the end of `prompt_ids` the server added to enforce `tool_choice`
            (`"required"` or a named function): the opening of a tool call, which the model then completed.
        sampling: the sampling parameters actually used.
        requested_sampling: what the agent asked for (recorded, not necessarily obeyed).
        wall_time: seconds spent serving the call.
    """

    index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int = 0
    request_messages: list[dict[str, Any]] = field(default_factory=list)
    request_tools: list[dict[str, Any]] | None = None
    response_message: dict[str, Any] = field(default_factory=dict)
    prompt_source: PromptSource = "rendered"
    parent_turn: int | None = None
    drift: int = 0
    fork_reason: str | None = None
    malformed_tool_call: bool = False
    forced_tokens: int = 0
    sampling: dict[str, Any] = field(default_factory=dict)
    requested_sampling: dict[str, Any] = field(default_factory=dict)
    wall_time: float = 0.0

    @property
    def num_tool_calls(self) -> int:
        return len(self.response_message.get("tool_calls") or [])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Turn:
        return cls(**data)


@dataclass
class Episode:
    """One agent run against the endpoint.

    Args:
        id: unique episode id.
        task_index: index of the task (dataset row) in the generation batch.
        group_index: index of the episode inside its GRPO group.
        turns: every model call, in order.
        messages: the final message list (last request's messages + the last assistant message).
        result: the agent's return value (JSON-serialisable form).
        status: one of `EPISODE_STATUSES`.
        error: a short description of what went wrong, if anything.
        wall_time: seconds from open to close.
        metadata: free-form (task columns, exit code of a command agent, ...).
    """

    id: str
    task_index: int = 0
    group_index: int = 0
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    result: Any = None
    status: str = "running"
    error: str | None = None
    wall_time: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def num_forks(self) -> int:
        return sum(1 for turn in self.turns[1:] if turn.prompt_source != "continued")

    @property
    def num_sampled_tokens(self) -> int:
        return sum(len(turn.completion_ids) for turn in self.turns)

    @property
    def num_tool_calls(self) -> int:
        return sum(turn.num_tool_calls for turn in self.turns)

    @property
    def num_malformed_tool_calls(self) -> int:
        return sum(turn.malformed_tool_call for turn in self.turns)

    @property
    def total_drift(self) -> int:
        return sum(turn.drift for turn in self.turns)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["result"] = _jsonable(self.result)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Episode:
        data = dict(data)
        data["turns"] = [Turn.from_dict(t) for t in data.get("turns", [])]
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Episode:
        return cls.from_dict(json.loads(text))


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)
