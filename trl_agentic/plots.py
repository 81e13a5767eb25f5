"""Training-curve plots from a trainer's `state.log_history`: one PNG per metric, against the optimizer step.

Example:

```python
>>> from trl_agentic.plots import plot_training_curves
>>> paths = plot_training_curves(trainer.state.log_history, held_out={0: 0.31, 50: 0.52, 100: 0.68}, out_dir="plots")
>>> [p.name for p in paths]
['reward.png', 'held_out_success.png', 'completion_length.png', 'frac_reward_zero_std.png', 'tool_calls.png',
 'episode_status.png']
```
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


# file stem -> (log keys plotted together, title, y label)
_SINGLE_METRICS: list[tuple[str, tuple[str, ...], str, str]] = [
    ("reward", ("reward",), "Training reward (mean checker score per episode)", "reward"),
    ("kl", ("kl",), "KL to the reference policy", "KL"),
    ("completion_length", ("completions/mean_length",), "Sampled tokens per episode", "tokens"),
    (
        "frac_reward_zero_std",
        ("frac_reward_zero_std",),
        "Groups with no reward spread (no learning signal)",
        "fraction of groups",
    ),
    (
        "tool_calls",
        ("episodes/tool_calls_mean", "episodes/malformed_tool_calls_mean"),
        "Tool calls per episode (well-formed and malformed)",
        "calls per episode",
    ),
]


def _series(log_history: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    for record in log_history:
        value = record.get(key)
        if value is None or "step" not in record or isinstance(value, bool):
            continue
        try:
            value = float(value)
        except (TypeError, ValueError):
            continue
        if math.isnan(value):
            continue
        steps.append(float(record["step"]))
        values.append(value)
    return steps, values


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_training_curves(
    log_history: Sequence[Mapping[str, Any]],
    held_out: Mapping[int, float] | None,
    out_dir: str | Path,
    smoothing: int | None = None,
) -> list[Path]:
    """Write one PNG per metric of `log_history` (TRL's `trainer.state.log_history`) into `out_dir`.

    Plots, when present: `reward`, held-out success (`held_out`: step -> success rate, e.g. from evaluations before,
    during and after training), `kl`, sampled tokens per episode (`completions/mean_length`), `frac_reward_zero_std`,
    tool calls and malformed tool calls per episode (`episodes/tool_calls_mean`,
    `episodes/malformed_tool_calls_mean`), and the share of episodes by status (`episodes/status_*`, stacked). Noisy per-step curves are drawn raw (faint)
    with a moving average over `smoothing` logged points (default: ~1/10 of the points).

    Args:
        log_history: list of logged dicts, each with a `step`.
        held_out: step -> held-out success rate in [0, 1], or `None`.
        out_dir: folder for the PNGs (created).
        smoothing: moving-average window in logged points; `1` disables smoothing.

    Returns:
        The paths written, in the order above.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig, stem: str) -> None:
        path = out_dir / f"{stem}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def line_plot(stem: str, keys: tuple[str, ...], title: str, ylabel: str, ylim=None) -> None:
        curves = [(key, *_series(log_history, key)) for key in keys]
        curves = [c for c in curves if c[1]]
        if not curves:
            return
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for index, (key, steps, values) in enumerate(curves):
            window = smoothing or max(1, len(values) // 10)
            color = f"C{index}"
            if window > 1:
                ax.plot(steps, values, alpha=0.3, linewidth=1, color=color, label=f"{key} (per step)")
                ax.plot(
                    steps,
                    _smooth(values, window),
                    linewidth=2,
                    color=color,
                    label=f"{key} (moving average of {window})",
                )
            else:
                ax.plot(steps, values, marker="o" if len(values) < 30 else None, linewidth=2, color=color, label=key)
        ax.set(title=title, xlabel="optimizer step", ylabel=ylabel)
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, stem)

    stem, keys, title, ylabel = _SINGLE_METRICS[0]
    line_plot(stem, keys, title, ylabel)

    if held_out:
        points = sorted((int(step), float(value)) for step, value in held_out.items())
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        ax.plot([s for s, _ in points], [v for _, v in points], marker="o", linewidth=2, color="tab:green")
        for step, value in points:
            ax.annotate(
                f"{value:.0%}", (step, value), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8
            )
        ax.set(
            title="Held-out success rate (eval split, never trained on)", xlabel="optimizer step", ylabel="success rate"
        )
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        save(fig, "held_out_success")

    for stem, keys, title, ylabel in _SINGLE_METRICS[1:]:
        line_plot(stem, keys, title, ylabel, ylim=(0, 1.05) if stem == "frac_reward_zero_std" else None)

    # The learning signal (issue #11): share of groups that split, the sampled difficulty, held-out success.
    split_steps, split_values = _series(log_history, "sampling/split_rate")
    if split_steps:
        window = max(1, min(10, len(split_values) // 5))
        fig, ax = plt.subplots(figsize=(7.2, 4.2))
        ax.plot(split_steps, split_values, alpha=0.25, linewidth=1, color="tab:blue")
        ax.plot(
            split_steps,
            _smooth(split_values, window),
            linewidth=2,
            color="tab:blue",
            label=f"split rate (groups with differing rewards, moving average of {window})",
        )
        if held_out:
            points = sorted((int(step), float(value)) for step, value in held_out.items())
            ax.plot(
                [s for s, _ in points],
                [v for _, v in points],
                marker="o",
                linewidth=2,
                color="tab:green",
                label="held-out success (target difficulty, all episodes)",
            )
        ax.set(title="Learning signal and held-out success", xlabel="optimizer step", ylabel="share")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        difficulty_steps, difficulty = _series(log_history, "sampling/difficulty_mean")
        handles, labels = ax.get_legend_handles_labels()
        if difficulty_steps:
            twin = ax.twinx()
            twin.plot(difficulty_steps, _smooth(difficulty, window), linewidth=1.5, color="tab:orange", linestyle="--")
            twin.set_ylabel("mean sampled difficulty", color="tab:orange")
            handles.append(twin.lines[0])
            labels.append(f"sampled difficulty (moving average of {window})")
        ax.legend(handles, labels, fontsize=8, loc="lower right")
        save(fig, "learning_signal")

    status_keys = sorted({key for record in log_history for key in record if key.startswith("episodes/status_")})
    curves = [(key.removeprefix("episodes/status_"), *_series(log_history, key)) for key in status_keys]
    curves = [c for c in curves if c[1] and any(v > 0 for v in c[2])]
    if curves:
        steps = curves[0][1]
        if all(c[1] == steps for c in curves):
            fig, ax = plt.subplots(figsize=(6.4, 4.0))
            ax.stackplot(steps, *[c[2] for c in curves], labels=[c[0] for c in curves], alpha=0.8)
            ax.set(title="Episodes by status", xlabel="optimizer step", ylabel="share of episodes")
            ax.set_ylim(0, 1.0)
            ax.legend(fontsize=8, loc="lower left")
            save(fig, "episode_status")

    return written


__all__ = ["plot_training_curves"]
