"""Alarms: training signals checked against each other and against a held-out measure (issue #11).

GRPO amplifies whatever the checker rewards and learns only from groups whose episodes disagree. Training reward alone
cannot tell learning from gaming, so a run is watched for six patterns, each a pure function over metric histories
(`{metric: [(global_step, value), ...]}`, as logged):

- `reward_hacking`: training reward rose by `reward_rise` since a held-out evaluation while held-out success gained
  less than `held_out_min_gain` (it fell or stayed flat), beyond the noise of both measurements: the policy may be
  gaming the checker. With a target difficulty (adaptive sampling), the training success at the target on tasks drawn
  for the first time (`sampling/target_success_unseen`) stands for the reward: the mean reward moves with the mix of
  difficulties drawn, and a revisited task may have been learned by heart, which held-out tasks cannot be.
- `length_drift`: sampled tokens or turns per episode grew by `length_growth` (relative) while the reward did not
  rise by `reward_rise`.
- `malformed_tool_calls` / `unscorable_episodes`: the share of model calls with a malformed tool call, or of episodes
  that could not be scored (or failed), rose by `spike` over its earlier level. With a difficulty column, both are
  compared at the same mix of difficulties (an adaptive sampler moving to tasks where the policy writes broken calls,
  or times out, more often is not the policy breaking; [`malformed_spike`], [`unscorable_spike`]).
- `entropy_collapse`: mean token entropy fell below `entropy_ratio` x its level at the start of training.
- `low_split_rate`: the split rate (groups whose rewards differ, `1 - frac_reward_zero_std`) stayed below
  `min_split_rate`: most groups give GRPO nothing to learn from.

[`AlarmsCallback`] wires them into a `Trainer`: every log gets `alarms/<name>` (1.0 while the alarm holds, else 0.0),
a new alarm is emitted as a [`TrainingAlarm`] warning, and `output_dir/alarms.json` lists every alarm of the run. With
`held_out_eval_steps > 0` it also evaluates the live policy on the trainer's `eval_dataset` (a split never trained on)
with [`trl_agentic.evaluation.Evaluator`] and logs `held_out/success` (successes over all episodes).

Example (offline, on the log history of a finished run):

```python
>>> from trl_agentic.alarms import check_alarms, history_from_log_history
>>> history = history_from_log_history(trainer.state.log_history)
>>> [alarm.name for alarm in check_alarms(history)]
['low_split_rate']
```
"""

from __future__ import annotations

import json
import math
import warnings
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from transformers import TrainerCallback
from transformers.utils import logging


logger = logging.get_logger(__name__)

# metric name -> [(global step, value), ...] in step order: what a Trainer logs, one point per log.
Series = Sequence[tuple[int, float]]
History = dict[str, list[tuple[int, float]]]

ALARM_NAMES = (
    "reward_hacking",
    "length_drift",
    "malformed_tool_calls",
    "unscorable_episodes",
    "entropy_collapse",
    "low_split_rate",
)


class HeldOutEvaluator(Protocol):
    """What the callback calls every `held_out_eval_steps`: `evaluate(model, seed=...)` returns at least `success`
    (successes over all episodes, as [`trl_agentic.evaluation.Evaluator.evaluate`] does)."""

    def evaluate(self, model=None, seed: int | None = None) -> dict[str, Any]: ...


class TrainingAlarm(UserWarning):
    """Warning category of the alarms: `warnings.simplefilter("error", TrainingAlarm)` stops a run at the first."""


