"""The calculator task's tool, standard library only: `calculator(expression)`, its safe evaluator and its OpenAI
schema. `tasks/calculator.py` imports them from here; `calculator_command.py`, the demo's agent run as a command in a
sandbox (`--set agent=command`), loads this file by its path, without importing the package (a fast start).
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any


CALCULATOR_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with numbers, + - * / // % and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "The expression, e.g. '12 * (3 + 4)'."}},
                "required": ["expression"],
            },
        },
    }
]


MAX_EXPRESSION_LENGTH = 200  # bounds the size of the integers a single call can build (no `**`, so ~200 digits)

_BINARY_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY_OPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


# ---------------------------------------------------------------------------------------------------------------------
# Tool


def evaluate_expression(expression: str) -> int | float:
    """Evaluate an arithmetic expression safely: only numbers, `+ - * / // %`, unary signs and parentheses.

    The expression is parsed with `ast` and walked node by node; names, calls, attributes, `**` and everything else
    are rejected, so nothing the model writes is ever executed.

    Args:
        expression: e.g. `"12 * (3 + 4)"`.

    Raises:
        ValueError: with a message meant for the model (it is shown as the tool result).

    Example:

    ```python
    >>> evaluate_expression("12 * (3 + 4)")
    84
    >>> evaluate_expression("__import__('os')")
    Traceback (most recent call last):
    ValueError: only numbers, + - * / // % and parentheses are allowed, found a function call
    ```
    """
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_LENGTH:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r} as arithmetic") from None
    value = _evaluate_node(tree.body)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    return value


def _evaluate_node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # `type`, not isinstance: rejects bools
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate_node(node.left), _evaluate_node(node.right)
        try:
            return _BINARY_OPS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _UNARY_OPS[type(node.op)](_evaluate_node(node.operand))
    raise ValueError(f"only numbers, + - * / // % and parentheses are allowed, found {_describe(node)}")


_OPERATOR_SYMBOLS = {
    ast.Pow: "**", ast.BitXor: "^", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<", ast.RShift: ">>",
    ast.MatMult: "@", ast.Invert: "~", ast.Not: "not",
}  # fmt: skip
_NODE_NAMES = {
    ast.Call: "a function call",
    ast.Name: "a name",
    ast.Attribute: "an attribute",
    ast.Constant: "a non-number",
}


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.BinOp | ast.UnaryOp):
        return f"the operator {_OPERATOR_SYMBOLS.get(type(node.op), type(node.op).__name__)}"
    return _NODE_NAMES.get(type(node), f"a {type(node).__name__} expression")


def calculator(expression: str) -> str:
    """The `calculator` tool: the value of `expression` as text (integral results without a trailing `.0`).

    Raises `ValueError` for anything but arithmetic; the agent loop (`call_tool`) turns it into an error message.

    Example:

    ```python
    >>> calculator("7 / 2"), calculator("6 / 3")
    ('3.5', '2')
    >>> from trl_agentic.tasks.agent_loop import call_tool
    >>> call_tool({"calculator": calculator}, "calculator", '{"expression": "2 ** 10"}')  # text for the model
    'Error: only numbers, + - * / // % and parentheses are allowed, found the operator **'
    ```
    """
    value = evaluate_expression(expression)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.12g}"
    return str(value)
