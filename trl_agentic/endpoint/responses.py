"""`POST /v1/responses`: the OpenAI Responses API, as an adapter over `service.py`.

What the OpenAI Agents SDK (its default model provider) and Codex-style agents speak. The request's `instructions`
and `input` items become chat messages; the answer becomes output items; `stream: true` emits the Responses event
sequence as the tokens are sampled: reasoning and message text as they come, function calls once parsed (what is
recorded is identical whether or not it streams).

Input items → chat messages (one assistant message per run of assistant-side items, so that the items we returned,
sent back, are exactly the assistant message we recorded and the next prompt continues its tokens):

| item                                   | chat message                                              |
|----------------------------------------|-----------------------------------------------------------|
| `message` user / system / developer    | that role, text parts joined                              |
| `reasoning` (`content` or `summary`)   | `reasoning_content` of the assistant message that follows |
| `message` assistant (`output_text`)    | assistant `content`                                       |
| `function_call` (`call_id`, arguments) | a `tool_calls` entry of that assistant message            |
| `function_call_output`                 | a `tool` message                                          |

Output items: `reasoning` (a thinking model's `<think>` text, as `reasoning_text` content; with `include:
["reasoning.encrypted_content"]` also as an opaque `encrypted_content` we can read back), `message` with one
`output_text` part (always present unless the answer is tool calls only), one `function_call` per tool call.

Tools, as Codex sends them (issue 31; recorded in tests/data/harness_requests/codex/): a `namespace` tool (Codex's
sub-agent tools, `multi_agent_v1`) is flattened into one function per member, named as Codex itself names them for
models without namespaces (`multi_agent_v1__spawn_agent`); a call of one is returned with its `namespace` and member
`name` again, which is how Codex routes it, and an echoed call with a `namespace` is flattened back to the same name
(so the history renders as sampled). Hosted tools (`web_search`, ...) run on OpenAI's servers: dropped with a warning
and listed on the turn, or a 400, as `EndpointSettings.hosted_tools` says. `reasoning`, `include`, `store`,
`prompt_cache_key`, `client_metadata` and other fields are accepted and recorded; sampling is the trainer's.

`previous_response_id` works within an episode: the episode keeps what each stored response (`store` not false) added
to the conversation, and a request naming one is that conversation + its own `input` (its own `instructions` only, as
OpenAI does). Only function (and namespace) tools are served; images, files and audio are a 400 (the policy reads
text).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .service import RESPONSES, APIError, Choice, Completion, CompletionService, Delta, ModelCall
from .sessions import EpisodeSession


logger = logging.getLogger(__name__)

# `encrypted_content` of our reasoning items: the text, readable back when a client echoes the item without it.
ENCRYPTED_REASONING_PREFIX = "trl-agentic.reasoning.v1:"
_warned_hosted_tools: set[str] = set()  # tool types whose dropping was logged at WARNING (once per process)


class ResponsesRequest(BaseModel):
    """The request body of `POST /v1/responses`. Unknown fields are accepted and recorded (`include`, `text`,
    `reasoning`, `truncation`, `metadata`, ...); sampling is the trainer's."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include: list[str] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    store: bool | None = None
    stream: bool = False
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None


async def serve_responses(service: CompletionService, session: EpisodeSession, raw: bytes, request: Request):
    """Answer one Responses request body `raw` in `session` (a dict, or a streaming response)."""
    req = service.validate(ResponsesRequest, service.parse_json(raw))
    service.check_model(req.model)
    for name in ("conversation", "prompt"):
        if getattr(req, name) is not None:
            raise APIError(
                400,
                f"'{name}' is not supported by this endpoint: send the conversation as 'input' "
                "(and 'previous_response_id').",
                param=name,
                code="unsupported_parameter",
            )
    if req.background:
        raise APIError(
            400,
            "Background responses are not supported by this endpoint.",
            param="background",
            code="unsupported_parameter",
        )
    tools = request_tools(req.tools, service.settings.hosted_tools)
    tool_choice, forced = _tool_choice(req.tool_choice, tools.chat)

    history = _stored_conversation(session, req.previous_response_id)
    added = input_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages = system + history + added
    if not messages:
        raise APIError(400, "The request has no input: send 'input' (a string or a list of items).", param="input")
    requested = req.model_dump(exclude_none=True, exclude={"input", "tools", "instructions"})
    if tools.dropped:
        requested["dropped_tools"] = tools.dropped
    conversation = ModelCall(
        messages=messages,
        tools=tools.chat,
        tool_choice=tool_choice,
        forced_tool_name=forced,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_logprobs=req.top_logprobs or 0,
        requested=requested,
        wire_format=RESPONSES,
        size=len(raw),
        split_reasoning=True,
        messages_param="input",
    )
    response_id = f"resp_{uuid.uuid4().hex}"
    created = int(time.time())
    if not req.stream:
        completion = await service.complete(session, conversation, request)
        (choice,) = completion.choices
        _store(session, req, response_id, added, choice)
        return response_body(req, response_id, created, output_items(choice, req, tools), completion, choice)
    call = await service.prepare(session, conversation)  # admitted; errors before the stream are answered as such
    events = _stream_events(service.stream(call, request), session, req, tools, response_id, created, added)
    return StreamingResponse(_sse(events), media_type="text/event-stream")


