"""`POST /v1/chat/completions`: the OpenAI Chat Completions wire format, as an adapter over `service.py`.

The request (`protocol.ChatCompletionRequest`) is already a conversation; this module validates it, hands it to the
`CompletionService`, and shapes the answer as a `chat.completion` or, with `stream: true`, as `chat.completion.chunk`
server-sent events that leave as the tokens are sampled: content (and a thinking model's `reasoning_content`) as it
comes, tool calls once parsed, then each choice's finish reason and logprobs, and the usage when asked for. What is
recorded is identical whether or not it streams.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..generation.engine import GenerationOutput
from .protocol import ChatCompletionRequest, FunctionCall, Message, TextPart, ToolCall, error_body, template_message
from .service import CHAT_COMPLETIONS, APIError, Completion, CompletionService, Delta, ModelCall
from .sessions import EpisodeSession


logger = logging.getLogger(__name__)

# Validate, dump and normalize only the messages a request adds to the validated prefix of the episode's last request
# (`ValidatedPrefix`); off, every call does all of its messages (the tests compare both).
REUSE_VALIDATED_PREFIX = True


@dataclass
class ValidatedPrefix:
    """The leading messages of an episode's last request that `_plain` lets reuse: as parsed (`raw`), validated and
    dumped (`dumped`, recorded as the turn's `request_messages`) and normalized for the template (`normalized`)."""

    raw: list[Any]
    dumped: list[dict]
    normalized: list[dict]


async def serve_chat_completions(service: CompletionService, session: EpisodeSession, raw: bytes, request: Request):
    """Answer one Chat Completions request body `raw` in `session` (a dict, or a streaming response)."""
    req, messages, normalized = _validate(service, session, service.parse_json(raw))
    service.check_model(req.model)
    conversation = ModelCall(
        messages=messages,
        template_messages=normalized,
        tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
        tool_choice=req.tool_choice if isinstance(req.tool_choice, str) else None,
        forced_tool_name=req.forced_tool_name,
        max_tokens=req.max_completion_tokens or req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        n=req.n,
        stop=req.stop_sequences,
        top_logprobs=req.top_logprobs or 0,
        requested=req.model_dump(exclude_none=True, exclude={"messages", "tools"}),
        wire_format=CHAT_COMPLETIONS,
        size=len(raw),
    )
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if not req.stream:
        completion = await service.complete(session, conversation, request)
        usage, choices = _usage(completion), _choices(service.tokenizer, completion, req.logprobs)
        return {
            "id": response_id,
            "object": "chat.completion",
            "created": created,
            "model": req.model,
            "choices": choices,
            "usage": usage,
            "system_fingerprint": f"policy-v{completion.policy_version}",
        }
    call = await service.prepare(session, conversation)  # admitted; errors before the stream are answered as such
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    chunks = _stream_chunks(
        service, call, service.stream(call, request), response_id, created, req.model, req.logprobs, include_usage
    )
    return StreamingResponse(_sse(chunks), media_type="text/event-stream")


def _validate(
    service: CompletionService, session: EpisodeSession, body: Any
) -> tuple[ChatCompletionRequest, list[dict], list[dict] | None]:
    """The validated request, its messages dumped (the recorded `request_messages`) and normalized (`None`: left to
    the service). An agent re-sends the whole conversation each call; validating, dumping and normalizing 127
    messages cost a 64-turn call ~400 us (issue 29), so the messages equal to the episode's `ValidatedPrefix` are
    taken from it and only the rest is validated. Exact: `_plain` messages that are `==` validate to the same
    message, and an error in the rest names the index it has in the whole list."""
    if not REUSE_VALIDATED_PREFIX:
        req = service.validate(ChatCompletionRequest, body)
        return req, req.model_dump(exclude_none=True, include={"messages"})["messages"], None
    prefix: ValidatedPrefix | None = session.chat_prefix
    messages = body.get("messages") if type(body) is dict else None
    reused = _common_prefix(prefix.raw, messages) if prefix is not None and type(messages) is list else 0
    if reused:
        # From the last reused message on: the list stays non-empty (`min_length`), that message is known valid.
        req = service.validate(
            ChatCompletionRequest, {**body, "messages": messages[reused - 1 :]}, skipped=("messages", reused - 1)
        )
        added = req.model_dump(exclude_none=True, include={"messages"})["messages"][1:]
        dumped = prefix.dumped[:reused] + added
        normalized = prefix.normalized[:reused] + [template_message(m) for m in added]
    else:
        req = service.validate(ChatCompletionRequest, body)
        dumped = req.model_dump(exclude_none=True, include={"messages"})["messages"]  # one call: half the time
        normalized = [template_message(m) for m in dumped]
    plain = reused
    while plain < len(messages) and _plain(messages[plain]):
        plain += 1
    if reused or prefix is None or plain >= len(prefix.raw):  # a side call (a title, a summary) leaves it be
        session.chat_prefix = ValidatedPrefix(messages[:plain], dumped[:plain], normalized[:plain]) if plain else None
    return req, dumped, normalized


def _common_prefix(old: list, new: list) -> int:
    """How many leading items `old` and `new` share (`==`), by halving: a few list comparisons at C speed."""
    high = min(len(old), len(new))
    if new[:high] == old[:high]:
        return high
    low = 0  # old[:low] == new[:low]; not so at high
    while high - low > 1:
        middle = (low + high) // 2
        if new[:middle] == old[:middle]:
            low = middle
        else:
            high = middle
    return low


_MESSAGE_FIELDS = frozenset(Message.model_fields)
_CALL_FIELDS, _FUNCTION_FIELDS = frozenset(ToolCall.model_fields), frozenset(FunctionCall.model_fields)
_PART_FIELDS = frozenset(TextPart.model_fields)


def _plain(message: Any) -> bool:
    """Whether any parsed message `==` this one (a valid one) validates and dumps to the same message: every value a
    string or null (`==` tells `1`, `1.0` and `true` apart from neither), content parts and tool calls lists of dicts
    of those with no field of their own, and at most one extra field that is not null, a string or a list of strings
    (pydantic keeps extra fields in the order they came; declared ones in its own)."""
    if type(message) is not dict:
        return False
    extras = 0
    for key, value in message.items():
        if value is None:
            continue
        if key not in _MESSAGE_FIELDS:
            extras += 1
            if extras > 1 or not (type(value) is str or (type(value) is list and _strings(value))):
                return False
        elif type(value) is str:
            continue
        elif key == "content" and type(value) is list:
            if not all(
                type(part) is dict and part.keys() <= _PART_FIELDS and _strings(part.values()) for part in value
            ):
                return False
        elif key == "tool_calls" and type(value) is list:
            for call in value:
                if type(call) is not dict or not call.keys() <= _CALL_FIELDS:
                    return False
                function = call.get("function")
                if (
                    type(function) is not dict
                    or not function.keys() <= _FUNCTION_FIELDS
                    or not _strings(function.values())
                    or not all(v is None or type(v) is str for k, v in call.items() if k != "function")
                ):
                    return False
        else:
            return False
    return True


def _strings(values) -> bool:
    return all(type(value) is str for value in values)


def _usage(completion: Completion) -> dict:
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }


def _choices(tokenizer, completion: Completion, logprobs: bool | None) -> list[dict]:
    return [
        {
            "index": i,
            "message": choice.message,
            "finish_reason": choice.finish_reason,
            "logprobs": _logprobs_body(tokenizer, choice.output) if logprobs else None,
        }
        for i, choice in enumerate(completion.choices)
    ]


def _token_entry(tokenizer, token_id: int, logprob: float) -> dict:
    token = tokenizer.decode([token_id])
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _logprobs_body(tokenizer, out: GenerationOutput) -> dict:
    content = []
    for k, (token_id, logprob) in enumerate(zip(out.token_ids, out.logprobs)):
        entry = _token_entry(tokenizer, token_id, logprob)
        alternatives = out.top_logprobs[k] if out.top_logprobs else []
        entry["top_logprobs"] = [_token_entry(tokenizer, t, lp) for t, lp in alternatives]
        content.append(entry)
    return {"content": content}


async def _stream_chunks(service, call, answer, response_id, created, model, logprobs, include_usage):
    def chunk(choice_index, delta, finish=None, logprobs=None):
        return {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": choice_index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
        }

    for index in range(call.conversation.n):
        yield chunk(index, {"role": "assistant", "content": ""})
    try:
        async for item in answer:
            if isinstance(item, Delta):
                yield chunk(item.index, {"content" if item.kind == "content" else "reasoning_content": item.text})
                continue
            completion = item
    except APIError as error:
        yield error_body(error.message, error.type, error.param, error.code)
        return
    except Exception as error:  # noqa: BLE001 - the response has started: say so in the stream, then end it
        logger.exception("Internal error while streaming a chat completion")
        yield error_body(f"Internal error: {type(error).__name__}: {error}", "server_error", code="internal_error")
        return
    for choice in _choices(service.tokenizer, completion, logprobs):
        index, message = choice["index"], choice["message"]
        for j, call_ in enumerate(message.get("tool_calls") or []):
            yield chunk(
                index,
                {
                    "tool_calls": [
                        {
                            "index": j,
                            "id": call_["id"],
                            "type": "function",
                            "function": {"name": call_["function"]["name"], "arguments": ""},
                        }
                    ]
                },
            )
            arguments = call_["function"]["arguments"]
            yield chunk(index, {"tool_calls": [{"index": j, "function": {"arguments": arguments}}]})
        yield chunk(index, {}, choice["finish_reason"], choice["logprobs"])
    if include_usage:
        yield {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [],
            "usage": _usage(completion),
        }


async def _sse(chunks):
    async for item in chunks:
        yield f"data: {json.dumps(item)}\n\n"
    yield "data: [DONE]\n\n"
