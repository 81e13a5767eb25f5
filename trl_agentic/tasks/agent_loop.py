"""The reference agents' tool loop over Python functions: call the model, run the tool calls it makes, repeat until
it answers (the package's one loop, `rollout/tool_loop.py`, with `FunctionTools`' hooks).

This is what a typical OpenAI-API agent does, written out plainly so the bundled tasks exercise the endpoint the same
way third-party agents do: the assistant message is sent back as returned (with its `tool_calls`), each call gets a
`{"role": "tool", "tool_call_id": ..., "content": ...}` answer, and a broken call becomes an error *message* the
model can read and recover from, never an exception that ends the episode.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from typing import Any

from ..endpoint import SERVED_MODEL_NAME
from ..rollout.tool_loop import ToolLoop


# A tool: keyword arguments from the model's JSON, returns the text of the tool message (or, an async function, an
# awaitable of it). Expected failures (bad path, bad expression) are raised as exceptions and turned into
# `"Error: ..."` text by `call_tool`.
ToolFunction = Callable[..., str]


def call_tool(tools: Mapping[str, ToolFunction], name: str, arguments: str | dict[str, Any] | None) -> str:
    """Run one tool call and return the text of its tool message. Never raises: errors become `"Error: ..."` text.

    Args:
        tools: tool name -> Python function taking the call's arguments as keyword arguments.
        name: the tool name the model asked for.
        arguments: the call's arguments, a JSON object as text (OpenAI wire format) or already decoded.

    Example:

    ```python
    >>> call_tool({"echo": lambda text: text}, "echo", '{"text": "hi"}')
    'hi'
    >>> call_tool({"echo": lambda text: text}, "echo", '{"txt": "hi"}')
    "Error: bad arguments for tool 'echo': missing a required argument: 'text'. Expected arguments: (text)."
    ```
    """
    if name not in tools:
        return f"Error: unknown tool {name!r}. Available tools: {', '.join(sorted(tools))}."
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            return f"Error: the arguments of {name!r} are not valid JSON ({error.msg}). Send a JSON object."
    if not isinstance(arguments, dict):
        return f"Error: the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}."

    function = tools[name]
    signature = inspect.signature(function)
    try:
        # Bind first so a wrong argument name is reported as such, not confused with a TypeError inside the tool.
        signature.bind(**arguments)
    except TypeError as error:
        expected = ", ".join(signature.parameters)
        return f"Error: bad arguments for tool {name!r}: {error}. Expected arguments: ({expected})."
    try:
        result = function(**arguments)
    except Exception as error:  # the model must see any tool failure as text and get a chance to recover
        return f"Error: {error}"
    return result if inspect.isawaitable(result) else str(result)  # an async tool's result: awaited by the loop


class FunctionTools(ToolLoop):
    """The tool loop's hooks for tools that are Python functions: each call runs through `call_tool`, answered by a
    `{"role": "tool", "tool_call_id": ..., "content": ...}` message; the episode ends when the model answers without
    tool calls or after `max_rounds` model calls.

    Args:
        tools: tool name -> Python function (see `call_tool`).
        tool_schemas: the OpenAI tool schemas sent with every request.
        model: the model name sent with every request.
        max_rounds: most model calls.
    """

    def __init__(
        self,
        tools: Mapping[str, ToolFunction],
        tool_schemas: list[dict[str, Any]],
        *,
        model: str = SERVED_MODEL_NAME,
        max_rounds: int = 6,
    ):
        self.tools, self.tool_schemas, self.model, self.max_turns = tools, tool_schemas, model, max_rounds

    def request(self) -> dict[str, Any]:
        return {"model": self.model, "tools": self.tool_schemas}

    async def env_response(self, message: Any, response: Any) -> list[dict[str, Any]]:
        answer = []
        for tool_call in message.tool_calls:
            if tool_call.type != "function":
                content = f"Error: unsupported tool call type {tool_call.type!r}; call one of the provided functions."
            else:
                content = call_tool(self.tools, tool_call.function.name, tool_call.function.arguments)
                if inspect.isawaitable(content):
                    try:
                        content = str(await content)
                    except Exception as error:  # noqa: BLE001 - as for a sync tool: text the model reads
                        content = f"Error: {error}"
            answer.append({"role": "tool", "tool_call_id": tool_call.id, "content": content})
        return answer


async def run_tool_loop(
    client: Any,
    messages: list[dict[str, Any]],
    *,
    tools: Mapping[str, ToolFunction],
    tool_schemas: list[dict[str, Any]],
    model: str = SERVED_MODEL_NAME,
    max_rounds: int = 6,
) -> str:
    """Chat with tools until the model answers without tool calls or `max_rounds` model calls were made: the one tool
    loop (`rollout/tool_loop.py`) with `FunctionTools`' hooks.

    `messages` is extended in place with every assistant and tool message. Errors of the *client* (endpoint refused
    the call, episode limit reached) propagate: they end the episode and the runner records them.

    Args:
        client: an `openai.AsyncOpenAI` (or anything with an async `chat.completions.create`).
        messages: the conversation so far (typically the task's `prompt`).
        tools: tool name -> Python function (see `call_tool`).
        tool_schemas: the OpenAI tool schemas sent with every request.
        model: the model name sent with every request.
        max_rounds: most model calls.

    Returns:
        The text content of the last assistant message (`""` if it had none).

    Example:

    ```python
    >>> messages = [{"role": "user", "content": "What is 2 + 2?"}]
    >>> text = await run_tool_loop(client, messages, tools={"calculator": calculator}, tool_schemas=CALCULATOR_TOOLS)
    ```
    """
    hooks = FunctionTools(tools, tool_schemas, model=model, max_rounds=max_rounds)
    return (await hooks.run(client, messages)).text


class ToolAgent:
    """A reference tool-calling agent: tools are plain Python functions, their schemas built from signature and
    docstring as TRL builds them (`transformers.utils.get_json_schema`, what `GRPOTrainer(tools=[fn])` renders), the
    call-tool-append loop of `run_tool_loop`, tool errors returned to the model as text. Usable as `agent=` anywhere
    (the trainer, `Evaluator`, a `TaskSuite`).

    Args:
        tools: the functions (sync or async), each with a Google-style docstring describing its arguments.
        max_rounds: most model calls per episode.
        system_prompt: prepended to the task's prompt when it has no system message.
        model: the model name sent (default: the task's `model` column, else `SERVED_MODEL_NAME`).

    Example:

    ```python
    >>> def convert(value: float, from_unit: str, to_unit: str) -> str:
    ...     \"\"\"Convert a length between units.
    ...
    ...     Args:
    ...         value: The number to convert.
    ...         from_unit: The unit it is in, e.g. "km".
    ...         to_unit: The unit to convert to, e.g. "mi".
    ...     \"\"\"
    ...     return str(value * RATIOS[from_unit] / RATIOS[to_unit])
    >>> agent = ToolAgent([convert])
    >>> agent.tool_schemas[0]["function"]["name"]
    'convert'
    >>> trainer = AgenticGRPOTrainer(model, agent=agent, reward_funcs=[within_one_percent], ...)
    ```
    """

    def __init__(
        self, tools: list[Callable], *, max_rounds: int = 10, system_prompt: str | None = None, model: str | None = None
    ):
        from transformers.utils import get_json_schema

        if not tools:
            raise ValueError("ToolAgent needs at least one tool function.")
        self.tools: dict[str, ToolFunction] = {}
        self.tool_schemas: list[dict[str, Any]] = []
        for function in tools:
            name = getattr(function, "__name__", None)
            if not callable(function) or not name or name == "<lambda>":
                raise ValueError(f"Each tool must be a named function (def ...), got {function!r}.")
            if name in self.tools:
                raise ValueError(f"Two tools are named {name!r}; tool names must be unique.")
            try:
                schema = get_json_schema(function)
            except Exception as error:  # transformers' DocstringParsingException, TypeHintParsingException
                raise ValueError(
                    f"Cannot build the schema of tool {name!r}: {error}. Give it type hints and a Google-style "
                    "docstring with an `Args:` section describing every argument."
                ) from error
            self.tools[name] = function
            self.tool_schemas.append(schema)
        self.max_rounds, self.system_prompt, self.model = max_rounds, system_prompt, model

    async def __call__(self, client: Any, task: dict[str, Any]) -> str:
        prompt = task["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system_prompt is not None and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return await run_tool_loop(
            client,
            messages,
            tools=self.tools,
            tool_schemas=self.tool_schemas,
            model=self.model or task.get("model") or SERVED_MODEL_NAME,
            max_rounds=self.max_rounds,
        )
