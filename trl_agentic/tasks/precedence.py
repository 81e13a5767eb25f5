"""Order of operations: a two-tool task where the first tool call decides the outcome (issue 42's learning study).

The question is a three-operand expression (operands 3 to `max_operand`, 9 by default) in one of four shapes, `a + b * c`, `a * b + c`, `(a + b) * c` and
`a * (b + c)`. The agent has two tools, `add(a, b)` and `multiply(a, b)`, one operation per call, and three model calls
(`max_rounds=3`): the operation evaluated first, the second on its result, then `The answer is N.`. The first call is
the decision: `add(7, 3)` for `7 + 3 * 12` (the classic precedence mistake) leaves no call to undo it, and the end is
unreachable whatever the later calls do. The later calls are copying (a number from the question, the tool's result),
which a warm-started tiny model does well; the decision it gets right only sometimes. Tree rollouts
(`AgenticGRPOConfig.rollout_tree`) branching after the first call see siblings that share the decision, so their
differences isolate it (`benchmarks/tree_study.py`).

Example:

```python
>>> from trl_agentic.tasks.precedence import PRECEDENCE, reference_calls
>>> row = PRECEDENCE.build_dataset(split="eval", size=1, seed=0)[0]
>>> row["expression"], row["answer"]
('4 * 4 + 4', 20)
>>> reference_calls(row["expression"])
[('multiply', 4, 4, 16), ('add', 16, 4, 20)]
>>> finishable("4 * 4 + 4", ("add", 4, 4))  # the sum first: no second call gives 20
False
```
"""

from __future__ import annotations

import random
import re
from typing import Any

import datasets

from . import TaskSuite
from .agent_loop import ToolAgent
from .calculator import calculator_correct
from .splits import sample_split


SYSTEM_PROMPT = (
    "Evaluate the expression with the add and multiply tools, one operation per call, in the order arithmetic "
    "evaluates it (parentheses first, then *, then +). Then reply with 'The answer is N.'"
)
SHAPES = ("{a} + {b} * {c}", "{a} * {b} + {c}", "({a} + {b}) * {c}", "{a} * ({b} + {c})")
MAX_ROUNDS = 3  # two tool calls and the answer: no call is left to undo a wrong first operation


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if not number.is_integer() or abs(number) > 10**9:
        raise ValueError(f"{name} must be an integer below 1e9, got {value!r}")
    return int(number)


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return str(_integer(a, "a") + _integer(b, "b"))


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return str(_integer(a, "a") * _integer(b, "b"))


TOOLS = {"add": add, "multiply": multiply}
_EXPRESSION = re.compile(r"^\(?(\d+) ([+*]) \(?(\d+)\)? ([+*]) (\d+)\)?$")


def reference_calls(expression: str) -> list[tuple[str, int, int, int]]:
    """The reference solver's two tool calls for one of the four shapes: `[(tool, a, b, result), ...]`, the operation
    evaluated first, then the second on its result.

    Example:

    ```python
    >>> reference_calls("(2 + 3) * 4")
    [('add', 2, 3, 5), ('multiply', 5, 4, 20)]
    >>> reference_calls("2 * (3 + 4)")
    [('add', 3, 4, 7), ('multiply', 2, 7, 14)]
    ```
    """
    return _calls_in_order(expression, wrong_order=False)


def wrong_order_calls(expression: str) -> list[tuple[str, int, int, int]]:
    """The precedence mistake, carried out correctly: the other operation evaluated first (`add(7, 3)` for
    `7 + 3 * 4`), then the second on its result. Well-formed calls, operands and results copied right; the last
    result is not the answer (the questions are `decisive`).

    Example:

    ```python
    >>> wrong_order_calls("7 + 3 * 4")
    [('add', 7, 3, 10), ('multiply', 10, 4, 40)]
    >>> wrong_order_calls("(2 + 3) * 4")
    [('multiply', 3, 4, 12), ('add', 2, 12, 14)]
    ```
    """
    return _calls_in_order(expression, wrong_order=True)


def _calls_in_order(expression: str, wrong_order: bool) -> list[tuple[str, int, int, int]]:
    match = _EXPRESSION.match(expression)
    if match is None or expression.count("(") != expression.count(")"):
        raise ValueError(f"{expression!r} is not one of the shapes {SHAPES}")
    a, first, b, second, c = match.groups()
    a, b, c = int(a), int(b), int(c)
    name = {"+": "add", "*": "multiply"}
    left_first = expression.startswith("(") or (first == "*" and "(" not in expression)  # (a + b) * c, a * b + c
    if left_first != wrong_order:
        inner = int(TOOLS[name[first]](a, b))
        return [(name[first], a, b, inner), (name[second], inner, c, int(TOOLS[name[second]](inner, c)))]
    inner = int(TOOLS[name[second]](b, c))  # a * (b + c), a + b * c
    return [(name[second], b, c, inner), (name[first], a, inner, int(TOOLS[name[first]](a, inner)))]


def finishable(expression: str, first_call: tuple[str, int, int]) -> bool:
    """Whether one more tool call after `first_call` (`(tool, a, b)`) can produce the answer, its operands taken from
    the question's numbers and the first call's result: what the agent's last tool call can still do (`MAX_ROUNDS`).

    Example:

    ```python
    >>> finishable("7 + 3 * 12", ("multiply", 3, 12)), finishable("7 + 3 * 12", ("add", 7, 3))
    (True, False)
    ```
    """
    answer = reference_calls(expression)[-1][-1]
    tool, a, b = first_call
    numbers = [int(n) for n in re.findall(r"\d+", expression)] + [int(TOOLS[tool](a, b))]
    return any(int(f(x, y)) == answer for f in TOOLS.values() for x in numbers for y in numbers)


