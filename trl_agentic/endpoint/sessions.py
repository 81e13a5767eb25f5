"""Episode registry: keys, per-episode token history, and how each new call's prompt ids are built.

State is bounded (issue #9: episodes opened and never closed stayed forever): at most `max_open` episodes at once, and
an episode without a call for `idle_timeout` seconds is closed with status `cancelled`; its trace stays retrievable
(`get`/`close`) among the last `KEPT_REAPED` reaped episodes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ..generation.engine import derive_seed
from ..lineage import label_conversations
from ..trace import REPLAY_KEY, Episode, ReplaySpec, Turn
from .chat import ChatRenderer, common_prefix_length
from .protocol import comparable_message, template_message


_EPISODE_ID = re.compile(r"ep-[0-9a-f]{32}")


def redact_episode_ids(text: str) -> str:
    """`text` with every episode id replaced by `ep-<redacted>` (ids are the secret of the path route).

    Example:

    ```python
    >>> redact_episode_ids("POST /episodes/ep-0123456789abcdef0123456789abcdef/v1/chat/completions")
    'POST /episodes/ep-<redacted>/v1/chat/completions'
    ```
    """
    return _EPISODE_ID.sub("ep-<redacted>", text)


# Why a turn was rendered fresh although the episode had earlier turns.
FORK_HISTORY_REWRITTEN = "history_rewritten"  # shares a message prefix with a turn, but not that turn + its answer
FORK_TEMPLATE = "template_not_append_only"  # a continuation, but the template re-renders earlier messages
FORK_TOOLS_CHANGED = "tools_changed"  # a continuation, but with different tools (the system block changes)
# Shares nothing with the episode so far: a new conversation (a title request, a sub-agent, or the task's own
# conversation after a title request). Which conversation is the main line is decided when the episode closes
# (`trl_agentic.lineage`), not by this.
SIDE_CALL = "side_call"


@dataclass
class EpisodeLimits:
    """Per-episode caps; a call over a cap is answered 400 `episode_limit_exceeded` and flags the episode.

    Args:
        max_turns: most model calls (each choice of `n > 1` counts as one).
        max_episode_tokens: most sampled tokens over the whole episode (a call's `max_tokens` is cut to what is left).

    Calls in flight count as if they sampled their whole `max_tokens`, from the moment they are admitted, streamed or
    not, in every wire format (`EpisodeSession.admit`). A call cancelled because its client went away counts toward
    neither cap: nothing of it is recorded or trained, and the agent's retry (what SDKs do after a timeout) is served
    as the call would have been. Its sampling is stopped when the disconnect is seen; an agent that keeps hanging up
    is bounded by the episode's timeout, not by these caps.
    """

    max_turns: int | None = None
    max_episode_tokens: int | None = None


def message_key(message: dict) -> bytes:
    """A digest of what must match for a message to count as the same one (`comparable_message`): canonical JSON,
    keys sorted, integral floats as ints (`==`, which compared messages before keys did, holds 1 == 1.0)."""
    text = json.dumps(
        _integral_floats(comparable_message(message)),
        sort_keys=True,
        ensure_ascii=False,
        separators=(",", ":"),
        default=repr,
    )
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def prefix_keys(messages: list[dict], start: bytes = b"") -> list[bytes]:
    """Chained keys: `prefix_keys(m)[k]` identifies `m[: k + 1]` (normalized messages) as `message_key` sees them;
    `start` is the key of the messages before `messages`, so a continued turn extends its parent's keys."""
    keys = []
    for message in messages:
        start = hashlib.blake2b(start + message_key(message), digest_size=16).digest()
        keys.append(start)
    return keys


def _call_ids(message: dict) -> list[str]:
    """The ids of an assistant message's tool calls (empty ones dropped)."""
    return [call["id"] for call in message.get("tool_calls") or () if call.get("id")]


def _integral_floats(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _integral_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral_floats(v) for v in value]
    return value


@dataclass
class PromptPlan:
    """How the prompt of a call was built; `keys` are the request's `prefix_keys`, recorded with its turns."""

    prompt_ids: list[int]
    source: str
    parent: int | None
    drift: int
    fork_reason: str | None
    keys: list[bytes] | None = None


@dataclass
class _TurnHistory:
    """What the continuation check needs of a recorded turn (kept beside the Turn, not serialized)."""

    messages: list[dict]  # the request's messages as the template read them (normalized)
    tools: list[dict] | None
    answer: dict | None = None  # the answer we returned, normalized
    keys: list[bytes] | None = None  # `prefix_keys` of messages + answer
    delivered: bool = True  # False for a call cancelled before its answer reached the agent: never a parent


class EpisodeClosedError(Exception):
    """A call started or finished on an episode that was closed meanwhile."""


class EpisodeLimitError(Exception):
    """A call over one of the episode's `EpisodeLimits`; the message says which."""


class TooManyOpenEpisodesError(Exception):
    """The registry holds `max_open` episodes already."""


@dataclass
class EpisodeSession:
    episode: Episode
    key: str
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    seed: int | None = None  # the episode's seed: its calls' seeds derive from it (`call_seed`)
    user: str | None = None  # the user key's user, for an episode the endpoint opened for it (`users.py`)
    # With versions served side by side (`versions.py`): the version the episode runs on, and that version's engine
    # (`None`: the endpoint's one engine).
    version: int | None = None
    engine: Any = None
    opened_at: float = field(default_factory=time.monotonic)
    closed: bool = False
    in_flight: int = 0  # choices admitted and not finished yet
    reserved_tokens: int = 0  # `max_tokens` of the choices in flight, held against `max_episode_tokens`
    counted_turns: int = 0  # recorded turns that count toward `max_turns` (all but cancelled ones)
    counted_tokens: int = 0  # their sampled tokens, counted toward `max_episode_tokens`
    last_active: float = field(default_factory=time.monotonic)
    flags: set[str] = field(default_factory=set)  # "context_overflow", "limit_exceeded"
    late_turns: int = 0  # choices still being sampled when the episode closed (dropped, counted in the trace)
    # Responses API (`previous_response_id`): response id -> (the id it continued, the messages it added: its input
    # items and its answer, as chat messages). Lives and dies with the episode.
    responses: dict[str, tuple[str | None, list[dict]]] = field(default_factory=dict)
    # Chat Completions: the validated prefix of the last request's messages (`chat_completions.ValidatedPrefix`), so
    # that a call re-sending them validates and normalizes only its new messages (issue 29). A hint: checked exactly.
    chat_prefix: Any = None
    _histories: list[_TurnHistory] = field(default_factory=list)
    # Delivered turns by key (issue #12: finding the parent by comparing the request with every turn's history made
    # an episode O(T²)): turns by the key of their answer (latest last), and the latest turn whose history (request +
    # answer) has a prefix key (what a fork shares most with).
    _by_answer: dict[bytes, list[int]] = field(default_factory=dict)
    _by_prefix: dict[bytes, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _calls: itertools.count = field(default_factory=itertools.count)  # indices of the episode's calls, in order
    # A branch episode: the parent's calls it replays before sampling (`replay_call`); `None` for any other episode.
    replay: ReplaySpec | None = None
    _replay_next: int = 0  # index of the next call in the replayed main line
    _replay_live: bool = True  # False once replay ended (the branch point reached, or a request that did not match)
    _replay_divergence: dict | None = None

    def replay_call(self, prompt_ids: list[int], choices: int, max_tokens: int) -> tuple[Turn | None, dict | None]:
        """The recorded call that answers this call of a branch episode, or why replay ends here.

        Calls take the replayed main line's indices in the order they are planned. Call `j < branch_point` is
        replayed when its prompt ids equal recorded call `j`'s exactly (forced tool-call tokens included), it asks
        for one choice, and the recorded completion fits its `max_tokens`. Returns `(recorded turn, None)` to replay,
        `(None, divergence)` for the call where replay ends early (the divergence goes on its turn), `(None, None)`
        to sample (no replay, or replay is over).
        """
        replay = self.replay
        if replay is None:
            return None, None
        with self._lock:
            if not self._replay_live:
                return None, None
            j = self._replay_next
            self._replay_next += 1
            if j >= replay.branch_point:
                self._replay_live = False
                return None, None
            recorded = replay.calls[j]
            expected = recorded.prompt_ids
            divergence = None
            if prompt_ids != expected:
                at = common_prefix_length(prompt_ids, expected)
                divergence = {
                    "call": j,
                    "reason": "prompt_mismatch",
                    "token_index": at,
                    "recorded_tokens": len(expected),
                    "request_tokens": len(prompt_ids),
                }
            elif choices != 1:
                divergence = {"call": j, "reason": "choices", "detail": f"the call asks for n={choices} choices"}
            elif len(recorded.completion_ids) > max_tokens:
                divergence = {
                    "call": j,
                    "reason": "max_tokens",
                    "detail": f"the recorded completion has {len(recorded.completion_ids)} tokens, the call allows "
                    f"{max_tokens}",
                }
            if divergence is None:
                return recorded, None
            self._replay_live = False
            self._replay_divergence = divergence
            return None, divergence

    def call_seed(self) -> int | None:
        """The seed of the episode's next model call: derived from the episode's seed and the call's index in the
        episode (every call takes an index, whether it brings a seed of its own or not), so that what an episode
        samples does not depend on how its calls interleave with other episodes' (issue 29). `None` for an episode
        opened without a seed (the engine draws one)."""
        index = next(self._calls)  # atomic: one C call under the GIL
        return None if self.seed is None else derive_seed(self.seed, index)

    def admit(self, choices: int) -> int | None:
        """Check the episode's limits for a call of `choices` choices and, in the same step, count it in flight: the
        one admission of every call, streamed or not, before anything else is decided (issue 29: streamed calls were
        counted only once their stream started, and six concurrent ones all passed a cap of two).

        Returns the tokens each choice may sample (`None`: no token budget), held against the budget until
        `finish_call` (`shrink` gives back what the call will not use). Raises `EpisodeClosedError`, or
        `EpisodeLimitError` (the episode is flagged `limit_exceeded`).
        """
        limits = self.limits
        with self._lock:
            if self.closed:
                raise EpisodeClosedError(self.episode.id)
            if limits.max_turns is not None and self.counted_turns + self.in_flight + choices > limits.max_turns:
                self.flags.add("limit_exceeded")
                raise EpisodeLimitError(f"Episode limit reached: at most {limits.max_turns} model calls.")
            budget = None
            if limits.max_episode_tokens is not None:
                # Each choice may use an equal share of what is left, counting what calls in flight may sample.
                left = limits.max_episode_tokens - self.counted_tokens - self.reserved_tokens
                budget = left // choices
                if budget <= 0:
                    self.flags.add("limit_exceeded")
                    raise EpisodeLimitError(
                        f"Episode limit reached: at most {limits.max_episode_tokens} sampled tokens."
                    )
                self.reserved_tokens += budget * choices
            self.in_flight += choices
            self.last_active = time.monotonic()
            return budget

    def shrink(self, tokens: int) -> None:
        """Give back `tokens` of an admitted call's reservation (its `max_tokens` came out lower than its share)."""
        with self._lock:
            self.reserved_tokens -= tokens

    def finish_call(
        self,
        choices: int,
        reserved_tokens: int,
        turns: list[tuple[Turn, list[dict], list[dict] | None, list[bytes] | None]],
    ) -> bool:
        """Release what `admit` held and record the call's turns `(turn, messages, tools, keys)`: `messages` as
        the template read them (normalized), `keys` their `prefix_keys` (computed when `None`).

        Returns False when the episode closed meanwhile: the turns are dropped (the close counted them as late).
        """
        histories = []
        for turn, messages, tools, keys in turns:
            if turn.finish_reason == "cancelled":
                histories.append(_TurnHistory(messages, tools, delivered=False))
                continue
            answer = template_message(turn.response_message)
            keys = prefix_keys(messages) if keys is None else keys
            histories.append(
                _TurnHistory(messages, tools, answer, keys + prefix_keys([answer], keys[-1] if keys else b""))
            )
        with self._lock:
            self.in_flight -= choices
            self.reserved_tokens -= reserved_tokens
            self.last_active = time.monotonic()
            if self.closed:
                return False
            for (turn, *_), history in zip(turns, histories, strict=True):
                turn.index = len(self.episode.turns)
                if history.delivered and turn.prompt_source == "rendered":
                    turn.forked_from = self._shared_turn(history.keys[: len(history.messages)])
                self.episode.turns.append(turn)
                self._histories.append(history)
                if turn.finish_reason != "cancelled":
                    self.counted_turns += 1
                    self.counted_tokens += len(turn.completion_ids)
                if history.delivered:
                    self.episode.messages = turn.request_messages + [turn.response_message]
                    self._by_answer.setdefault(message_key(history.answer), []).append(turn.index)
                    for key in history.keys:
                        self._by_prefix[key] = turn.index
            return True

    def _shared_turn(self, keys: list[bytes]) -> int | None:
        """The latest recorded turn whose history shares the longest message prefix with a request of `keys` (what
        lineage joins a fork to, `Turn.forked_from`). Looked up when the turn is recorded, not when it was planned: a
        call that started with the episode's first (concurrent title and task requests) is compared with the turns
        recorded meanwhile, and a second choice of the same request with the first."""
        return next((self._by_prefix[key] for key in reversed(keys) if key in self._by_prefix), None)

    def _find_parent(self, messages: list[dict]) -> tuple[int | None, bool]:
        """The latest turn whose history (request + answer) is the longest strict prefix of `messages`, and whether
        its request is the same as `messages`' field for field (`==`, not just `comparable_message`).

        Candidates come from the key of an assistant message, scanning back from the end (the new messages come
        first, then the answer they follow): O(new messages) keys, then one comparison of the prefix at C speed.
        Among candidates with the same history, the one whose answer carries the request's tool-call ids wins (issue
        40: two sub-agents sent the same request and got the same answer; the keys ignore ids, which agents may
        regenerate, so the first sub-agent's next call continued the second's turn). Without ids, the latest.
        """
        for k in range(len(messages) - 2, -1, -1):  # k: where the parent's answer would be
            if messages[k]["role"] != "assistant":
                continue
            ids = _call_ids(messages[k])
            found = None
            for index in reversed(self._by_answer.get(message_key(messages[k])) or ()):
                history = self._histories[index]
                if len(history.messages) != k:
                    continue
                if messages[:k] == history.messages:
                    same = True
                elif [comparable_message(m) for m in messages[:k]] == [comparable_message(m) for m in history.messages]:
                    same = False
                else:
                    continue
                if ids and ids == _call_ids(history.answer):
                    return index, same
                found = found or (index, same)
                if not ids:
                    break  # nothing to tell candidates apart by: the latest
            if found is not None:
                return found
        return None, False

    def plan_prompt(self, renderer: ChatRenderer, messages: list[dict], tools: list[dict] | None) -> PromptPlan:
        """Token-in continuation from the turn whose history is the longest prefix of `messages`, else a render.

        `messages` are normalized (`template_message`). The parent is found by key lookups, and a continuation
        renders and tokenizes only the new messages (`ChatRenderer.continue_from`): a call's cost does not grow with
        the episode. A fork renders the whole request fresh.
        """
        with self._lock:
            parent, same = self._find_parent(messages)
            first_call = not self._by_prefix  # only delivered turns are keyed
            best = self.episode.turns[parent] if parent is not None else None
            history = self._histories[parent] if parent is not None else None

        fork_reason = shared = None
        if best is not None:
            n = len(history.messages)
            keys = history.keys + prefix_keys(messages[n + 1 :], history.keys[-1])
            if (history.tools or None) != (tools or None):
                fork_reason = FORK_TOOLS_CHANGED
            else:
                # Windows render the request's own messages: exact when the parent's are the same, field for field.
                continuation = renderer.continue_from(
                    history.messages, messages, tools, best.completion_ids, same_prefix=same
                )
                if continuation is not None:
                    prompt = best.prompt_ids + best.completion_ids + continuation.glue + continuation.suffix
                    return PromptPlan(prompt, "continued", best.index, 0, None, keys)
                fork_reason = FORK_TEMPLATE
            shared = parent
        else:
            keys = prefix_keys(messages)
            if not first_call:
                with self._lock:  # what the fork shares most with: the latest turn with the longest common prefix
                    shared = next((self._by_prefix[key] for key in reversed(keys) if key in self._by_prefix), None)
                fork_reason = FORK_HISTORY_REWRITTEN if shared is not None else SIDE_CALL

        prompt = renderer.render(messages, tools)
        drift = 0
        if shared is not None:
            with self._lock:
                base = self.episode.turns[shared]
            exact = base.prompt_ids + base.completion_ids
            drift = len(exact) - common_prefix_length(exact, prompt)
        return PromptPlan(prompt, "rendered", None, drift, fork_reason, keys)

    def record(
        self, turn: Turn, messages: list[dict], tools: list[dict] | None, keys: list[bytes] | None = None
    ) -> bool:
        """Append a finished turn (of a call not counted in flight); returns False when the episode was closed."""
        return self.finish_call(0, 0, [(turn, messages, tools, keys)])

    def close(self, status: str | None = None, result: Any = None, error: str | None = None) -> Episode:
        """Close the episode (idempotent: a second close returns the same Episode unchanged).

        Choices still being sampled will be dropped when they finish; they are counted now, as
        `metadata["late_turns"]`, since the trace is handed out before they finish. The episode's conversations and
        its main line are decided now, by lineage (`trl_agentic.lineage.label_conversations`; the task's prompt is
        taken from `metadata["task_prompt"]` when the episode was opened with one): `episode.messages` becomes the main
        line's final messages.
        """
        with self._lock:
            if not self.closed:
                self.closed = True
                episode = self.episode
                episode.wall_time = time.monotonic() - self.opened_at
                # A failure the endpoint saw outranks an agent that carried on and returned normally, and one that
                # crashed on the refusal (a harness exiting non-zero after a 400 past max_turns); its error is kept.
                seen = next((f for f in ("context_overflow", "limit_exceeded") if f in self.flags), None)
                if status in (None, "ok", "running"):
                    status = seen or "ok"
                elif status == "agent_error" and seen:
                    status = seen
                episode.status = status
                episode.result = result
                episode.error = error
                self.late_turns = self.in_flight
                if self.late_turns:
                    episode.metadata["late_turns"] = self.late_turns
                if self.replay is not None:
                    episode.metadata[REPLAY_KEY] = self._replay_summary()
                # The task's prompt (given at open) decides the main line; not kept: the episode has its messages
                label_conversations(episode, episode.metadata.pop("task_prompt", None))
            return self.episode

    def _replay_summary(self) -> dict[str, Any]:
        """A branch episode's `metadata["replay"]` (under the lock, at close)."""
        replay = self.replay
        replayed = sum(turn.replayed for turn in self.episode.turns)
        divergence = self._replay_divergence
        if divergence is None and replayed < replay.branch_point:
            # The agent ended (or failed) before reaching the branch point: the branch is not the parent's prefix.
            divergence = {
                "call": replayed,
                "reason": "ended_before_branch_point",
                "detail": f"the episode made {replayed} matching calls of the {replay.branch_point} to replay",
            }
        return {
            "parent": replay.parent_id,
            "branch_point": replay.branch_point,
            "replayed_calls": replayed,
            "diverged": divergence is not None,
            "divergence": divergence,
        }


KEPT_REAPED = 256  # idle-closed episodes whose traces stay retrievable (oldest dropped first)


class EpisodeRegistry:
    """All open episodes of an endpoint, by id and by key (both unguessable); closing one forgets it.

    Args:
        max_open: most episodes open at once; `open` raises `TooManyOpenEpisodesError` beyond it (`None`: no cap).
        idle_timeout: seconds without a call (and none in flight) after which `reap_idle` closes an episode with
            status `cancelled` (`None`: never).
    """

    def __init__(self, max_open: int | None = None, idle_timeout: float | None = None):
        self.max_open = max_open
        self.idle_timeout = idle_timeout
        self._by_id: dict[str, EpisodeSession] = {}
        self._by_key: dict[str, EpisodeSession] = {}
        self._reaped: OrderedDict[str, Episode] = OrderedDict()
        self._lock = threading.Lock()
        self.versions = None  # a `versions.VersionManager`: gives each new episode its version (set by `create_app`)

    def open(
        self,
        task_index: int = 0,
        group_index: int = 0,
        metadata: dict[str, Any] | None = None,
        limits: EpisodeLimits | None = None,
        seed: int | None = None,
        replay: ReplaySpec | None = None,
    ) -> EpisodeSession:
        """Open an episode; with a `seed`, each model call that brings no seed of its own samples from a seed derived
        from it and the call's index in the episode (`EpisodeSession.call_seed`). With a `replay`, a branch episode:
        its first calls are answered from the recorded ones (`EpisodeSession.replay_call`)."""
        episode_id = f"ep-{secrets.token_hex(16)}"
        key = f"sk-ep-{secrets.token_urlsafe(32)}"
        episode = Episode(id=episode_id, task_index=task_index, group_index=group_index, metadata=metadata or {})
        session = EpisodeSession(episode=episode, key=key, limits=limits or EpisodeLimits(), seed=seed, replay=replay)
        if self.max_open is not None and len(self._by_id) >= self.max_open:
            self.reap_idle()
        with self._lock:
            if self.max_open is not None and len(self._by_id) >= self.max_open:
                raise TooManyOpenEpisodesError(
                    f"{len(self._by_id)} episodes are open, the most this endpoint keeps (max_open_episodes="
                    f"{self.max_open}); close finished episodes first."
                )
            self._by_id[episode_id] = session
            self._by_key[key] = session
        if self.versions is not None:
            self.versions.attach(session)
        return session

    def by_key(self, key: str) -> EpisodeSession | None:
        return self._by_key.get(key)

    def by_id(self, episode_id: str) -> EpisodeSession | None:
        return self._by_id.get(episode_id)

    def reaped(self, episode_id: str) -> Episode | None:
        """The trace of an episode closed for idleness, if it is still kept."""
        with self._lock:
            return self._reaped.get(episode_id)

    def close(self, episode_id: str, status: str | None = None, result: Any = None, error: str | None = None):
        """Close an episode and forget it; returns the Episode with all its turns."""
        episode = self.finish(episode_id, status, result, error)
        self.forget(episode_id)
        return episode

    def finish(self, episode_id: str, status: str | None = None, result: Any = None, error: str | None = None):
        """Close an episode but keep it findable until `forget`: a caller that still has to serialise the trace
        must not lose it if that fails. An idle-reaped episode returns its trace (status `cancelled`)."""
        session = self._by_id.get(episode_id)
        if session is None:
            episode = self.reaped(episode_id)
            if episode is None:
                raise KeyError(episode_id)
            return episode
        return session.close(status=status, result=result, error=error)

    def forget(self, episode_id: str) -> None:
        with self._lock:
            session = self._by_id.pop(episode_id, None)
            if session is not None:
                self._by_key.pop(session.key, None)
            self._reaped.pop(episode_id, None)

    def reap_idle(self, now: float | None = None) -> list[str]:
        """Close (status `cancelled`) and forget the episodes idle for longer than `idle_timeout`; returns their ids.

        An episode with a call in flight is not idle, however long the call takes.
        """
        if self.idle_timeout is None:
            return []
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [
                s
                for s in self._by_id.values()
                if s.in_flight == 0 and not s.closed and now - s.last_active > self.idle_timeout and s.user is None
            ]  # a user key's episode ends by its own rule and is stored (`users.UserEpisodes.reap`)
        for session in idle:
            episode = session.close(
                status="cancelled", error=f"closed by the endpoint: no call for {self.idle_timeout:g}s"
            )
            with self._lock:
                self._by_id.pop(episode.id, None)
                self._by_key.pop(session.key, None)
                self._reaped[episode.id] = episode
                while len(self._reaped) > KEPT_REAPED:
                    self._reaped.popitem(last=False)
        return [s.episode.id for s in idle]

    def __len__(self) -> int:
        return len(self._by_id)
