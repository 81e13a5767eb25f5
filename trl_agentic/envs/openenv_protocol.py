"""OpenEnv actions and observations as chat for [`OpenEnvAgent`](openenv.py): the action's JSON schema -> a text or a
tool protocol (`_protocol_from_schema`), an observation -> a message (`default_observation_to_message`)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


ACTION_FORMATS = ("text", "tool")
# Fields every OpenEnv `Action` / `Observation` carries that are not the environment's content.
ACTION_BASE_FIELDS = ("metadata",)
OBSERVATION_BASE_FIELDS = ("done", "reward", "metadata")


@dataclass(frozen=True)
class _Protocol:
    """How replies become actions and observations messages, decided once from the action's schema."""

    format: str
    tools: list[dict[str, Any]] | None  # the action tool, in "tool" format
    text_field: str | None  # the action's string field, in "text" format
    fields: tuple[str, ...] | None  # the action's fields (without `metadata`); None: unknown, not checked here


def _protocol_from_schema(
    schema: dict[str, Any], action_format: str | None, tool_name: str | None, custom_reply: bool = False
) -> _Protocol:
    """`_Protocol` for an action's JSON schema.

    Example:

    ```python
    >>> schema = {"title": "GuessAction", "type": "object", "required": ["guess"],
    ...           "properties": {"guess": {"type": "integer"}, "metadata": {"type": "object"}}}
    >>> protocol = _protocol_from_schema(schema, None, None)
    >>> tool = protocol.tools[0]["function"]
    >>> protocol.format, tool["name"], tool["parameters"]["properties"]
    ('tool', 'guess', {'guess': {'type': 'integer'}})
    ```
    """
    properties = {k: v for k, v in (schema.get("properties") or {}).items() if k not in ACTION_BASE_FIELDS}
    required = [k for k in schema.get("required") or [] if k not in ACTION_BASE_FIELDS]
    strings = [k for k in required if properties.get(k, {}).get("type") == "string"]
    text_field = strings[0] if len(required) == 1 and strings else None
    chosen = action_format or ("text" if text_field else "tool")
    if chosen == "text" and text_field is None and not custom_reply:
        raise ValueError(
            f"action_format='text' needs an action with exactly one required string field; this one's "
            f"required fields are {required} ({schema.get('title', 'the action')}). Use "
            "action_format='tool', or pass reply_to_action= to build the action from the reply."
        )
    tools = None
    if chosen == "tool":
        title = schema.get("title") or "Action"
        name = tool_name or _snake_case(title.removesuffix("Action")) or "act"
        parameters = {"type": "object", "properties": properties, "required": required}
        if "$defs" in schema:
            parameters["$defs"] = schema["$defs"]
        description = schema.get("description") or f"Take one action in the environment ({title})."
        tools = [{"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}]
    return _Protocol(chosen, tools, text_field, tuple(properties))


def default_observation_to_message(observation: Any) -> str:
    """The text that shows an observation to the model: its single field's text, else its fields as JSON (without
    `done`, `reward` and `metadata`).

    Example:

    ```python
    >>> default_observation_to_message({"prompt": "Guess a number from 1 to 8."})
    'Guess a number from 1 to 8.'
    >>> default_observation_to_message({"echoed_message": "hi", "message_length": 2})
    '{"echoed_message": "hi", "message_length": 2}'
    ```
    """
    fields = {k: v for k, v in _as_dict(observation).items() if k not in OBSERVATION_BASE_FIELDS}
    if len(fields) == 1:
        (value,) = fields.values()
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return json.dumps(fields, ensure_ascii=False, default=str)


def _snake_case(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _as_dict(value: Any) -> dict[str, Any]:
    if hasattr(value, "model_dump"):
        return value.model_dump()
    return dict(value) if isinstance(value, Mapping) else {"value": value}


def _decode_arguments(arguments: str | None) -> Any:
    if arguments is None or not arguments.strip():
        return {}
    try:
        return json.loads(arguments)
    except json.JSONDecodeError as error:
        raise ValueError(f"the arguments are not valid JSON ({error.msg}); send a JSON object.") from None
