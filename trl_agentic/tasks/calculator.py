"""Calculator task: arithmetic questions, a safe `calculator` tool, and an exact-answer checker.

The smallest task on which tool use pays: a tiny model cannot multiply two 3-digit numbers in its head, but it can
learn to call `calculator(expression="417 * 283")` and copy the result. Difficulty knobs: `digits` (operand size),
`ops` (subset of `+ - * // %`) and `num_operands`.

Example:

```python
>>> from trl_agentic.tasks.calculator import make_calculator_suite
>>> suite = make_calculator_suite(digits=3, ops=("+", "*"))
>>> list(suite.build_dataset(split="eval", size=2, seed=0)["expression"])
['429 + 607', '659 * 923']
```
"""

from __future__ import annotations

import functools
import random
import re
import shlex
import sys
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import datasets

from ..endpoint import SERVED_MODEL_NAME
from ..rewards.utils import episode_for, final_assistant_text, is_scorable
from ..rollout.agents import CommandAgent
from . import TaskSuite
from .agent_loop import run_tool_loop

# The tool, standard library only (the command agent loads it without the package): re-exported here as before.
from .calculator_tool import CALCULATOR_TOOLS, MAX_EXPRESSION_LENGTH, calculator, evaluate_expression  # noqa: F401
from .splits import sample_split


SYSTEM_PROMPT = (
    "You are a careful assistant. Use the calculator tool to compute arithmetic exactly, then reply with "
    "'The answer is N.' where N is the result."
)

DEFAULT_OPS = ("+", "-", "*")
QUESTION_OPS = ("+", "-", "*", "//", "%")  # `/` is left out of questions: its answers are not integers


# ---------------------------------------------------------------------------------------------------------------------
# Dataset


def _validate_knobs(digits: int, ops: Sequence[str], num_operands: int) -> tuple[str, ...]:
    if isinstance(ops, str):
        ops = (ops,)
    ops = tuple(ops)
    unknown = [op for op in ops if op not in QUESTION_OPS]
    if not ops or unknown:
        raise ValueError(f"ops must be a non-empty subset of {QUESTION_OPS}, got {ops!r}.")
    if not 1 <= digits <= 18:
        raise ValueError(f"digits must be between 1 and 18, got {digits}.")
    if num_operands < 2:
        raise ValueError(f"num_operands must be >= 2, got {num_operands}.")
    if num_operands * digits + (num_operands - 1) * 4 > MAX_EXPRESSION_LENGTH:
        raise ValueError(
            f"{num_operands} operands of {digits} digits can exceed the calculator's limit of {MAX_EXPRESSION_LENGTH} "
            "characters; use fewer operands or digits."
        )
    return ops


def _fits(digits: int, num_operands: int) -> bool:
    return digits <= 18 and num_operands * digits + (num_operands - 1) * 4 <= MAX_EXPRESSION_LENGTH


def _make_question(rng: random.Random, digits: int, ops: tuple[str, ...], num_operands: int) -> tuple[str, dict]:
    low, high = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    parts = [str(rng.randint(low, high))]
    for _ in range(num_operands - 1):
        op = rng.choice(ops)
        operand = rng.randint(low, high)
        # Without parentheses the right operand of `//` / `%` is the next literal: keep it non-zero.
        if op in ("//", "%") and operand == 0:
            operand = 1
        parts += [op, str(operand)]
    expression = " ".join(parts)
    row = {
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"What is {expression}?"}],
        "expression": expression,
        "answer": str(evaluate_expression(expression)),
    }
    return expression, row


def build_calculator_dataset(
    split: str = "train",
    size: int = 256,
    seed: int = 0,
    *,
    digits: int = 2,
    ops: Sequence[str] = DEFAULT_OPS,
    num_operands: int = 2,
) -> datasets.Dataset:
    """Arithmetic questions ("What is 41 * 73?") with their exact answers.

    Args:
        split: `"train"` or `"eval"`; an expression belongs to exactly one split (hash partition, see `splits.py`).
        size: number of rows.
        seed: sampling seed.
        digits: digits of each operand (`1` draws 0-9, `2` draws 10-99, ...).
        ops: operations to draw from, a subset of `("+", "-", "*", "//", "%")`.
        num_operands: operands per expression (Python precedence, no parentheses).

    Returns:
        A dataset with columns `prompt` (system + user message), `expression` (e.g. `"41 * 73"`) and `answer` (the
        exact integer value as a string, since it may not fit in int64).

    Example:

    ```python
    >>> list(build_calculator_dataset("train", size=2, digits=1, ops=("+",))["expression"])
    ['6 + 9', '4 + 6']
    ```
    """
    ops = _validate_knobs(digits, ops, num_operands)
    rows = sample_split(lambda rng: _make_question(rng, digits, ops, num_operands), split, size, seed)
    return datasets.Dataset.from_list(rows, features=_FEATURES)


