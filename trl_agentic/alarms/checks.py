"""From a logged history to alarms: the series each detector reads ([`derived_series`]) and [`check_alarms`], which
runs every detector with one [`AlarmSettings`]."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .definitions import Alarm, AlarmSettings, History, Series
from .detectors import (
    entropy_collapse,
    length_drift,
    low_split_rate,
    malformed_spike,
    reward_hacking,
    sampled_flat,
    unscorable_spike,
)


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
    `sampling/episodes/<level>`, `sampling/unscorable/<level>` and `sampling/groups/<level>`), `entropy`, and, with
    tree rollouts, `sampled_flat_tasks` (`tree/sampled_flat_tasks`) and `replay_diverged` (`tree/replay_diverged`).
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
        "sampled_flat_tasks": get("tree/sampled_flat_tasks"),
        "replay_diverged": get("tree/replay_diverged"),
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
    if settings.reward_metric is not None:
        training_success, what = list(history.get(settings.reward_metric, [])), settings.reward_metric
        if not training_success and series["reward"]:
            raise ValueError(
                f"alarm_reward_metric {settings.reward_metric!r} was never logged; name a logged metric, e.g. "
                f"'rewards/<reward function name>/mean' (logged: {sorted(history)[:12]}...)."
            )
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
        sampled_flat(series["sampled_flat_tasks"], series["replay_diverged"]),
    ]
    return [alarm for alarm in found if alarm is not None]