@dataclass(frozen=True)
class AlarmSettings:
    """Thresholds of the alarms (the `alarm_*` fields of [`AgenticGRPOConfig`] carry the same names and defaults).

    Args:
        window: logged points averaged on each side of a comparison (a window of steps with `logging_steps=1`).
        reward_rise: a training-reward increase at least this large counts as "reward rising" (reward units).
        held_out_min_gain: held-out success must gain at least this much (absolute, 0.02 = 2 points) while the
            reward rises, or `reward_hacking` fires.
        length_growth: relative growth of sampled tokens or turns per episode that counts as drift (0.5 = +50%).
        spike: absolute rise of the malformed-tool-call share of calls, or of the unscorable share of episodes.
        entropy_ratio: `entropy_collapse` fires when recent entropy is below this fraction of its starting level.
        min_split_rate: `low_split_rate` fires when the recent split rate is below this.
        noise_z: `reward_hacking` fires only when held-out success falls short of the training reward's rise by more
            than this many standard errors of the comparison (both sides' noise; see [`reward_hacking`]). 3: a run
            compares each evaluation with every earlier one, and a policy's state carries from step to step, so
            training windows scatter more than their per-step values say (at 2 a healthy demo run fired).
            `malformed_tool_calls` and `unscorable_episodes` (with per-difficulty counts) likewise fire only on a
            rise beyond this many standard errors of what the last steps' groups could give by chance
            ([`malformed_spike`]).
    """

    window: int = 10
    reward_rise: float = 0.1
    held_out_min_gain: float = 0.02
    length_growth: float = 0.5
    spike: float = 0.1
    entropy_ratio: float = 0.1
    min_split_rate: float = 0.25
    noise_z: float = 3.0

    @classmethod
    def from_config(cls, args) -> AlarmSettings:
        """The thresholds of an [`AgenticGRPOConfig`] (its `alarm_*` fields)."""
        return cls(
            window=args.alarm_window,
            reward_rise=args.alarm_reward_rise,
            held_out_min_gain=args.alarm_held_out_min_gain,
            length_growth=args.alarm_length_growth,
            spike=args.alarm_spike,
            entropy_ratio=args.alarm_entropy_ratio,
            min_split_rate=args.alarm_min_split_rate,
            noise_z=args.alarm_noise_z,
        )


@dataclass
class Alarm:
    """One alarm: which pattern, at which step, a message for people, and the numbers behind it."""

    name: str
    step: int
    message: str
    evidence: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------------
# Detectors: pure functions over series


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


# ---------------------------------------------------------------------------------------------------------------------
# Histories


def _training_success(series: dict[str, Series]) -> tuple[Series, str]:
    """What `reward_hacking` holds against held-out success, and its name: the training success on tasks drawn for
    the first time at the target difficulty (to the policy what held-out tasks are: the checker is the only thing that
    differs), else on all tasks at the target (revisited ones may have been learned by heart), else the reward (the
    mean reward moves with the mix of difficulties an adaptive sampler draws)."""
    if series["target_success_unseen"]:
        return series["target_success_unseen"], "training success on new tasks at the target difficulty"
    if series["target_success"]:
        return series["target_success"], "training success at the target difficulty"
    return series["reward"], "training reward"


def _by_level(history: History, counts: str, rates: str) -> dict[int, dict[Any, tuple[float, float, float | None]]]:
    """step -> {level: (count, count x rate, groups or None)} from `sampling/<counts>/<level>`,
    `sampling/<rates>/<level>` and `sampling/groups/<level>` (empty without a difficulty column)."""
    by_level: dict[int, dict[Any, tuple[float, float, float | None]]] = defaultdict(dict)
    prefix = f"sampling/{counts}/"
    for name, points in history.items():
        if not name.startswith(prefix):
            continue
        level = name[len(prefix) :]
        shares = dict(history.get(f"sampling/{rates}/{level}", []))
        groups = dict(history.get(f"sampling/groups/{level}", []))
        for step, count in points:
            if step in shares:
                by_level[step][level] = (count, count * shares[step], groups.get(step))
    return dict(by_level)


