"""Turn and Episode: the records of what the model saw and sampled. Pure data with a JSON round-trip.

A trace must survive whatever an agent put in it (issue #9: a lone surrogate, a NaN or a 500-deep list in a request
or a return value made the trace unreadable, and crashed the episode log writer): `to_dict` goes through `jsonable`,
and `json_text` writes anything as valid, UTF-8-encodable JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
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
        policy_version: the trainer's global step (the policy version) whose weights sampled the first token: under
            asynchronous rollouts a call may go on across a weight update, see `token_versions`.
        token_versions: the version that sampled each completion token when they differ (the weights changed while
            the call decoded), `None` when all are `policy_version`.
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
        wire_format: the API the call came in: `"chat_completions"`, `"responses"` or `"anthropic_messages"`
            (`request_messages` and `response_message` are in the chat-completions shape whatever it was).
        forked_from: for a rendered turn, the latest earlier turn whose history (request + answer) shares the longest
            message prefix with this request (`None`: it shares nothing, or the turn was continued).
        conversation: the conversation the turn belongs to, named by its first turn's index; `role`: that
            conversation's role, `"main"`, `"side_call"` or `"sub_agent"`; `spawned_by`: for a sub-agent, the turn
            whose tool call handed it its task. Decided by lineage when the episode closes (`trl_agentic.lineage`);
            `None` before, and for cancelled calls.
        replayed: the endpoint answered this call with the recorded completion of the episode's parent (a branch
            replays its parent's first calls, `ReplaySpec`): `prompt_ids`, `completion_ids`, `logprobs`,
            `response_message` and the policy versions are the parent's call's, token for token, nothing was sampled
            (training code can dedupe such a turn against its parent's).
        replay_divergence: set on the call at which replay ended early (the request did not render to the recorded
            call's prompt): `{"call", "reason", "token_index", "recorded_context", "request_context", ...}`; that call
            and every later one were sampled.
    """

    index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int = 0
    token_versions: list[int] | None = None
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
    wire_format: str = "chat_completions"
    forked_from: int | None = None
    conversation: int | None = None
    role: str | None = None
    spawned_by: int | None = None
    replayed: bool = False
    replay_divergence: dict[str, Any] | None = None

    @property
    def versions(self) -> list[int]:
        """The policy version that sampled each completion token."""
        return (
            list(self.token_versions)
            if self.token_versions is not None
            else [self.policy_version] * len(self.completion_ids)
        )

    @property
    def num_tool_calls(self) -> int:
        return len(self.response_message.get("tool_calls") or [])

    def to_dict(self) -> dict[str, Any]:
        return jsonable({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

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
        messages: the final message list: the messages of the main line's last call + the assistant message it got
            (the main line is decided when the episode closes, `trl_agentic.lineage`; before, the last call's).
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
        """Calls after the first that did not continue an earlier call (forks, side calls, sub-agents' first calls)."""
        return sum(1 for turn in self.turns[1:] if turn.prompt_source != "continued")

    @property
    def num_main_line_forks(self) -> int:
        """Calls of the main line after its first that did not continue an earlier call (0: the main line is one
        token-exact sequence); counts only once the episode closed and its conversations are labelled."""
        main = [turn for turn in self.turns if turn.role == "main"]
        return sum(1 for turn in main[1:] if turn.prompt_source != "continued")

    @property
    def num_sampled_tokens(self) -> int:
        return sum(len(turn.completion_ids) for turn in self.turns)

    @property
    def versions(self) -> list[int]:
        """The policy version that sampled each sampled token of the episode, turn after turn (one per token of
        `num_sampled_tokens`)."""
        return [version for turn in self.turns for version in turn.versions]

    @property
    def num_tool_calls(self) -> int:
        return sum(turn.num_tool_calls for turn in self.turns)

    @property
    def num_malformed_tool_calls(self) -> int:
        return sum(turn.malformed_tool_call for turn in self.turns)

    @property
    def total_drift(self) -> int:
        return sum(turn.drift for turn in self.turns)

    @property
    def num_replayed_calls(self) -> int:
        """Calls answered from the parent's record (a branch episode's replayed prefix, `ReplaySpec`)."""
        return sum(turn.replayed for turn in self.turns)

    @property
    def replay(self) -> dict[str, Any] | None:
        """What replay did in a branch episode (`metadata["replay"]`, set when it closes): `parent`, `branch_point`,
        `replayed_calls`, `diverged`, `divergence`; `None` for an episode that was not a branch."""
        return self.metadata.get(REPLAY_KEY)

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "turns"}
        data = jsonable(data)
        data["turns"] = [turn.to_dict() for turn in self.turns]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Episode:
        data = dict(data)
        data["turns"] = [Turn.from_dict(t) for t in data.get("turns", [])]
        return cls(**data)

    def to_json(self) -> str:
        return json_text(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Episode:
        return cls.from_dict(json.loads(text))


REPLAY_KEY = "replay"  # `Episode.metadata` key of a branch episode's replay summary


@dataclass
class ReplaySpec:
    """A recorded main line to replay, and where the branch leaves it: what a branch episode is opened with.

    The endpoint answers the branch's model calls `0 .. branch_point - 1` with `calls[j]`'s recorded completion (ids,
    logprobs, the answer message and its policy versions unchanged, nothing sampled) as long as each request renders
    to exactly `calls[j].prompt_ids`; from call `branch_point` on, or from the first call that does not match, it
    samples. See `docs/tree_rollouts.md`.

    Args:
        calls: the parent's model calls in the order it made them (its recorded turns, cancelled ones left out).
        branch_point: `k`, the first call sampled fresh (`0 <= k <= len(calls)`; `0` samples everything).
        parent_id: the parent episode's id (recorded in the branch's `metadata["replay"]`).
    """

    calls: list[Turn]
    branch_point: int
    parent_id: str | None = None

    def __post_init__(self):
        if not isinstance(self.branch_point, int) or not 0 <= self.branch_point <= len(self.calls):
            raise ValueError(
                f"branch_point={self.branch_point!r} is out of range: the recorded episode made {len(self.calls)} "
                f"model calls, so a branch point is an int in [0, {len(self.calls)}]."
            )

    @classmethod
    def from_episode(cls, episode: Episode, branch_point: int) -> ReplaySpec:
        """Replay `episode`'s calls before `branch_point` (its turns in order, cancelled calls left out)."""
        calls = [turn for turn in episode.turns if turn.finish_reason != "cancelled"]
        return cls(calls, branch_point, episode.id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "calls": [turn.to_dict() for turn in self.calls],
            "branch_point": self.branch_point,
            "parent_id": self.parent_id,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplaySpec:
        return cls(
            [Turn.from_dict(t) for t in data.get("calls") or []], data.get("branch_point"), data.get("parent_id")
        )


MAX_TRACE_DEPTH = 100  # nesting levels kept in a trace (request bodies are already capped at 64 by the endpoint)


def jsonable(value: Any, max_depth: int = MAX_TRACE_DEPTH) -> Any:
    """A copy of `value` that `json.dumps(..., allow_nan=False)` writes and UTF-8 encodes, whatever `value` holds.

    Non-finite floats become the strings `"nan"`, `"inf"`, `"-inf"`; lone surrogates in strings become `"?"`; tuples and
    sets become lists; keys become strings; other objects become their `repr`; nesting deeper than `max_depth` (or a
    cycle) is cut with a marker string.

    Example:

    ```python
    >>> jsonable({"x": float("nan"), "y": ("a", "\\ud800"), 3: object}, max_depth=4)
    {'x': 'nan', 'y': ['a', '?'], '3': "<class 'object'>"}
    ```
    """

    def convert(item: Any, depth: int) -> Any:
        kind = type(item)
        if item is None or kind is bool or kind is int:
            return item
        if kind is str:
            return item if item.isascii() else _utf8_text(item)
        if kind is float:
            return item if math.isfinite(item) else repr(item)
        if isinstance(item, dict | list | tuple | set | frozenset):
            if depth >= max_depth:
                return f"<cut: nested deeper than {max_depth} levels>"
            if isinstance(item, dict):
                return {_utf8_text(str(k)): convert(v, depth + 1) for k, v in item.items()}
            return [convert(v, depth + 1) for v in item]
        if isinstance(item, bool | int):
            return int(item) if kind is not bool else bool(item)
        if isinstance(item, float):
            return convert(float(item), depth)
        if isinstance(item, str):
            return convert(str(item), depth)
        return _utf8_text(_safe_repr(item))

    return convert(value, 0)


def json_text(value: Any) -> str:
    """`value` as one line of JSON that always encodes to UTF-8 (see `jsonable`): what trace files and responses use.

    Example:

    ```python
    >>> json_text({"result": float("inf")})
    '{"result": "inf"}'
    ```
    """
    return json.dumps(jsonable(value), ensure_ascii=False, allow_nan=False)


def _utf8_text(text: str) -> str:
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def _safe_repr(item: Any) -> str:
    try:
        return repr(item)[:10_000]
    except Exception as error:  # noqa: BLE001 - a broken __repr__ must not break the trace
        return f"<unrepresentable {type(item).__name__}: {type(error).__name__}>"


def weighted_reward(episode: Episode, weights: dict[str, float]) -> float | None:
    """The episode's reward as TRL sums it: its kept rewards (`keep_episode_rewards`) times the reward functions'
    `weights` (by name), the unscorable ones left out; `None` when none scored it.

    Example:

    ```python
    >>> weighted_reward(Episode("e", metadata={"rewards": {"right": 1.0, "short": None}}), {"right": 0.5, "short": 1.0})
    0.5
    ```
    """
    values = [(weights[name], v) for name, v in (episode.metadata.get("rewards") or {}).items() if v is not None]
    return sum(w * v for w, v in values) if values else None
