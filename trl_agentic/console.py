"""What a training run prints: one line per logged step, and only the warnings a user can act on.

transformers prints every log as a raw dict (60+ keys a step for `AgenticGRPOTrainer`); the full metrics still go to
`report_to` (W&B, TensorBoard, ...) and `trainer.state.log_history`, but the console gets one line:

```
step  12/300  reward 0.42 ±0.31  split 0.83  held-out 0.55  unscorable 0.06  tokens/episode 41.2  2.31 s/step
step  13/300  reward 0.47 ±0.30  split 0.79  unscorable 0.00  tokens/episode 40.8  2.28 s/step  ALARM low_split_rate
```

[`StepLines`] replaces transformers' progress bar's log printing (and [`StepLinePrinter`] its `PrinterCallback`, used
when `disable_tqdm=True`, or when stdout or stderr is not a terminal: a bar redirected to a file is one line of `\r`
updates, 12,000 characters after 300 steps, issue 40); `AgenticGRPOTrainer` installs them. [`quiet_known_warnings`] silences warnings a user cannot
act on (deprecations raised inside TRL's own calls) and shortens TRL's "All reward functions returned None" warning,
which prints the whole episode: for `AgenticGRPOTrainer` an unscorable episode is expected (it failed, or a checker
said `None`) and counted in `episodes/unscorable`.
"""

from __future__ import annotations

import sys
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from .quiet import quiet_known_warnings


# (log key, label, format): what a step line shows, when the log has it.
STEP_FIELDS = (
    ("reward", "reward", "{:.2f}"),
    ("reward_std", "±", "{:.2f}"),
    ("sampling/split_rate", "split", "{:.2f}"),
    ("sampling/difficulty_mean", "difficulty", "{:.2f}"),
    ("held_out/success", "held-out", "{:.2f}"),
    ("episodes/unscorable", "unscorable", "{:.2f}"),
    ("episodes/sampled_tokens_mean", "tokens/episode", "{:.1f}"),
    ("async/staleness_max", "staleness", "{:.0f}"),
)


def step_line(logs: dict[str, Any], step: int, max_steps: int) -> str | None:
    """The one line for a training log (`None` for a log without rollout metrics, e.g. the end-of-training summary).

    Example:

    ```python
    >>> step_line({"reward": 0.5, "reward_std": 0.25, "sampling/split_rate": 0.75, "step_time": 2.0,
    ...            "alarms/low_split_rate": 1.0}, 3, 10)
    'step   3/10  reward 0.50 ±0.25  split 0.75  2.00 s/step  ALARM low_split_rate'
    ```
    """
    if "reward" not in logs and "loss" not in logs:
        return None
    width = len(str(max_steps))
    parts = [f"step {step:>{width}}/{max_steps}"]
    for key, label, fmt in STEP_FIELDS:
        value = logs.get(key)
        if isinstance(value, (int, float)):
            text = fmt.format(value)
            if label == "±" and len(parts) > 1 and parts[-1].startswith("reward"):
                parts[-1] += f" ±{text}"
            elif label != "±":
                parts.append(f"{label} {text}")
    if isinstance(logs.get("step_time"), (int, float)):
        parts.append(f"{logs['step_time']:.2f} s/step")
    alarms = sorted(
        key.removeprefix("alarms/") for key, value in logs.items() if key.startswith("alarms/") and value == 1.0
    )
    if alarms:
        parts.append("ALARM " + ", ".join(alarms))
    return "  ".join(parts)


class StepLines(ProgressCallback):
    """transformers' progress bar, with one line per training log instead of the raw dict."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        line = step_line(logs, state.global_step, state.max_steps)
        if line is not None:
            self.training_bar.write(line)


class StepLinePrinter(TrainerCallback):
    """`disable_tqdm=True`: the same lines, printed (transformers' `PrinterCallback` prints the raw dict)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        line = step_line(logs, state.global_step, state.max_steps)
        if line is not None:
            print(line, flush=True)


def interactive_console() -> bool:
    """Whether progress bars are wanted: stdout and stderr both terminals. Off a terminal (a file, a pipe, CI) a bar is
    a stream of carriage returns, so every progress bar of the package is then replaced by plain lines."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def step_line_callback() -> TrainerCallback:
    """The callback that prints one line per training log: under a progress bar on a terminal ([`StepLines`]), else
    plain lines ([`StepLinePrinter`])."""
    return StepLines() if interactive_console() else StepLinePrinter()


def install_step_lines(trainer) -> None:
    """Replace the trainer's raw-dict printing (progress bar or printer) with one line per step; no bar off a
    terminal."""
    from transformers.trainer_callback import PrinterCallback

    bar = StepLines if interactive_console() else StepLinePrinter
    for old, new in ((ProgressCallback, bar), (PrinterCallback, StepLinePrinter)):
        found = [cb for cb in trainer.callback_handler.callbacks if type(cb) is old]
        for callback in found:
            trainer.remove_callback(callback)
            trainer.add_callback(new)


__all__ = [
    "StepLinePrinter",
    "StepLines",
    "install_step_lines",
    "interactive_console",
    "quiet_known_warnings",
    "step_line",
    "step_line_callback",
]