def _store(session: EpisodeSession, req: ResponsesRequest, response_id: str, added: list[dict], choice: Choice):
    if req.store is not False:
        session.responses[response_id] = (req.previous_response_id, added + [choice.message])


@dataclass
class RequestTools:
    """A request's `tools` as the model sees them.

    Args:
        chat: function tools in the chat-completions shape (`None`: no tools).
        namespaced: flattened name -> (namespace, member name), for the members of `namespace` tools.
        dropped: the types of the tools left out (hosted tools: `EndpointSettings.hosted_tools`), in request order.
    """

    chat: list[dict[str, Any]] | None = None
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)


def namespaced_name(namespace: str, name: str) -> str:
    """The function name a `namespace` tool's member `name` is shown to the model under: Codex's own flattening for
    models without namespaces (`code_mode_name_for_tool_name` in codex-rs/tools/src/code_mode.rs).

    Example:

    ```python
    >>> namespaced_name("multi_agent_v1", "spawn_agent")
    'multi_agent_v1__spawn_agent'
    >>> namespaced_name("mcp__docs__", "search")
    'mcp__docs__search'
    ```
    """
    if namespace.endswith("_") or name.startswith("_"):
        return namespace + name
    return f"{namespace}__{name}"


def request_tools(tools: list[dict[str, Any]] | None, hosted_tools: str = "drop") -> RequestTools:
    """Responses tools as chat-completions function tools (keys in the order the chat format sends them: templates
    render the schema as JSON, key order included). `namespace` tools are flattened into their members; tools of
    any other type (OpenAI's hosted tools: `web_search`, `file_search`, ...) cannot be served: dropped
    (`hosted_tools="drop"`, logged and listed in `dropped`) or a 400."""
    result = RequestTools()
    converted: list[dict[str, Any]] = []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        kind = tool.get("type")
        if kind == "function":
            converted.append(_chat_function(tool, where))
        elif kind == "namespace":
            namespace = tool.get("name")
            if not isinstance(namespace, str) or not namespace:
                raise APIError(400, f"{where} (a namespace) needs a 'name'.", param=f"{where}.name")
            members = tool.get("tools")
            if not isinstance(members, list) or not members:
                raise APIError(
                    400,
                    f"{where} (namespace {namespace!r}) needs 'tools', a list of function tools.",
                    param=f"{where}.tools",
                )
            for j, member in enumerate(members):
                inner = f"{where}.tools[{j}]"
                if not isinstance(member, dict) or member.get("type") != "function":
                    kind_j = member.get("type") if isinstance(member, dict) else None
                    raise APIError(
                        400,
                        f"{inner} has type {kind_j!r}; a namespace holds function tools only.",
                        param=inner,
                        code="unsupported_tool",
                    )
                function = _chat_function(member, inner)
                flat = namespaced_name(namespace, function["function"]["name"])
                result.namespaced[flat] = (namespace, function["function"]["name"])
                function["function"]["name"] = flat
                converted.append(function)
        elif hosted_tools == "drop" and isinstance(kind, str) and kind:
            result.dropped.append(kind)
        else:
            raise APIError(
                400,
                f"{where} has type {kind!r}; this endpoint runs function and namespace tools only "
                "(hosted tools such as web_search run on OpenAI's servers: leave them out, or start "
                "the endpoint with hosted_tools='drop' to drop them with a warning).",
                param=where,
                code="unsupported_tool",
            )
    names = [t["function"]["name"] for t in converted]
    if len(set(names)) < len(names):
        duplicate = next(name for name in names if names.count(name) > 1)
        raise APIError(
            400,
            f"Two tools are named {duplicate!r} (namespace members are named "
            "'<namespace>__<name>'); tool names must be unique.",
            param="tools",
        )
    for kind in result.dropped:
        level = logging.DEBUG if kind in _warned_hosted_tools else logging.WARNING
        _warned_hosted_tools.add(kind)
        logger.log(
            level,
            "Dropped a tool of type %r from a Responses request: this endpoint runs function and "
            "namespace tools only, so the model does not see it (listed on each turn as "
            "requested_sampling['dropped_tools']; EndpointSettings(hosted_tools='reject') refuses such "
            "requests instead).",
            kind,
        )
    result.chat = converted or None
    return result


