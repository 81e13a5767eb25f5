"""Order of operations after look-ups: the decision comes after a costly, deterministic shared prefix (issue 42's
second learning study).

The precedence task (`trl_agentic.tasks.precedence`: same shapes, tools, checker and decisiveness) with the operands
named by letters: "What is x + y * z?". A third tool, `read(name)`, substitutes a letter's value and answers with the
expression as far as it is read (`"7 + 3 * z"`), and the agent must read `x`, `y` and `z` first (three calls, always in that order, each answered deterministically; not `a`
and `b`, the names of `add`'s and `multiply`'s arguments), then make the two
operations and answer: six model calls (`MAX_ROUNDS`). Call 3, the first operation, is the decision: the wrong
operation first leaves one call, which cannot reach the answer (`precedence.finishable`). A tree rollout branched AT
the decision (`AgenticGRPOConfig(tree_branch_points="call:3")`) replays the three look-ups for free and samples the
decision fresh, so siblings differ exactly at the decision (`benchmarks/tree_study.py --suite precedence_lookup`).

Example:

```python
>>> from trl_agentic.tasks.precedence_lookup import PRECEDENCE_LOOKUP, reference_calls
>>> row = PRECEDENCE_LOOKUP.build_dataset(split="eval", size=1, seed=0)[0]
>>> row["prompt"][-1]["content"], row["operands"], row["answer"]
('What is x * y + z?', [4, 4, 4], 20)
>>> reference_calls(row["expression"])[3:]
[('multiply', {'a': 4, 'b': 4}, 16), ('add', {'a': 16, 'b': 4}, 20)]
```
"""

from __future__ import annotations

import random
import re
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


SYSTEM_PROMPT = (
    "The expression names its numbers with letters. First read each letter with the read tool, one call each, in "
    "the order x, y, z: it answers with the expression, the letters read so far replaced by their values. Then "
    "evaluate the expression with the add and multiply tools, one operation "
    "per call, in the order arithmetic evaluates it (parentheses first, then *, then +). Then reply with "
    "'The answer is N.'"
)
LETTERS = ("x", "y", "z")  # not a and b: the tools' argument names
MAX_ROUNDS = 6  # three look-ups, two operations, the answer: no call is left to undo a wrong first operation
DECISION_CALL = len(LETTERS)  # the first operation's call index (0-based), what `tree_branch_points="call:3"` branches
_NUMBERS = re.compile(r"\d+")


def read(name: str) -> str:
    """Read the value of a letter of the expression.

    Args:
        name: The letter, one of "x", "y", "z".
    """
    raise RuntimeError("read is bound to a task's operands by lookup_agent")  # the schema's source only


TOOL_SCHEMAS = [get_json_schema(read), get_json_schema(add), get_json_schema(multiply)]


def task_tools(shape: str, operands: list[int]) -> dict[str, Any]:
    """The tools of one task (one episode: `read` keeps what it substituted): `read(name)` substitutes the letter's
    value (`operands`: x, y, z) into the lettered expression `shape` and answers with the expression as far as it is
    read (the letters read so far, in any order, replaced by their values); `add` and `multiply`. After the three
    look-ups the last tool message is the numeric expression, which the operations copy from.

    Example:

    ```python
    >>> tools = task_tools("x + y * z", [7, 3, 4])
    >>> tools["read"]("x"), tools["read"](" Y "), tools["read"]("z")
    ('7 + y * z', '7 + 3 * z', '7 + 3 * 4')
    ```
    """
    values = dict(zip(LETTERS, operands, strict=True))
    if sorted(re.findall(r"[a-z]", shape)) != sorted(LETTERS):
        raise ValueError(f"shape must name each of the letters {LETTERS} once, got {shape!r}")
    read_so_far: list[str] = []

    def read(name: str) -> str:
        key = str(name).strip().lower()
        if key not in values:
            raise ValueError(f"unknown letter {name!r}; the letters are x, y and z")
        if key not in read_so_far:
            read_so_far.append(key)
        return _substituted(shape, {letter: values[letter] for letter in read_so_far})

    return {"read": read, "add": add, "multiply": multiply}


def _substituted(shape: str, values: dict[str, int]) -> str:
    return re.sub(r"[a-z]", lambda m: str(values.get(m.group(0), m.group(0))), shape)


def _operands(expression: str) -> list[int]:
    return [int(n) for n in _NUMBERS.findall(expression)]


def _shape_of(expression: str) -> str:
    letters = iter(LETTERS)
    return _NUMBERS.sub(lambda _: next(letters), expression)


