"""The pipeline's tasks: the warm start's demonstrations and checks, and GRPO's tasks, kept apart from each other and
from the eval split.

Every task comes from the suite's training split (`build_dataset(split="train")`); the held-out evaluation alone uses
the eval split, which shares no question with it (`trl_agentic.tasks.splits`). A task is identified by the text of its
last prompt message (the question).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from ..tasks import TaskSuite, build_difficulty_dataset
from .config import PipelineConfig, check_levels, level_list, warm_start_levels


DEMONSTRATIONS_HELP = (
    "give its TaskSuite `demonstrations=fn(n, seed=0, **difficulty_knobs)`: a reference solver returning n successful "
    "conversations on training-split tasks, each {'messages': [system?, user, assistant (with tool_calls), tool, ..., "
    "assistant (the answer)], 'tools': [the tool schemas the agent sends]}, tool-call arguments as dicts "
    "(see examples/custom_task/ and docs/pipeline.md)"
)


def question_of(messages: list[dict[str, Any]]) -> str:
    """The question of a conversation or prompt: the content of the last message before the first assistant one."""
    prompt = messages
    for index, message in enumerate(messages):
        if message.get("role") == "assistant":
            prompt = messages[:index]
            break
    return str(prompt[-1].get("content")) if prompt else ""


def check_demonstrations(suite: TaskSuite, demonstrations: Any) -> list[dict[str, Any]]:
    """Validate what `suite.demonstrations` returned; a `ValueError` says what the warm start needs instead."""
    problem = None
    if not isinstance(demonstrations, list) or not demonstrations:
        problem = f"returned {type(demonstrations).__name__} {str(demonstrations)[:80]!r}, not a non-empty list"
    else:
        for index, demonstration in enumerate(demonstrations):
            messages = demonstration.get("messages") if isinstance(demonstration, dict) else None
            if not isinstance(messages, list) or not any(m.get("role") == "assistant" for m in messages):
                problem = f"demonstration {index} has no 'messages' list with an assistant message"
            elif not question_of(messages):
                problem = f"demonstration {index} has no message before its first assistant message (the task)"
            else:
                calls = [c for m in messages if m.get("role") == "assistant" for c in m.get("tool_calls") or []]
                if any(not isinstance(c.get("function", {}).get("arguments"), dict) for c in calls):
                    problem = f"demonstration {index} has a tool call whose arguments are not a dict"
            if problem:
                break
    if problem:
        raise ValueError(f"Task {suite.name!r} cannot be warm-started: its demonstrations {problem}. To fix it, "
                         f"{DEMONSTRATIONS_HELP}.")  # fmt: skip
    return demonstrations


def check_task(suite: TaskSuite, config: PipelineConfig) -> None:
    """Fail fast, before a model is built, when `suite` cannot run through the pipeline: no checker, no or unusable
    demonstrations, or difficulty levels the config names that the suite does not have."""
    check_reward_funcs(suite)
    for levels in (config.levels, config.warm_start_levels, config.warm_start_check_levels):
        level_list(suite, levels)  # a level the suite does not have: named, with those it has
    warm_start_demonstrations(suite, dataclasses.replace(config, num_demonstrations=2))


def check_reward_funcs(suite: TaskSuite) -> None:
    """A `ValueError` when `suite` has no checker to score its episodes."""
    if not suite.reward_funcs:
        raise ValueError(f"Task {suite.name!r} has no reward_funcs: give its TaskSuite a checker that scores episodes.")


def warm_start_demonstrations(
    suite: TaskSuite, config: PipelineConfig, *, levels: tuple[float, ...] | None = None
) -> list[dict[str, Any]]:
    """`num_demonstrations` successful conversations from the suite's reference solver, evenly over the warm-start
    difficulty levels (`levels`, when already resolved: `warm_start_levels(suite, config)`), shuffled."""
    if not callable(suite.demonstrations):
        raise ValueError(f"Task {suite.name!r} has no demonstrations for the warm start: {DEMONSTRATIONS_HELP}.")
    levels = warm_start_levels(suite, config) if levels is None else levels
    knobs = [suite.difficulty_levels[level] for level in levels] or [{}]
    per_level = -(-config.num_demonstrations // len(knobs))
    demonstrations = []
    for level_knobs in knobs:
        demonstrations += check_demonstrations(suite, suite.demonstrations(per_level, seed=config.seed, **level_knobs))
    random.Random(config.seed).shuffle(demonstrations)
    return demonstrations[: config.num_demonstrations]


def short_form_rows(demonstrations: list[dict], seed: int, max_exchanges: int = 3) -> list[dict]:
    """Phase-1 rows: each demonstration's conversation (system prompt and tool schemas left out) after 0 to
    `max_exchanges - 1` other demonstrations' conversations.

    With the question always at the start of the row, a tiny model learns to copy it into the call from a fixed
    place, and that copy breaks when phase 2 puts ~270 tokens of system prompt and tool schema in front (on some seeds
    phase 2 then stalls at 0% success for 60+ steps). Earlier exchanges in front make it copy from the *last* question.
    """
    rng = random.Random(seed)
    rows = []
    for demonstration in demonstrations:
        messages = _without_system(demonstration)
        for _ in range(rng.randrange(max_exchanges)):
            messages = _without_system(demonstrations[rng.randrange(len(demonstrations))]) + messages
        rows.append({"messages": messages, "tools": None})
    return rows


def _without_system(demonstration: dict) -> list[dict]:
    return [m for m in demonstration["messages"] if m["role"] != "system"]


def validation_tasks(
    suite: TaskSuite, config: PipelineConfig, demonstrations: list[dict], *, levels: tuple[float, ...] | None = None
) -> list[dict]:
    """The warm start's check tasks: `validation_size` training-split tasks at the check levels (`levels`, when
    already resolved: `check_levels(suite, config)`) that are not among the demonstrations (the eval split stays
    untouched until the held-out evaluation)."""
    size, seed = config.validation_size, config.seed
    levels = check_levels(suite, config) if levels is None else levels
    seen = {question_of(d["messages"]) for d in demonstrations}
    if levels:
        dataset = build_difficulty_dataset(suite, split="train", size=size * 4, seed=seed + 10_000, levels=levels)
    else:
        dataset = suite.build_dataset(split="train", size=size * 4, seed=seed + 10_000)
    rows = [row for row in dataset if question_of(row["prompt"]) not in seen]
    rows = rows if len(rows) >= size else list(dataset)
    random.Random(seed).shuffle(rows)
    return rows[:size]


def grpo_tasks(
    suite: TaskSuite, config: PipelineConfig, demonstrations: list[dict], *, levels: tuple[float, ...] | None = None
):
    """GRPO's training tasks: `train_size` training-split tasks over the GRPO levels (`levels`, when already resolved:
    `level_list(suite, config.levels)`), without the questions the warm start was trained on wherever a level has
    others (the calculator's 1-digit products are all demonstrated: that level keeps them).

    Drawn with the demonstrations' seed, as they once were, they were the demonstrations: all 642 of seed 0's 2-digit
    GRPO tasks had been trained on in the warm start, so training success measured recall as much as skill, and the
    sampler's "new" tasks were not new to the model.
    """
    levels = level_list(suite, config.levels) if levels is None else levels
    seed = config.seed + 20_000
    if levels:
        dataset = build_difficulty_dataset(suite, split="train", size=config.train_size, seed=seed, levels=list(levels))
        buckets = dataset["difficulty"]
    else:
        dataset = suite.build_dataset(split="train", size=config.train_size, seed=seed)
        buckets = [None] * len(dataset)
    seen = {question_of(d["messages"]) for d in demonstrations}
    unseen = [question_of(prompt) not in seen for prompt in dataset["prompt"]]
    with_unseen = {bucket for ok, bucket in zip(unseen, buckets) if ok}
    keep = [i for i, (ok, bucket) in enumerate(zip(unseen, buckets)) if ok or bucket not in with_unseen]
    return dataset.select(keep) if len(keep) < len(dataset) else dataset
