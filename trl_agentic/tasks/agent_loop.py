"""The reference agents' tool loop: call the model, run the tool calls it makes, repeat until it answers.

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


# A tool: keyword arguments from the model's JSON, returns the text of the tool message. Expected failures (bad path,
# bad expression) are raised as exceptions and turned into `"Error: ..."` text by `call_tool`.
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
        return str(function(**arguments))
    except Exception as error:  # the model must see any tool failure as text and get a chance to recover
        return f"Error: {error}"


async def run_tool_loop(
    client: Any,
    messages: list[dict[str, Any]],
    *,
    tools: Mapping[str, ToolFunction],
    tool_schemas: list[dict[str, Any]],
    model: str = SERVED_MODEL_NAME,
    max_rounds: int = 6,
) -> str:
    """Chat with tools until the model answers without tool calls or `max_rounds` model calls were made.

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
    text = ""
    for _ in range(max_rounds):
        response = await client.chat.completions.create(model=model, messages=messages, tools=tool_schemas)
        message = response.choices[0].message
        # Send the message back exactly as returned: the fields the server sent (ids, tool_calls, `content: null`,
        # extra fields) and nothing else, as agents do that append `response.choices[0].message` to their history.
        messages.append(message.model_dump(exclude_unset=True))
        text = message.content or ""
        if not message.tool_calls:
            return text
        for tool_call in message.tool_calls:
            if tool_call.type != "function":
                content = f"Error: unsupported tool call type {tool_call.type!r}; call one of the provided functions."
            else:
                content = call_tool(tools, tool_call.function.name, tool_call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": content})
    return text
