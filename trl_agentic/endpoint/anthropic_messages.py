"""`POST /v1/messages`: Anthropic's Messages API, as an adapter over `service.py`.

What the `anthropic` SDK, LangChain's `ChatAnthropic` and Claude Code speak. The episode key is accepted as
`x-api-key` (what the SDK sends) or `Authorization: Bearer`; `anthropic-version` and `anthropic-beta` are accepted and
ignored, and so is a query string (Claude Code posts to `/v1/messages?beta=true`).
`stream: true` emits Anthropic's events as the tokens are sampled: thinking and text blocks as their text comes,
tool_use blocks once parsed (what is recorded is identical whether or not it streams); errors come as
`{"type": "error", "error": {"type": ..., "message": ...}}` (`app.py`).

Messages → chat messages (so that the blocks we returned, sent back, are exactly the assistant message we recorded
and the next prompt continues its tokens):

| Anthropic                                      | chat message                                                  |
|------------------------------------------------|---------------------------------------------------------------|
| `system` (string or text blocks)               | a `system` message                                            |
| a `system` message inside `messages`           | a `system` message at that position                           |
| user `text` blocks                             | a `user` message (blocks joined by a newline)                 |
| user `tool_result` (string or text blocks)     | a `tool` message (`is_error` kept in the recorded message)    |
| assistant `thinking`                           | `reasoning_content` (a thinking model's `<think>` text)       |
| assistant `text`                               | `content`                                                     |
| assistant `tool_use` (`input` object)          | a `tool_calls` entry, arguments as JSON                       |

Answer blocks: `thinking` (when the model reasoned), `text` (when it wrote any), one `tool_use` per tool call;
`stop_reason` `end_turn`, `tool_use`, `max_tokens` or `stop_sequence`. Images, documents and server tools are a 400
(the policy reads text and calls the agent's own tools); so is a last assistant message (prefill), which this endpoint
does not continue, and a conversation without a user message.

System messages inside `messages` (Claude Code's `mid-conversation-system` beta: it keeps one at index 1, after the
task, for the whole episode) are rendered where they stand, as a `system` message at that position of the chat
template's messages, the same way on every call: a later turn then extends the earlier one token for token. Moving
them (to the top-level system, or to the end) would re-render the history and fork the episode at every turn. A
template that refuses a system message past the first is answered 400 with the template's own message.

Fields accepted and recorded with the turn (`Turn.requested_sampling`), but not applied, because what the policy
sees and how it samples is the trainer's (DESIGN.md, decision 4) and a prompt the server edits could not continue
token for token:

- `thinking` (`enabled`, `disabled`, `adaptive`) and `output_config` (`effort`, ...): ignored. The chat template (with
  the trainer's `chat_template_kwargs`) decides whether the model reasons; its reasoning comes back as `thinking`
  blocks either way.
- `context_management` (`edits` that clear old thinking or tool results): not applied. The prompt is the
  conversation as sent; a harness that compacts its history itself shows as a fork.
- `metadata` (`user_id`; Claude Code's is a JSON string holding its `session_id`): recorded only, a hint for lineage.
- `cache_control` on blocks and tools: ignored (continuation is this endpoint's prompt cache).
- `service_tier`, `container` and any other field: accepted and recorded.

Each of `metadata`, `thinking`, `output_config` and `context_management` must be an object when present (400
naming the field otherwise).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .service import ANTHROPIC_MESSAGES, APIError, Choice, Completion, CompletionService, Delta, ModelCall
from .sessions import EpisodeSession


logger = logging.getLogger(__name__)


# Anthropic's error `type` for an HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
# Thinking blocks carry a signature that Anthropic's API verifies when they come back; ours is a marker (the
# endpoint matches returned blocks by their content, not by a signature).
THINKING_SIGNATURE = "trl-agentic"


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape for a response of HTTP `status`."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessagesRequest(BaseModel):
    """The request body of `POST /v1/messages`. `metadata`, `thinking`, `output_config`, `context_management` and
    unknown fields (`service_tier`, ...) are accepted and recorded, not applied (see the module docstring); sampling
    is the trainer's."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None


