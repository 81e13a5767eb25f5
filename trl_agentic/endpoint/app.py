"""The OpenAI-compatible endpoint that records every token: `create_app(...) -> FastAPI`.

Routes:
- `POST /v1/chat/completions`, `GET /v1/models` (episode by `Authorization: Bearer <episode key>`), and the same under
  `/episodes/{episode_id}/v1/...` (episode by path).
- `GET /health`.
- `POST /admin/episodes`, `GET /admin/episodes/{id}`, `POST /admin/episodes/{id}/close`, guarded by the admin token
  (the agent only ever holds its episode key or id).

The path route is a capability URL: the episode id (128 random bits) is the secret, kept out of access logs
(`server.redact_episode_ids`). A request on it that carries an episode key must carry that episode's key (401
otherwise); placeholder keys (`EMPTY`, `sk-...`) that agents send when they must send something are ignored.

Nothing an agent sends can cost another episode (issue #9): bodies are strict JSON with bounded nesting and sampling
fields in range (4xx otherwise), a batch survives one failing member (`generation/batching.py`), and a genuine server
error is answered 500 on a connection that stays usable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import ValidationError

from ..generation.engine import GenerationEngine, GenerationOutput, SamplingParams
from ..trace import EPISODE_STATUSES, Turn, json_text
from . import SERVED_MODEL_NAME
from .chat import ChatRenderer
from .protocol import (
    ChatCompletionRequest,
    CloseEpisodeRequest,
    OpenEpisodeRequest,
    error_body,
    parse_json_body,
    template_message,
)
from .sessions import (
    EpisodeClosedError,
    EpisodeLimits,
    EpisodeRegistry,
    EpisodeSession,
    TooManyOpenEpisodesError,
    redact_episode_ids,
)


logger = logging.getLogger(__name__)


@dataclass
class SamplingOverrides:
    """Sampling set by the server (the trainer), whatever the agent asks for. `None` = use the request's value."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None  # cap on tokens per call (the request may ask for fewer)


@dataclass
class EndpointSettings:
    """How the endpoint serves: model names, admin token, defaults and caps.

    Args:
        served_model_names: values of `model` the endpoint answers to (others get 404 `model_not_found`).
        admin_token: bearer token of the `/admin` routes (episodes are opened and closed with it).
        default_max_tokens: `max_tokens` of a request that sets none.
        max_body_bytes: larger request bodies are answered 413.
        overrides: sampling the trainer imposes, whatever the request asks for.
        default_limits: limits of an episode opened without its own.
        max_open_episodes: most episodes open at once; opening one more is answered 429 (`None`: no cap).
        episode_idle_timeout: seconds without a call after which an episode is closed with status `cancelled`
            (`None`: never); its trace stays retrievable through the admin routes for a while.
    """

    served_model_names: list[str] = field(default_factory=lambda: [SERVED_MODEL_NAME])
    admin_token: str = field(default_factory=lambda: f"sk-admin-{secrets.token_urlsafe(32)}")
    default_max_tokens: int = 512
    max_body_bytes: int = 4 * 1024 * 1024
    overrides: SamplingOverrides = field(default_factory=SamplingOverrides)
    default_limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    max_open_episodes: int | None = None
    episode_idle_timeout: float | None = None


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param


