"""Versions served side by side, and gradual rollout: a candidate policy takes a share of new episodes, is promoted
when its online reward holds up against the incumbent's, and is rolled back automatically when it does not.

Each optimizer step of online training makes a candidate version (an engine over a copy of the new weights). The
endpoint then serves two versions at once:
- **Per episode, never per call**: an episode is given its version when it opens (`assign`: the candidate with
  probability `candidate_share`, decided from the episode's id, so reproducible) and keeps that version's engine until
  it closes, whatever is promoted meanwhile. Every answer names the version that produced it (the header
  `x-trl-agentic-version`, the trace's `policy_version`, Chat Completions' `system_fingerprint`).
- **The rule** (`RolloutPolicy`): once the candidate has rewards for `min_episodes` episodes, compare its mean reward
  with the incumbent's over the same period (the incumbent's episodes rewarded since the candidate arrived; its
  all-time mean when it has none there). Candidate mean >= incumbent mean - `margin`: **promoted** (all new episodes
  go to it; the old incumbent is retired). Otherwise **rolled back** (no new episode goes to it; an alarm is logged
  with the reason; its weights stay where the trainer saved them, `path`). A candidate still on trial when a newer one
  arrives is **superseded**: the newer one is what the trainer's weights are now.
- **No request fails or stalls on a swap**: a retired or rolled-back version's engine keeps serving the episodes that
  opened on it, and is stopped only once they all closed (`sweep`, run by the app's background task).

Example:

```python
>>> versions = VersionManager(engine, RolloutPolicy(candidate_share=0.1, min_episodes=32, margin=0.05))
>>> app = create_app(engine, renderer, settings, store=store, versions=versions)
>>> await versions.add_candidate_async(new_engine, version=step)  # after an optimizer step
```
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any


logger = logging.getLogger(__name__)

VERSION_HEADER = "x-trl-agentic-version"
VERSION_STATES = ("incumbent", "candidate", "retired", "rolled_back", "superseded")


@dataclass
class RolloutPolicy:
    """How a candidate version is rolled out.

    Args:
        candidate_share: share of new episodes the candidate serves while on trial (0 < share <= 1).
        min_episodes: rewarded episodes the candidate needs before it is judged.
        margin: how much lower than the incumbent's its mean reward may be and still be promoted.
    """

    candidate_share: float = 0.1
    min_episodes: int = 32
    margin: float = 0.05

    def __post_init__(self):
        if not 0 < self.candidate_share <= 1:
            raise ValueError(f"candidate_share must be in (0, 1], not {self.candidate_share}.")
        if self.min_episodes < 1:
            raise ValueError(f"min_episodes must be at least 1, not {self.min_episodes}.")
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, not {self.margin}.")


@dataclass
class Decision:
    """A candidate's fate: `action` `"promoted"` or `"rolled_back"`, with the numbers behind it."""

    action: str
    version: int
    reason: str


@dataclass
class _Version:
    engine: Any
    state: str
    path: str | None = None
    rewards: list[float] = field(default_factory=list)  # every rewarded episode's reward
    window: list[float] = field(default_factory=list)  # the incumbent's, since the current candidate arrived
    sessions: list = field(default_factory=list)  # episodes opened on it and not yet seen closed
    episodes: int = 0