def decisive(expression: str) -> bool:
    """Whether the first tool decides the outcome: no first call with the other tool, on any two of the question's
    numbers, leaves a call that finishes (`finishable`). Questions where it would (`19 * (11 + 8)`: `11 + 8` is
    `19`, so `multiply(19, 19)` skips the first step) are not drawn.

    Example:

    ```python
    >>> decisive("7 + 3 * 12"), decisive("19 * (11 + 8)")
    (True, False)
    ```
    """
    first_tool = reference_calls(expression)[0][0]
    other = "add" if first_tool == "multiply" else "multiply"
    numbers = [int(n) for n in re.findall(r"\d+", expression)]
    return not any(finishable(expression, (other, x, y)) for x in numbers for y in numbers)


def make_question(rng: random.Random, max_operand: int = 9) -> tuple[str, dict[str, Any]]:
    """One question: a shape and three operands in `[3, max_operand]`, redrawn until `decisive`. Returns its split key
    (the expression) and its row."""
    while True:
        shape = rng.choice(SHAPES)
        a, b, c = (rng.randint(3, max_operand) for _ in range(3))
        expression = shape.format(a=a, b=b, c=c)
        if decisive(expression):
            break
    row = {
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"What is {expression}?"}],
        "expression": expression,
        "answer": reference_calls(expression)[-1][-1],
    }
    return expression, row


def build_precedence_dataset(
    split: str = "train", size: int = 256, seed: int = 0, max_operand: int = 9
) -> datasets.Dataset:
    """`size` questions of `split` (`"train"` and `"eval"` share no expression: `sample_split` by its text)."""
    return question_dataset(make_question, split, size, seed, max_operand)


def question_dataset(make_question, split: str, size: int, seed: int, max_operand: int) -> datasets.Dataset:
    """`size` rows of `make_question(rng, max_operand)` (`(split key, row)`) in `split` (`sample_split` by the key):
    the dataset builder of this task and of its variants."""
    if max_operand < 4:
        raise ValueError(f"max_operand must be >= 4, got {max_operand}")
    return datasets.Dataset.from_list(sample_split(lambda rng: make_question(rng, max_operand), split, size, seed))


AGENT = ToolAgent([add, multiply], max_rounds=MAX_ROUNDS)


def precedence_demonstrations(
    n: int, seed: int = 0, max_operand: int = 9, decision_noise: float = 0.0
) -> list[dict[str, Any]]:
    """The reference solver on `n` training questions: the first operation, the second on its result, the answer.

    `decision_noise`: the share of demonstrations that take the other operation first (`wrong_order_calls`: the
    precedence mistake, with well-formed calls, operands and tool results copied right, and `The answer is N.` with
    the last result), each drawn independently from a stream of its own seeded by `seed`. At 0.5 a warm start on them
    learns the mechanics (the call format, copying numbers) and is left at chance on the decision, which is then what
    GRPO has to learn (`benchmarks/tree_study.py`); those demonstrations are not all successful. 0: every
    demonstration is the reference solver's (the stream is not drawn from).

    Example:

    ```python
    >>> demo = precedence_demonstrations(1)[0]
    >>> [m["role"] for m in demo["messages"]]
    ['system', 'user', 'assistant', 'tool', 'assistant', 'tool', 'assistant']
    ```
    """
    return noisy_demonstrations(
        build_precedence_dataset("train", n, seed, max_operand),
        lambda expression: [(tool, {"a": a, "b": b}, result) for tool, a, b, result in reference_calls(expression)],
        lambda expression: [(tool, {"a": a, "b": b}, result) for tool, a, b, result in wrong_order_calls(expression)],
        AGENT.tool_schemas,
        decision_noise,
        f"precedence-decision-noise-{seed}",
    )


def noisy_demonstrations(
    rows, solver, wrong_solver, tools: list[dict], decision_noise: float, noise_key: str
) -> list[dict[str, Any]]:
    """Each row's reference solution (`solver(expression)`: `(tool, arguments, result)` calls), or `wrong_solver`'s
    `decision_noise` of the time, drawn independently per row from the stream `random.Random(noise_key)` (not drawn
    from at 0): the calls, their tool messages, then `The answer is N.` with the last result."""
    if not 0.0 <= decision_noise <= 1.0:
        raise ValueError(f"decision_noise must be a probability in [0, 1], got {decision_noise!r}")
    noise = random.Random(noise_key)
    solved = []
    for row in rows:
        wrong = decision_noise > 0 and noise.random() < decision_noise
        calls = (wrong_solver if wrong else solver)(row["expression"])
        messages = list(row["prompt"])
        for index, (tool, arguments, result) in enumerate(calls):
            call_id = f"call_{index}"
            call = {"id": call_id, "type": "function", "function": {"name": tool, "arguments": arguments}}
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": call_id, "name": tool, "content": str(result)})
        messages.append({"role": "assistant", "content": f"The answer is {calls[-1][-1]}."})
        solved.append({"messages": messages, "tools": tools})
    return solved


PRECEDENCE = TaskSuite(
    name="precedence",
    tools=AGENT.tool_schemas,
    system_prompt=SYSTEM_PROMPT,
    build_dataset=build_precedence_dataset,
    agent=AGENT,
    reward_funcs=[calculator_correct],  # the last number of the final answer equals `answer`
    demonstrations=precedence_demonstrations,
    agent_columns=("prompt",),  # `expression` and `answer` are the checker's
    # Operands up to 9 (one token each: a warm-started tiny model copies them), or up to 20.
    difficulty_levels={1: {"max_operand": 9}, 2: {"max_operand": 20}},
    target_difficulty=1,
)
