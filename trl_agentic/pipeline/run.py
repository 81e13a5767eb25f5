"""[`run_pipeline`]: warm start -> held-out eval -> GRPO -> held-out eval -> plots, saved model, summary."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path
from typing import Any

from ..tasks import TaskSuite, get_task
from .config import PipelineConfig, level_list
from .data import check_task
from .grpo import make_callbacks, train_grpo
from .held_out import HeldOutEvaluator
from .printing import info, quiet_libraries, stage
from .report import (
    describe_episode_log,
    format_split_rate,
    format_table,
    json_default,
    keep_episode_log,
    save_trained_model,
    split_rate_summary,
)
from .report import task_file_source as spec_task_file_source
from .warm_start import build_warm_started


def run_pipeline(
    task: TaskSuite | str,
    config: PipelineConfig | None = None,
    output_dir: str | Path = "outputs/pipeline",
    *,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    threads: int = 1,
    task_file_source: str | None = None,
    title: str = "trl-agentic pipeline",
    smoke: bool = False,
) -> dict[str, Any]:
    """Train a tiny model on `task` on CPU and measure it on held-out tasks before and after; return the summary.

    1. A tiny Qwen2-shaped model and its BPE tokenizer are built locally (nothing is downloaded) and warm-started on
       the task's demonstrations until it sometimes succeeds ([`build_warm_started`], cached).
    2. Held-out evaluation: the task's agent on its eval split (no question of which is trained on), one episode per
       task at `temperature`; success counts over all episodes (a failed episode is a failure).
    3. GRPO with [`AgenticGRPOTrainer`] on training-split tasks the warm start did not see, adaptive task sampling over
       the task's difficulty levels when it has them; held-out success again every `eval_every` steps, which the
       alarms hold training reward against. The model and tokenizer are saved to `<output_dir>/model`.
    4. Held-out evaluation after training (the alarms' evaluation at the last step).
    5. Results: a before/after table, `<output_dir>/summary.json`, PNGs under `<output_dir>/plots/`, and the
       `trl-agentic eval` / `trl-agentic serve` commands for the saved model (`<output_dir>/task.py` names the task).

    Args:
        task: a [`TaskSuite`] with `demonstrations` (its reference solver), or what `get_task` accepts
            (`"pkg.module:TASK"`, `"path/to/file.py:TASK"`, a bundled name).
        config: the knobs ([`PipelineConfig`], default: its defaults).
        output_dir: where everything goes.
        cache_dir: the warm-start cache's folder (default `$TRL_AGENTIC_CACHE/demo` or `~/.cache/trl-agentic/demo`).
        use_cache: read and write the warm-start cache.
        threads: torch CPU threads (0: torch's default). One leaves a core to the endpoint and the agents.
        task_file_source: the text of `<output_dir>/task.py` (default: one that loads `task` when it is a name; none
            for a `TaskSuite` object, and then no eval command).
        title: the start of the header line.
        smoke: `config` is a toy-sized one (`SMOKE_OVERRIDES`): said in the header and the summary.

    Example:

    ```python
    >>> from trl_agentic.pipeline import PipelineConfig, run_pipeline
    >>> summary = run_pipeline("examples/custom_task/unit_converter.py:TASK", PipelineConfig(seed=1), "outputs/units")
    >>> summary["before"]["success"], summary["after"]["success"]
    (0.23, 0.61)
    ```
    """
    config = config or PipelineConfig()
    if isinstance(task, str):
        task_file_source = task_file_source or spec_task_file_source(task)
        task = get_task(task)
    check_task(task, config)
    quiet_libraries()
    started = time.monotonic()

    import torch
    from transformers import set_seed

    from ..plots import plot_training_curves

    if threads < 0:
        raise ValueError(f"threads={threads}: expected 0 (all cores) or a positive thread count")
    if threads:
        torch.set_num_threads(threads)
    set_seed(config.seed)
    random.seed(config.seed)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    suite = task
    timings: dict[str, float] = {}
    total_stages = 5
    print(
        f"{title}{' (smoke)' if smoke else ''}: {config.describe_task(suite)}, seed {config.seed}; outputs in {output_dir}",
        flush=True,
    )
    if smoke:
        info(
            "--smoke: every stage at toy sizes, to check the wiring in seconds. The model is too small and trained too "
            "briefly to learn: 0% success, answers cut at the token limit and the notes below are expected."
        )

    # 1. Model and warm start
    stage(1, total_stages, "Tiny model + warm start (SFT on demonstrations)")
    t = time.monotonic()
    model, tokenizer, warm_info = build_warm_started(config, suite, cache_dir, use_cache=use_cache, smoke=smoke)
    timings["warm_start"] = time.monotonic() - t

    # 2. Held-out evaluation before
    stage(2, total_stages, "Held-out evaluation BEFORE GRPO")
    eval_dataset = suite.build_dataset(split="eval", size=config.eval_size, seed=config.seed)
    evaluator = HeldOutEvaluator(
        model, tokenizer, suite, eval_dataset, config.temperature, config.max_completion_length, config.max_turns
    )
    grpo_temperature = config.grpo_temperature if config.grpo_temperature is not None else config.temperature
    alarm_evaluator = (
        HeldOutEvaluator(
            model, tokenizer, suite, eval_dataset, grpo_temperature, config.max_completion_length, config.max_turns
        )
        if grpo_temperature != config.temperature
        else None
    )
    try:
        info(
            f"{len(eval_dataset)} eval-split tasks (no question is in the training split), temperature {config.temperature}"
        )
        t = time.monotonic()
        before = evaluator.evaluate(model, seed=config.seed)
        timings["eval_before"] = time.monotonic() - t
        info(
            f"success {before['success']:.1%} of {before['episodes']} episodes ({before['scored_episodes']} scored, "
            f"{before['seconds']:.0f}s)"
        )
        for example in before["examples"][:2]:
            info(
                f"e.g. {example['question']!r} -> calls {example['tool_calls']} -> {example['answer']!r} "
                f"(expected {example['expected']})"
            )
        held_out: dict[int, float] = {}
        evaluations: dict[int, dict] = {}
        alarm_held_out: dict[int, dict] = {}

        # 3. GRPO
        stage(
            3,
            total_stages,
            f"GRPO: {config.steps} steps x {config.tasks_per_step} tasks x "
            f"{config.num_generations} episodes, reward = the checker's score"
            + (", -1 for an answer cut at the token limit" if config.cut_off_penalty else " only"),
        )
        t = time.monotonic()
        levels = level_list(suite, config.levels)
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
            config, evaluator, held_out, evaluations, alarm_evaluator=alarm_evaluator, alarm_held_out=alarm_held_out
        )
        # the alarms compare against step 0: the reported evaluation is not run twice
        callbacks[0].record_held_out(0, callbacks[0].held_out.evaluate(model, seed=config.seed, reported=before))
        trainer = train_grpo(model, tokenizer, suite, config, output_dir, callbacks)
        timings["grpo"] = time.monotonic() - t
        # the alarms' own evaluations (step 0's too) ran inside the GRPO phase; without `alarm_evaluator` they are the
        # reported ones, already counted
        eval_seconds_in_grpo = sum(e["seconds"] for s, e in evaluations.items() if s > 0)
        if alarm_evaluator is not None:
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
            task_file_source,
            eval_seed=config.seed + trainer.state.global_step,
        )
        info(f"trained model saved to {output_dir / 'model'}")

        # 4. Held-out evaluation after (the alarms' evaluation at the last step)
        stage(4, total_stages, "Held-out evaluation AFTER GRPO")
        after = evaluations[trainer.state.global_step]
        info(
            f"success {after['success']:.1%} of {after['episodes']} episodes ({after['scored_episodes']} scored, "
            f"{after['seconds']:.0f}s)"
        )
    finally:
        evaluator.close()
        if alarm_evaluator is not None:
            alarm_evaluator.close()

    # 5. Results
    stage(5, total_stages, "Results")
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
        "task": suite.name,
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
        "smoke": smoke,
        "torch_threads": torch.get_num_threads(),
        "warm_start": {k: v for k, v in warm_info.items() if k != "settings"},
        "timings_seconds": timings,
        "seconds_per_grpo_step": grpo_only / max(config.steps, 1),
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
