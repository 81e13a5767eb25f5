"""Order of operations after a plan: the decision comes after a costly shared prefix that a small model gets right
(issue 42's third learning study).

The precedence task (`trl_agentic.tasks.precedence`: same questions, tools, checker and decisiveness) with one more
tool, `plan(steps)`, which the agent must call first to write down its plan (`PLAN`, the same four steps for every
question: a coding agent's to-do list, with its cost and none of its variety); the tool notes it and restates the
expression (`"Noted. Evaluate 7 + 3 * 4."`), so the numbers are in front of the model again when it decides (a
warm-started tiny model does not copy them from the question across the plan's ~90 tokens). Then the two operations
and the answer, four model calls (`MAX_ROUNDS`). Call 1, the first operation, is the decision: the wrong operation
first leaves one call, which cannot reach the answer (`precedence.finishable`). The plan call is about half of a
successful episode's sampled tokens, so a tree rollout branched AT the decision
(`AgenticGRPOConfig(tree_branch_points="call:1")`) replays it for free and samples the decision fresh
(`benchmarks/tree_study.py --suite precedence_plan`).

Example:

```python
>>> from trl_agentic.tasks.precedence_plan import PRECEDENCE_PLAN, reference_calls
>>> row = PRECEDENCE_PLAN.build_dataset(split="eval", size=1, seed=0)[0]
>>> row["prompt"][-1]["content"], row["answer"]
('What is 4 * 4 + 4?', 20)
>>> [(tool, result) for tool, _, result in reference_calls(row["expression"])]
[('plan', 'Noted. Evaluate 4 * 4 + 4.'), ('multiply', 16), ('add', 20)]
```
"""

from __future__ import annotations

import random
from typing import Any

import datasets
from transformers.utils import get_json_schema

from ..endpoint import SERVED_MODEL_NAME
from . import TaskSuite
from .agent_loop import run_tool_loop
from .calculator import calculator_correct
from .precedence import add, multiply, noisy_demonstrations, question_dataset
from .precedence import make_question as precedence_question
from .precedence import reference_calls as operation_calls
from .precedence import wrong_order_calls as wrong_operation_calls


PLAN = (
    "1. Find the operation that arithmetic evaluates first. 2. Evaluate it with its tool. 3. Evaluate the other "
    "operation on its result. 4. Reply with the answer."
)
SYSTEM_PROMPT = (
    "First call the plan tool with your plan. Then evaluate the expression with the add and multiply tools, one "
    "operation per call, in the order arithmetic evaluates it (parentheses first, then *, then +). Then reply with "
    "'The answer is N.'"
)
MAX_ROUNDS = 4  # the plan, two operations, the answer: no call is left to undo a wrong first operation
DECISION_CALL = 1  # the first operation's call index (0-based), what `tree_branch_points="call:1"` branches


def plan(steps: str) -> str:
    """Write down the plan before the first operation.

    Args:
        steps: The steps, in order.
    """
    raise RuntimeError("plan is bound to a task's expression by task_tools")  # the schema's source only


TOOL_SCHEMAS = [get_json_schema(plan), get_json_schema(add), get_json_schema(multiply)]


def question_expression(prompt: list[dict[str, Any]]) -> str:
    """The expression of a task's question (its last user message, `"What is 7 + 3 * 4?"`)."""
    question = [m["content"] for m in prompt if m.get("role") == "user"][-1]
    return question.strip().removeprefix("What is ").removesuffix("?").strip()


def task_tools(expression: str) -> dict[str, Any]:
    """The tools of one task: `plan(steps)`, which takes any steps but none and restates `expression`; `add` and
    `multiply`.

    Example:

    ```python
    >>> task_tools("7 + 3 * 4")["plan"]("add, then multiply")
    'Noted. Evaluate 7 + 3 * 4.'
    ```
    """

    def plan(steps: str) -> str:
        if not str(steps).strip():
            raise ValueError("the plan is empty; write the steps")
        return f"Noted. Evaluate {expression}."

    return {"plan": plan, "add": add, "multiply": multiply}


async def plan_agent(client: Any, task: dict[str, Any], *, max_rounds: int = MAX_ROUNDS) -> str:
    """The reference agent: the tool loop with the task's tools (`task_tools` on its question's expression)."""
    return await run_tool_loop(
        client,
        list(task["prompt"]),
        tools=task_tools(question_expression(task["prompt"])),
        tool_schemas=TOOL_SCHEMAS,
        model=task.get("model") or SERVED_MODEL_NAME,
        max_rounds=max_rounds,
    )


def _with_plan(expression: str, calls: list[tuple[str, int, int, int]]) -> list[tuple[str, dict[str, Any], int | str]]:
    planned = ("plan", {"steps": PLAN}, task_tools(expression)["plan"](PLAN))
    return [planned] + [(tool, {"a": a, "b": b}, result) for tool, a, b, result in calls]


def reference_calls(expression: str) -> list[tuple[str, dict[str, Any], int | str]]:
    """The reference solver's three tool calls: the plan, then `precedence.reference_calls` (the operation evaluated
    first, the second on its result), each as `(tool, arguments, result)`."""
    return _with_plan(expression, operation_calls(expression))


def wrong_order_calls(expression: str) -> list[tuple[str, dict[str, Any], int | str]]:
    """The plan, then the precedence mistake carried out correctly (`precedence.wrong_order_calls`)."""
    return _with_plan(expression, wrong_operation_calls(expression))


def make_question(rng: random.Random, max_operand: int = 9) -> tuple[str, dict[str, Any]]:
    """`precedence.make_question`'s question with this task's system prompt."""
    expression, row = precedence_question(rng, max_operand)
    row["prompt"] = [{"role": "system", "content": SYSTEM_PROMPT}, *row["prompt"][1:]]
    return expression, row


def build_precedence_plan_dataset(
    split: str = "train", size: int = 256, seed: int = 0, max_operand: int = 9
) -> datasets.Dataset:
    """`size` questions of `split` (`"train"` and `"eval"` share no expression: `sample_split` by its text)."""
    return question_dataset(make_question, split, size, seed, max_operand)


def precedence_plan_demonstrations(
    n: int, seed: int = 0, max_operand: int = 9, decision_noise: float = 0.0
) -> list[dict[str, Any]]:
    """The reference solver on `n` training questions: the plan, the two operations, the answer; `decision_noise` of
    them with the operations in the wrong order (`wrong_order_calls`), drawn as `precedence.precedence_demonstrations`
    draws it.

    Example:

    ```python
    >>> demo = precedence_plan_demonstrations(1)[0]
    >>> [m["role"] for m in demo["messages"]][2:]
    ['assistant', 'tool', 'assistant', 'tool', 'assistant', 'tool', 'assistant']
    ```
    """
    return noisy_demonstrations(
        build_precedence_plan_dataset("train", n, seed, max_operand),
        reference_calls,
        wrong_order_calls,
        TOOL_SCHEMAS,
        decision_noise,
        f"precedence-plan-decision-noise-{seed}",
    )


PRECEDENCE_PLAN = TaskSuite(
    name="precedence_plan",
    tools=TOOL_SCHEMAS,
    system_prompt=SYSTEM_PROMPT,
    build_dataset=build_precedence_plan_dataset,
    agent=plan_agent,
    reward_funcs=[calculator_correct],  # the last number of the final answer equals `answer`
    demonstrations=precedence_plan_demonstrations,
    agent_columns=("prompt",),  # `expression` and `answer` are the checker's
    difficulty_levels={1: {"max_operand": 9}, 2: {"max_operand": 20}},
    target_difficulty=1,
)
