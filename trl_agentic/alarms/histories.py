"""Histories (`{metric: [(global_step, value), ...]}`) rebuilt after the fact: from a finished run's `log_history`, or
recomputed from its episode log (what `trl-agentic inspect` shows when a run wrote no `alarms.json`)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from .definitions import History
from .detectors import _mean


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