class VersionManager:
    """The versions an endpoint serves, the engine of each episode, and the rollout rule.

    Args:
        engine: the incumbent's engine (its `policy_version` is the incumbent's version).
        policy: the [`RolloutPolicy`].
        seed: mixed into the per-episode draw.
    """

    def __init__(self, engine: Any, policy: RolloutPolicy | None = None, seed: int = 0):
        self.policy = policy or RolloutPolicy()
        self.seed = seed
        self.incumbent: int = int(getattr(engine, "policy_version", 0))
        self.candidate: int | None = None
        self.decisions: list[Decision] = []
        self._versions: dict[int, _Version] = {self.incumbent: _Version(engine, "incumbent")}
        self._lock = threading.Lock()

    # Serving

    def assign(self, episode_id: str) -> int:
        """The version a new episode runs on."""
        with self._lock:
            if self.candidate is None:
                return self.incumbent
            digest = hashlib.blake2b(f"{self.seed}:{episode_id}".encode(), digest_size=8).digest()
            draw = int.from_bytes(digest, "big") / 2**64
            return self.candidate if draw < self.policy.candidate_share else self.incumbent

    def attach(self, session) -> None:
        """Give a newly opened episode its version and that version's engine (`session.version`, `session.engine`)."""
        version = self.assign(session.episode.id)
        with self._lock:
            entry = self._versions[version]
            entry.sessions.append(session)
            entry.episodes += 1
        session.version, session.engine = version, entry.engine

    def engine_of(self, version: int) -> Any | None:
        """A version's engine, `None` once it was stopped (or never served)."""
        with self._lock:
            entry = self._versions.get(version)
            return None if entry is None else entry.engine

    def add_candidate(self, engine: Any, version: int, path: str | None = None) -> None:
        """Put a new version on trial (its engine started already; `path`: where its weights are saved). A
        candidate still on trial is superseded."""
        engine.policy_version = version
        with self._lock:
            if version in self._versions:
                raise ValueError(f"Version {version} is served already; each optimizer step makes a new one.")
            if self.candidate is not None:
                self._versions[self.candidate].state = "superseded"
            self._versions[version] = _Version(engine, "candidate", path)
            self.candidate = version
            self._versions[self.incumbent].window = []

    async def add_candidate_async(self, engine: Any, version: int, path: str | None = None) -> None:
        """Start `engine` (on the server's event loop) and put it on trial."""
        await engine.start()
        self.add_candidate(engine, version, path)

    # The rule

    def record_reward(self, version: int | None, value: float) -> Decision | None:
        """Count one rewarded episode of `version`; returns the decision it triggered, if any."""
        with self._lock:
            entry = self._versions.get(version) if version is not None else None
            if entry is None:
                return None
            entry.rewards.append(float(value))
            if version == self.incumbent:
                entry.window.append(float(value))
            if version != self.candidate or len(entry.rewards) < self.policy.min_episodes:
                return None
            decision = self._decide(version, entry)
            self.decisions.append(decision)
        log = logger.warning if decision.action == "rolled_back" else logger.info
        log("[trl-agentic %s] version %d: %s", decision.action, decision.version, decision.reason)
        return decision

    def _decide(self, version: int, entry: _Version) -> Decision:
        incumbent = self._versions[self.incumbent]
        candidate_mean = sum(entry.rewards) / len(entry.rewards)
        reference = incumbent.window or incumbent.rewards
        over = "over the same period" if incumbent.window else "all time (none rewarded during the trial)"
        if not reference:
            self._promote(version, entry)
            return Decision("promoted", version, f"mean reward {candidate_mean:.3f}; the incumbent has none to compare")
        incumbent_mean = sum(reference) / len(reference)
        numbers = (
            f"mean reward {candidate_mean:.3f} over {len(entry.rewards)} episodes vs the incumbent's "
            f"{incumbent_mean:.3f} over {len(reference)} ({over}), margin {self.policy.margin:g}"
        )
        if candidate_mean >= incumbent_mean - self.policy.margin:
            self._promote(version, entry)
            return Decision("promoted", version, numbers)
        entry.state, self.candidate = "rolled_back", None
        kept = f"; its weights stay at {entry.path}" if entry.path else ""
        return Decision("rolled_back", version, numbers + kept)

    def _promote(self, version: int, entry: _Version) -> None:
        self._versions[self.incumbent].state = "retired"
        entry.state, self.incumbent, self.candidate = "incumbent", version, None

    # Reporting and cleanup

    def describe(self) -> list[dict]:
        """Every version: state, share of new episodes, episodes served, rewarded episodes, mean reward."""
        with self._lock:
            rows = []
            for version, entry in sorted(self._versions.items()):
                if entry.state == "candidate":
                    share = self.policy.candidate_share
                elif entry.state == "incumbent":
                    share = 1.0 - (self.policy.candidate_share if self.candidate is not None else 0.0)
                else:
                    share = 0.0
                rows.append(
                    {
                        "version": version,
                        "state": entry.state,
                        "share": share,
                        "episodes": entry.episodes,
                        "rewarded": len(entry.rewards),
                        "mean_reward": sum(entry.rewards) / len(entry.rewards) if entry.rewards else None,
                        "path": entry.path,
                        "serving": entry.engine is not None,
                    }
                )
            return rows

    async def sweep(self) -> None:
        """Stop the engines of versions that serve no new episode (retired, rolled back, superseded) once every
        episode opened on them closed, and nothing of theirs is in flight."""
        done = []
        with self._lock:
            for entry in self._versions.values():
                entry.sessions = [s for s in entry.sessions if not (s.closed and s.in_flight == 0)]
                if entry.state not in ("incumbent", "candidate") and entry.engine is not None and not entry.sessions:
                    done.append(entry.engine)
                    entry.engine = None
        for engine in done:
            await engine.stop()
