"""MCP tools as OpenAI function tools for [`MCPAgent`](mcp.py): the names the model sees, and the text of a tool's
result."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any


OPENAI_TOOL_NAME = re.compile(r"[^A-Za-z0-9_-]")


def openai_tool_names(servers: Sequence[tuple[str, Sequence[str]]]) -> list[list[str]]:
    """The function names the model sees for each server's tools, in order.

    A tool keeps its name unless another server has a tool of the same name: then every tool of that name is called
    `<server>__<tool>`. Characters OpenAI function names do not allow become `_`, names are cut to 64 characters, and
    a name still taken gets a `_2`, `_3`, ... suffix.

    Example:

    ```python
    >>> openai_tool_names([("kv", ["get", "put"]), ("files", ["get", "read.text"])])
    [['kv__get', 'put'], ['files__get', 'read_text']]
    ```
    """
    counts: dict[str, int] = {}
    for _, tools in servers:
        for tool in set(tools):
            counts[tool] = counts.get(tool, 0) + 1
    taken: set[str] = set()
    names = []
    for server, tools in servers:
        names.append([])
        for tool in tools:
            name = f"{server}__{tool}" if counts[tool] > 1 else tool
            name = OPENAI_TOOL_NAME.sub("_", name)[:64] or "tool"
            unique, k = name, 2
            while unique in taken:
                suffix = f"_{k}"
                unique, k = name[: 64 - len(suffix)] + suffix, k + 1
            taken.add(unique)
            names[-1].append(unique)
    return names


def tool_result_text(result: Any, limit: int | None = None) -> str:
    """The text of the tool message answering an MCP `CallToolResult`: its text blocks (a placeholder for images,
    audio and binary resources), or its structured content as JSON when it has no content; `"Error: "` first when the
    tool failed and its text does not say so already; cut to `limit` characters."""
    parts = []
    for block in result.content:
        if block.type == "text":
            parts.append(block.text)
        elif block.type in ("image", "audio"):
            parts.append(f"[{block.type}: {block.mime_type}, {len(block.data) * 3 // 4} bytes]")
        elif block.type == "resource_link":
            parts.append(f"[resource: {block.uri}]")
        elif block.type == "resource":
            text = getattr(block.resource, "text", None)
            parts.append(text if text is not None else f"[resource: {block.resource.uri}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    text = "\n".join(parts)
    if result.is_error and not text.lower().startswith("error"):  # the model must see that it failed
        text = f"Error: {text}" if text else "Error: the tool failed."
    if limit is not None and len(text) > limit:
        text = text[:limit] + f"\n[... {len(text) - limit} more characters]"
    return text
