"""Episodes of user keys: a plain client (an OpenAI, Anthropic or Gemini SDK, a CLI harness) points at the endpoint
with one user key and no per-episode handshake; the endpoint groups the key's calls into episodes itself.

A user key (`sk-user-...`, issued by `POST /admin/users`, stored hashed in the `EpisodeStore`, revocable) has at most
one open episode. Its first call opens one; every call until the episode ends goes to it (lineage then tells its
conversations apart, as for any episode). It ends on:
- an explicit end (`POST /v1/episodes/end` with the key),
- a reward for it (`POST /v1/feedback`, or the admin's `POST /admin/rewards`),
- `user_episode_idle_timeout` seconds without a call (and none in flight).
It is then closed with status `ok` and stored, with its user, in the store; the next call opens the next one. Every
answer to a user key carries its episode's id (header `x-trl-agentic-episode`), which feedback names.

A client may name its episode's task (`{"task": "..."}` on `POST /v1/episodes/end`, or the header `x-trl-agentic-task`
on any model call of the episode): the episode is stored with the task's fingerprint (`task_fingerprint`, a digest:
the task's text is not stored), and training groups episodes of one fingerprint for GRPO's baseline (same-task groups,
`online_trainer.py`). Real traffic repeats popular tasks; without a name, episodes are grouped by arrival.

Feedback is rate-limited per user (`feedback_per_minute`); a user reaches only its own episodes (another's id is
answered 404, as an unknown one). Nothing of a request but its messages, tools and sampling is recorded: no header,
so no secret a client sends along, reaches the store or the trainer.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import deque

from ..store import USER_KEY_PREFIX, EpisodeStore
from .sessions import EpisodeLimits, EpisodeRegistry, EpisodeSession


EPISODE_HEADER = "x-trl-agentic-episode"
TASK_HEADER = "x-trl-agentic-task"
MAX_TASK_LENGTH = 10_000


def task_fingerprint(task: str) -> str:
    """The stored fingerprint of a task a client named: `task-` and the first 16 bytes of its SHA-256, hex. Two
    episodes of one task (same text, whoever sent it) share it. `ValueError` for an empty or overlong name."""
    if not isinstance(task, str) or not task.strip():
        raise ValueError(f"A task is a non-empty string, not {task!r}.")
    if len(task) > MAX_TASK_LENGTH:
        raise ValueError(f"A task name is at most {MAX_TASK_LENGTH} characters, not {len(task)}.")
    return "task-" + hashlib.sha256(task.encode("utf-8")).hexdigest()[:32]


class UserEpisodes:
    """The open episode of each user key, closed into `store` when it ends.

    Args:
        store: where users live and closed episodes go.
        registry: the endpoint's episode registry (a user's episode is an ordinary episode there, with `user` set).
        idle_timeout: seconds without a call after which a user's episode ends.
        feedback_per_minute: most feedback calls a user may make in any 60 s.
        limits: each user episode's limits.
    """

    def __init__(
        self,
        store: EpisodeStore,
        registry: EpisodeRegistry,
        idle_timeout: float = 300.0,
        feedback_per_minute: int = 60,
        limits: EpisodeLimits | None = None,
    ):
        self.store, self.registry = store, registry
        self.idle_timeout, self.feedback_per_minute = idle_timeout, feedback_per_minute
        self.limits = limits or EpisodeLimits()
        self._open: dict[str, EpisodeSession] = {}
        self._feedback: dict[str, deque] = {}
        self._tasks: dict[str, str] = {}  # open episode id -> the fingerprint of the task its client named
        self._lock = threading.Lock()
        self.versions = None  # a `versions.VersionManager`: each episode's first reward counts toward its version

    @staticmethod
    def is_user_key(key: str) -> bool:
        return key.startswith(USER_KEY_PREFIX)

    def user(self, key: str) -> str | None:
        """The user of a key; `None` for an unknown or revoked one."""
        return self.store.user_for_key(key)

    def session_for(self, user: str) -> EpisodeSession:
        """The user's open episode, opened now if it has none."""
        with self._lock:
            session = self._open.get(user)
            if session is None or session.closed:
                session = self.registry.open(metadata={"user": user}, limits=self.limits)
                session.user = user
                self._open[user] = session
            return session

    def current(self, user: str) -> EpisodeSession | None:
        with self._lock:
            session = self._open.get(user)
        return None if session is None or session.closed else session

    def name_task(self, session: EpisodeSession, task: str) -> None:
        """Record the task an open episode's client named (`task_fingerprint`; the latest name wins)."""
        fingerprint = task_fingerprint(task)
        with self._lock:
            self._tasks[session.episode.id] = fingerprint

    def end(self, user: str, episode_id: str | None = None, task: str | None = None) -> str | None:
        """End the user's open episode (only if it is `episode_id`, when given) and store it, with the fingerprint of
        `task` when the client names one; returns its id, `None` when there was none to end."""
        fingerprint = None if task is None else task_fingerprint(task)
        with self._lock:
            session = self._open.get(user)
            if session is None or session.closed or (episode_id is not None and session.episode.id != episode_id):
                return None
            del self._open[user]
            if fingerprint is not None:
                self._tasks[session.episode.id] = fingerprint
        return self._store(session)

    def reap(self, now: float | None = None) -> list[str]:
        """End and store the user episodes idle for longer than `idle_timeout`."""
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [
                (user, s)
                for user, s in self._open.items()
                if s.in_flight == 0 and now - s.last_active > self.idle_timeout
            ]
            for user, _ in idle:
                del self._open[user]
        return [self._store(session) for _, session in idle]

    def allow_feedback(self, user: str, now: float | None = None) -> bool:
        """Count a feedback call of `user`; `False` when it is over `feedback_per_minute` in the last 60 s."""
        now = time.monotonic() if now is None else now
        with self._lock:
            times = self._feedback.setdefault(user, deque())
            while times and now - times[0] >= 60.0:
                times.popleft()
            if len(times) >= self.feedback_per_minute:
                return False
            times.append(now)
            return True

    def owns(self, user: str, episode_id: str) -> bool:
        """Whether `episode_id` is one of `user`'s episodes, open or stored."""
        current = self.current(user)
        if current is not None and current.episode.id == episode_id:
            return True
        stored, owner = self.store.owner(episode_id)
        return stored and owner == user

    def reward(self, episode_id: str, value: float, source: str, giver: str, note: str | None = None) -> int:
        """Store a reward; an episode still open ends first (a reward closes it). `KeyError` for an unknown one,
        `ValueError` for a value that is not a finite number."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"A reward is a finite number, not {value!r}.")
        session = self.registry.by_id(episode_id)
        user = getattr(session, "user", None) if session is not None else None
        if user is not None:
            self.end(user, episode_id)
        first = self.versions is not None and not self.store.rewards(episode_id)
        reward_id = self.store.add_reward(episode_id, float(value), source, giver, note)
        if first:
            episode = self.store.get_episode(episode_id)[0]
            version = episode.turns[0].policy_version if episode.turns else None
            self.versions.record_reward(
                version,
                float(value),
                task=episode.metadata.get("fingerprint"),
                tokens=episode.num_sampled_tokens,
                calls=len(episode.turns),
                malformed=episode.num_malformed_tool_calls,
            )
        return reward_id

    def close_all(self) -> None:
        """End and store every open user episode (the server is stopping)."""
        with self._lock:
            sessions = list(self._open.values())
            self._open.clear()
        for session in sessions:
            self._store(session)

    def _store(self, session: EpisodeSession) -> str:
        episode_id = session.episode.id
        episode = self.registry.finish(episode_id, status="ok")
        with self._lock:
            fingerprint = self._tasks.pop(episode_id, None)
        self.store.put_episode(episode, user=session.user, fingerprint=fingerprint)
        self.registry.forget(episode_id)  # only once it is stored: a failure above leaves it in the registry
        return episode_id