def derived_series(history: History) -> dict[str, list[tuple[int, float]]]:
    """The series the detectors read, from logged metrics (TRL's and the trainer's `episodes/*`):

    `reward`, `target_success` (`sampling/target_success`), `target_success_unseen` (the same on tasks drawn for the
    first time, `sampling/target_success_unseen`), `held_out_success` (`held_out/success`),
    `held_out_episodes` (`held_out/episodes`), `split_rate` (`1 - frac_reward_zero_std`), `sampled_tokens`
    (`episodes/sampled_tokens_mean`, else TRL's `completions/mean_length`), `turns` (`episodes/turns_mean`),
    `malformed_rate` (malformed tool calls per model call), `malformed_by_level` (step -> {difficulty: (model calls,
    malformed calls, groups)}, from `sampling/model_calls/<level>`, `sampling/malformed_rate/<level>` and
    `sampling/groups/<level>`), `unscorable` (`episodes/unscorable` when logged, else the
    share of episodes that did not end `ok`, which are unscorable unless a checker scores failures),
    `unscorable_by_level` (step -> {difficulty: (episodes, unscorable episodes, groups)}, from
    `sampling/episodes/<level>`, `sampling/unscorable/<level>` and `sampling/groups/<level>`) and `entropy`.
    """
    get = lambda name: list(history.get(name, []))  # noqa: E731
    turns = dict(get("episodes/turns_mean"))
    unscorable = get("episodes/unscorable") or [(s, 1.0 - v) for s, v in get("episodes/status_ok")]
    return {
        "reward": get("reward"),
        "target_success": get("sampling/target_success"),
        "target_success_unseen": get("sampling/target_success_unseen"),
        "held_out_success": get("held_out/success"),
        "held_out_episodes": get("held_out/episodes"),
        "split_rate": [(s, 1.0 - v) for s, v in get("frac_reward_zero_std")],
        "sampled_tokens": get("episodes/sampled_tokens_mean") or get("completions/mean_length"),
        "turns": get("episodes/turns_mean"),
        "malformed_rate": [(s, v / turns[s]) for s, v in get("episodes/malformed_tool_calls_mean") if turns.get(s)],
        "malformed_by_level": _by_level(history, "model_calls", "malformed_rate"),
        "unscorable": unscorable,
        "unscorable_by_level": _by_level(history, "episodes", "unscorable"),
        "entropy": get("entropy"),
    }


def check_alarms(history: History, settings: AlarmSettings | None = None) -> list[Alarm]:
    """Every alarm that holds at the end of `history` (see the module docstring for what each means).

    Example:

    ```python
    >>> history = {"frac_reward_zero_std": [(s, 1.0) for s in range(1, 11)]}
    >>> [alarm.name for alarm in check_alarms(history)]
    ['low_split_rate']
    ```
    """
    settings = settings or AlarmSettings()
    series = derived_series(history)
    window = settings.window
    training_success, what = _training_success(series)
    found = [
        # The mean reward moves with the mix of difficulties an adaptive sampler draws: held-out success (measured at
        # the target difficulty) is held against the training success at the target (on new tasks) when logged.
        reward_hacking(
            training_success,
            series["held_out_success"],
            window=window,
            reward_rise=settings.reward_rise,
            held_out_min_gain=settings.held_out_min_gain,
            held_out_episodes=series["held_out_episodes"],
            noise_z=settings.noise_z,
            what=what,
        ),
        length_drift(
            series["sampled_tokens"],
            series["reward"],
            window=window,
            length_growth=settings.length_growth,
            reward_rise=settings.reward_rise,
        )
        or length_drift(
            series["turns"],
            series["reward"],
            window=window,
            length_growth=settings.length_growth,
            reward_rise=settings.reward_rise,
            what="turns per episode",
        ),
        malformed_spike(
            series["malformed_rate"],
            series["malformed_by_level"],
            window=window,
            spike=settings.spike,
            noise_z=settings.noise_z,
        ),
        unscorable_spike(
            series["unscorable"],
            series["unscorable_by_level"],
            window=window,
            spike=settings.spike,
            noise_z=settings.noise_z,
        ),
        entropy_collapse(series["entropy"], window=window, entropy_ratio=settings.entropy_ratio),
        low_split_rate(series["split_rate"], window=window, min_split_rate=settings.min_split_rate),
    ]
    return [alarm for alarm in found if alarm is not None]


def history_from_log_history(log_history: list[dict[str, Any]]) -> History:
    """A `History` from `trainer.state.log_history` (or `trainer_state.json`'s): every numeric metric of the training
    logs by step (evaluation logs, `eval_*`, are left out)."""
    history: History = defaultdict(list)
    for entry in log_history:
        step = entry.get("step")
        for key, value in entry.items():
            if key == "step" or key.startswith("eval_") or isinstance(value, bool):
                continue
            if isinstance(value, int | float) and math.isfinite(value):
                history[key].append((step, float(value)))
    return dict(history)