def _chat_function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """A Responses function tool (`{"type": "function", "name", "parameters", ...}`) in the chat shape."""
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise APIError(400, f"{where} needs a 'name'.", param=f"{where}.name")
    function = {"name": tool["name"]}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    if "parameters" in function and not isinstance(function["parameters"], dict):
        raise APIError(400, f"{where}.parameters must be a JSON schema object.", param=f"{where}.parameters")
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict | None, tools: list[dict] | None) -> tuple[str | None, str | None]:
    if choice is None or isinstance(choice, str):
        if choice == "required" and not tools:
            raise APIError(400, "tool_choice 'required' needs 'tools'.", param="tool_choice")
        return choice, None
    name = choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise APIError(
            400,
            f"Unsupported tool_choice {choice!r}: use 'auto', 'none', 'required' or "
            "{'type': 'function', 'name': ...}.",
            param="tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools or []}:
        raise APIError(400, f"tool_choice names function {name!r}, which is not in 'tools'.", param="tool_choice")
    return None, name


def _stored_conversation(session: EpisodeSession, response_id: str | None) -> list[dict]:
    """The messages of the stored response `response_id` and of those it continued, oldest first."""
    chain, current = [], response_id
    while current is not None:
        if current not in session.responses:
            raise APIError(
                400,
                f"Previous response with id {current!r} not found (in this episode, stored with 'store' not false).",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        current, messages = session.responses[current]
        chain.append(messages)
    return [m for messages in reversed(chain) for m in messages]


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages (see the module's table); 400 naming the item it cannot take."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    assistant: dict[str, Any] | None = None  # the assistant message the current run of items builds

    def open_assistant(*blocking: str) -> dict[str, Any]:
        nonlocal assistant
        if assistant is None or any(assistant.get(key) for key in blocking):
            assistant = {"role": "assistant", "content": None}
            messages.append(assistant)
        return assistant

    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(
                    400,
                    f"{where}.role must be 'user', 'system', 'developer' or 'assistant', not {role!r}.",
                    param=f"{where}.role",
                )
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                open_assistant("content", "tool_calls")["content"] = text
            else:
                assistant = None
                messages.append({"role": role, "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = _text(parts, f"{where}.content", separator="\n\n")
            if not reasoning:  # a client that sends back only the opaque copy (Codex's own serializer can)
                reasoning = _decrypted_reasoning(item.get("encrypted_content"), f"{where}.encrypted_content")
            if reasoning:
                open_assistant("content", "tool_calls", "reasoning_content")["reasoning_content"] = reasoning
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise APIError(400, f"{where} (a function_call) needs '{key}' as a string.", param=f"{where}.{key}")
            name = item["name"]
            if item.get("namespace") is not None:
                if not isinstance(item["namespace"], str) or not item["namespace"]:
                    raise APIError(400, f"{where}.namespace must be a non-empty string.", param=f"{where}.namespace")
                name = namespaced_name(item["namespace"], name)  # as the model sampled it
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": name, "arguments": item["arguments"]},
            }
            open_assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where} (a function_call_output) needs 'call_id'.", param=f"{where}.call_id")
            assistant = None
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": _text(item.get("output"), f"{where}.output"),
                }
            )
        else:
            raise APIError(
                400,
                f"{where} has type {kind!r}; this endpoint takes 'message', 'function_call', "
                "'function_call_output' and 'reasoning' items.",
                param=f"{where}.type",
                code="unsupported_item",
            )
    for message in messages:
        if message["role"] == "assistant" and message["content"] is None and not message.get("tool_calls"):
            message["content"] = ""
    return messages


def encrypted_reasoning(text: str) -> str:
    """The `encrypted_content` of a reasoning item: opaque to the client, the text to us (nothing here is secret: the
    agent's own history; what matters is that a client which sends back only this gets its reasoning rendered)."""
    return ENCRYPTED_REASONING_PREFIX + base64.urlsafe_b64encode(text.encode("utf-8")).decode("ascii")


def _decrypted_reasoning(value: Any, where: str) -> str:
    """The text of an `encrypted_content` we issued; `""` for anyone else's (OpenAI's: unreadable, left out)."""
    if not isinstance(value, str) or not value.startswith(ENCRYPTED_REASONING_PREFIX):
        return ""
    try:
        encoded = value[len(ENCRYPTED_REASONING_PREFIX) :].encode("ascii")
        return base64.b64decode(encoded, altchars=b"-_", validate=True).decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError):
        raise APIError(
            400, f"{where} is not an encrypted_content this endpoint issued (it was altered).", param=where
        ) from None


