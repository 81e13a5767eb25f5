"""The pipeline's five stages, each a function of the [`PipelinePlan`] and of what the stages before it made:
warm start -> held-out eval -> GRPO -> held-out eval -> report. [`run_pipeline`] calls them in that order; each prints
its own header and lines, and records its wall time in `timings` (the summary's `timings_seconds`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

from .grpo import grpo_config, make_callbacks, train_grpo
from .held_out import HeldOutEvaluator
from .plan import PipelinePlan
from .printing import info, stage
from .report import (
    describe_episode_log,
    format_split_rate,
    format_table,
    json_default,
    keep_episode_log,
    save_trained_model,
    split_rate_summary,
)
from .warm_started_model import warm_start_model


TOTAL_STAGES = 5


@dataclass
class HeldOutEvaluators:
    """The held-out evaluation's evaluators, up from stage 2 to the end of stage 4: `reported` samples at
    `temperature` (the table's figures), `alarms` at GRPO's temperature when it differs (what the alarms get)."""

    reported: HeldOutEvaluator
    alarms: HeldOutEvaluator | None

    def close(self) -> None:
        self.reported.close()
        if self.alarms is not None:
            self.alarms.close()


@dataclass
class GRPOOutcome:
    """What stage 3 leaves: the (closed) trainer, the held-out results by step, the saved model's commands and its
    timings."""

    trainer: Any
    held_out: dict[int, float]  # reported held-out success by step
    evaluations: dict[int, dict]  # the reported evaluations by step
    alarm_held_out: dict[int, dict]  # what the alarms got by step
    commands: dict[str, str]
    seconds_per_step: float  # without the held-out evaluations


def warm_start_stage(plan: PipelinePlan, timings: dict[str, float]) -> tuple[Any, Any, dict[str, Any]]:
    """1. The tiny model, warm-started on the plan's demonstrations (or loaded from the cache)."""
    stage(1, TOTAL_STAGES, "Tiny model + warm start (SFT on demonstrations)")
    t = time.monotonic()
    model, tokenizer, warm_info = warm_start_model(plan)
    timings["warm_start"] = time.monotonic() - t
    return model, tokenizer, warm_info


def held_out_evaluators(plan: PipelinePlan, model, tokenizer) -> HeldOutEvaluators:
    """The evaluators over the plan's eval tasks; the caller closes them."""
    config = plan.config
    sampling = (config.max_completion_length, config.max_turns)
    evaluator = HeldOutEvaluator(model, tokenizer, plan.suite, plan.eval_tasks, config.temperature, *sampling)
    alarm_evaluator = (
        HeldOutEvaluator(model, tokenizer, plan.suite, plan.eval_tasks, plan.grpo_temperature, *sampling)
        if plan.grpo_temperature != config.temperature
        else None
    )
    return HeldOutEvaluators(evaluator, alarm_evaluator)


def held_out_before_stage(
    plan: PipelinePlan, evaluators: HeldOutEvaluators, model, timings: dict[str, float]
) -> dict[str, Any]:
    """2. Held-out success of the warm-started model."""
    config = plan.config
    stage(2, TOTAL_STAGES, "Held-out evaluation BEFORE GRPO")
    info(
        f"{len(plan.eval_tasks)} eval-split tasks (no question is in the training split), temperature {config.temperature}"
    )
    t = time.monotonic()
    before = evaluators.reported.evaluate(model, seed=config.seed)
    timings["eval_before"] = time.monotonic() - t
    info(
        f"success {before['success']:.1%} of {before['episodes']} episodes ({before['scored_episodes']} scored, "
        f"{before['seconds']:.0f}s)"
    )
    for example in before["examples"][:2]:
        info(example_line(example))
    return before


def example_line(example: dict[str, Any], width: int = 100) -> str:
    """One held-out episode as printed: its question (cut to `width` characters), its tool calls, its answer, the
    expected answer when the task names one (an `answer` column), its reward (`unscored` when none) and how it ended
    when not `ok` (`limit_exceeded`, ...)."""
    question = example["question"]
    if len(question) > width:
        question = question[: width - 3] + "..."
    line = f"e.g. {question!r} -> calls {example['tool_calls']}"
    if example.get("answer") is not None:
        line += f" -> {example['answer']!r}"
    if example.get("expected") is not None:
        line += f" (expected {example['expected']})"
    reward = example.get("reward")
    line += f", reward {reward:g}" if reward is not None else ", unscored"
    status = example.get("status")
    return line + (f" ({status})" if status not in (None, "ok") else "")


def grpo_stage(
    plan: PipelinePlan,
    model,
    tokenizer,
    evaluators: HeldOutEvaluators,
    before: dict[str, Any],
    timings: dict[str, float],
) -> GRPOOutcome:
    """3. GRPO on the plan's training tasks, held-out success every `eval_every` steps (the alarms'), the trained model
    saved to `<output_dir>/model`."""
    config, suite, output_dir = plan.config, plan.suite, plan.output_dir
    held_out: dict[int, float] = {}
    evaluations: dict[int, dict] = {}
    alarm_held_out: dict[int, dict] = {}
    stage(
        3,
        TOTAL_STAGES,
        f"GRPO: {config.steps} steps x {config.tasks_per_step} tasks x "
        f"{config.num_generations} episodes, reward = the checker's score"
        + (", -1 for an answer cut at the token limit" if config.cut_off_penalty else " only"),
    )
    t = time.monotonic()
    levels = plan.levels
    if not levels:
        info(f"training tasks: the training split ({suite.name!r} declares no difficulty levels), uniform sampling")
    elif config.task_sampling == "adaptive":
        info(
            f"training tasks: {config.describe_levels(levels)}, adaptive task sampling (target: "
            f"{config.describe_levels((suite.target_difficulty,))}, at least {config.target_min_share:.0%} of the "
            "groups)"
        )
    else:
        info(f"training tasks: {config.describe_levels(levels)}, uniform sampling")
    callbacks = make_callbacks(
        config,
        evaluators.reported,
        held_out,
        evaluations,
        alarm_evaluator=evaluators.alarms,
        alarm_held_out=alarm_held_out,
    )
    # the alarms compare against step 0: the reported evaluation is not run twice
    callbacks[0].record_held_out(0, callbacks[0].held_out.evaluate(model, seed=config.seed, reported=before))
    trainer = train_grpo(
        model,
        tokenizer,
        suite,
        config,
        output_dir,
        callbacks,
        args=grpo_config(config, suite, output_dir, levels=levels),
        train_dataset=plan.grpo_tasks,
    )
    timings["grpo"] = time.monotonic() - t
    # the alarms' own evaluations (step 0's too) ran inside the GRPO phase; without `alarm_evaluator` they are the
    # reported ones, already counted
    eval_seconds_in_grpo = sum(e["seconds"] for s, e in evaluations.items() if s > 0)
    if evaluators.alarms is not None:
        eval_seconds_in_grpo += sum(e["seconds"] for e in alarm_held_out.values())
    grpo_only = timings["grpo"] - eval_seconds_in_grpo
    info(
        f"{config.steps} steps in {timings['grpo']:.0f}s ({grpo_only / max(config.steps, 1):.2f} s/step "
        f"without the held-out evaluations)"
    )
    # the "after" figure is the alarms' evaluation at the last step, sampled with `seed + step`
    commands = save_trained_model(
        trainer.model,
        tokenizer,
        config,
        output_dir,
        plan.task_file_source,
        eval_seed=config.seed + trainer.state.global_step,
    )
    info(f"trained model saved to {output_dir / 'model'}")
    return GRPOOutcome(
        trainer, held_out, evaluations, alarm_held_out, commands, seconds_per_step=grpo_only / max(config.steps, 1)
    )


def held_out_after_stage(plan: PipelinePlan, grpo: GRPOOutcome) -> dict[str, Any]:
    """4. Held-out success after GRPO: the alarms' evaluation at the last step (not run again)."""
    stage(4, TOTAL_STAGES, "Held-out evaluation AFTER GRPO")
    after = grpo.evaluations[grpo.trainer.state.global_step]
    info(
        f"success {after['success']:.1%} of {after['episodes']} episodes ({after['scored_episodes']} scored, "
        f"{after['seconds']:.0f}s)"
    )
    return after


def report_stage(
    plan: PipelinePlan,
    before: dict[str, Any],
    after: dict[str, Any],
    grpo: GRPOOutcome,
    warm_info: dict[str, Any],
    timings: dict[str, float],
    started: float,
) -> dict[str, Any]:
    """5. The before/after table, plots, `<output_dir>/summary.json` and the commands for the saved model; returns the
    summary. `started`: when the run started (`time.monotonic()`), for its wall time."""
    import torch

    from ..plots import plot_training_curves

    config, output_dir = plan.config, plan.output_dir
    trainer, held_out, alarm_held_out, commands = grpo.trainer, grpo.held_out, grpo.alarm_held_out, grpo.commands
    stage(5, TOTAL_STAGES, "Results")
    print(format_table(before, after), flush=True)
    delta = after["success"] - before["success"]
    print(
        f"\n  held-out success: {before['success']:.1%} -> {after['success']:.1%} ({delta * 100:+.1f} points)",
        flush=True,
    )
    print("  held-out success by step: " + ", ".join(f"{s}: {v:.0%}" for s, v in sorted(held_out.items())), flush=True)
    signal = split_rate_summary(trainer.state.log_history)
    if (line := format_split_rate(signal)) is not None:
        print(f"  {line}", flush=True)
    alarms = trainer.alarms
    print(
        "  alarms: "
        + (
            "none fired"
            if not alarms
            else "; ".join(f"{a['name']} (steps {a['step']}-{a['last_step']})" for a in alarms)
        ),
        flush=True,
    )
    plots = plot_training_curves(trainer.state.log_history, held_out, output_dir / "plots")
    episode_log = keep_episode_log(output_dir / "grpo" / "episodes" / "episodes-rank0.jsonl", config.episode_log)
    timings["total"] = time.monotonic() - started
    summary = {
        "task": plan.suite.name,
        "before": {k: v for k, v in before.items() if k != "examples"},
        "after": {k: v for k, v in after.items() if k != "examples"},
        "improvement_points": delta * 100,
        "held_out_success_by_step": {str(k): v for k, v in sorted(held_out.items())},
        # what the alarms held training success against (sampled as GRPO samples; see `ReportingEvaluator`)
        "alarm_held_out_success_by_step": {str(k): v["success"] for k, v in sorted(alarm_held_out.items())},
        "alarm_held_out_sampled_temperatures": sorted(
            {t for v in alarm_held_out.values() for t in v.get("sampled_temperatures", [])}
        ),
        "split_rate": signal,
        "alarms": alarms,
        "examples": {"before": before["examples"], "after": after["examples"]},
        "settings": dataclasses.asdict(config),
        "smoke": plan.smoke,
        "torch_threads": torch.get_num_threads(),
        "warm_start": {k: v for k, v in warm_info.items() if k != "settings"},
        "timings_seconds": timings,
        "seconds_per_grpo_step": grpo.seconds_per_step,
        "plots": [str(p) for p in plots],
        "model_dir": str(output_dir / "model"),
        "commands": commands,
        "episode_log": str(episode_log),
        "log_history": trainer.state.log_history,
    }
    summary_path = output_dir / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2, default=json_default))
    print(
        f"\n  summary: {summary_path}\n  plots:   {output_dir / 'plots'} ({len(plots)} PNGs)\n"
        f"  model:   {output_dir / 'model'}\n"
        + describe_episode_log(episode_log, output_dir)
        + f"  wall time: {timings['total'] / 60:.1f} min ("
        + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items() if k != "total")
        + ")",
        flush=True,
    )
    if "eval" in commands:
        print(f"\n  evaluate the trained model again:\n    {commands['eval']}", flush=True)
    print(f"  serve it to any OpenAI-compatible agent:\n    {commands['serve']}", flush=True)
    return summary
