"""`POST /v1/chat/completions`: the OpenAI Chat Completions wire format, as an adapter over `service.py`.

The request (`protocol.ChatCompletionRequest`) is already a conversation; this module validates it, hands it to the
`CompletionService`, and shapes the answer as a `chat.completion` or, with `stream: true`, as `chat.completion.chunk`
server-sent events (the whole answer is sampled first: what is recorded is identical whether or not it streams).
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..generation.engine import GenerationOutput
from .protocol import ChatCompletionRequest
from .service import CHAT_COMPLETIONS, CompletionService, Conversation, content_pieces
from .sessions import EpisodeSession


async def serve_chat_completions(service: CompletionService, session: EpisodeSession, raw: bytes, request: Request):
    """Answer one Chat Completions request body `raw` in `session` (a dict, or a streaming response)."""
    req = service.validate(ChatCompletionRequest, service.parse_json(raw))
    service.check_model(req.model)
    conversation = Conversation(
        messages=[m.model_dump(exclude_none=True) for m in req.messages],
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
    )
    completion = await service.complete(session, conversation, request)

    tokenizer = service.tokenizer
    choices = [{"index": i, "message": choice.message, "finish_reason": choice.finish_reason,
                "logprobs": _logprobs_body(tokenizer, choice.output) if req.logprobs else None}
               for i, choice in enumerate(completion.choices)]
    usage = {"prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens,
             "total_tokens": completion.prompt_tokens + completion.completion_tokens}
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if not req.stream:
        return {"id": response_id, "object": "chat.completion", "created": created, "model": req.model,
                "choices": choices, "usage": usage, "system_fingerprint": f"policy-v{completion.policy_version}"}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    outputs = [choice.output for choice in completion.choices]
    return StreamingResponse(
        _sse(_stream_chunks(tokenizer, response_id, created, req.model, choices, outputs, usage, include_usage)),
        media_type="text/event-stream",
    )


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


def _stream_chunks(tokenizer, response_id, created, model, choices, outputs, usage, include_usage):
    def chunk(choice_index, delta, finish=None, logprobs=None):
        return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": choice_index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}

    for choice, out in zip(choices, outputs):
        index, message = choice["index"], choice["message"]
        yield chunk(index, {"role": "assistant", "content": ""})
        for piece in content_pieces(tokenizer, out.token_ids, message.get("content") or ""):
            yield chunk(index, {"content": piece})
        for j, call in enumerate(message.get("tool_calls") or []):
            yield chunk(index, {"tool_calls": [{"index": j, "id": call["id"], "type": "function",
                                                "function": {"name": call["function"]["name"], "arguments": ""}}]})
            arguments = call["function"]["arguments"]
            yield chunk(index, {"tool_calls": [{"index": j, "function": {"arguments": arguments}}]})
        yield chunk(index, {}, choice["finish_reason"], choice["logprobs"])
    if include_usage:
        yield {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [], "usage": usage}


async def _sse(chunks):
    for item in chunks:
        yield f"data: {json.dumps(item)}\n\n"
    yield "data: [DONE]\n\n"