def create_app(
    engine: GenerationEngine,
    renderer: ChatRenderer,
    settings: EndpointSettings | None = None,
    registry: EpisodeRegistry | None = None,
) -> FastAPI:
    """Build the endpoint app.

    Example:

    ```python
    >>> app = create_app(TransformersEngine(model, tokenizer.pad_token_id), ChatRenderer(tokenizer))
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)
    ```
    """
    settings = settings or EndpointSettings()
    registry = registry or EpisodeRegistry(settings.max_open_episodes, settings.episode_idle_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        reaper = asyncio.create_task(_reap_idle_episodes(registry)) if registry.idle_timeout is not None else None
        yield
        if reaper is not None:
            reaper.cancel()

    app = FastAPI(title="trl-agentic endpoint", lifespan=lifespan)
    app.add_middleware(_ServerErrors)
    app.state.engine, app.state.renderer, app.state.settings, app.state.registry = engine, renderer, settings, registry
    tokenizer = renderer.tokenizer

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError):
        return JSONResponse(error_body(error.message, error.type, error.param, error.code), status_code=error.status)

    @app.exception_handler(404)
    async def _not_found(request: Request, _):
        return JSONResponse(error_body(f"Unknown route {request.url.path}", code="not_found"), status_code=404)

    @app.exception_handler(405)
    async def _bad_method(request: Request, _):
        return JSONResponse(error_body(f"Method {request.method} not allowed on {request.url.path}"), status_code=405)

    # Episodes

    def episode_from_key(request: Request) -> EpisodeSession:
        header = request.headers.get("authorization", "")
        if not header.lower().startswith("bearer ") or not header[7:].strip():
            raise APIError(401, "Missing API key: send the episode key as 'Authorization: Bearer <key>'.",
                           "authentication_error", "missing_api_key")
        session = registry.by_key(header[7:].strip())
        if session is None:
            raise APIError(401, "Unknown or closed episode key.", "authentication_error", "invalid_api_key")
        return session

    def episode_from_path(episode_id: str, request: Request) -> EpisodeSession:
        session = registry.by_id(episode_id)
        if session is None or session.closed:
            raise APIError(404, "Unknown or closed episode (the id in the path).", "invalid_request_error",
                           "episode_not_found")
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if key.startswith("sk-ep-") and not secrets.compare_digest(key.encode(), session.key.encode()):
            raise APIError(401, "This episode key belongs to another episode than the one in the path.",
                           "authentication_error", "invalid_api_key")
        return session

    def check_admin(request: Request) -> None:
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if not secrets.compare_digest(token.encode(), settings.admin_token.encode()):
            raise APIError(401, "Admin routes need the admin token.", "authentication_error", "invalid_admin_token")

    # Routes

    @app.get("/health")
    async def health():
        return {"status": "ok", "open_episodes": len(registry)}

    def models_body():
        now = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": now, "owned_by": "trl-agentic"}
            for name in settings.served_model_names
        ]}

    @app.get("/v1/models")
    async def models(request: Request):
        episode_from_key(request)
        return models_body()

    @app.get("/episodes/{episode_id}/v1/models")
    async def models_by_path(episode_id: str, request: Request):
        episode_from_path(episode_id, request)
        return models_body()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        session = episode_from_key(request)
        return await serve_chat(session, await read_body(request), request)

    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def chat_completions_by_path(episode_id: str, request: Request):
        session = episode_from_path(episode_id, request)
        return await serve_chat(session, await read_body(request), request)

    @app.post("/admin/episodes")
    async def open_episode(request: Request):
        check_admin(request)
        body = validate(OpenEpisodeRequest, await read_json(request, required=False) or {})
        defaults = settings.default_limits
        limits = EpisodeLimits(
            max_turns=_first(body.max_turns, defaults.max_turns, None),
            max_episode_tokens=_first(body.max_episode_tokens, defaults.max_episode_tokens, None),
        )
        try:
            session = registry.open(body.task_index, body.group_index, body.metadata, limits)
        except TooManyOpenEpisodesError as error:
            raise APIError(429, str(error), "rate_limit_error", "too_many_open_episodes") from None
        base = str(request.base_url).rstrip("/")
        return {"id": session.episode.id, "key": session.key, "base_url": f"{base}/v1",
                "path_base_url": f"{base}/episodes/{session.episode.id}/v1"}

    @app.get("/admin/episodes/{episode_id}")
    async def get_episode(episode_id: str, request: Request):
        check_admin(request)
        session = registry.by_id(episode_id)
        episode = session.episode if session is not None else registry.reaped(episode_id)
        if episode is None:
            raise APIError(404, f"Unknown or closed episode {episode_id!r}.", code="episode_not_found")
        return trace_response(episode)

    @app.post("/admin/episodes/{episode_id}/close")
    async def close_episode(episode_id: str, request: Request):
        check_admin(request)
        body = validate(CloseEpisodeRequest, await read_json(request, required=False) or {})
        if body.status is not None and (body.status not in EPISODE_STATUSES or body.status == "running"):
            raise APIError(400, f"Unknown episode status {body.status!r}; use one of "
                                f"{[s for s in EPISODE_STATUSES if s != 'running']}.", param="status")
        try:
            episode = registry.finish(episode_id, body.status, body.result, body.error)
        except KeyError:
            raise APIError(404, f"Unknown or closed episode {episode_id!r}.", code="episode_not_found") from None
        response = trace_response(episode)
        registry.forget(episode_id)  # only once the trace is in hand: a failure above leaves it retrievable
        return response

    def trace_response(episode) -> Response:
        return Response(json_text(episode.to_dict()).encode("utf-8"), media_type="application/json")

    # Request handling

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > settings.max_body_bytes:
            raise APIError(413, f"Request body of {declared} bytes is over the limit of {settings.max_body_bytes}.",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > settings.max_body_bytes:
                raise APIError(413, f"Request body is over the limit of {settings.max_body_bytes} bytes.",
                               code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    async def read_json(request: Request, required: bool = True) -> Any:
        raw = await read_body(request)
        if not raw.strip() and not required:
            return None
        try:
            return parse_json_body(raw)
        except ValueError as error:
            raise APIError(400, f"Request body is not valid JSON: {error}", code="invalid_json") from None

    def validate(model, body: Any):
        try:
            return model.model_validate(body)
        except ValidationError as error:
            first = error.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ()))
            raise APIError(400, f"Invalid request: {param or 'body'}: {first.get('msg')}", param=param or None,
                           code="invalid_request") from None

    async def serve_chat(session: EpisodeSession, raw: bytes, request: Request):
        try:
            body = parse_json_body(raw)
        except ValueError as error:
            raise APIError(400, f"Request body is not valid JSON: {error}", code="invalid_json") from None
        req = validate(ChatCompletionRequest, body)
        if req.model not in settings.served_model_names:
            raise APIError(404, f"The model {req.model!r} does not exist; this endpoint serves "
                                f"{settings.served_model_names}.", code="model_not_found", param="model")

        limits = session.limits
        if limits.max_turns is not None and len(session.episode.turns) + session.in_flight + req.n > limits.max_turns:
            session.flags.add("limit_exceeded")
            raise APIError(400, f"Episode limit reached: at most {limits.max_turns} model calls.",
                           code="episode_limit_exceeded")
        budget = None
        if limits.max_episode_tokens is not None:
            # Each of the n choices may use an equal share of what is left, counting what calls in flight may sample.
            left = limits.max_episode_tokens - session.episode.num_sampled_tokens - session.reserved_tokens
            budget = left // req.n
            if budget <= 0:
                session.flags.add("limit_exceeded")
                raise APIError(400, f"Episode limit reached: at most {limits.max_episode_tokens} sampled tokens.",
                               code="episode_limit_exceeded")

        raw_messages = [m.model_dump(exclude_none=True) for m in req.messages]
        messages = [template_message(m) for m in raw_messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            plan = session.plan_prompt(renderer, messages, tools)
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError) as error:
            # The template is code run on what the agent sent: any of these is the request's doing.
            raise APIError(400, f"The chat template rejected these messages: {type(error).__name__}: {error}",
                           code="template_error") from None
        # tool_choice "required" / a named function: start the assistant turn with the template's tool-call opening
        # (prompt tokens, not sampled) so the model can only complete a call.
        forced: list[int] = []
        if tools and (req.tool_choice == "required" or req.forced_tool_name) and renderer.can_parse_tools:
            forced = renderer.tool_call_prefix(tools, req.forced_tool_name)
        prompt_ids = plan.prompt_ids + forced
        context = engine.max_context_length
        if len(prompt_ids) >= context:
            session.flags.add("context_overflow")
            raise APIError(400, f"This model's maximum context length is {context} tokens; the messages take "
                                f"{len(prompt_ids)}.", code="context_length_exceeded", param="messages")

        overrides = settings.overrides
        asked = req.max_completion_tokens or req.max_tokens or settings.default_max_tokens
        caps = [asked, context - len(prompt_ids)]
        caps += [c for c in (overrides.max_tokens, budget) if c is not None]
        sampling = SamplingParams(
            max_tokens=min(caps),
            temperature=_first(overrides.temperature, req.temperature, 1.0),
            top_p=_first(overrides.top_p, req.top_p, 1.0),
            top_k=_first(overrides.top_k, 0),
            seed=req.seed,
            stop_token_ids=sorted(renderer.end_of_turn_ids),
            top_logprobs=req.top_logprobs or 0,
        )
        requested = {k: v for k, v in req.model_dump(exclude_none=True).items() if k not in ("messages", "tools")}

        reserved = sampling.max_tokens * req.n if budget is not None else 0
        try:
            session.start_call(req.n, reserved)
        except EpisodeClosedError:
            raise APIError(401, "Unknown or closed episode key.", "authentication_error", "invalid_api_key") from None
        started = time.monotonic()

        def turn_of(out: GenerationOutput | None, message: dict, finish: str, malformed: bool = False) -> Turn:
            return Turn(
                index=0, prompt_ids=prompt_ids, completion_ids=out.token_ids if out else [],
                logprobs=out.logprobs if out else [], finish_reason=finish, policy_version=engine.policy_version,
                request_messages=raw_messages, request_tools=tools, response_message=message,
                prompt_source=plan.source, parent_turn=plan.parent, drift=plan.drift, fork_reason=plan.fork_reason,
                malformed_tool_call=malformed, forced_tokens=len(forced), sampling=sampling.to_dict(),
                requested_sampling=requested, wall_time=time.monotonic() - started,
            )

        generation = asyncio.ensure_future(asyncio.gather(*[
            engine.generate(prompt_ids, _with_seed(sampling, req.seed, i)) for i in range(req.n)
        ]))
        disconnected = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({generation, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            generation.cancel()
            session.finish_call(req.n, reserved, [])
            raise
        finally:
            disconnected.cancel()
        if not generation.done():
            # The client went away: stop sampling, and record the call as cancelled (never trained, never a parent),
            # so that a retry of the same request continues from the last answer the agent actually received.
            generation.cancel()
            cancelled = [(turn_of(None, {}, "cancelled"), messages, tools, plan.context) for _ in range(req.n)]
            session.finish_call(req.n, reserved, cancelled)
            return JSONResponse(error_body("The client closed the connection before the answer was ready.",
                                           code="client_closed_request"), status_code=499)
        try:
            outputs = generation.result()
        except BaseException:
            session.finish_call(req.n, reserved, [])
            raise

        choices, finals, turns = [], [], []
        for i, out in enumerate(outputs):
            out, stopped_text = _apply_stop_strings(tokenizer, out, req.stop_sequences)
            finals.append(out)
            message, malformed = renderer.parse(
                forced + out.token_ids, plan.prompt_ids, tools, parse_tools=req.tool_choice != "none"
            )
            if stopped_text is not None:
                message = {"role": "assistant", "content": stopped_text}
            finish = "tool_calls" if message.get("tool_calls") else out.finish_reason
            turns.append((turn_of(out, message, finish, malformed), messages, tools, plan.context))
            choices.append({"index": i, "message": message, "finish_reason": finish,
                            "logprobs": _logprobs_body(tokenizer, out) if req.logprobs else None})
        if not session.finish_call(req.n, reserved, turns):
            raise APIError(409, "The episode was closed while this call was running; its answer is not recorded.",
                           code="episode_closed")

        completion_tokens = sum(len(o.token_ids) for o in finals)
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                 "total_tokens": len(prompt_ids) + completion_tokens}
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if not req.stream:
            return {"id": response_id, "object": "chat.completion", "created": created, "model": req.model,
                    "choices": choices, "usage": usage, "system_fingerprint": f"policy-v{engine.policy_version}"}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _sse(_stream_chunks(tokenizer, response_id, created, req.model, choices, finals, usage, include_usage)),
            media_type="text/event-stream",
        )

    return app


