"""The detectors: pure functions over metric series (`[(global_step, value), ...]`), each returning an [`Alarm`] when
its pattern holds at the end of the series, else `None`. [`check_alarms`] runs them all on a logged history."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from .definitions import Alarm, Series


def _mean(values: Iterable[float]) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else None


def _mean_over_steps(series: Series, first: int, last: int) -> float | None:
    """Mean of the points with `first <= step <= last`."""
    return _mean(v for s, v in series if first <= s <= last)


def reward_hacking(
    reward: Series,
    held_out_success: Series,
    *,
    window: int = 10,
    reward_rise: float = 0.1,
    held_out_min_gain: float = 0.02,
    held_out_episodes: Series | None = None,
    noise_z: float = 3.0,
    what: str = "training reward",
) -> Alarm | None:
    """Training reward rising while held-out success falls or stays flat, beyond the noise of both measurements.

    The latest held-out point is compared with each earlier one (oldest first): the training reward around each
    held-out step is the mean of the `window` logged rewards up to it (the first `window` for a step before any
    reward, e.g. the evaluation before training). It fires when the reward rose by `reward_rise`, held-out success
    gained less than `held_out_min_gain`, and held-out success fell short of the reward's rise by more than `noise_z`
    standard errors of that difference: the training side's from the scatter of each window's values, the held-out
    side's binomial from `held_out_episodes` (episodes per evaluation, by step; without it, the training side's only).

    Example:

    ```python
    >>> reward = [(s, 0.2 + 0.02 * s) for s in range(1, 31)]         # 0.22 -> 0.80
    >>> reward_hacking(reward, [(0, 0.30), (30, 0.29)]).name         # held-out flat
    'reward_hacking'
    >>> reward_hacking(reward, [(0, 0.30), (30, 0.55)]) is None      # held-out follows the reward
    True
    ```
    """
    if len(held_out_success) < 2 or not reward:
        return None
    episodes = dict(held_out_episodes or [])

    def reward_around(step: int) -> tuple[float, float] | None:
        """Mean and squared standard error of the `window` rewards up to `step` (or the first `window`)."""
        values = [v for s, v in reward if s <= step][-window:]
        values = values if len(values) == window else [v for _, v in list(reward)[:window]]
        values = [v for v in values if v is not None and not math.isnan(v)]
        if not values:
            return None
        mean = sum(values) / len(values)
        variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
        return mean, variance / len(values)

    def held_out_variance(step: int, success: float) -> float:
        n = episodes.get(step)
        return success * (1.0 - success) / n if n else 0.0

    last_step, last_success = held_out_success[-1]
    last = reward_around(last_step)
    for step, success in held_out_success[:-1]:
        earlier = reward_around(step)
        if last is None or earlier is None or step >= last_step:
            continue
        rise, gain = last[0] - earlier[0], last_success - success
        noise = noise_z * math.sqrt(
            last[1] + earlier[1] + held_out_variance(step, success) + held_out_variance(last_step, last_success)
        )
        if rise >= reward_rise and gain < held_out_min_gain and rise - gain > noise:
            trend = "fell" if gain < 0 else "stayed flat"
            return Alarm(
                "reward_hacking",
                last_step,
                (
                    f"{what} rose {earlier[0]:.3f} -> {last[0]:.3f} (+{rise:.3f}) between steps {step} and {last_step} "
                    f"while held-out success {trend} ({success:.1%} -> {last_success:.1%}; noise of the comparison "
                    f"{noise:.3f}): the policy may be gaming the reward. Read some episodes "
                    "(`trl-agentic inspect <output_dir>`) and tighten the checker."
                ),
                {
                    "from_step": step,
                    "reward_before": earlier[0],
                    "reward_after": last[0],
                    "held_out_before": success,
                    "held_out_after": last_success,
                    "noise": noise,
                },
            )
    return None


def length_drift(
    length: Series,
    reward: Series,
    *,
    window: int = 10,
    length_growth: float = 0.5,
    reward_rise: float = 0.1,
    what: str = "sampled tokens per episode",
) -> Alarm | None:
    """`length` (tokens or turns per episode) growing while reward does not.

    The last `window` points are compared with every earlier, non-overlapping window (the oldest that shows drift is
    reported): drift = length grew by `length_growth` (relative) and the reward over the same steps rose by less than
    `reward_rise`.

    Example:

    ```python
    >>> length = [(s, 30.0 + 2 * s) for s in range(1, 31)]           # 32 -> 90 tokens
    >>> length_drift(length, [(s, 0.5) for s in range(1, 31)]).name   # reward flat
    'length_drift'
    ```
    """
    if len(length) < 2 * window:
        return None
    length = list(length)
    recent = length[-window:]
    recent_length = _mean(v for _, v in recent)
    recent_reward = _mean_over_steps(reward, recent[0][0], recent[-1][0])
    for start in range(0, len(length) - 2 * window + 1, window):
        earlier = length[start : start + window]
        earlier_length = _mean(v for _, v in earlier)
        earlier_reward = _mean_over_steps(reward, earlier[0][0], earlier[-1][0])
        if not earlier_length or recent_length is None or recent_reward is None or earlier_reward is None:
            continue
        growth = recent_length / earlier_length - 1
        if growth >= length_growth and recent_reward - earlier_reward < reward_rise:
            return Alarm(
                "length_drift",
                recent[-1][0],
                (
                    f"{what} grew {earlier_length:.1f} -> {recent_length:.1f} (+{growth:.0%}) between steps "
                    f"{earlier[0][0]}-{earlier[-1][0]} and {recent[0][0]}-{recent[-1][0]} while the reward went "
                    f"{earlier_reward:.3f} -> {recent_reward:.3f}: longer episodes are not paying off (rambling, loops, "
                    "repeated tool calls?)."
                ),
                {
                    "length_before": earlier_length,
                    "length_after": recent_length,
                    "reward_before": earlier_reward,
                    "reward_after": recent_reward,
                },
            )
    return None


def spike(series: Series, *, name: str, what: str, window: int = 10, spike: float = 0.1) -> Alarm | None:
    """A share (`series`, in [0, 1]) rising by `spike` or more: the mean of the last `window // 2` points against the
    mean of every point before them (at least `window // 2` of them).

    Example:

    ```python
    >>> malformed = [(s, 0.05) for s in range(1, 21)] + [(s, 0.40) for s in range(21, 26)]
    >>> spike(malformed, name="malformed_tool_calls", what="malformed tool calls per model call").name
    'malformed_tool_calls'
    ```
    """
    recent_size = max(1, window // 2)
    if len(series) < 2 * recent_size:
        return None
    series = list(series)
    baseline = _mean(v for _, v in series[:-recent_size])
    recent = _mean(v for _, v in series[-recent_size:])
    if baseline is None or recent is None or recent - baseline < spike:
        return None
    return Alarm(
        name,
        series[-1][0],
        (
            f"{what} rose to {recent:.1%} over the last {recent_size} logged steps (from {baseline:.1%} before): read the "
            "latest episodes (`trl-agentic inspect <output_dir>`) for what broke."
        ),
        {"before": baseline, "after": recent},
    )


_pooled_spike = spike  # `malformed_spike`'s `spike` argument is the threshold, as in every detector


def malformed_spike(
    rate: Series,
    by_level: dict[int, dict[Any, tuple[float, float, float | None]]] | None = None,
    *,
    window: int = 10,
    spike: float = 0.1,
    noise_z: float = 3.0,
    min_calls: int = 20,
) -> Alarm | None:
    """`malformed_tool_calls`: malformed tool calls per model call rising by `spike`, compared like with like and
    beyond chance.

    An adaptive sampler moves the mix of difficulties, and a policy writes broken calls more often on some (on the CPU
    demo, 3-digit tasks: 10-100% of calls against 2-10% at the target): the pooled rate then rises with no change in
    the policy. With per-difficulty counts (`by_level`: step -> {level: (model calls, malformed calls, groups)}, from
    the trainer's `sampling/model_calls/<level>`, `sampling/malformed_rate/<level>` and `sampling/groups/<level>`),
    the last `window // 2` logged steps' rate is held against the rate expected at their own mix from each
    difficulty's rate before them (a difficulty with fewer than `min_calls` earlier calls has no rate to expect and is
    left out), and the rise must also exceed `noise_z` standard errors of that comparison. The unit of the standard
    error is the group: a task's episodes tend to fail alike (on the demo, every episode of a 1-digit task ending its
    call with "4 * 1."), so a level's share is taken to vary from group to group as much as a share with its mean can,
    `p (1 - p) / groups`, on both sides of the comparison; without group counts, each call is a unit. An alarm checked
    at every log must not report what a few groups give by chance. Without per-difficulty counts (no difficulty
    column), the pooled `rate` series ([`spike`]).

    Example:

    ```python
    >>> steady = {s: {2: (90, 4.5, 7), 3: (10, 5.0, 1)} for s in range(1, 21)}  # 5% and 50% of calls
    >>> moved = {s: {2: (50, 2.5, 4), 3: (50, 25.0, 4)} for s in range(21, 26)}  # more 3-digit tasks, same rates
    >>> malformed_spike([], {**steady, **moved}) is None
    True
    ```
    """
    if not by_level:
        return _pooled_spike(
            rate, name="malformed_tool_calls", what="malformed tool calls per model call", window=window, spike=spike
        )
    return _mix_spike(
        by_level,
        name="malformed_tool_calls",
        what="malformed tool calls per model call",
        window=window,
        spike=spike,
        noise_z=noise_z,
        min_count=min_calls,
    )


def unscorable_spike(
    rate: Series,
    by_level: dict[int, dict[Any, tuple[float, float, float | None]]] | None = None,
    *,
    window: int = 10,
    spike: float = 0.1,
    noise_z: float = 3.0,
    min_episodes: int = 20,
) -> Alarm | None:
    """`unscorable_episodes`: the share of episodes that could not be scored (or failed) rising by `spike`, compared
    like with like and beyond chance, as [`malformed_spike`] compares malformed calls: with per-difficulty counts
    (`by_level`: step -> {level: (episodes, unscorable episodes, groups)}, from the trainer's
    `sampling/episodes/<level>`, `sampling/unscorable/<level>` and `sampling/groups/<level>`), the last steps' share
    is held against the one their mix of difficulties would give at each difficulty's earlier share (harder tasks
    time out or overflow the context more often: a curriculum moving to them has not broken the agent); without them
    (no difficulty column), the pooled `rate` series ([`spike`]).

    Example:

    ```python
    >>> steady = {s: {2: (48, 0.0, 4)} for s in range(1, 21)}
    >>> broken = {s: {2: (48, 24.0, 4)} for s in range(21, 26)}  # half of the target's episodes time out
    >>> unscorable_spike([], {**steady, **broken}).name
    'unscorable_episodes'
    ```
    """
    what = "unscorable or failed episodes"
    if not by_level:
        return _pooled_spike(rate, name="unscorable_episodes", what=what, window=window, spike=spike)
    return _mix_spike(
        by_level,
        name="unscorable_episodes",
        what=f"the share of {what}",
        window=window,
        spike=spike,
        noise_z=noise_z,
        min_count=min_episodes,
    )


def _mix_spike(
    by_level: dict[int, dict[Any, tuple[float, float, float | None]]],
    *,
    name: str,
    what: str,
    window: int,
    spike: float,
    noise_z: float,
    min_count: int,
) -> Alarm | None:
    """A share rising by `spike` and by `noise_z` standard errors at the same mix of difficulties: `by_level` is
    step -> {level: (count, hits, groups)}; see [`malformed_spike`]."""
    recent_size = max(1, window // 2)
    steps = sorted(by_level)
    if len(steps) < 2 * recent_size:
        return None

    def totals(points: list[int]) -> dict[Any, list[float | None]]:
        summed: dict[Any, list[float | None]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        for step in points:
            for level, (count, hits, groups) in by_level[step].items():
                entry = summed[level]
                entry[0] += count
                entry[1] += hits
                entry[2] = None if groups is None or entry[2] is None else entry[2] + groups
        return summed

    earlier, recent = totals(steps[:-recent_size]), totals(steps[-recent_size:])
    compared = {
        level: (earlier[level], counts)
        for level, counts in recent.items()
        if level in earlier and earlier[level][0] >= min_count and counts[0]
    }
    total = sum(counts[0] for _, counts in compared.values())
    if not total:
        return None
    seen = expected = variance = 0.0
    for (past_count, past_hits, past_groups), (count, hits, groups) in compared.values():
        share = past_hits / past_count
        seen += hits
        expected += count * share
        units = (groups, past_groups) if groups and past_groups else (count, past_count)
        variance += (count / total) ** 2 * share * (1 - share) * (1 / units[0] + 1 / units[1])
    after, before = seen / total, expected / total
    if after - before < spike or after - before < noise_z * math.sqrt(variance):
        return None
    return Alarm(
        name,
        steps[-1],
        (
            f"{what} rose to {after:.1%} over the last {recent_size} logged steps, against {before:.1%} expected at their "
            "mix of difficulties from the rate at each difficulty before: read the latest episodes "
            "(`trl-agentic inspect <output_dir>`) for what broke."
        ),
        {"before": before, "after": after, "z": (after - before) / math.sqrt(variance) if variance else math.inf},
    )


def entropy_collapse(entropy: Series, *, window: int = 10, entropy_ratio: float = 0.1) -> Alarm | None:
    """Mean token entropy of the last `window` points below `entropy_ratio` x its mean over the first `window`.

    Example:

    ```python
    >>> entropy_collapse([(s, 1.0 if s <= 10 else 0.05) for s in range(1, 21)]).name
    'entropy_collapse'
    ```
    """
    if len(entropy) < 2 * window:
        return None
    start = _mean(v for _, v in list(entropy)[:window])
    recent = _mean(v for _, v in list(entropy)[-window:])
    if not start or recent is None or start <= 0 or recent >= entropy_ratio * start:
        return None
    return Alarm(
        "entropy_collapse",
        entropy[-1][0],
        (
            f"mean token entropy fell to {recent:.4f} from {start:.4f} at the start ({recent / start:.1%}): the policy "
            "samples nearly deterministically, so groups stop splitting and exploration ends. Consider a higher "
            "temperature, a KL penalty (beta) or a lower learning rate."
        ),
        {"start": start, "recent": recent},
    )


def low_split_rate(split_rate: Series, *, window: int = 10, min_split_rate: float = 0.25) -> Alarm | None:
    """The split rate (share of groups whose rewards differ, `1 - frac_reward_zero_std`) averaged over the last
    `window` points below `min_split_rate`.

    Example:

    ```python
    >>> low_split_rate([(s, 0.0) for s in range(1, 11)]).name        # every group agreed: nothing to learn
    'low_split_rate'
    ```
    """
    if len(split_rate) < window:
        return None
    recent = _mean(v for _, v in list(split_rate)[-window:])
    if recent is None or recent >= min_split_rate:
        return None
    return Alarm(
        "low_split_rate",
        split_rate[-1][0],
        (
            f"only {recent:.0%} of groups had rewards that differ over the last {window} logged steps (TRL's "
            f"frac_reward_zero_std {1 - recent:.2f}): a group whose episodes all score alike has zero advantage, so most "
            "of each step teaches nothing. Make tasks easier or harder to match the policy, or raise num_generations."
        ),
        {"split_rate": recent},
    )


def sampled_flat(flat_tasks: Series, replay_diverged: Series = ()) -> Alarm | None:
    """Tree rollouts on tasks whose agent never replays: at the last logged step, a share of the branched tasks had
    no branch that replayed even one call of its parent (`tree/sampled_flat_tasks` > 0, `episode_log.replay_counts`).

    Example:

    ```python
    >>> sampled_flat([(1, 0.0), (2, 0.5)]).name       # half the tasks branched at step 2 never replayed
    'sampled_flat'
    >>> sampled_flat([(1, 0.5), (2, 0.0)]) is None
    True
    ```
    """
    if not flat_tasks:
        return None
    step, share = flat_tasks[-1]
    if share <= 0:
        return None
    diverged = replay_diverged[-1][1] if replay_diverged else None
    return Alarm(
        "sampled_flat",
        step,
        (
            f"{share:.0%} of the tasks branched at step {step} were sampled flat: none of their branches replayed a "
            "single model call of its parent, so each branch cost a whole episode's sampling and shares no prefix. "
            "The agent's requests change from run to run (a clock, a random id, unordered tools in its prompt): each "
            "branch's first differing turn says where (`turn.replay_divergence`, the viewer or the episode log). "
            "Make the agent deterministic, or branch only the tasks of agents that replay."
        ),
        {"sampled_flat_tasks": share, **({"replay_diverged": diverged} if diverged is not None else {})},
    )