def _with_reads(expression: str, calls: list[tuple[str, int, int, int]]) -> list[tuple[str, dict[str, Any], int | str]]:
    tools = task_tools(_shape_of(expression), _operands(expression))
    reads = [("read", {"name": letter}, tools["read"](letter)) for letter in LETTERS]
    return reads + [(tool, {"a": a, "b": b}, result) for tool, a, b, result in calls]


def reference_calls(expression: str) -> list[tuple[str, dict[str, Any], int | str]]:
    """The reference solver's five tool calls for the numeric `expression` (the row's `expression` column): the three
    look-ups, then `precedence.reference_calls` (the operation evaluated first, the second on its result), each as
    `(tool, arguments, result)` (a look-up's result is its tool message, `"7 + y * z"`).

    Example:

    ```python
    >>> reference_calls("7 + 3 * 4")
    [('read', {'name': 'x'}, '7 + y * z'), ('read', {'name': 'y'}, '7 + 3 * z'), ('read', {'name': 'z'}, '7 + 3 * 4'), ('multiply', {'a': 3, 'b': 4}, 12), ('add', {'a': 7, 'b': 12}, 19)]
    ```
    """
    return _with_reads(expression, operation_calls(expression))


def wrong_order_calls(expression: str) -> list[tuple[str, dict[str, Any], int | str]]:
    """The look-ups, then the precedence mistake carried out correctly (`precedence.wrong_order_calls`)."""
    return _with_reads(expression, wrong_operation_calls(expression))


def make_question(rng: random.Random, max_operand: int = 9) -> tuple[str, dict[str, Any]]:
    """One question: `precedence.make_question`'s (a shape and three operands in `[3, max_operand]`, redrawn until
    `precedence.decisive`), its numbers named by letters. Returns
    its split key (the numeric expression) and its row: the prompt names the letters, `shape` (the lettered expression)
    and `operands` (their values) are the agent's, for `read`; `expression` and `answer` the checker's."""
    expression, _ = precedence_question(rng, max_operand)
    lettered = _shape_of(expression)
    row = {
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"What is {lettered}?"}],
        "shape": lettered,
        "operands": _operands(expression),
        "expression": expression,
        "answer": operation_calls(expression)[-1][-1],
    }
    return expression, row


def build_precedence_lookup_dataset(
    split: str = "train", size: int = 256, seed: int = 0, max_operand: int = 9
) -> datasets.Dataset:
    """`size` questions of `split` (`"train"` and `"eval"` share no numeric expression: `sample_split` by its text)."""
    return question_dataset(make_question, split, size, seed, max_operand)


async def lookup_agent(client: Any, task: dict[str, Any], *, max_rounds: int = MAX_ROUNDS) -> str:
    """The reference agent: the tool loop with the task's tools (`task_tools`: `read` on its `shape` and `operands`)."""
    return await run_tool_loop(
        client,
        list(task["prompt"]),
        tools=task_tools(task["shape"], list(task["operands"])),
        tool_schemas=TOOL_SCHEMAS,
        model=task.get("model") or SERVED_MODEL_NAME,
        max_rounds=max_rounds,
    )


def precedence_lookup_demonstrations(
    n: int, seed: int = 0, max_operand: int = 9, decision_noise: float = 0.0
) -> list[dict[str, Any]]:
    """The reference solver on `n` training questions: the three look-ups, the two operations, the answer.

    `decision_noise`: the share of demonstrations whose operations are in the wrong order (`wrong_order_calls`; the
    look-ups and the copying right, `The answer is N.` with the last result), each drawn independently from a stream
    of its own seeded by `seed`, as `precedence.precedence_demonstrations` draws it. 0: no draws.

    Example:

    ```python
    >>> demo = precedence_lookup_demonstrations(1)[0]
    >>> [m["role"] for m in demo["messages"]][2:]
    ['assistant', 'tool', 'assistant', 'tool', 'assistant', 'tool', 'assistant', 'tool', 'assistant', 'tool', 'assistant']
    ```
    """
    return noisy_demonstrations(
        build_precedence_lookup_dataset("train", n, seed, max_operand),
        reference_calls,
        wrong_order_calls,
        TOOL_SCHEMAS,
        decision_noise,
        f"precedence-lookup-decision-noise-{seed}",
    )


PRECEDENCE_LOOKUP = TaskSuite(
    name="precedence_lookup",
    tools=TOOL_SCHEMAS,
    system_prompt=SYSTEM_PROMPT,
    build_dataset=build_precedence_lookup_dataset,
    agent=lookup_agent,
    reward_funcs=[calculator_correct],  # the last number of the final answer equals `answer`
    demonstrations=precedence_lookup_demonstrations,
    agent_columns=("prompt", "shape", "operands"),  # `expression` and `answer` are the checker's
    difficulty_levels={1: {"max_operand": 9}, 2: {"max_operand": 20}},
    target_difficulty=1,
)