_MESSAGE = {"role": datasets.Value("string"), "content": datasets.Value("string")}
_FEATURES = datasets.Features(
    {"prompt": [_MESSAGE], "expression": datasets.Value("string"), "answer": datasets.Value("string")}
)


# ---------------------------------------------------------------------------------------------------------------------
# Agent


async def calculator_agent(client: Any, task: dict[str, Any], *, max_rounds: int = 6) -> str:
    """Reference agent: chat with the `calculator` tool until the model answers; return its final text.

    Args:
        client: an `openai.AsyncOpenAI` pointed at this episode.
        task: one dataset row (`prompt`, ...); `task.get("model")` overrides the model name `SERVED_MODEL_NAME`.
        max_rounds: most model calls.

    Example:

    ```python
    >>> await calculator_agent(openai.AsyncOpenAI(base_url=..., api_key=...), dataset[0])
    'The answer is 48.'
    ```
    """
    messages = list(task["prompt"])  # a new list: the dataset row must not grow
    return await run_tool_loop(
        client,
        messages,
        tools={"calculator": calculator},
        tool_schemas=CALCULATOR_TOOLS,
        model=task.get("model") or SERVED_MODEL_NAME,
        max_rounds=max_rounds,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Checker

# Integers with optional thousands separators and decimals, e.g. "-1,234" or "3.5".
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def last_number(text: str) -> Decimal | None:
    """The last number written in `text`, or `None`.

    Example:

    ```python
    >>> last_number("12 * 3 = 36, so the answer is 1,234.")
    Decimal('1234')
    ```
    """
    matches = _NUMBER.findall(text or "")
    if not matches:
        return None
    try:
        return Decimal(matches[-1].replace(",", ""))
    except InvalidOperation:
        return None


def calculator_correct(prompts: list, completions: list, answer: list[str | int], **kwargs: Any) -> list[float | None]:
    """1.0 if the last number of the agent's final answer equals `answer`, else 0.0; `None` for failed episodes.

    The final answer is the agent's return value (`Episode.result`) when it is text, else the last assistant message
    of the completion (so the checker also works with plain TRL, without `episodes`). An episode whose last model
    call was a broken tool call (`Turn.malformed_tool_call`) gave no answer and scores 0.0, whatever number its text
    ends with: the agent returns such a reply as text, and a policy learned to end broken calls with the product
    (`{"expression": "0 * 1 * 1 * 8.` for "What is 8 * 1?").

    Example:

    ```python
    >>> completions = [[{"role": "assistant", "content": "It is 42."}], [{"role": "assistant", "content": "41"}]]
    >>> calculator_correct(prompts=[None, None], completions=completions, answer=["42", "42"])
    [1.0, 0.0]
    ```
    """
    rewards: list[float | None] = []
    for index, (completion, expected) in enumerate(zip(completions, answer, strict=True)):
        episode = episode_for(kwargs, index)
        if not is_scorable(episode):
            rewards.append(None)
            continue
        if episode is not None and episode.turns and episode.turns[-1].malformed_tool_call:
            rewards.append(0.0)  # a broken tool call is no answer
            continue
        if episode is not None and isinstance(episode.result, str):
            text = episode.result
        else:
            text = final_assistant_text(completion)
        predicted = last_number(text)
        rewards.append(1.0 if predicted is not None and predicted == Decimal(str(expected)) else 0.0)
    return rewards


# ---------------------------------------------------------------------------------------------------------------------
# Demonstrations


def calculator_demonstrations(
    n: int, seed: int = 0, *, digits: int = 2, ops: Sequence[str] = DEFAULT_OPS, num_operands: int = 2
) -> list[dict[str, Any]]:
    """Successful conversations for SFT warm start: question → `calculator` call → result → "The answer is N.".

    Questions come from the train split only. Tool results are produced by the real tool, so the format matches
    what the model will see during RL.

    Example:

    ```python
    >>> demo = calculator_demonstrations(1)[0]
    >>> [m["role"] for m in demo["messages"]]
    ['system', 'user', 'assistant', 'tool', 'assistant']
    >>> demo["messages"][2]["tool_calls"][0]["function"]
    {'name': 'calculator', 'arguments': {'expression': '96 - 48'}}
    ```
    """
    dataset = build_calculator_dataset("train", n, seed, digits=digits, ops=ops, num_operands=num_operands)
    demonstrations = []
    for row in dataset:
        expression = row["expression"]
        tool_call = {
            "id": "call_0",
            "type": "function",
            # Arguments as a dict: the transformers chat-template convention (templates `tojson` them).
            "function": {"name": "calculator", "arguments": {"expression": expression}},
        }
        messages = row["prompt"] + [
            {"role": "assistant", "content": "", "tool_calls": [tool_call]},
            {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": calculator(expression)},
            {"role": "assistant", "content": f"The answer is {row['answer']}."},
        ]
        demonstrations.append({"messages": messages, "tools": CALCULATOR_TOOLS})
    return demonstrations


# ---------------------------------------------------------------------------------------------------------------------
# Suite


def calculator_command_agent(max_rounds: int = 6, sandbox: Any = "auto") -> CommandAgent:
    """The reference agent as a command (`calculator_command.py`, standard library only) run by a [`CommandAgent`] in
    the episode's sandbox: the same requests and tool answers as `calculator_agent`, from a process of its own.

    Args:
        max_rounds: most model calls per episode.
        sandbox: the `CommandAgent`'s `sandbox=` (default: bubblewrap where it works here).

    Example:

    ```python
    >>> agent = calculator_command_agent()  # `python -I -S .../calculator_command.py`, its tool bound read-only
    ```
    """
    script = Path(__file__).with_name("calculator_command.py")
    return CommandAgent(
        f"{shlex.quote(sys.executable)} -I -S {shlex.quote(str(script))}",
        env={"AGENT_MAX_ROUNDS": str(max_rounds)},
        sandbox=sandbox,
        binds=[str(script.with_name("calculator_tool.py"))],
    )


CALCULATOR_AGENTS = ("python", "command")


def make_calculator_suite(
    digits: int = 2, ops: Sequence[str] = DEFAULT_OPS, num_operands: int = 2, max_rounds: int = 6, agent: str = "python"
) -> TaskSuite:
    """The calculator [`TaskSuite`] at a given difficulty.

    Args:
        digits: digits of each operand.
        ops: operations drawn in questions, a subset of `("+", "-", "*", "//", "%")`.
        num_operands: operands per expression.
        max_rounds: most model calls of the reference agent per episode.
        agent: `"python"` (`calculator_agent`, in the trainer's process) or `"command"` (the same loop as a command
            in the episode's sandbox, `calculator_command_agent`).

    Example:

    ```python
    >>> HARD = make_calculator_suite(digits=4, ops=("*", "//", "%"), num_operands=3)  # get_task("my_module:HARD")
    ```
    """
    knobs = {"digits": digits, "ops": _validate_knobs(digits, ops, num_operands), "num_operands": num_operands}
    if agent not in CALCULATOR_AGENTS:
        raise ValueError(
            f"agent={agent!r}: use one of {list(CALCULATOR_AGENTS)} (the agent in the trainer, or a command)."
        )

    # A real coroutine function (not a partial), so sync/async detection and logs see a named async agent.
    async def python_agent(client: Any, task: dict[str, Any]) -> str:
        return await calculator_agent(client, task, max_rounds=max_rounds)

    python_agent.__name__ = python_agent.__qualname__ = "calculator_agent"
    return TaskSuite(
        name="calculator",
        tools=CALCULATOR_TOOLS,
        system_prompt=SYSTEM_PROMPT,
        build_dataset=functools.partial(build_calculator_dataset, **knobs),
        agent=python_agent if agent == "python" else calculator_command_agent(max_rounds),
        reward_funcs=[calculator_correct],
        demonstrations=functools.partial(calculator_demonstrations, **knobs),
        agent_columns=("prompt",),  # the question; `expression` and `answer` are the checker's
        # Difficulty = operand digits: one level easier and one harder than the suite's own (adaptive sampling).
        difficulty_levels={
            level: {"digits": level}
            for level in range(max(1, digits - 1), digits + 2)
            if _fits(level, knobs["num_operands"])
        },
        target_difficulty=digits,
    )


CALCULATOR = make_calculator_suite()
