"""Bundled task suites: what to ask (dataset), how a reference agent works on it, and how a checker scores it.

A [`TaskSuite`] bundles everything a training run on one task needs. The agent talks to the policy only through the
OpenAI-compatible client it is handed; the checker (`reward_funcs`) runs on the trainer side with columns of the
dataset (e.g. `answer`, `expected`) that the agent never puts in front of the model.

Example:

```python
>>> from trl_agentic.tasks import get_task
>>> suite = get_task("calculator")
>>> dataset = suite.build_dataset(split="train", size=64, seed=0)
>>> dataset[0]["prompt"][-1]["content"]
'What is 96 - 48?'
```
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import datasets

from ..imports import TASK_SOURCES, import_object, register_task_source


@dataclass
class TaskSuite:
    """One task: dataset builder, reference agent, checker and SFT demonstrations.

    Args:
        name: short name, used in logs and recipe file names.
        tools: OpenAI tool schemas (`{"type": "function", "function": {...}}`) the reference agent sends.
        system_prompt: the system message of every dataset prompt.
        build_dataset: `build_dataset(split="train", size=256, seed=0, **knobs) -> datasets.Dataset`. Rows have a
            conversational `prompt` (system + user message) and the checker's columns. `"train"` and `"eval"` are
            disjoint whatever `size` and `seed`.
        agent: `async def agent(client: openai.AsyncOpenAI, task: dict) -> Any`, where `task` holds the
            `agent_columns` of one dataset row. The model name sent is `task.get("model") or SERVED_MODEL_NAME`
            (`trl_agentic.endpoint`). The return value reaches the reward functions as `Episode.result`.
        reward_funcs: TRL-signature checkers `f(prompts, completions, **kwargs) -> list[float | None]`; they read
            `kwargs["episodes"]` and the dataset columns, and return `None` for episodes that did not end `"ok"`.
        demonstrations: `demonstrations(n, seed=0) -> [{"messages": [...], "tools": [...]}]`: full successful
            conversations (train split only) for an SFT warm start; tool-call arguments are dicts, as chat templates
            expect.
        agent_columns: the dataset columns the agent needs (`AgenticGRPOConfig.agent_columns`); the others, the
            checker's, never reach it.
        difficulty_levels: the suite's difficulty knobs by level (numbers, larger = harder), e.g. the calculator's
            `{1: {"digits": 1}, 2: {"digits": 2}, 3: {"digits": 3}}`; `build_difficulty_dataset` mixes them for
            adaptive task sampling (`AgenticGRPOConfig.task_sampling="adaptive"`).
        target_difficulty: the level `build_dataset` draws (the difficulty the suite is for).
        reward_weights: one weight per `reward_funcs` (`None`: 1.0 each); `trl-agentic train`/`eval` use them when
            the recipe sets neither `reward_funcs` nor `reward_weights` (a verifiers rubric's weights, for one).
        chance_success: the success rate of random play (`None`: unknown, taken as 0), e.g. 0.27 for guessing a
            number from 1 to 15 in 4 tries; the demo pipeline's warm start stops at `warm_start_target` of the way
            from it to 100% (`trl_agentic.pipeline.config.warm_start_goal`), not below it.
    """

    name: str
    tools: list[dict[str, Any]]
    system_prompt: str
    build_dataset: Callable[..., datasets.Dataset]
    agent: Callable
    reward_funcs: list[Callable]
    demonstrations: Callable[..., list[dict[str, Any]]]
    agent_columns: tuple[str, ...] = ("prompt",)
    difficulty_levels: dict[float, dict[str, Any]] = field(default_factory=dict)
    target_difficulty: float | None = None
    reward_weights: list[float] | None = None
    chance_success: float | None = None


def build_difficulty_dataset(
    suite: TaskSuite,
    split: str = "train",
    size: int = 256,
    seed: int = 0,
    levels: list[float] | None = None,
    column: str = "difficulty",
) -> datasets.Dataset:
    """The suite's tasks at each of its difficulty levels, in one dataset with a `difficulty` column.

    Each level contributes `ceil(size / number of levels)` tasks built with that level's knobs (so `"train"` and
    `"eval"` stay disjoint level by level). This is what [`AdaptiveTaskSampler`] chooses from.

    Args:
        suite: a suite with `difficulty_levels`.
        split, size, seed: as `suite.build_dataset`.
        levels: the levels to include (default: all of the suite's).
        column: name of the difficulty column.

    Example:

    ```python
    >>> from trl_agentic.tasks.calculator import make_calculator_suite
    >>> dataset = build_difficulty_dataset(make_calculator_suite(digits=2, ops=("*",)), size=6)
    >>> sorted(set(dataset["difficulty"]))
    [1, 2, 3]
    ```
    """
    if not suite.difficulty_levels:
        raise ValueError(
            f"Task {suite.name!r} declares no difficulty_levels; give its TaskSuite difficulty_levels={{level: knobs}} "
            "or train on suite.build_dataset alone."
        )
    chosen = list(suite.difficulty_levels) if levels is None else list(levels)
    unknown = [level for level in chosen if level not in suite.difficulty_levels]
    if unknown or not chosen:
        raise ValueError(
            f"levels {chosen} must be a non-empty subset of the suite's difficulty_levels "
            f"{list(suite.difficulty_levels)}."
        )
    per_level = -(-size // len(chosen))
    parts = []
    for level in chosen:
        part = suite.build_dataset(split=split, size=per_level, seed=seed, **suite.difficulty_levels[level])
        parts.append(part.add_column(column, [level] * len(part)))
    return datasets.concatenate_datasets(parts)


# Name -> "module:attribute", imported on first use so that `import trl_agentic.tasks` stays cheap.
BUNDLED_TASKS: dict[str, str] = {
    "calculator": "trl_agentic.tasks.calculator:CALCULATOR",
    "files": "trl_agentic.tasks.files:FILES",
    "latency": "trl_agentic.tasks.latency:LATENCY",
}


def get_task(name: str) -> TaskSuite:
    """Resolve a task suite by bundled name (`"calculator"`, `"files"`, `"latency"`), import path `"pkg.module:attr"`,
    or installed verifiers environment `"verifiers:<env-id>"`.

    Args:
        name: a bundled name, or the import path of a module-level [`TaskSuite`], e.g. `"my_tasks:SQL_SUITE"`, or
            `"<source>:<id>"` for a source an environment adapter registered (`register_task_source`), e.g.
            `"verifiers:<env-id>"` (`trl_agentic.envs.verifiers.load_verifiers_suite`).
            For other difficulty settings of a bundled task, point at your own suite, e.g. one built with
            `trl_agentic.tasks.calculator.make_calculator_suite(digits=3)`.

    Example:

    ```python
    >>> get_task("files").name
    'files'
    >>> get_task("trl_agentic.tasks.calculator:CALCULATOR").name
    'calculator'
    ```
    """
    prefix, _, task_id = name.partition(":")
    if prefix in TASK_SOURCES:  # another system's task by id, e.g. an installed verifiers environment (its extra)
        module, _, loader = TASK_SOURCES[prefix].partition(":")
        return getattr(importlib.import_module(module), loader)(task_id)
    path = BUNDLED_TASKS.get(name, name)
    if ":" not in path:
        raise ValueError(
            f"Unknown task {name!r}. Use one of the bundled tasks {sorted(BUNDLED_TASKS)} or the import path of a "
            "TaskSuite, 'pkg.module:attr'."
        )
    suite = import_object(path)
    if not isinstance(suite, TaskSuite):
        raise ValueError(
            f"Task {name!r} resolved to a {type(suite).__name__}, not a TaskSuite. Point the path at a TaskSuite "
            "instance (build one with trl_agentic.tasks.TaskSuite(...))."
        )
    return suite


__all__ = ["BUNDLED_TASKS", "TaskSuite", "build_difficulty_dataset", "get_task", "register_task_source"]
