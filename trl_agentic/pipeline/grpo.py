"""The pipeline's GRPO stage: `AgenticGRPOTrainer` on the suite's agent and checkers, the alarms checked against the
held-out evaluation, and one line per step (`trl_agentic.console`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..tasks import TaskSuite
from .config import PipelineConfig, level_list
from .data import grpo_tasks, warm_start_demonstrations
from .held_out import HeldOutEvaluator, ReportingEvaluator


def make_callbacks(
    config: PipelineConfig,
    evaluator: HeldOutEvaluator | None = None,
    held_out: dict[int, float] | None = None,
    evaluations: dict[int, dict] | None = None,
    alarm_evaluator: HeldOutEvaluator | None = None,
    alarm_held_out: dict[int, dict] | None = None,
):
    """`(alarms_callback, progress_class)`: the alarms, checked against held-out success measured every `eval_every`
    steps and at the last step by `evaluator` (issue #11: reward hacking is training reward rising while held-out
    success does not; without `evaluator`, the alarms alone), and what makes the step lines (`step  12/300  reward
    ...`, `trl_agentic.console`): `AgenticGRPOTrainer` prints them itself, a plain TRL trainer (a study's control)
    gets them from `progress_class()`. `held_out` / `evaluations`
    (the reported evaluation, `evaluator`) and `alarm_held_out` (what the alarms got: `alarm_evaluator`'s when given,
    see `ReportingEvaluator`), when given, are filled in after training."""
    from ..alarms import AlarmsCallback
    from ..console import step_line_callback

    class PipelineAlarms(AlarmsCallback):
        def on_train_end(self, args, state, control, **kwargs):
            super().on_train_end(args, state, control, **kwargs)
            for step, result in sorted(self.held_out_results.items()):
                reported = result.get("reported", result)
                if held_out is not None:
                    held_out[step] = reported["success"]
                if evaluations is not None:
                    evaluations[step] = reported
                if alarm_held_out is not None:
                    alarm_held_out[step] = {k: v for k, v in result.items() if k not in ("reported", "examples")}

    eval_every = config.eval_every if config.eval_every > 0 else config.steps
    alarm_temperature = config.temperature if config.grpo_temperature is None else config.grpo_temperature
    alarms = (
        PipelineAlarms(
            held_out=ReportingEvaluator(evaluator, config.seed, alarm_evaluator, alarm_temperature),
            held_out_eval_steps=max(1, eval_every),
        )
        if evaluator is not None
        else PipelineAlarms()
    )

    return alarms, step_line_callback


def grpo_config(
    config: PipelineConfig,
    suite: TaskSuite,
    output_dir: Path,
    *,
    levels: tuple[float, ...] | None = None,
    **overrides: Any,
):
    """The pipeline's `AgenticGRPOConfig` (its output in `<output_dir>/grpo`); `levels`: GRPO's difficulty levels when
    already resolved (`PipelinePlan.levels`; default `level_list(suite, config.levels)`); `overrides`: other
    `AgenticGRPOConfig` fields, set when it is built (a study's arm, e.g. `rollout_tree=True` in
    benchmarks/tree_study.py; TRL's checks forbid changing a built config with `dataclasses.replace`)."""
    from .. import AgenticGRPOConfig
    from ..console import interactive_console

    warmup_steps = min(config.warmup_steps, config.steps)
    decay_steps = min(config.decay_steps, config.steps - warmup_steps)  # runs shorter than the schedule (--smoke)
    levels = level_list(suite, config.levels) if levels is None else levels
    adaptive = config.task_sampling == "adaptive" and bool(levels)
    return AgenticGRPOConfig(
        output_dir=str(Path(output_dir) / "grpo"),
        max_steps=config.steps,
        learning_rate=config.learning_rate,
        lr_scheduler_type="warmup_stable_decay" if decay_steps > 0 else config.lr_scheduler_type,
        lr_scheduler_kwargs={"num_decay_steps": decay_steps, "decay_type": "linear"} if decay_steps > 0 else None,
        steps_per_generation=config.steps_per_generation,
        num_iterations=config.num_iterations,
        warmup_steps=warmup_steps,
        max_grad_norm=config.max_grad_norm,
        num_generations=config.num_generations,
        per_device_train_batch_size=config.num_generations * config.tasks_per_step,
        gradient_accumulation_steps=1,
        beta=config.beta,
        temperature=config.temperature if config.grpo_temperature is None else config.grpo_temperature,
        max_completion_length=config.max_completion_length,
        mask_truncated_completions=config.mask_truncated_completions,
        max_turns=config.max_turns,
        max_concurrent_episodes=256,
        max_generation_batch_size=256,
        generation_batch_wait_ms=config.generation_batch_wait_ms,
        episode_timeout=300,
        use_cpu=True,
        bf16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        log_episodes=True,
        seed=config.seed,
        data_seed=config.seed,
        disable_tqdm=not interactive_console(),  # a bar off a terminal is a 12,000-character line (issue 40)
        # TRL turns it on by default; recomputing a 2-layer model's activations only costs time on CPU (3.98 -> 3.26
        # s/step measured on the calculator's seed 1, 2 threads)
        gradient_checkpointing=False,
        task_sampling="adaptive" if adaptive else "uniform",
        target_difficulty=suite.target_difficulty if adaptive else None,
        target_min_share=config.target_min_share,
        target_affinity=config.target_affinity,
        sampling_revisit=config.sampling_revisit,
        async_rollouts=config.async_rollouts,
        max_staleness=config.max_staleness,
        rollout_process=config.rollout_process,
        rollout_tree=config.rollout_tree,
        tree_branches=config.tree_branches,
        tree_branch_points=config.tree_branch_points,
        tree_depth=config.tree_depth,
        # the agent's task: the columns the suite declares its agent needs (the others are the checker's)
        agent_columns=list(dict.fromkeys(["prompt", *suite.agent_columns])),
        # the suite's checkers with its weights (a verifiers rubric's), the cut-off penalty at 1
        **(
            {"reward_weights": [*suite.reward_weights, *([1.0] if config.cut_off_penalty else [])]}
            if suite.reward_weights is not None
            else {}
        ),
        **overrides,
    )


def grpo_reward_funcs(suite: TaskSuite, config: PipelineConfig) -> list:
    """The training reward: the suite's checkers, and `cut_off_penalty` unless switched off."""
    from ..rewards import cut_off_penalty

    return [*suite.reward_funcs, *([cut_off_penalty] if config.cut_off_penalty else [])]


def train_grpo(
    model,
    tokenizer,
    suite: TaskSuite,
    config: PipelineConfig,
    output_dir: Path,
    callbacks,
    reward_funcs: list | None = None,
    args=None,
    train_dataset=None,
) -> Any:
    """Train `model` in place with GRPO on `grpo_tasks` (the warm start's demonstrations left out); returns the
    trainer (closed: its endpoint is down, its `state.log_history` and `alarms` remain). `reward_funcs` and `args`
    replace `grpo_reward_funcs` and `grpo_config` (a study's variants, e.g. benchmarks/judge_demo.py);
    `train_dataset` replaces `grpo_tasks` (the pipeline's, already drawn: `PipelinePlan.grpo_tasks`)."""
    from .. import AgenticGRPOTrainer

    alarms_callback, _ = callbacks  # the trainer prints the step lines itself (`trl_agentic.console`)
    trainer = AgenticGRPOTrainer(
        model,
        agent=suite.agent,
        reward_funcs=reward_funcs if reward_funcs is not None else grpo_reward_funcs(suite, config),
        args=args if args is not None else grpo_config(config, suite, output_dir),
        train_dataset=(
            train_dataset
            if train_dataset is not None
            else grpo_tasks(suite, config, warm_start_demonstrations(suite, config))
        ),
        processing_class=tokenizer,
        callbacks=[alarms_callback],
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer
