"""`POST /v1beta/models/{model}:generateContent`: the Gemini API, as an adapter over `service.py`.

What the `google-genai` SDKs (Python, JS) and Gemini CLI speak. `generateContent`, `streamGenerateContent` (server-sent
events with `?alt=sse`, else a streamed JSON array, as Google serves them) and `countTokens`. The episode key is
accepted as `x-goog-api-key` (what the SDKs send), `?key=` or `Authorization: Bearer`. Fields are accepted in
camelCase or snake_case, as Google's JSON parser takes them. Errors come as `{"error": {"code", "message", "status"}}`
(`error_body`, written by `app.py`).

Contents → chat messages (so that the parts we returned, sent back, are exactly the assistant message we recorded and
the next prompt continues its tokens):

| Gemini                                        | chat message                                                  |
|-----------------------------------------------|---------------------------------------------------------------|
| `systemInstruction` (text parts)              | a `system` message (parts joined by a newline)                |
| `user` text parts                             | a `user` message (parts joined by a newline)                  |
| `user` `functionResponse` (`id`, `response`)  | a `tool` message: `response.output` (or `.error`, marked      |
|                                               | `is_error`) alone, else the whole `response` as JSON          |
| `model` text parts with `thought: true`       | `reasoning_content` (a thinking model's `<think>` text)       |
| `model` text parts                            | `content` (joined as they are: a stream's pieces add up)      |
| `model` `functionCall` (`id`, `name`, `args`) | a `tool_calls` entry, arguments as JSON                       |

Model contents in a row are one assistant message (the `google-genai` chat keeps each streamed chunk as a content).
`thoughtSignature`s are accepted and ignored (the endpoint matches returned parts by their content). A
`functionResponse` without an `id` answers the earliest unanswered call of that name. Function declarations take
`parametersJsonSchema` (JSON schema, as Gemini CLI sends them) or `parameters` (Google's OpenAPI subset: its
upper-case types become JSON schema's lower-case ones, what chat templates and models know).

Answer parts: a `thought` text part (when the model reasoned and `thinkingConfig.includeThoughts` asks for it), a
text part (when it wrote any), one `functionCall` per tool call (with the id the response may name); `finishReason`
`STOP` or `MAX_TOKENS`. `toolConfig.functionCallingConfig` modes `AUTO`, `ANY` (one allowed name: that function) and
`NONE` are served. Images, files, code execution and Google's hosted tools (`googleSearch`, `codeExecution`, ...) are
a 400 (the policy reads text and calls the agent's own functions); so is a last `model` content (prefill), which this
endpoint does not continue.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .service import GEMINI, APIError, Choice, Completion, CompletionService, Delta, ModelCall
from .sessions import EpisodeSession


logger = logging.getLogger(__name__)


# Google's canonical status name for an HTTP status (https://ai.google.dev/gemini-api/docs/troubleshooting).
STATUSES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
# Paths in the Gemini API's shape: `/v1beta/...`, and `/v1/models/{model}:{method}` (its stable version).
_ROUTE = re.compile(r"/v1beta/|/v1/models/[^/]+:[A-Za-z]+$")
# Part fields that carry data (a part holds exactly one); the others (`thought`, `thoughtSignature`, ...) qualify it.
_DATA_FIELDS = (
    "text",
    "functionCall",
    "functionResponse",
    "inlineData",
    "fileData",
    "executableCode",
    "codeExecutionResult",
)
# Tool fields of Google's hosted tools: they run on Google's servers, not here.
_HOSTED_TOOLS = (
    "googleSearch",
    "googleSearchRetrieval",
    "codeExecution",
    "urlContext",
    "computerUse",
    "fileSearch",
    "googleMaps",
    "enterpriseWebSearch",
    "retrieval",
)


def is_gemini_route(path: str) -> bool:
    """Whether errors on `path` are answered in Google's shape."""
    return bool(_ROUTE.search(path))


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """Google's error shape for a response of HTTP `status`; `param`, the field at fault, as a `BadRequest` detail."""
    error: dict[str, Any] = {
        "code": status,
        "message": message,
        "status": STATUSES.get(status, "INTERNAL" if status >= 500 else "INVALID_ARGUMENT"),
    }
    if param:
        error["details"] = [
            {
                "@type": "type.googleapis.com/google.rpc.BadRequest",
                "fieldViolations": [{"field": param, "description": message}],
            }
        ]
    return {"error": error}


class GenerationConfig(BaseModel):
    """`generationConfig`. Unknown fields (`responseMimeType`, `responseSchema`, `thinkingConfig`, penalties, ...)
    are accepted and recorded; sampling is the trainer's."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    topP: float | None = Field(default=None, gt=0.0, le=1.0)
    topK: int | None = Field(default=None, ge=0)
    maxOutputTokens: int | None = Field(default=None, ge=1)
    stopSequences: list[str] | None = None
    candidateCount: int = Field(default=1, ge=1, le=8)
    seed: int | None = Field(default=None, ge=-(2**31), le=2**31 - 1)  # int32, as Google's
    responseLogprobs: bool | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    thinkingConfig: dict[str, Any] | None = None


class GenerateContentRequest(BaseModel):
    """The body of `generateContent` and `streamGenerateContent` (the model is in the path)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    contents: list[dict[str, Any]] = Field(min_length=1)
    systemInstruction: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    toolConfig: dict[str, Any] | None = None
    generationConfig: GenerationConfig = Field(default_factory=GenerationConfig)
    cachedContent: str | None = None


async def serve(service: CompletionService, session: EpisodeSession, target: str, raw: bytes, request: Request):
    """Answer `POST .../models/{target}` (`target` = `model:method`) in `session`: a dict, or a streaming response."""
    model, _, method = target.rpartition(":")
    if method == "countTokens":
        service.check_model(model)
        return await count_tokens(service, raw)
    if method not in ("generateContent", "streamGenerateContent"):
        raise APIError(
            404,
            f"Unknown method {target!r}: this endpoint serves 'generateContent', "
            "'streamGenerateContent' and 'countTokens' of models/{model}.",
            code="not_found",
        )
    service.check_model(model)
    stream = method == "streamGenerateContent"
    req = service.validate(GenerateContentRequest, _camel_body(service.parse_json(raw)))
    if req.cachedContent is not None:
        raise APIError(
            400,
            "cachedContent names content cached on Google's servers; send the contents instead.",
            param="cachedContent",
        )
    config = req.generationConfig
    tools = chat_tools(req.tools)
    tool_choice, forced = _tool_choice(req.toolConfig, tools)
    requested = {
        "model": model,
        "stream": stream,
        **req.model_dump(exclude_unset=True, exclude_none=True, exclude={"contents", "systemInstruction", "tools"}),
    }
    conversation = ModelCall(
        messages=chat_messages(req.systemInstruction, req.contents),
        tools=tools,
        tool_choice=tool_choice,
        forced_tool_name=forced,
        max_tokens=config.maxOutputTokens,
        temperature=config.temperature,
        top_p=config.topP,
        top_k=config.topK,
        seed=config.seed,
        n=config.candidateCount,
        stop=[s for s in config.stopSequences or [] if s],
        top_logprobs=config.logprobs or 0,
        requested=requested,
        wire_format=GEMINI,
        split_reasoning=True,
        messages_param="contents",
        size=len(raw),
    )
    shape = _Shape(
        model,
        f"trl-{uuid.uuid4().hex}",
        bool((config.thinkingConfig or {}).get("includeThoughts")),
        bool(config.responseLogprobs),
        service.tokenizer,
    )
    if not stream:
        return shape.response(await service.complete(session, conversation, request))
    call = await service.prepare(session, conversation)  # admitted; errors before the stream are answered as such
    chunks = _stream_chunks(call, service.stream(call, request), shape)
    if request.query_params.get("alt") == "sse":
        return StreamingResponse(_sse(chunks), media_type="text/event-stream")
    return StreamingResponse(_json_array(chunks), media_type="application/json")


async def count_tokens(service: CompletionService, raw: bytes) -> dict[str, Any]:
    """`countTokens`: the prompt tokens of the contents (or of a whole `generateContentRequest`) rendered fresh."""
    body = _camel(service.parse_json(raw), "body")
    inner = body.get("generateContentRequest")
    if inner is not None:
        body = _camel(inner, "generateContentRequest")
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        raise APIError(
            400, "countTokens needs 'contents' (a non-empty list), or a 'generateContentRequest'.", param="contents"
        )
    system, tools = body.get("systemInstruction"), body.get("tools")
    if system is not None and not isinstance(system, dict):
        raise APIError(
            400, "systemInstruction must be a content object ({'parts': [{'text': ...}]}).", param="systemInstruction"
        )
    if tools is not None and not isinstance(tools, list):
        raise APIError(400, "tools must be a list.", param="tools")
    messages = chat_messages(system, contents, answerable=False)
    total = await service.count_prompt_tokens(messages, chat_tools(tools), size=len(raw))
    return {"totalTokens": total, "promptTokensDetails": [{"modality": "TEXT", "tokenCount": total}]}