class _ServerErrors:
    """Answer an unexpected exception with a 500 in OpenAI's format, on a connection that stays usable.

    FastAPI's `exception_handler(Exception)` answers too, but Starlette re-raises afterwards and uvicorn then drops
    the keep-alive connection: with the rollout's shared HTTP pool, another episode's next call on that connection got
    a reset (issue #9). Here the exception ends with the answer. One that happens after the answer started (mid
    stream) is re-raised: uvicorn closes that connection, the only honest end of a half-sent response.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_tracking(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception as error:  # noqa: BLE001 - a bug or an engine failure, never the client's mistake
            if started:
                raise
            logger.exception("Internal error while serving %s %s", scope.get("method"),
                             redact_episode_ids(scope.get("path", "")))
            response = JSONResponse(error_body(f"Internal error: {type(error).__name__}: {error}", "server_error",
                                               code="internal_error"), status_code=500)
            await response(scope, receive, send)


async def _wait_for_disconnect(request: Request) -> None:
    # Once the body is read, the next ASGI message of a request is its client disconnecting.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _reap_idle_episodes(registry: EpisodeRegistry) -> None:
    period = min(max(registry.idle_timeout / 4, 0.05), 5.0)
    while True:
        await asyncio.sleep(period)
        registry.reap_idle()


def _first(*values):
    return next((v for v in values if v is not None), None)


def _with_seed(sampling: SamplingParams, seed: int | None, i: int) -> SamplingParams:
    if seed is None or i == 0:
        return sampling
    return SamplingParams(**{**sampling.to_dict(), "seed": seed + i})


def _apply_stop_strings(tokenizer, out: GenerationOutput, stops: list[str]) -> tuple[GenerationOutput, str | None]:
    """Cut the sampled ids after the token that completes the first stop string (those tokens were sampled and are
    kept); the returned content ends before the stop string, as OpenAI does."""
    if not stops:
        return out, None
    text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return out, None
    position, stop = min(hits)
    pieces = _text_pieces(tokenizer, out.token_ids)
    if "".join(piece for _, piece in pieces) != text:  # the decoder is not incremental: decode prefixes instead
        ends = [(k, len(tokenizer.decode(out.token_ids[:k], skip_special_tokens=True)))
                for k in range(1, len(out.token_ids) + 1)]
    else:
        ends, length = [], 0
        for k, piece in pieces:
            length += len(piece)
            ends.append((k, length))
    k = next((k for k, length in ends if length >= position + len(stop)), len(out.token_ids))
    top = out.top_logprobs[:k] if out.top_logprobs is not None else None
    return GenerationOutput(out.token_ids[:k], out.logprobs[:k], "stop", top), text[:position]


def _text_pieces(tokenizer, token_ids: list[int]) -> list[tuple[int, str]]:
    """The decoded text as `(end, piece)` pairs, `piece` completed by `token_ids[:end]`, in linear time.

    Incremental detokenization (as vLLM does it): each step decodes only the tokens since the previous piece, with
    one piece of left context (so tokenizers that drop a leading space still add up), and holds back text that ends
    in an incomplete UTF-8 character.
    """
    pieces, prefix_start, read_start = [], 0, 0
    for k in range(len(token_ids)):
        prefix = tokenizer.decode(token_ids[prefix_start:read_start], skip_special_tokens=True)
        text = tokenizer.decode(token_ids[prefix_start : k + 1], skip_special_tokens=True)
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            pieces.append((k + 1, text[len(prefix) :]))
            prefix_start, read_start = read_start, k + 1
    return pieces


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


def _content_pieces(tokenizer, token_ids: list[int], content: str) -> list[str]:
    """Split `content` into per-token pieces for streaming; one piece when they don't add up to it (e.g. content
    parsed out of a tool call)."""
    pieces = [piece for _, piece in _text_pieces(tokenizer, token_ids)]
    return pieces if "".join(pieces) == content else ([content] if content else [])


def _stream_chunks(tokenizer, response_id, created, model, choices, outputs, usage, include_usage):
    def chunk(choice_index, delta, finish=None, logprobs=None):
        return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": choice_index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}

    for choice, out in zip(choices, outputs):
        index, message = choice["index"], choice["message"]
        yield chunk(index, {"role": "assistant", "content": ""})
        content = message.get("content") or ""
        if content:
            pieces = _content_pieces(tokenizer, out.token_ids, content)
            for piece in pieces:
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
