"""[`run_pipeline`]: warm start -> held-out eval -> GRPO -> held-out eval -> plots, saved model, summary.

The task is resolved once into a [`PipelinePlan`] (`trl_agentic.pipeline.plan`: levels, demonstrations, the tasks of
each split, the warm-start cache key); each stage (`trl_agentic.pipeline.stages`) is a function of it.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from ..tasks import TaskSuite
from .config import PipelineConfig
from .plan import PipelinePlan, make_plan
from .printing import info, quiet_libraries
from .stages import (
    grpo_stage,
    held_out_after_stage,
    held_out_before_stage,
    held_out_evaluators,
    report_stage,
    warm_start_stage,
)


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
    plan = make_plan(
        task,
        config,
        output_dir,
        cache_dir=cache_dir,
        use_cache=use_cache,
        task_file_source=task_file_source,
        smoke=smoke,
    )
    return run_plan(plan, threads=threads, title=title)


def run_plan(plan: PipelinePlan, *, threads: int = 1, title: str = "trl-agentic pipeline") -> dict[str, Any]:
    """[`run_pipeline`] on a task already resolved by [`make_plan`] (`trl-agentic demo` resolves it first, to fail
    before a model is built): the five stages, in order, each a function of `plan`; returns the summary."""
    config, smoke = plan.config, plan.smoke
    quiet_libraries()
    started = time.monotonic()

    import torch
    from transformers import set_seed

    if threads < 0:
        raise ValueError(f"threads={threads}: expected 0 (all cores) or a positive thread count")
    if threads:
        torch.set_num_threads(threads)
    set_seed(config.seed)
    random.seed(config.seed)
    plan.output_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"{title}{' (smoke)' if smoke else ''}: {config.describe_task(plan.suite)}, seed {config.seed}; outputs in "
        f"{plan.output_dir}",
        flush=True,
    )
    if smoke:
        info(
            "--smoke: every stage at toy sizes, to check the wiring in seconds. The model is too small and trained too "
            "briefly to learn: 0% success, answers cut at the token limit and the notes below are expected."
        )

    timings: dict[str, float] = {}
    model, tokenizer, warm_info = warm_start_stage(plan, timings)
    evaluators = held_out_evaluators(plan, model, tokenizer)
    try:
        before = held_out_before_stage(plan, evaluators, model, timings)
        grpo = grpo_stage(plan, model, tokenizer, evaluators, before, timings)
        after = held_out_after_stage(plan, grpo)
    finally:
        evaluators.close()
    return report_stage(plan, before, after, grpo, warm_info, timings, started)