def models_body(names: list[str], context_length: int) -> dict[str, Any]:
    """`GET /v1beta/models`: the served model names as Gemini `Model`s."""
    return {"models": [model_body(name, context_length) for name in names]}


def model_body(name: str, context_length: int) -> dict[str, Any]:
    return {
        "name": f"models/{name}",
        "baseModelId": name,
        "version": "trl-agentic",
        "displayName": name,
        "inputTokenLimit": context_length,
        "outputTokenLimit": context_length,
        "supportedGenerationMethods": ["generateContent", "countTokens"],
    }


# Requests → chat


def _snake_to_camel(key: str) -> str:
    return re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), key)


def _camel(value: Any, where: str) -> dict[str, Any]:
    """`value` (an object of Google's API) with snake_case keys spelled in camelCase; 400 when it is no object or
    has a field in both spellings."""
    if not isinstance(value, dict):
        raise APIError(400, f"{where} must be an object.", param=where)
    out: dict[str, Any] = {}
    for key, item in value.items():
        name = _snake_to_camel(key) if "_" in key else key
        if name in out:
            raise APIError(400, f"{where} has '{name}' twice (in camelCase and snake_case).", param=f"{where}.{name}")
        out[name] = item
    return out


def _camel_body(body: Any) -> dict[str, Any]:
    body = _camel(body, "body")
    for key in ("generationConfig", "toolConfig"):
        if isinstance(body.get(key), dict):
            body[key] = _camel(body[key], key)
    config = body.get("generationConfig")
    if isinstance(config, dict) and isinstance(config.get("thinkingConfig"), dict):
        config["thinkingConfig"] = _camel(config["thinkingConfig"], "generationConfig.thinkingConfig")
    tool_config = body.get("toolConfig")
    if isinstance(tool_config, dict) and isinstance(tool_config.get("functionCallingConfig"), dict):
        tool_config["functionCallingConfig"] = _camel(
            tool_config["functionCallingConfig"], "toolConfig.functionCallingConfig"
        )
    return body


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Gemini tools' `functionDeclarations` as chat-completions function tools, in order."""
    if not tools:
        return None
    converted = []
    for i, tool in enumerate(tools):
        tool = _camel(tool, f"tools[{i}]")
        hosted = [key for key in tool if key in _HOSTED_TOOLS]
        if hosted:
            raise APIError(
                400,
                f"tools[{i}] is Google's hosted tool {hosted[0]!r}, which runs on Google's servers; "
                "this endpoint serves the agent's own functionDeclarations.",
                param=f"tools[{i}]",
            )
        declarations = tool.get("functionDeclarations")
        if not isinstance(declarations, list):
            raise APIError(400, f"tools[{i}] needs 'functionDeclarations' (a list).", param=f"tools[{i}]")
        for k, declaration in enumerate(declarations):
            where = f"tools[{i}].functionDeclarations[{k}]"
            declaration = _camel(declaration, where)
            name = declaration.get("name")
            if not isinstance(name, str) or not name:
                raise APIError(400, f"{where} needs a 'name'.", param=f"{where}.name")
            function: dict[str, Any] = {"name": name}
            if declaration.get("description") is not None:
                function["description"] = declaration["description"]
            schema, json_schema = declaration.get("parameters"), declaration.get("parametersJsonSchema")
            if schema is not None and json_schema is not None:
                raise APIError(400, f"{where} has both 'parameters' and 'parametersJsonSchema': send one.", param=where)
            if schema is not None or json_schema is not None:
                parameters = json_schema if json_schema is not None else _json_schema(schema)
                if not isinstance(parameters, dict):
                    raise APIError(400, f"{where}: the parameters must be a schema object.", param=where)
                function["parameters"] = parameters
            converted.append({"type": "function", "function": function})
    return converted or None


