"""Versions served side by side, and gradual rollout: a candidate policy takes a share of new episodes, is promoted
when its online reward holds up against the incumbent's, and is rolled back automatically when it does not.

Each optimizer step of online training makes a candidate version (an engine over a copy of the new weights). The
endpoint then serves two versions at once:
- **Per episode, never per call**: an episode is given its version when it opens (`assign`: the candidate with
  probability `candidate_share`, decided from the episode's id, so reproducible) and keeps that version's engine until
  it closes, whatever is promoted meanwhile. Every answer names the version that produced it (the header
  `x-trl-agentic-version`, the trace's `policy_version`, Chat Completions' `system_fingerprint`).
- **The rule** (`RolloutPolicy`): once the candidate has rewards for `min_episodes` episodes (and the incumbent as
  many over the same period, when it has any there), compare its mean reward with the incumbent's over the same
  period (the incumbent's episodes rewarded since the candidate arrived; its all-time mean when it has none there),
  with the standard error of the difference. **Paired by task** when clients
  name their tasks (`record_reward(..., task=fingerprint)`): the difference is the mean over the candidate's episodes
  of (its reward minus the incumbent's mean on the same task), counting only tasks both versions served in the
  window, with a standard error from the within-task variances. Two versions that served different task mixes are
  then compared on what they both did, not on how easy their tasks were (unpaired, a few popular tasks make the
  verdict over-confident both ways). Until `min_episodes` of the candidate's episodes pair, the trial goes on; a
  candidate that reaches `max_episodes` without them is judged unpaired (the reason says so). Shown no worse than the
  incumbent by more than `margin` at `confidence`: **promoted** (all new episodes go to it; the old incumbent is
  retired). Shown worse by more than `margin`, or not shown safe after `max_episodes`: **rolled back** (no new episode
  goes to it; an alarm is logged with the numbers; its weights stay where the trainer saved them, `path`). Between
  the two the trial goes on. A candidate still on trial when a newer one arrives is **superseded**.
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
import math
import threading
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, NamedTuple


logger = logging.getLogger(__name__)

VERSION_HEADER = "x-trl-agentic-version"
VERSION_STATES = ("incumbent", "candidate", "retired", "rolled_back", "superseded")


@dataclass
class RolloutPolicy:
    """How a candidate version is rolled out.

    Args:
        candidate_share: share of new episodes the candidate serves while on trial (0 < share <= 1).
        min_episodes: rewarded episodes the candidate needs before it is judged, and the incumbent over the same period
            (paired: on the same tasks); a candidate whose episodes fail fast gets its count first.
        margin: how much lower than the incumbent's its mean reward may be and still be promoted.
        confidence: how sure the verdict must be (one-sided, normal approximation of the difference of the two means):
            promoted once `diff - z * se >= -margin`, rolled back once `diff + z * se < -margin`, where `diff` is the
            candidate's mean reward minus the incumbent's and `se` its standard error; between the two the trial goes
            on. 0.5 (z = 0) compares the means alone.
        max_episodes: rewarded episodes after which a candidate not shown safe is rolled back (default
            `4 * min_episodes`): a harmful update's exposure is bounded by its share and this.
        length_guard: a guard beside the reward (`None`: off). Once both versions have `min_episodes`, a candidate
            whose mean sampled tokens per episode differ from the incumbent's by more than this factor (either way:
            0.5 rolls back above 1.5x and below 1/1.5x) is rolled back, whatever its reward. The reward alone let
            through learning-rate spikes that left answers as often right but ran every episode to the token limit,
            or cut them to a few tokens (docs/benchmarks.md, "Online RL").
        malformed_guard: a second guard beside the reward (`None`: off). Once both versions have `min_episodes`, a
            candidate whose malformed tool calls per model call (an episode's share, averaged over episodes) exceed
            the incumbent's by more than this, at `confidence`, is rolled back, whatever its reward: `0.15` rolls back
            once `diff - z * se > 0.15`. A learning-rate spike that broke the policy's tool-call format went through
            the reward (users' feedback on a weak incumbent and on a broken candidate differed by less than its noise)
            and the length guard (the broken calls were as long), and tripled this rate (docs/benchmarks.md).
    """

    candidate_share: float = 0.1
    min_episodes: int = 32
    margin: float = 0.05
    confidence: float = 0.95
    max_episodes: int | None = None
    length_guard: float | None = None
    malformed_guard: float | None = None

    def __post_init__(self):
        if not 0 < self.candidate_share <= 1:
            raise ValueError(f"candidate_share must be in (0, 1], not {self.candidate_share}.")
        if self.min_episodes < 1:
            raise ValueError(f"min_episodes must be at least 1, not {self.min_episodes}.")
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, not {self.margin}.")
        if not 0.5 <= self.confidence < 1:
            raise ValueError(f"confidence must be in [0.5, 1), not {self.confidence}.")
        if self.max_episodes is None:
            self.max_episodes = 4 * self.min_episodes
        if self.length_guard is not None and not self.length_guard > 0:
            raise ValueError(f"length_guard must be > 0 (or None: off), not {self.length_guard}.")
        if self.malformed_guard is not None and not 0 < self.malformed_guard < 1:
            raise ValueError(f"malformed_guard must be in (0, 1) (or None: off), not {self.malformed_guard}.")
        if self.max_episodes < self.min_episodes:
            raise ValueError(f"max_episodes ({self.max_episodes}) must be >= min_episodes ({self.min_episodes}).")


@dataclass
class Decision:
    """A candidate's fate: `action` `"promoted"` or `"rolled_back"`, with the numbers behind it."""

    action: str
    version: int
    reason: str


class _Reward(NamedTuple):
    """One rewarded episode: its reward, its task's fingerprint (`None`: not named), its sampled tokens, its model
    calls and how many of them held a malformed tool call (`None`: not reported)."""

    value: float
    task: str | None
    tokens: int | None
    calls: int | None = None
    malformed: int | None = None


@dataclass
class _Version:
    engine: Any
    state: str
    path: str | None = None
    rewards: list[_Reward] = field(default_factory=list)  # every rewarded episode
    window_start: int = 0  # the incumbent's `rewards[window_start:]` came since the current candidate arrived
    sessions: list = field(default_factory=list)  # episodes opened on it and not yet seen closed
    episodes: int = 0

    @property
    def window(self) -> list[_Reward]:
        return self.rewards[self.window_start :]


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
            incumbent = self._versions[self.incumbent]
            incumbent.window_start = len(incumbent.rewards)

    async def add_candidate_async(self, engine: Any, version: int, path: str | None = None) -> None:
        """Start `engine` (on the server's event loop) and put it on trial."""
        await engine.start()
        self.add_candidate(engine, version, path)

    # The rule

    def record_reward(
        self,
        version: int | None,
        value: float,
        task: str | None = None,
        tokens: int | None = None,
        calls: int | None = None,
        malformed: int | None = None,
    ) -> Decision | None:
        """Count one rewarded episode of `version` (`task`: its task's fingerprint, when the client named it: the
        comparison is then paired by task; `tokens`: the tokens it sampled, for `RolloutPolicy.length_guard`; `calls`
        and `malformed`: its model calls and those with a malformed tool call, for `RolloutPolicy.malformed_guard`);
        returns the decision it triggered, if any."""
        with self._lock:
            entry = self._versions.get(version) if version is not None else None
            if entry is None:
                return None
            entry.rewards.append(
                _Reward(
                    float(value),
                    task,
                    None if tokens is None else int(tokens),
                    None if calls is None else int(calls),
                    None if malformed is None else int(malformed),
                )
            )
            # a candidate's reward, or the incumbent's while a candidate waits for its side of the comparison
            on_trial = self._versions.get(self.candidate) if self.candidate is not None else None
            if version not in (self.candidate, self.incumbent) or on_trial is None:
                return None
            if len(on_trial.rewards) < self.policy.min_episodes:
                return None
            decision = self._decide(self.candidate, on_trial)
            if decision is None:  # not sure yet: the trial goes on
                return None
            self.decisions.append(decision)
        log = logger.warning if decision.action == "rolled_back" else logger.info
        log("[trl-agentic %s] version %d: %s", decision.action, decision.version, decision.reason)
        return decision

    def _decide(self, version: int, entry: _Version) -> Decision | None:
        incumbent, policy = self._versions[self.incumbent], self.policy
        mine = [r.value for r in entry.rewards]
        candidate_mean, candidate_var = _mean_var(mine)
        window = incumbent.window
        over = "over the same period" if window else "all time (none rewarded during the trial)"
        if not window and not incumbent.rewards:
            self._promote(version, entry)
            return Decision("promoted", version, f"mean reward {candidate_mean:.3f}; the incumbent has none to compare")
        # Both sides need `min_episodes`: a broken candidate whose episodes fail fast reaches its count first, and
        # judged then against the incumbent's first few episodes it was promoted (issue 43's harmful-update run)
        waiting = len(entry.rewards) < policy.max_episodes
        named = any(r.task is not None for r in entry.rewards)
        paired = None
        if named and window:
            paired = _paired_difference(entry.rewards, window)
            if min(paired[2], paired[4]) < policy.min_episodes and waiting:
                return None  # clients name tasks: wait until enough episodes of each version pair
            if min(paired[2], paired[4]) < policy.min_episodes:
                paired = None  # `max_episodes` reached with too few pairs: judged unpaired (said below)
        elif 0 < len(window) < policy.min_episodes and waiting:
            return None
        z = NormalDist().inv_cdf(policy.confidence)
        reference = window if len(window) >= policy.min_episodes else incumbent.rewards
        guard = self._length_guard(entry.rewards, reference) or self._malformed_guard(entry.rewards, reference, z)
        if guard is not None:
            entry.state, self.candidate = "rolled_back", None
            kept = f"; its weights stay at {entry.path}" if entry.path else ""
            return Decision("rolled_back", version, guard + kept)
        if paired is not None:
            diff, se, pairs, tasks, _ = paired
            numbers = (
                f"paired by task over {pairs} of its {len(mine)} episodes ({tasks} task{'s' * (tasks != 1)} both "
                f"versions served {over}): difference {diff:+.3f} +- {z * se:.3f} (confidence {policy.confidence:g}), "
                f"margin {policy.margin:g}; unpaired means {candidate_mean:.3f} vs the incumbent's "
                f"{_mean_var([r.value for r in window])[0]:.3f}"
            )
        else:
            reference = [r.value for r in (window or incumbent.rewards)]
            incumbent_mean, incumbent_var = _mean_var(reference)
            diff = candidate_mean - incumbent_mean
            se = math.sqrt(candidate_var / len(mine) + incumbent_var / len(reference))
            unpaired = " (too few episodes paired by task)" if named else ""
            numbers = (
                f"mean reward {candidate_mean:.3f} over {len(mine)} episodes vs the incumbent's "
                f"{incumbent_mean:.3f} over {len(reference)} ({over}){unpaired}: difference {diff:+.3f} +- "
                f"{z * se:.3f} (confidence {policy.confidence:g}), margin {policy.margin:g}"
            )
        if diff - z * se >= -policy.margin:
            self._promote(version, entry)
            return Decision("promoted", version, numbers)
        if diff + z * se >= -policy.margin and len(entry.rewards) < policy.max_episodes:
            return None
        why = "" if diff + z * se < -policy.margin else f"; not shown safe within {policy.max_episodes} episodes"
        entry.state, self.candidate = "rolled_back", None
        kept = f"; its weights stay at {entry.path}" if entry.path else ""
        return Decision("rolled_back", version, numbers + why + kept)

    def _length_guard(self, candidate: list[_Reward], incumbent: list[_Reward]) -> str | None:
        """Why the candidate's tokens per episode are outside `length_guard` against the incumbent's (`None`: within,
        or fewer than `min_episodes` reported on a side)."""
        guard, least = self.policy.length_guard, self.policy.min_episodes
        mine = [r.tokens for r in candidate if r.tokens is not None]
        theirs = [r.tokens for r in incumbent if r.tokens is not None]
        if guard is None or len(mine) < least or len(theirs) < least:
            return None
        mean, reference = sum(mine) / len(mine), sum(theirs) / len(theirs)
        if reference <= 0 or mean <= 0:
            return None
        ratio = mean / reference
        if 1 / (1 + guard) <= ratio <= 1 + guard:
            return None
        return (
            f"length guard: {mean:.1f} sampled tokens per episode over {len(mine)} episodes vs the incumbent's "
            f"{reference:.1f} over {len(theirs)} ({ratio:.2f}x, outside 1/{1 + guard:g}-{1 + guard:g}x)"
        )

    def _malformed_guard(self, candidate: list[_Reward], incumbent: list[_Reward], z: float) -> str | None:
        """Why the candidate's malformed tool calls per model call exceed the incumbent's by more than
        `malformed_guard` at the policy's confidence (`None`: not shown, or fewer than `min_episodes` reported)."""
        guard, least = self.policy.malformed_guard, self.policy.min_episodes
        mine = [r.malformed / r.calls for r in candidate if r.calls and r.malformed is not None]
        theirs = [r.malformed / r.calls for r in incumbent if r.calls and r.malformed is not None]
        if guard is None or len(mine) < least or len(theirs) < least:
            return None
        (rate, mine_var), (reference, theirs_var) = _mean_var(mine), _mean_var(theirs)
        diff, se = rate - reference, math.sqrt(mine_var / len(mine) + theirs_var / len(theirs))
        if diff - z * se <= guard:
            return None
        return (
            f"malformed guard: {rate:.1%} of model calls with a malformed tool call over {len(mine)} episodes vs the "
            f"incumbent's {reference:.1%} over {len(theirs)}: difference {diff:+.3f} +- {z * se:.3f} (confidence "
            f"{self.policy.confidence:g}), guard {guard:g}"
        )

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
                        "mean_reward": _mean_var([r.value for r in entry.rewards])[0] if entry.rewards else None,
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


def _mean_var(values: list[float]) -> tuple[float, float]:
    """Mean and sample variance (0 for a single value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, sum((v - mean) ** 2 for v in values) / (len(values) - 1)


def _paired_difference(candidate: list[_Reward], incumbent: list[_Reward]) -> tuple[float, float, int, int, int]:
    """The candidate's mean reward minus the incumbent's, paired by task: over the candidate's episodes of tasks the
    incumbent also served, the mean of (reward - the incumbent's mean on that task). Returns (difference, its standard
    error, the candidate's episodes paired, tasks, the incumbent's episodes on those tasks). The error uses each
    version's within-task variance, pooled over tasks (a task seen once or twice says little about its own spread):
    `se^2 = sum_t w_t^2 (s_c^2 / n_ct + s_i^2 / n_it)` with `w_t = n_ct / n`."""
    by_task: dict[str, tuple[list[float], list[float]]] = {}
    for reward in candidate:
        if reward.task is not None:
            by_task.setdefault(reward.task, ([], []))[0].append(reward.value)
    for reward in incumbent:
        if reward.task in by_task:
            by_task[reward.task][1].append(reward.value)
    cells = {task: cell for task, cell in by_task.items() if cell[1]}
    pairs = sum(len(c) for c, _ in cells.values())
    if not pairs:
        return 0.0, 0.0, 0, 0, 0
    diff = sum(len(c) * (sum(c) / len(c) - sum(i) / len(i)) for c, i in cells.values()) / pairs
    pooled = [_pooled_variance([cell[arm] for cell in cells.values()]) for arm in (0, 1)]
    variance = sum((len(c) / pairs) ** 2 * (pooled[0] / len(c) + pooled[1] / len(i)) for c, i in cells.values())
    return diff, math.sqrt(variance), pairs, len(cells), sum(len(i) for _, i in cells.values())


def _pooled_variance(groups: list[list[float]]) -> float:
    """The within-group variance pooled over groups; all values' variance when no group has two."""
    squares = sum(sum((v - sum(g) / len(g)) ** 2 for v in g) for g in groups)
    freedom = sum(len(g) - 1 for g in groups)
    if freedom > 0:
        return squares / freedom
    return _mean_var([v for g in groups for v in g])[1]
