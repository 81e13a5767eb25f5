"""Episode registry: keys, per-episode token history, and how each new call's prompt ids are built."""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..trace import Episode, Turn
from .chat import ChatRenderer, RenderedContext, common_prefix_length
from .protocol import comparable_message, template_message


# Why a turn was rendered fresh although the episode had earlier turns.
FORK_HISTORY_REWRITTEN = "history_rewritten"  # shares a message prefix with a turn, but not that turn + its answer
FORK_TEMPLATE = "template_not_append_only"  # a continuation, but the template re-renders earlier messages
FORK_TOOLS_CHANGED = "tools_changed"  # a continuation, but with different tools (the system block changes)
SIDE_CALL = "side_call"  # shares nothing with the episode so far (a title or summary request)


@dataclass
class EpisodeLimits:
    """Per-episode caps; a call over a cap is answered 400 `episode_limit_exceeded` and flags the episode.

    Args:
        max_turns: most model calls (each choice of `n > 1` counts as one).
        max_episode_tokens: most sampled tokens over the whole episode (a call's `max_tokens` is cut to what is left).
    """

    max_turns: int | None = None
    max_episode_tokens: int | None = None


@dataclass
class PromptPlan:
    """How the prompt of a call was built; `context` fingerprints the request rendered without generation prompt."""

    prompt_ids: list[int]
    source: str
    parent: int | None
    drift: int
    fork_reason: str | None
    context: RenderedContext | None = None


@dataclass
class _TurnHistory:
    """What the continuation check needs of a recorded turn (kept beside the Turn, not serialized)."""

    messages: list[dict]  # comparable request messages + the comparable assistant message we returned
    tools: list[dict] | None
    context: RenderedContext | None  # the request rendered without the generation prompt


@dataclass
class EpisodeSession:
    episode: Episode
    key: str
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    opened_at: float = field(default_factory=time.monotonic)
    closed: bool = False
    in_flight: int = 0
    flags: set[str] = field(default_factory=set)  # "context_overflow", "limit_exceeded"
    late_turns: int = 0  # calls that finished after the episode was closed (not recorded)
    _histories: list[_TurnHistory] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def plan_prompt(self, renderer: ChatRenderer, messages: list[dict], tools: list[dict] | None) -> PromptPlan:
        """Token-in continuation from the turn whose history is the longest prefix of `messages`, else a render.

        `messages` are normalized (`template_message`). One render of the request to text is all a continuation
        costs: only the new messages are tokenized.
        """
        with self._lock:
            turns = list(self.episode.turns)
            histories = list(self._histories)
        text = renderer.render_text(messages, tools)
        context = renderer.context_of(text, messages, tools)
        comparable = [comparable_message(m) for m in messages]

        # The parent: the latest turn whose messages + answer are a strict prefix of this request.
        best, best_len, best_shared, best_shared_len = None, -1, None, 0
        for turn, history in zip(reversed(turns), reversed(histories)):
            n = len(history.messages)
            if best_len < n < len(comparable) and history.messages[-1] == comparable[n - 1] and (
                history.messages[:-1] == comparable[: n - 1]
            ):
                best, best_len = turn, n
            if best is None:
                shared = _common_messages(history.messages, comparable)
                if shared > best_shared_len:
                    best_shared, best_shared_len = turn, shared

        fork_reason = None
        if best is not None:
            history = histories[best.index]
            if (history.tools or None) != (tools or None):
                fork_reason = FORK_TOOLS_CHANGED
            elif history.context is not None:
                continuation = renderer.continuation(history.context, text, best.completion_ids)
                if continuation is not None:
                    prompt = best.prompt_ids + best.completion_ids + continuation.glue + continuation.suffix
                    return PromptPlan(prompt, "continued", best.index, 0, None, context)
                fork_reason = FORK_TEMPLATE
            else:
                fork_reason = FORK_TEMPLATE
            best_shared = best
        elif turns:
            fork_reason = FORK_HISTORY_REWRITTEN if best_shared is not None else SIDE_CALL

        prompt = renderer.encode(text)
        drift = 0
        if best_shared is not None:
            exact = best_shared.prompt_ids + best_shared.completion_ids
            drift = len(exact) - common_prefix_length(exact, prompt)
        return PromptPlan(prompt, "rendered", None, drift, fork_reason, context)

    def record(self, turn: Turn, messages: list[dict], tools: list[dict] | None,
               context: RenderedContext | None = None) -> bool:
        """Append a finished turn; returns False (and counts it) when the episode was closed meanwhile."""
        history = [comparable_message(m) for m in messages]
        history.append(comparable_message(template_message(turn.response_message)))
        with self._lock:
            if self.closed:
                self.late_turns += 1
                return False
            turn.index = len(self.episode.turns)
            self.episode.turns.append(turn)
            self._histories.append(_TurnHistory(history, tools, context))
            self.episode.messages = turn.request_messages + [turn.response_message]
            return True

    def close(self, status: str | None = None, result: Any = None, error: str | None = None) -> Episode:
        with self._lock:
            if not self.closed:
                self.closed = True
                episode = self.episode
                episode.wall_time = time.monotonic() - self.opened_at
                # A failure the endpoint saw outranks an agent that carried on and returned normally.
                if status in (None, "ok", "running"):
                    status = next((f for f in ("context_overflow", "limit_exceeded") if f in self.flags), "ok")
                episode.status = status
                episode.result = result
                episode.error = error
                if self.late_turns:
                    episode.metadata["late_turns"] = self.late_turns
            return self.episode


def _common_messages(a: list[dict], b: list[dict]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class EpisodeRegistry:
    """All open episodes of an endpoint, by id and by key (both unguessable); closing one forgets it."""

    def __init__(self):
        self._by_id: dict[str, EpisodeSession] = {}
        self._by_key: dict[str, EpisodeSession] = {}
        self._lock = threading.Lock()

    def open(
        self,
        task_index: int = 0,
        group_index: int = 0,
        metadata: dict[str, Any] | None = None,
        limits: EpisodeLimits | None = None,
    ) -> EpisodeSession:
        episode_id = f"ep-{secrets.token_hex(16)}"
        key = f"sk-ep-{secrets.token_urlsafe(32)}"
        episode = Episode(id=episode_id, task_index=task_index, group_index=group_index, metadata=metadata or {})
        session = EpisodeSession(episode=episode, key=key, limits=limits or EpisodeLimits())
        with self._lock:
            self._by_id[episode_id] = session
            self._by_key[key] = session
        return session

    def by_key(self, key: str) -> EpisodeSession | None:
        return self._by_key.get(key)

    def by_id(self, episode_id: str) -> EpisodeSession | None:
        return self._by_id.get(episode_id)

    def close(self, episode_id: str, status: str | None = None, result: Any = None, error: str | None = None):
        """Close an episode and forget it; returns the Episode with all its turns."""
        with self._lock:
            session = self._by_id.pop(episode_id, None)
            if session is None:
                raise KeyError(episode_id)
            self._by_key.pop(session.key, None)
        return session.close(status=status, result=result, error=error)

    def __len__(self) -> int:
        return len(self._by_id)