def _json_schema(schema: Any) -> Any:
    """Google's OpenAPI schema subset as JSON schema: `type` values lower-cased (`STRING` → `string`), wherever a
    schema can nest (`properties`, `items`, `anyOf`, ...); everything else as sent."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            value = value.lower()
        elif key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            value = {name: _json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not"):
            value = _json_schema(value)
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems") and isinstance(value, list):
            value = [_json_schema(sub) for sub in value]
        out[key] = value
    return out


def _tool_choice(config: dict[str, Any] | None, tools: list[dict] | None) -> tuple[str | None, str | None]:
    calling = (config or {}).get("functionCallingConfig")
    if calling is None:
        return None, None
    if not isinstance(calling, dict):
        raise APIError(
            400, "toolConfig.functionCallingConfig must be an object.", param="toolConfig.functionCallingConfig"
        )
    mode = calling.get("mode", "AUTO")
    names = calling.get("allowedFunctionNames") or []
    where = "toolConfig.functionCallingConfig"
    if mode in ("AUTO", "MODE_UNSPECIFIED", "VALIDATED"):
        return "auto", None
    if mode == "NONE":
        return "none", None
    if mode != "ANY":
        raise APIError(
            400, f"Unsupported {where}.mode {mode!r}: use 'AUTO', 'ANY', 'NONE' or 'VALIDATED'.", param=f"{where}.mode"
        )
    if not tools:
        raise APIError(400, f"{where}.mode 'ANY' needs function declarations in 'tools'.", param=f"{where}.mode")
    declared = [t["function"]["name"] for t in tools]
    if not isinstance(names, list) or any(name not in declared for name in names):
        raise APIError(
            400,
            f"{where}.allowedFunctionNames {names!r} names functions that are not declared (declared: {declared}).",
            param=f"{where}.allowedFunctionNames",
        )
    if len(set(names)) == 1:
        return None, names[0]
    if names and set(names) != set(declared):
        raise APIError(
            400,
            f"{where}.allowedFunctionNames restricts the call to {len(set(names))} of the "
            f"{len(declared)} declared functions; this endpoint can force one function or any: "
            "name one, or none.",
            param=f"{where}.allowedFunctionNames",
        )
    return "required", None


def chat_messages(system: dict[str, Any] | None, contents: list[Any], answerable: bool = True) -> list[dict[str, Any]]:
    """`systemInstruction` + `contents` as chat messages (see the module's table); 400 naming the part it cannot
    take. `answerable`: the contents must end with a user turn (not for countTokens)."""
    out: list[dict[str, Any]] = []
    if system is not None:
        system = _camel(system, "systemInstruction")
        texts = _texts(_parts(system, "systemInstruction"), "systemInstruction")
        if texts:
            out.append({"role": "system", "content": "\n".join(texts)})
    unanswered: list[tuple[str, str]] = []  # (id, name) of the calls of the last model turn without a response yet
    model_parts: list[tuple[str, dict[str, Any]]] = []  # (where, part) of the model contents in a row

    def end_model_turn():
        nonlocal unanswered
        if model_parts:
            message = _model_message(model_parts)
            unanswered = [(call["id"], call["function"]["name"]) for call in message.get("tool_calls") or []]
            out.append(message)
            model_parts.clear()

    for i, content in enumerate(contents):
        where = f"contents[{i}]"
        content = _camel(content, where)
        role = content.get("role") or "user"
        parts = _parts(content, where)
        if role == "model":
            # Model contents in a row are one turn: a chat client keeps each streamed chunk as a content of its own.
            model_parts.extend((f"{where}.parts[{j}]", part) for j, part in enumerate(parts))
        elif role == "user":
            end_model_turn()
            out.extend(_user_messages(parts, where, unanswered))
        else:
            raise APIError(400, f"{where}.role must be 'user' or 'model', not {role!r}.", param=f"{where}.role")
    end_model_turn()
    if answerable and out and out[-1]["role"] == "assistant":
        raise APIError(
            400,
            "The last content is the model's (a prefill); this endpoint answers user turns only: end "
            "with a user content.",
            param=f"contents[{len(contents) - 1}]",
        )
    return out


def _parts(content: dict[str, Any], where: str) -> list[dict[str, Any]]:
    parts = content.get("parts")
    if not isinstance(parts, list):
        raise APIError(400, f"{where}.parts must be a list of parts.", param=f"{where}.parts")
    out = []
    for j, part in enumerate(parts):
        at = f"{where}.parts[{j}]"
        part = _camel(part, at)
        kinds = [key for key in _DATA_FIELDS if key in part]
        if len(kinds) != 1:
            raise APIError(
                400, f"{at} must hold exactly one of {list(_DATA_FIELDS)} (it holds {kinds or 'none'}).", param=at
            )
        if kinds[0] in ("inlineData", "fileData"):
            raise APIError(
                400, f"{at} is {kinds[0]} (an image, file or audio); the served model reads text only.", param=at
            )
        if kinds[0] in ("executableCode", "codeExecutionResult"):
            raise APIError(400, f"{at} is {kinds[0]}: code execution runs on Google's servers, not here.", param=at)
        if kinds[0] == "text" and not isinstance(part["text"], str):
            raise APIError(400, f"{at}.text must be a string.", param=f"{at}.text")
        out.append(part)
    return out


def _texts(parts: list[dict[str, Any]], where: str) -> list[str]:
    """The text of each part; 400 for a part that is no text."""
    for j, part in enumerate(parts):
        if "text" not in part:
            raise APIError(400, f"{where}.parts[{j}] must be a text part.", param=f"{where}.parts[{j}]")
    return [part["text"] for part in parts]


def _model_message(parts: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    texts, reasoning, calls = [], [], []
    for at, part in parts:
        if "text" in part:
            (reasoning if part.get("thought") else texts).append(part["text"])
        elif "functionCall" in part:
            call = _camel(part["functionCall"], f"{at}.functionCall")
            name, args = call.get("name"), call.get("args", {})
            if not isinstance(name, str) or not name or not isinstance(args, dict):
                raise APIError(
                    400, f"{at}.functionCall needs a 'name' and 'args' as an object.", param=f"{at}.functionCall"
                )
            # An id the client did not keep is made from the call's place: the same on every turn that resends it.
            call_id = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else f"{name}@{at}"
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}})
        else:
            raise APIError(
                400,
                f"{at} is a functionResponse in a model content; a model content takes text and functionCall parts.",
                param=at,
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _user_messages(parts: list[dict[str, Any]], where: str, unanswered: list[tuple[str, str]]) -> list[dict[str, Any]]:
    # Function responses become tool messages in place; the text parts around them become user messages.
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, part in enumerate(parts):
        at = f"{where}.parts[{j}]"
        if "text" in part:
            if not part.get("thought"):
                texts.append(part["text"])
            continue
        if "functionCall" in part:
            raise APIError(400, f"{at} is a functionCall in a user content; calls are the model's.", param=at)
        response = _camel(part["functionResponse"], f"{at}.functionResponse")
        name, result = response.get("name"), response.get("response", {})
        if not isinstance(name, str) or not name or not isinstance(result, dict):
            raise APIError(
                400,
                f"{at}.functionResponse needs a 'name' and 'response' as an object.",
                param=f"{at}.functionResponse",
            )
        if response.get("parts"):
            raise APIError(
                400,
                f"{at}.functionResponse has 'parts' (images or files); the served model reads text only.",
                param=f"{at}.functionResponse.parts",
            )
        call_id = response.get("id") if isinstance(response.get("id"), str) and response.get("id") else None
        answered = next((k for k, (i, n) in enumerate(unanswered) if (i == call_id if call_id else n == name)), None)
        if answered is not None:
            call_id = call_id or unanswered[answered][0]
            del unanswered[answered]
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            texts = []
        tool = {"role": "tool", "tool_call_id": call_id or name, "name": name, "content": _response_text(result)}
        if set(result) == {"error"}:
            tool["is_error"] = True
        out.append(tool)
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _response_text(result: dict[str, Any]) -> str:
    """What a function returned, as the tool message's text: Google's documented `output` (or `error`) key alone,
    else the whole `response` as JSON."""
    if len(result) == 1 and next(iter(result)) in ("output", "error"):
        value = next(iter(result.values()))
        return value if isinstance(value, str) else json.dumps(value)
    return json.dumps(result)


# Chat → responses


class _Shape:
    """Writes answers in Gemini's shape: the model's name, the response id, and what the request asked to see."""

    def __init__(self, model: str, response_id: str, thoughts: bool, logprobs: bool, tokenizer):
        self.model, self.response_id, self.thoughts, self.logprobs, self.tokenizer = (
            model,
            response_id,
            thoughts,
            logprobs,
            tokenizer,
        )

    def chunk(self, candidates: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"candidates": candidates}
        if usage is not None:
            body["usageMetadata"] = usage
        body["modelVersion"] = self.model
        body["responseId"] = self.response_id
        return body

    def response(self, completion: Completion) -> dict[str, Any]:
        candidates = [
            self.candidate(index, choice, self.parts(choice)) for index, choice in enumerate(completion.choices)
        ]
        return self.chunk(candidates, usage(completion))

    def parts(self, choice: Choice, streamed: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """The answer's parts; with `streamed` (text a stream sent, by kind), only what is left to send."""
        message, streamed = choice.message, streamed or {}
        parts: list[dict[str, Any]] = []
        for kind, text in (("reasoning", message.get("reasoning_content")), ("content", message.get("content"))):
            if not text or (kind == "reasoning" and not self.thoughts):
                continue
            sent = streamed.get(kind, "")
            rest = text[len(sent) :] if text.startswith(sent) else ""
            if rest:
                parts.append({"text": rest, "thought": True} if kind == "reasoning" else {"text": rest})
        for call in message.get("tool_calls") or []:
            parts.append(
                {
                    "functionCall": {
                        "id": call["id"],
                        "name": call["function"]["name"],
                        "args": json.loads(call["function"]["arguments"]),
                    }
                }
            )
        return parts

    def candidate(self, index: int, choice: Choice, parts: list[dict[str, Any]]) -> dict[str, Any]:
        candidate: dict[str, Any] = {
            "content": {"role": "model", "parts": parts},
            "finishReason": "MAX_TOKENS" if choice.finish_reason == "length" else "STOP",
            "index": index,
        }
        out = choice.output
        if out.logprobs:
            candidate["avgLogprobs"] = sum(out.logprobs) / len(out.logprobs)
        if self.logprobs:
            candidate["logprobsResult"] = self.logprobs_result(out)
        return candidate

    def logprobs_result(self, out) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            return {"token": self.tokenizer.decode([token_id]), "tokenId": token_id, "logProbability": logprob}

        chosen = [entry(t, lp) for t, lp in zip(out.token_ids, out.logprobs)]
        top = [
            {"candidates": [entry(t, lp) for t, lp in (out.top_logprobs[k] if out.top_logprobs else [])]}
            for k in range(len(out.token_ids))
        ]
        return {"topCandidates": top, "chosenCandidates": chosen}


def usage(completion: Completion) -> dict[str, int]:
    return {
        "promptTokenCount": completion.prompt_tokens,
        "candidatesTokenCount": completion.completion_tokens,
        "totalTokenCount": completion.prompt_tokens + completion.completion_tokens,
    }


async def _stream_chunks(call, answer: AsyncIterator, shape: _Shape):
    """`GenerateContentResponse` chunks as the answer is sampled: one per piece of text (thoughts only when asked
    for), then one per candidate with its function calls, finish reason and the usage."""
    streamed: list[dict[str, str]] = [{} for _ in range(call.conversation.n)]  # text sent, per candidate and kind
    # The latest piece waits for the next, so that the last travels with the finish reason, as Google's streams do:
    # a chunk without parts is no valid answer to the `google-genai` chat, which then drops the whole turn.
    held: dict[str, Any] | None = None
    try:
        async for item in answer:
            if not isinstance(item, Delta):
                completion = item
                continue
            if item.kind == "reasoning" and not shape.thoughts:
                continue
            sent = streamed[item.index]
            sent[item.kind] = sent.get(item.kind, "") + item.text
            part = {"text": item.text, "thought": True} if item.kind == "reasoning" else {"text": item.text}
            if held is not None:
                yield shape.chunk([held])
            held = {"content": {"role": "model", "parts": [part]}, "index": item.index}
    except APIError as error:
        yield error_body(error.status, error.message, error.param)
        return
    except Exception as error:  # noqa: BLE001 - the response has started: say so in the stream, then end it
        logger.exception("Internal error while streaming a Gemini response")
        yield error_body(500, f"Internal error: {type(error).__name__}: {error}")
        return
    candidates = [
        shape.candidate(index, choice, shape.parts(choice, streamed[index]))
        for index, choice in enumerate(completion.choices)
    ]
    if held is not None:
        parts = candidates[held["index"]]["content"]["parts"]
        parts[:0] = held["content"]["parts"]
    yield shape.chunk(candidates, usage(completion))


async def _sse(chunks):
    async for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\r\n\r\n"


async def _json_array(chunks):
    # `streamGenerateContent` without `alt=sse`: one JSON array, its elements sent as they come.
    first = True
    async for chunk in chunks:
        yield ("[" if first else ",\r\n") + json.dumps(chunk)
        first = False
    yield "[]" if first else "]"