class CountTokensRequest(BaseModel):
    """The request body of `POST /v1/messages/count_tokens`."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


async def serve_messages(service: CompletionService, session: EpisodeSession, raw: bytes, request: Request):
    """Answer one Messages request body `raw` in `session` (a dict, or a streaming response)."""
    req = service.validate(MessagesRequest, service.parse_json(raw))
    service.check_model(req.model)
    tools = chat_tools(req.tools)
    tool_choice, forced = _tool_choice(req.tool_choice, tools)
    conversation = ModelCall(
        messages=chat_messages(req.system, req.messages),
        tools=tools,
        tool_choice=tool_choice,
        forced_tool_name=forced,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=[s for s in req.stop_sequences or [] if s],
        requested=req.model_dump(exclude_none=True, exclude={"messages", "system", "tools"}),
        wire_format=ANTHROPIC_MESSAGES,
        size=len(raw),
        split_reasoning=True,
    )
    message_id = f"msg_{uuid.uuid4().hex}"
    if not req.stream:
        completion = await service.complete(session, conversation, request)
        (choice,) = completion.choices
        return message_body(req.model, message_id, choice, completion)
    call = await service.prepare(session, conversation)  # admitted; errors before the stream are answered as such
    events = _stream_events(service, call, service.stream(call, request), req.model, message_id)
    return StreamingResponse(_sse(events), media_type="text/event-stream")


async def count_tokens(service: CompletionService, raw: bytes) -> dict[str, int]:
    """`POST /v1/messages/count_tokens`: the prompt tokens of the request rendered fresh."""
    req = service.validate(CountTokensRequest, service.parse_json(raw))
    service.check_model(req.model)
    return {
        "input_tokens": await service.count_prompt_tokens(
            chat_messages(req.system, req.messages), chat_tools(req.tools), size=len(raw)
        )
    }


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic tools (`name`, `description`, `input_schema`) as chat-completions function tools."""
    if not tools:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise APIError(
                400,
                f"tools.{i} has type {tool.get('type')!r}: server tools run on Anthropic's servers; "
                "this endpoint serves the agent's own tools (name, description, input_schema).",
                param=f"tools.{i}",
            )
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise APIError(400, f"tools.{i} needs a 'name' and an 'input_schema' object.", param=f"tools.{i}")
        function = {"name": tool["name"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: dict[str, Any] | None, tools: list[dict] | None) -> tuple[str | None, str | None]:
    if choice is None:
        return None, None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, None
    if kind in ("any", "tool") and not tools:
        raise APIError(400, f"tool_choice {kind!r} needs 'tools'.", param="tool_choice")
    if kind == "any":
        return "required", None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise APIError(400, f"tool_choice names tool {name!r}, which is not in 'tools'.", param="tool_choice")
        return None, name
    raise APIError(
        400, f"Unsupported tool_choice type {kind!r}: use 'auto', 'any', 'tool' or 'none'.", param="tool_choice"
    )


def chat_messages(system: str | list[dict] | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic `system` + messages as chat messages (see the module's table); 400 naming the block it cannot
    take.

    A system message inside `messages` stays where it stands (Claude Code keeps one after the task on every call):

    ```python
    >>> chat_messages("Brief.", [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Tip"}])
    [{'role': 'system', 'content': 'Brief.'}, {'role': 'user', 'content': 'Hi'}, {'role': 'system', 'content': 'Tip'}]
    ```
    """
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant", "system"):
            raise APIError(
                400, f"{where}.role must be 'user', 'assistant' or 'system', not {role!r}.", param=f"{where}.role"
            )
        if role == "system":
            out.append({"role": "system", "content": _text(content, f"{where}.content")})
            continue
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise APIError(
                400, f"{where}.content must be a string or a list of content blocks.", param=f"{where}.content"
            )
        if role == "assistant":
            out.append(_assistant_message(blocks, where))
        else:
            out.extend(_user_messages(blocks, where))
    if not any(message.get("role") == "user" for message in messages):
        raise APIError(
            400,
            "The messages hold no user message: there is nothing to answer. Put the task in a user "
            "message (system messages alone are instructions).",
            param="messages",
        )
    if messages[-1].get("role") == "assistant":
        raise APIError(
            400,
            "The last message is an assistant message (a prefill); this endpoint answers user turns "
            "only: end with a user message.",
            param=f"messages.{len(messages) - 1}",
        )
    return out


def _assistant_message(blocks: list, where: str) -> dict[str, Any]:
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # encrypted reasoning of another model: nothing the template can render
        elif kind == "tool_use":
            if (
                not isinstance(block.get("id"), str)
                or not isinstance(block.get("name"), str)
                or not isinstance(block.get("input"), dict)
            ):
                raise APIError(400, f"{at} (tool_use) needs 'id', 'name' and an 'input' object.", param=at)
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": json.dumps(block["input"])},
                }
            )
        else:
            raise APIError(
                400,
                f"{at} has type {kind!r}; an assistant message takes 'text', 'thinking' and 'tool_use' blocks.",
                param=at,
            )
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _user_messages(blocks: list, where: str) -> list[dict[str, Any]]:
    # Tool results become tool messages in place; the text blocks around them become user messages.
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise APIError(400, f"{at} (tool_result) needs 'tool_use_id'.", param=at)
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            tool = {
                "role": "tool",
                "tool_call_id": block["tool_use_id"],
                "content": _text(block.get("content") or "", f"{at}.content"),
            }
            if block.get("is_error"):
                tool["is_error"] = True
            out.append(tool)
        elif kind in ("image", "document", "search_result"):
            raise APIError(400, f"{at} is a {kind} block; the served model reads text only.", param=at)
        else:
            raise APIError(
                400, f"{at} has type {kind!r}; a user message takes 'text' and 'tool_result' blocks.", param=at
            )
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text blocks.", param=where)
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            what = "the served model reads text only" if kind in ("image", "document") else "only text blocks"
            raise APIError(400, f"{where}.{j} is a {kind!r} block; {what}.", param=f"{where}.{j}")
        texts.append(block["text"])
    return "\n".join(texts)


def message_body(
    model: str, message_id: str, choice: Choice, completion: Completion, streamed: list[str] = ()
) -> dict[str, Any]:
    """The Anthropic `message` of one answer; `streamed` are the kinds of text blocks (`"thinking"`, `"text"`) a
    stream already sent, in their order: they keep their places."""
    message = choice.message
    content: list[dict[str, Any]] = []
    texts = {"thinking": message.get("reasoning_content"), "text": message.get("content")}
    for kind in [*streamed, *(k for k in ("thinking", "text") if k not in streamed)]:
        if kind == "thinking" and texts[kind]:
            content.append({"type": "thinking", "thinking": texts[kind], "signature": THINKING_SIGNATURE})
        elif kind == "text" and texts[kind]:
            content.append({"type": "text", "text": texts[kind]})
    for call in message.get("tool_calls") or []:
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": json.loads(call["function"]["arguments"]),
            }
        )
    if choice.stop_sequence is not None:
        stop_reason = "stop_sequence"
    else:
        stop_reason = {"tool_calls": "tool_use", "length": "max_tokens"}.get(choice.finish_reason, "end_turn")
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": choice.stop_sequence,
        "usage": {
            "input_tokens": completion.prompt_tokens,
            "output_tokens": completion.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


async def _stream_events(service: CompletionService, call, answer: AsyncIterator, model: str, message_id: str):
    """Anthropic's event sequence, as the answer is sampled: `message_start`, a thinking and a text block opened as
    their text starts (one at a time, in the order the text comes), tool_use blocks once parsed, `message_delta` with
    the stop reason and usage, `message_stop`."""
    prompt_tokens = len(call.prompt_ids)
    yield {
        "type": "message_start",
        "message": {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": prompt_tokens,
                "output_tokens": 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        },
    }
    streamed: list[str] = []  # kinds of the text blocks opened, in order

    def stop_block(kind):
        if kind == "thinking":
            yield {
                "type": "content_block_delta",
                "index": len(streamed) - 1,
                "delta": {"type": "signature_delta", "signature": THINKING_SIGNATURE},
            }
        yield {"type": "content_block_stop", "index": len(streamed) - 1}

    try:
        async for item in answer:
            if not isinstance(item, Delta):
                completion = item
                continue
            kind = "text" if item.kind == "content" else "thinking"
            if not streamed or streamed[-1] != kind:
                if streamed:
                    for e in stop_block(streamed[-1]):
                        yield e
                streamed.append(kind)
                block = (
                    {"type": "text", "text": ""}
                    if kind == "text"
                    else {"type": "thinking", "thinking": "", "signature": ""}
                )
                yield {"type": "content_block_start", "index": len(streamed) - 1, "content_block": block}
            delta = (
                {"type": "text_delta", "text": item.text}
                if kind == "text"
                else {"type": "thinking_delta", "thinking": item.text}
            )
            yield {"type": "content_block_delta", "index": len(streamed) - 1, "delta": delta}
    except APIError as error:
        yield {"type": "error", "error": error_body(error.status, error.message)["error"]}
        return
    except Exception as error:  # noqa: BLE001 - the response has started: say so in the stream, then end it
        logger.exception("Internal error while streaming a message")
        yield {"type": "error", "error": {"type": "api_error", "message": f"Internal error: {error}"}}
        return
    (choice,) = completion.choices
    body = message_body(model, message_id, choice, completion, streamed)
    if streamed:
        for e in stop_block(streamed[-1]):
            yield e
    for index, block in enumerate(body["content"]):
        if index < len(streamed):
            continue
        if block["type"] == "thinking":  # text the answer has, though none of it streamed
            yield {
                "type": "content_block_start",
                "index": index,
                "content_block": {"type": "thinking", "thinking": "", "signature": ""},
            }
            yield {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "thinking_delta", "thinking": block["thinking"]},
            }
            yield {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "signature_delta", "signature": block["signature"]},
            }
        elif block["type"] == "text":
            yield {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}
            yield {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "text_delta", "text": block["text"]},
            }
        else:  # tool_use
            yield {
                "type": "content_block_start",
                "index": index,
                "content_block": {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}},
            }
            yield {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
            }
        yield {"type": "content_block_stop", "index": index}
    yield {
        "type": "message_delta",
        "delta": {"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]},
        "usage": {"output_tokens": body["usage"]["output_tokens"]},
    }
    yield {"type": "message_stop"}


async def _sse(events):
    async for data in events:
        yield f"event: {data['type']}\ndata: {json.dumps(data)}\n\n"
