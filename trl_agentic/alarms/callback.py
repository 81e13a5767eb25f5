"""[`AlarmsCallback`]: the alarms inside a `Trainer`, checked at every log, with an optional held-out evaluation of the
live policy; `alarms.json` and the `alarms/*`, `held_out/*` metrics come from here."""

from __future__ import annotations

import json
import math
import warnings
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from transformers import TrainerCallback
from transformers.utils import logging

from .checks import check_alarms
from .definitions import ALARM_NAMES, AlarmSettings, History, TrainingAlarm


logger = logging.get_logger(__name__)


class HeldOutEvaluator(Protocol):
    """What the callback calls every `held_out_eval_steps`: `evaluate(model, seed=...)` returns at least `success`
    (successes over all episodes, as [`trl_agentic.evaluation.Evaluator.evaluate`] does)."""

    def evaluate(self, model=None, seed: int | None = None) -> dict[str, Any]: ...


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