def history_from_episode_records(records: Iterable[dict[str, Any]], success_threshold: float = 1.0) -> History:
    """Per-step metrics recomputed from an episode log (`output_dir/episodes/*.jsonl`, `log_episodes=True`), under the
    names the trainer logs them: `reward` (mean over scorable episodes of the sum of the reward functions' scores:
    unit weights), `frac_reward_zero_std`, `episodes/sampled_tokens_mean`, `episodes/turns_mean`,
    `episodes/malformed_tool_calls_mean`, `episodes/status_ok`, `episodes/unscorable`, and `entropy`, estimated as
    the mean negative logprob of the sampled tokens (an unbiased estimate of the entropy of the distribution they
    were sampled from). A record's `step` is the policy version that sampled it; its metrics are logged at the step
    its update completes (`step + 1`), as the trainer logs them.

    Records of a run with a difficulty column carry each task's `difficulty` (and whether it is the `target`): then
    also `sampling/difficulty_mean` and, per level, `sampling/share/<level>`, `sampling/model_calls/<level>`,
    `sampling/groups/<level>`, `sampling/episodes/<level>`, `sampling/malformed_rate/<level>`,
    `sampling/unscorable/<level>` and `sampling/success/<level>` (an episode succeeds when its reward is at least
    `success_threshold`, the sampler's), and `sampling/target_success`: what `malformed_tool_calls`,
    `unscorable_episodes` and `reward_hacking` read, so that they compare like with like here as in the run.

    Example:

    ```python
    >>> records = [json.loads(line) for line in open("out/episodes/episodes-rank0.jsonl")]
    >>> check_alarms(history_from_episode_records(records))
    []
    ```
    """
    by_step: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        if record.get("mode", "train") == "train":
            by_step[record.get("step", 0)].append(record)
    history: History = defaultdict(list)
    for step in sorted(by_step):
        episodes = [record["episode"] for record in by_step[step]]
        rewards = [episode_reward(episode) for episode in episodes]
        num_generations = max(episode.get("group_index", 0) for episode in episodes) + 1
        groups: dict[int, list[float]] = defaultdict(list)
        for episode, reward in zip(episodes, rewards, strict=True):
            groups[episode.get("task_index", 0) // num_generations].append(reward)
        zero_std = [len({r for r in group if r is not None}) < 2 for group in groups.values()]
        turns = [episode.get("turns", []) for episode in episodes]
        negative_logprobs = [-lp for ts in turns for t in ts for lp in t.get("logprobs", []) if lp is not None]
        scored = [r for r in rewards if r is not None]
        values = {
            "reward": _mean(scored),
            "frac_reward_zero_std": sum(zero_std) / len(zero_std),
            "episodes/sampled_tokens_mean": _mean(sum(len(t["completion_ids"]) for t in ts) for ts in turns),
            "episodes/turns_mean": _mean(len(ts) for ts in turns),
            "episodes/malformed_tool_calls_mean": _mean(
                sum(bool(t.get("malformed_tool_call")) for t in ts) for ts in turns
            ),
            "episodes/status_ok": _mean(float(episode.get("status") == "ok") for episode in episodes),
            "episodes/unscorable": 1.0 - len(scored) / len(episodes),
            "entropy": _mean(negative_logprobs),
        }
        values.update(_level_metrics(by_step[step], rewards, num_generations, success_threshold))
        for key, value in values.items():
            if value is not None:
                history[key].append((step + 1, value))
    return dict(history)


def _level_metrics(
    records: list[dict[str, Any]], rewards: list[float | None], num_generations: int, success_threshold: float
) -> dict[str, float]:
    """One step's per-difficulty `sampling/*` metrics, from its records' `difficulty` and `target` (see
    `history_from_episode_records`); empty when the records have no difficulty."""
    levels = [record.get("difficulty") for record in records]
    if not levels or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in levels):
        return {}
    values = {"sampling/difficulty_mean": sum(levels) / len(levels)}
    target: list[float] = []
    for level in sorted(set(levels)):
        mine = [(record, reward) for record, lv, reward in zip(records, levels, rewards, strict=True) if lv == level]
        calls = sum(len(record["episode"].get("turns", [])) for record, _ in mine)
        values[f"sampling/share/{level:g}"] = len(mine) / len(levels)
        values[f"sampling/model_calls/{level:g}"] = float(calls)
        values[f"sampling/groups/{level:g}"] = len(mine) / num_generations
        values[f"sampling/episodes/{level:g}"] = float(len(mine))
        values[f"sampling/unscorable/{level:g}"] = sum(reward is None for _, reward in mine) / len(mine)
        if calls:
            values[f"sampling/malformed_rate/{level:g}"] = (
                sum(bool(t.get("malformed_tool_call")) for record, _ in mine for t in record["episode"]["turns"])
                / calls
            )
        outcomes = [float(reward >= success_threshold) for _, reward in mine if reward is not None]
        if outcomes:
            values[f"sampling/success/{level:g}"] = sum(outcomes) / len(outcomes)
        if outcomes and any(record.get("target") for record, _ in mine):
            target.append(sum(outcomes) / len(outcomes))  # the trainer's mean: over target levels, each its own rate
    if target:
        values["sampling/target_success"] = sum(target) / len(target)
    return values


