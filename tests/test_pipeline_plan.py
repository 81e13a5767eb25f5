"""`make_plan`: the calculator task resolved once into what the pipeline's stages read, without a model or training."""

import re
from collections import Counter

import pytest

from trl_agentic.pipeline import (
    CalculatorDemoConfig,
    PipelineConfig,
    grpo_tasks,
    make_plan,
    validation_tasks,
    warm_start_demonstrations,
)
from trl_agentic.pipeline.config import warm_start_key
from trl_agentic.pipeline.data import question_of
from trl_agentic.tasks.splits import split_of


def operand_digits(question: str) -> set[int]:
    return {len(number) for number in re.findall(r"\d+", question)}


def test_the_calculator_plan_resolves_levels_splits_and_sizes():
    settings = CalculatorDemoConfig(
        num_demonstrations=40,  # 20 per warm-start level
        validation_size=16,
        train_size=300,  # 100 per GRPO level before the demonstrated questions are left out
        eval_size=20,
    )
    suite = settings.suite()
    plan = make_plan(suite, settings, "outputs/plan")

    # levels: GRPO's with the target, the demonstrations' (1, 2 digits), the warm-start checks' (the target alone)
    assert (plan.levels, plan.warm_start_levels, plan.check_levels) == ((1, 2, 3), (1, 2), (2,))
    assert plan.adaptive_sampling and plan.grpo_temperature == 1.2
    assert plan.suite is suite and plan.config is settings

    # sizes
    assert len(plan.demonstrations) == 40 and len(plan.validation_tasks) == 16 and len(plan.eval_tasks) == 20
    # the demonstrated questions left out of GRPO's tasks: 17 of the 1-digit draws (81 distinct products), 1 of the
    # 2-digit ones
    assert Counter(plan.grpo_tasks["difficulty"]) == {1: 83, 2: 99, 3: 100}

    # splits: the demonstrations, the checks and GRPO's tasks from the training split, the evaluation from the eval split
    demonstrated = [question_of(d["messages"]) for d in plan.demonstrations]
    assert Counter(max(operand_digits(q)) for q in demonstrated) == {1: 20, 2: 20}
    assert {split_of(task["expression"]) for task in plan.validation_tasks} == {"train"}
    assert {split_of(expression) for expression in plan.grpo_tasks["expression"]} == {"train"}
    assert {split_of(expression) for expression in plan.eval_tasks["expression"]} == {"eval"}
    assert all(operand_digits(question_of(task["prompt"])) == {2} for task in plan.validation_tasks)
    assert not set(demonstrated) & {question_of(task["prompt"]) for task in plan.validation_tasks}
    assert not set(demonstrated) & {question_of(prompt) for prompt in plan.grpo_tasks["prompt"]}

    # the same tasks as the stages' own functions draw, and the warm-start cache key over them
    assert plan.demonstrations == warm_start_demonstrations(suite, settings)
    assert plan.validation_tasks == validation_tasks(suite, settings, plan.demonstrations)
    assert plan.grpo_tasks["prompt"] == grpo_tasks(suite, settings, plan.demonstrations)["prompt"]
    assert plan.eval_tasks["prompt"] == suite.build_dataset(split="eval", size=20, seed=0)["prompt"]
    assert plan.warm_start_key == warm_start_key(settings, suite, plan.demonstrations, plan.validation_tasks)

    # outputs, cache and the task file
    assert str(plan.output_dir) == "outputs/plan" and plan.cache_dir is None and plan.use_cache
    assert plan.task_file_source is None and not plan.smoke


def test_a_plan_from_a_task_name_writes_a_task_file_that_loads_it():
    plan = make_plan("calculator", PipelineConfig(num_demonstrations=4, validation_size=2, train_size=8, eval_size=2))
    assert plan.suite.name == "calculator" and "get_task('calculator')" in plan.task_file_source
    assert plan.grpo_temperature == 1.2 and len(plan.eval_tasks) == 2


def test_a_plan_names_a_level_the_task_does_not_have():
    with pytest.raises(ValueError, match=r"Difficulty level 7 is not one of task 'calculator'"):
        make_plan("calculator", PipelineConfig(warm_start_check_levels=(7,)))
