"""[`PipelinePlan`]: a task resolved once into what every stage of the pipeline reads.

The stages (warm start -> held-out eval -> GRPO -> held-out eval -> report, `trl_agentic.pipeline.run`) used to each
ask the suite and the config again for the difficulty levels, the demonstrations and the tasks of each split; the plan
answers those questions once, before a model is built, and a task that cannot run fails there.

Which tasks go where (`trl_agentic.pipeline.data`): the demonstrations, the warm start's check tasks and GRPO's tasks
all come from the training split, GRPO's and the checks without the demonstrated questions; the held-out evaluation
alone uses the eval split.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..tasks import TaskSuite, get_task
from .config import PipelineConfig, check_levels, level_list, warm_start_key, warm_start_levels
from .data import check_reward_funcs, grpo_tasks, validation_tasks, warm_start_demonstrations
from .report import task_file_source as spec_task_file_source


@dataclass(frozen=True)
class PipelinePlan:
    """A task and a [`PipelineConfig`] resolved into what the stages read; built by [`make_plan`].

    > The task and its knobs

    suite: the [`TaskSuite`]. config: the knobs, as given.

    > Difficulty levels (`()` each for a suite without `difficulty_levels`)

    levels: GRPO's (`config.levels`, with the suite's target). warm_start_levels: the demonstrations'.
    check_levels: the warm start's success checks'.

    > Tasks, by split (the training split for all but `eval_tasks`)

    demonstrations: `config.num_demonstrations` conversations of the reference solver.
    validation_tasks: the warm start's check tasks, none of them demonstrated.
    grpo_tasks: GRPO's training dataset (the demonstrated questions left out wherever a level has others).
    eval_tasks: the held-out evaluation's dataset (the eval split, `config.eval_size` tasks).

    > Warm start, sampling and outputs

    warm_start_key: the warm-start cache's key (`warm_start_key`); cache_dir: its folder (`None`: the default root's
    `demo`), use_cache: read and write it.
    grpo_temperature: GRPO's sampling temperature (`config.grpo_temperature`, else `config.temperature`).
    adaptive_sampling: GRPO samples its tasks adaptively (`task_sampling="adaptive"` on a suite with levels).
    output_dir: where the run's outputs go. task_file_source: the text of `<output_dir>/task.py` (`None`: none).
    smoke: `config` is `--smoke`'s toy one.

    Example:

    ```python
    >>> plan = make_plan("calculator", CalculatorDemoConfig())
    >>> plan.levels, plan.warm_start_levels, plan.check_levels
    ((1, 2, 3), (1, 2), (2,))
    ```
    """

    suite: TaskSuite
    config: PipelineConfig
    levels: tuple[float, ...]
    warm_start_levels: tuple[float, ...]
    check_levels: tuple[float, ...]
    demonstrations: list[dict[str, Any]]
    validation_tasks: list[dict[str, Any]]
    grpo_tasks: Any  # a `datasets.Dataset`
    eval_tasks: Any  # a `datasets.Dataset`
    warm_start_key: str
    grpo_temperature: float
    adaptive_sampling: bool
    output_dir: Path
    cache_dir: Path | None = None
    use_cache: bool = True
    task_file_source: str | None = None
    smoke: bool = False


def make_plan(
    task: TaskSuite | str,
    config: PipelineConfig | None = None,
    output_dir: str | Path = "outputs/pipeline",
    *,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    task_file_source: str | None = None,
    smoke: bool = False,
) -> PipelinePlan:
    """Resolve `task` and `config` into a [`PipelinePlan`]; a `ValueError` says what a task that cannot run through
    the pipeline lacks (as [`check_task`]: no checker, a difficulty level the suite does not have, no or unusable
    demonstrations).

    Args:
        task: a [`TaskSuite`], or what `get_task` accepts (`"pkg.module:TASK"`, `"path/to/file.py:TASK"`, a name).
        config: the knobs (default: [`PipelineConfig`]'s defaults).
        output_dir, cache_dir, use_cache, task_file_source, smoke: as [`run_pipeline`] takes them
            (`task_file_source` defaults to one that loads `task` when it is a name).

    Example:

    ```python
    >>> plan = make_plan("calculator", CalculatorDemoConfig(train_size=90, eval_size=20))
    >>> len(plan.eval_tasks), plan.grpo_temperature
    (20, 1.2)
    ```
    """
    config = config or PipelineConfig()
    if isinstance(task, str):
        task_file_source = task_file_source or spec_task_file_source(task)
        task = get_task(task)
    suite = task
    check_reward_funcs(suite)
    # each resolution names a level the suite does not have, with those it has
    levels = level_list(suite, config.levels)
    demonstration_levels = warm_start_levels(suite, config)
    checked_levels = check_levels(suite, config)
    demonstrations = warm_start_demonstrations(suite, config, levels=demonstration_levels)
    validation = validation_tasks(suite, config, demonstrations, levels=checked_levels)
    return PipelinePlan(
        suite=suite,
        config=config,
        levels=levels,
        warm_start_levels=demonstration_levels,
        check_levels=checked_levels,
        demonstrations=demonstrations,
        validation_tasks=validation,
        grpo_tasks=grpo_tasks(suite, config, demonstrations, levels=levels),
        eval_tasks=suite.build_dataset(split="eval", size=config.eval_size, seed=config.seed),
        warm_start_key=warm_start_key(config, suite, demonstrations, validation),
        grpo_temperature=config.grpo_temperature if config.grpo_temperature is not None else config.temperature,
        adaptive_sampling=config.task_sampling == "adaptive" and bool(levels),
        output_dir=Path(output_dir),
        cache_dir=Path(cache_dir).expanduser() if cache_dir else None,
        use_cache=use_cache,
        task_file_source=task_file_source,
        smoke=smoke,
    )