_TEXT_PARTS = {
    "input_text": "text",
    "output_text": "text",
    "text": "text",
    "refusal": "refusal",
    "reasoning_text": "text",
    "summary_text": "text",
}


def _text(content: Any, where: str, separator: str = "") -> str:
    """The text of a content field: a string, or its text parts joined with `separator`."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts.", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None or not isinstance(part.get(key), str):
            if kind in ("input_image", "input_file", "input_audio"):
                raise APIError(
                    400,
                    f"{where}[{j}] is an {kind} part; the served model reads text only.",
                    param=f"{where}[{j}]",
                    code="unsupported_content",
                )
            raise APIError(400, f"{where}[{j}] is not a text part (type {kind!r}).", param=f"{where}[{j}]")
        texts.append(part[key])
    return separator.join(texts)


def output_items(
    choice: Choice, req: ResponsesRequest, tools: RequestTools, streamed: list[dict[str, Any]] = ()
) -> list[dict[str, Any]]:
    """The output items of one answer: reasoning, message (unless only tool calls), function calls (a namespace
    member's with its `namespace` and member `name`). `streamed` are the reasoning / message items a stream already
    opened, in their order: they keep their ids and places."""
    message = choice.message
    items: list[dict[str, Any]] = []
    texts = {"reasoning": message.get("reasoning_content"), "message": message.get("content")}
    calls = message.get("tool_calls") or []
    kinds = [item["type"] for item in streamed]
    kinds += [
        kind
        for kind, wanted in (("reasoning", bool(texts["reasoning"])), ("message", bool(texts["message"]) or not calls))
        if wanted and kind not in kinds
    ]
    ids = {item["type"]: item["id"] for item in streamed}
    for kind in kinds:
        if kind == "reasoning":
            items.append(_reasoning_item(ids.get(kind, f"rs_{uuid.uuid4().hex}"), texts["reasoning"] or "", req))
        else:
            items.append(
                {
                    "type": "message",
                    "id": ids.get(kind, f"msg_{uuid.uuid4().hex}"),
                    "status": "completed",
                    "role": "assistant",
                    "content": [
                        {"type": "output_text", "text": texts["message"] or "", "annotations": [], "logprobs": []}
                    ],
                }
            )
    for call in calls:
        item = {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex}",
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
            "status": "completed",
        }
        if item["name"] in tools.namespaced:  # how Codex routes it: by namespace and member name
            item["namespace"], item["name"] = tools.namespaced[item["name"]]
        items.append(item)
    return items


def _reasoning_item(item_id: str, text: str, req: ResponsesRequest) -> dict[str, Any]:
    item = {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }
    if "reasoning.encrypted_content" in (req.include or ()):
        item["encrypted_content"] = encrypted_reasoning(text)
    return item


def response_body(
    req: ResponsesRequest,
    response_id: str,
    created: int,
    output: list[dict],
    completion: Completion | None,
    choice: Choice,
) -> dict[str, Any]:
    """The `response` object (`completion` `None`: one still in progress, without usage)."""
    incomplete = choice.finish_reason == "length"
    usage = (
        None
        if completion is None
        else {
            "input_tokens": completion.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": completion.prompt_tokens + completion.completion_tokens,
        }
    )
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": "incomplete" if incomplete else "completed",
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": req.model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": (req.model_extra or {}).get("reasoning"),
        "store": req.store is not False,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "truncation": "disabled",
        "usage": usage,
        "metadata": {},
        "user": None,
    }


async def _stream_events(
    answer: AsyncIterator,
    session: EpisodeSession,
    req: ResponsesRequest,
    tools: RequestTools,
    response_id: str,
    created: int,
    added: list[dict],
):
    """The Responses event sequence, as the answer is sampled: `response.created`, then a reasoning item and a
    message item opened as their text starts (one at a time, in the order the text comes), function calls once
    parsed, `response.completed` (or `.incomplete`) with the same items."""
    sequence = iter(range(1 << 62))

    def event(kind: str, **data) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(sequence), **data}

    placeholder = Choice({"role": "assistant", "content": ""}, "stop", None)
    started = {
        **response_body(req, response_id, created, [], None, placeholder),
        "status": "in_progress",
        "usage": None,
        "incomplete_details": None,
    }
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    opened: list[dict[str, Any]] = []  # reasoning / message items, in the order they opened
    text = ""  # the open item's text so far

    def close(item):
        ids = {"item_id": item["id"], "output_index": len(opened) - 1}
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            yield event("response.output_text.done", **ids, content_index=0, text=text, logprobs=[])
            yield event("response.content_part.done", **ids, content_index=0, part=part)
            done = {**item, "status": "completed", "content": [part]}
        else:
            yield event("response.reasoning_text.done", **ids, content_index=0, text=text)
            done = _reasoning_item(item["id"], text, req)
        yield event("response.output_item.done", output_index=len(opened) - 1, item=done)

    def open_(kind):
        if kind == "content":
            item = {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
        else:
            item = {
                "type": "reasoning",
                "id": f"rs_{uuid.uuid4().hex}",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
        opened.append(item)
        yield event("response.output_item.added", output_index=len(opened) - 1, item=item)
        if kind == "content":
            yield event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=len(opened) - 1,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            )

    try:
        async for item in answer:
            if not isinstance(item, Delta):
                completion = item
                continue
            kind = "message" if item.kind == "content" else "reasoning"
            if not opened or opened[-1]["type"] != kind:
                if opened:
                    for e in close(opened[-1]):
                        yield e
                text = ""
                for e in open_(item.kind):
                    yield e
            text += item.text
            ids = {"item_id": opened[-1]["id"], "output_index": len(opened) - 1, "content_index": 0}
            if kind == "message":
                yield event("response.output_text.delta", **ids, delta=item.text, logprobs=[])
            else:
                yield event("response.reasoning_text.delta", **ids, delta=item.text)
    except APIError as error:
        yield event("error", code=error.code, message=error.message, param=error.param)
        return
    except Exception as error:  # noqa: BLE001 - the response has started: say so in the stream, then end it
        logger.exception("Internal error while streaming a response")
        yield event(
            "error", code="internal_error", message=f"Internal error: {type(error).__name__}: {error}", param=None
        )
        return
    (choice,) = completion.choices
    _store(session, req, response_id, added, choice)
    output = output_items(choice, req, tools, opened)
    for index, item in enumerate(output):
        if index < len(opened):
            if index == len(opened) - 1:
                for e in close(opened[-1]):
                    yield e
            continue
        if item["type"] in ("message", "reasoning"):  # the answer has this text, though none of it streamed
            text = item["content"][0]["text"]
            for e in open_("content" if item["type"] == "message" else "reasoning"):
                yield e
            for e in close(opened[-1]):
                yield e
            continue
        ids = {"item_id": item["id"], "output_index": index}
        yield event(
            "response.output_item.added", output_index=index, item={**item, "status": "in_progress", "arguments": ""}
        )
        yield event("response.function_call_arguments.delta", **ids, delta=item["arguments"])
        yield event("response.function_call_arguments.done", **ids, name=item["name"], arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    body = response_body(req, response_id, created, output, completion, choice)
    yield event("response.incomplete" if body["status"] == "incomplete" else "response.completed", response=body)


async def _sse(events):
    async for data in events:
        yield f"event: {data['type']}\ndata: {json.dumps(data)}\n\n"