def episode_reward(episode: dict[str, Any]) -> float | None:
    """The reward of a logged episode: the sum of its reward functions' scores (`metadata.rewards`), `None` when no
    function scored it (unscorable)."""
    scores = [v for v in (episode.get("metadata") or {}).get("rewards", {}).values() if v is not None]
    return sum(scores) if scores else None


# ---------------------------------------------------------------------------------------------------------------------
# Callback


class AlarmsCallback(TrainerCallback):
    """Checks the alarms at every log, and optionally evaluates the policy on a held-out split.

    Added by [`AgenticGRPOTrainer`] when `alarms=True` (the default), at the front of the callback list so that every
    other callback (progress bar, W&B, ...) sees the `alarms/*` and `held_out/*` metrics of the same log. Pass your own
    instance in `callbacks=[...]` to use a custom held-out evaluation, e.g. with a stricter checker; the trainer then
    uses it instead of building one.

    Args:
        settings: the thresholds ([`AlarmSettings`]).
        held_out: evaluates the live policy: `evaluate(model, seed=...)` returns at least `success`, e.g. an
            [`trl_agentic.evaluation.Evaluator`] over a split never trained on (with `reward_funcs=` a stricter
            checker if you have one).
        held_out_eval_steps: evaluate before training, every this many optimizer steps and at the last step; `0`:
            never.
        output_dir: where `alarms.json` is written (default: the trainer's `output_dir`).

    Attributes:
        alarms: every alarm of the run, as dicts: `name`, `step` (first step it held), `last_step`, `message`,
            `evidence`. An alarm that clears and fires again is a new entry.
        history: every logged metric by step (`History`), plus `held_out/*`.
        held_out_results: the held-out evaluator's whole result at each step it ran.

    Example:

    ```python
    >>> from trl_agentic.evaluation import Evaluator
    >>> strict = Evaluator(model, tokenizer, "calculator", suite.build_dataset("eval", size=64),
    ...                    reward_funcs=[exact_answer])
    >>> trainer = AgenticGRPOTrainer(..., callbacks=[AlarmsCallback(held_out=strict, held_out_eval_steps=25)])
    >>> trainer.train()
    >>> trainer.alarms
    []
    ```
    """

    def __init__(
        self,
        settings: AlarmSettings | None = None,
        held_out: HeldOutEvaluator | None = None,
        held_out_eval_steps: int = 0,
        output_dir: str | Path | None = None,
    ):
        if held_out_eval_steps < 0:
            raise ValueError(f"held_out_eval_steps must be >= 0 (0 = never), got {held_out_eval_steps}.")
        if held_out is not None and held_out_eval_steps == 0:
            raise ValueError("A held_out evaluator needs held_out_eval_steps >= 1 (how often to evaluate).")
        self.settings = settings or AlarmSettings()
        self.held_out = held_out
        self.held_out_eval_steps = held_out_eval_steps
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.history: History = defaultdict(list)
        self.alarms: list[dict[str, Any]] = []
        self._active: dict[str, dict[str, Any]] = {}  # name -> its entry in self.alarms while it holds
        self._pending: dict[str, float] = {}  # held-out metrics waiting for the next log
        self.held_out_results: dict[int, dict[str, Any]] = {}  # step -> the evaluator's whole result

    # Held-out evaluation

    def _evaluate_held_out(self, args, state, model) -> None:
        if self.held_out is None or not state.is_world_process_zero:
            return
        step = state.global_step
        if self.history["held_out/success"] and self.history["held_out/success"][-1][0] == step:
            return
        self.record_held_out(step, self.held_out.evaluate(model, seed=args.seed + step))

    def record_held_out(self, step: int, result: dict[str, Any]) -> None:
        """Record a held-out result measured at `step` (by this callback, or by the caller, e.g. an evaluation it ran
        before training anyway: the callback then does not evaluate that step again). Its `held_out/*` metrics are
        logged with the next training log; the whole result stays in `held_out_results[step]`."""
        self.held_out_results[step] = result
        metrics = {"held_out/success": result["success"]}
        if isinstance(result.get("episodes"), int | float):
            metrics["held_out/episodes"] = float(result["episodes"])  # the alarm allows for its binomial noise
        for key in ("scored_mean_reward", "malformed_tool_call_rate", "mean_sampled_tokens", "mean_turns"):
            if isinstance(result.get(key), int | float):
                metrics[f"held_out/{key}"] = float(result[key])
        for key, value in metrics.items():
            self.history[key].append((step, value))
        self._pending.update(metrics)
        logger.info(f"held-out success at step {step}: {result['success']:.1%}")

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # Before training, unless a resumed run's checkpoint brought the held-out results (the run evaluated before
        # its first step already; evaluating again at the resumed step would add a point the run never had).
        if self.held_out is not None and not self.history.get("held_out/success"):
            self._evaluate_held_out(args, state, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        if self.held_out is not None and (step % self.held_out_eval_steps == 0 or step == state.max_steps):
            self._evaluate_held_out(args, state, model)

    # Checks

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "reward" not in logs:  # the end-of-training summary, or an evaluation log
            return
        step = state.global_step
        logs.update(self._pending)
        self._pending = {}
        for key, value in logs.items():
            if key.startswith("held_out/"):
                continue  # recorded at the step it was measured
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                self.history[key].append((step, float(value)))

        found = {alarm.name: alarm for alarm in check_alarms(self.history, self.settings)}
        for name in ALARM_NAMES:
            logs[f"alarms/{name}"] = float(name in found)
        for name in list(self._active):
            if name not in found:
                del self._active[name]
        new = False
        for name, alarm in found.items():
            entry = self._active.get(name)
            if entry is None:
                entry = {
                    "name": name,
                    "step": step,
                    "last_step": step,
                    "message": alarm.message,
                    "evidence": alarm.evidence,
                }
                self.alarms.append(entry)
                self._active[name] = entry
                new = True
                if state.is_world_process_zero:
                    warnings.warn(
                        f"[trl-agentic alarm: {name} at step {step}] {alarm.message}", TrainingAlarm, stacklevel=2
                    )
            entry.update(last_step=step, message=alarm.message, evidence=alarm.evidence)
        # Trainer.log appended its record to log_history before calling the callbacks: add ours to it too.
        if state.log_history and state.log_history[-1].get("step") == step:
            state.log_history[-1].update({k: v for k, v in logs.items() if k.startswith(("alarms/", "held_out/"))})
        if new:
            self.write_summary(args, state)

    def on_train_end(self, args, state, control, **kwargs):
        close = getattr(self.held_out, "close", None)  # an Evaluator holds an endpoint; a plain callable may not
        if close is not None:
            close()
        self.write_summary(args, state)
        if self.alarms and state.is_world_process_zero:
            lines = [f"  {a['name']} (steps {a['step']}-{a['last_step']}): {a['message']}" for a in self.alarms]
            logger.warning("Training alarms of this run:\n" + "\n".join(lines))

    # Checkpoints

    def state_dict(self) -> dict[str, Any]:
        """What the callback has seen and found, for a checkpoint (`json.dumps` writes it): the metric history, the
        alarms (and which still hold), the held-out results and the metrics waiting for the next log."""
        return {
            "history": {key: [list(point) for point in points] for key, points in self.history.items()},
            "alarms": self.alarms,
            "active": [self.alarms.index(entry) for entry in self._active.values()],
            "pending": self._pending,
            "held_out_results": [[step, result] for step, result in self.held_out_results.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`: a resumed run then alarms and writes `alarms.json` as the uninterrupted run."""
        # In place: the trainer's `alarms` is this list.
        self.history.clear()
        self.history.update({key: [tuple(point) for point in points] for key, points in state["history"].items()})
        self.alarms[:] = state["alarms"]
        self._active = {self.alarms[i]["name"]: self.alarms[i] for i in state["active"]}
        self._pending = dict(state["pending"])
        self.held_out_results = {step: result for step, result in state["held_out_results"]}

    def summary(self) -> dict[str, Any]:
        """What `alarms.json` holds: `alarms`, the `checks` run, the `settings`, and the held-out success by step."""
        return {
            "alarms": self.alarms,
            "checks": list(ALARM_NAMES),
            "settings": asdict(self.settings),
            "held_out_success": [[step, value] for step, value in self.history.get("held_out/success", [])],
        }

    def write_summary(self, args, state) -> Path | None:
        """Write `alarms.json` to the output directory (main process only)."""
        if not state.is_world_process_zero:
            return None
        path = (self.output_dir or Path(args.output_dir)) / "alarms.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.summary(), indent=2, default=str) + "\n")
        return path


# ---------------------------------------------------------------------------------------------------------------------
# Wiring into the trainer


class TrainerHeldOutEvaluator:
    """The held-out evaluation a trainer's config asks for (`held_out_eval_steps`): the trainer's agent and checkers on
    its `eval_dataset`, served as in training (same sampling and limits) by an [`Evaluator`] built on first use.

    Set `reward_funcs` (before training) to score the held-out episodes with a stricter checker than the training one:
    `trainer.alarms_callback.held_out.reward_funcs = [exact_answer]`.
    """

    def __init__(self, trainer, reward_funcs: list | None = None):
        if trainer.eval_dataset is None:
            raise ValueError(
                f"held_out_eval_steps={trainer.args.held_out_eval_steps} needs a held-out split: pass eval_dataset= "
                "(tasks never trained on, e.g. task.build_dataset('eval')) to the trainer, or set "
                "held_out_eval_steps=0."
            )
        if trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3:
            raise ValueError(
                "Held-out evaluation runs on the main process only and cannot gather ZeRO-3 shards; "
                "set held_out_eval_steps=0 (or evaluate the saved model with `trl-agentic eval`)."
            )
        self.trainer = trainer
        self.reward_funcs = reward_funcs
        self.evaluator = None

    def evaluate(self, model=None, seed: int | None = None) -> dict[str, Any]:
        from .evaluation import Evaluator
        from .tasks import TaskSuite

        trainer, args = self.trainer, self.trainer.args
        model = trainer.accelerator.unwrap_model(model if model is not None else trainer.model)
        if self.evaluator is None:
            reward_funcs, reward_weights = self.reward_funcs, None
            if reward_funcs is None:
                reward_funcs, reward_weights = list(trainer.reward_funcs), trainer.reward_weights.tolist()
            suite = TaskSuite(
                name="held_out",
                tools=[],
                system_prompt="",
                build_dataset=None,
                agent=trainer.agent,
                reward_funcs=reward_funcs,
                demonstrations=None,
                agent_columns=tuple(args.agent_columns),
            )
            self.evaluator = Evaluator(
                model,
                trainer.processing_class,
                suite,
                trainer.eval_dataset,
                num_samples=args.held_out_num_samples,
                temperature=args.temperature,
                max_tokens=args.max_completion_length,
                top_p=args.top_p,
                top_k=args.top_k,
                reward_weights=reward_weights,
                concurrency=args.max_concurrent_episodes,
                max_turns=args.max_turns,
                max_episode_tokens=args.max_episode_tokens,
                episode_timeout=args.episode_timeout,
                max_generation_batch_size=args.max_generation_batch_size,
                generation_batch_wait_ms=args.generation_batch_wait_ms,
                chat_template_kwargs=trainer.chat_template_kwargs,
            )
        return self.evaluator.evaluate(model, seed=seed)

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
            self.evaluator = None


def attach_alarms(trainer) -> AlarmsCallback:
    """Put an [`AlarmsCallback`] first in `trainer`'s callbacks (the one passed in `callbacks=`, or a new one built from
    the config) and give it the held-out evaluation the config asks for; returns it."""
    args = trainer.args
    callbacks = trainer.callback_handler.callbacks
    callback = next((c for c in callbacks if isinstance(c, AlarmsCallback)), None)
    if callback is None:
        callback = AlarmsCallback(AlarmSettings.from_config(args))
    else:
        callbacks.remove(callback)
    if callback.held_out is None and args.held_out_eval_steps > 0:
        callback.held_out = TrainerHeldOutEvaluator(trainer)
        callback.held_out_eval_steps = args.held_out_eval_steps
    callbacks.insert(0, callback)
    return callback


__all__ = [
    "ALARM_NAMES",
    "Alarm",
    "AlarmSettings",
    "AlarmsCallback",
    "TrainingAlarm",
    "attach_alarms",
    "check_alarms",
    "derived_series",
    "entropy_collapse",
    "history_from_episode_records",
    "history_from_log_history",
    "length_drift",
    "low_split_rate",
    "malformed_spike",
    "reward_hacking",
    "spike",
    "unscorable_spike",
]
