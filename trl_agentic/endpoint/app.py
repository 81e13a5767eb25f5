"""The OpenAI-, Anthropic- and Gemini-compatible endpoint that records every token: `create_app(...) -> FastAPI`.

Routes (each wire format is an adapter over one format-neutral model call, `service.py`):
- `POST /v1/chat/completions` (`chat_completions.py`), `POST /v1/responses` (`responses.py`), `POST /v1/messages` and
  `POST /v1/messages/count_tokens` (`anthropic_messages.py`), `GET /v1/models`: the episode by its key
  (`Authorization: Bearer <episode key>`, or `x-api-key: <episode key>` as the `anthropic` SDK sends it), and the same
  under `/episodes/{episode_id}/v1/...` (episode by path).
- `POST /v1beta/models/{model}:generateContent`, `:streamGenerateContent` (`?alt=sse`) and `:countTokens`, the same
  under `/v1/models/...` (`gemini.py`): the key as `x-goog-api-key` (what the `google-genai` SDKs and Gemini CLI
  send) or `?key=`, and the same under `/episodes/{episode_id}/...` (episode by path).
- `GET /v1/models[/{model}]` and `GET /v1beta/models[/{model}]`: the served model names, in Google's shape on
  `/v1beta` and to Google's clients (`x-goog-api-key` or `x-goog-api-client`), else in OpenAI's.
- `GET /health`; `GET /` and `HEAD /` answer 200 (harnesses probe the base URL before their first call).
- `POST /admin/episodes`, `GET /admin/episodes/{id}`, `POST /admin/episodes/{id}/close`, guarded by the admin token
  (the agent only ever holds its episode key or id).

The path route is a capability URL: the episode id (128 random bits) is the secret, kept out of access logs
(`server.RedactEpisodeIds`). A request on it that carries an episode key must carry that episode's key (401
otherwise); placeholder keys (`EMPTY`, `sk-...`) that agents send when they must send something are ignored.

Errors come in the shape of the route's format: OpenAI's `{"error": {...}}`, Anthropic's
`{"type": "error", "error": {...}}` on the `/v1/messages` routes, or Google's `{"error": {"code", "message", "status"}}`
on the Gemini routes.

Nothing an agent sends can cost another episode (issue #9): bodies are strict JSON with bounded nesting and sampling
fields in range (4xx otherwise), a batch survives one failing member (`generation/batching.py`), and a genuine server
error is answered 500 on a connection that stays usable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..generation.engine import GenerationEngine
from ..trace import EPISODE_STATUSES, json_text
from . import anthropic_messages, gemini
from .chat import ChatRenderer
from .chat_completions import serve_chat_completions
from .protocol import CloseEpisodeRequest, OpenEpisodeRequest, error_body
from .responses import serve_responses
from .service import APIError, CompletionService, EndpointSettings, SamplingOverrides
from .sessions import EpisodeLimits, EpisodeRegistry, EpisodeSession, TooManyOpenEpisodesError, redact_episode_ids


logger = logging.getLogger(__name__)


__all__ = ["APIError", "EndpointSettings", "SamplingOverrides", "create_app"]  # settings live in service.py


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
    service = app.state.service = CompletionService(engine, renderer, settings)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        return _error_response(request.url.path, error)

    @app.exception_handler(404)
    async def _not_found(request: Request, _):
        return _error_response(request.url.path, APIError(404, f"Unknown route {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def _bad_method(request: Request, _):
        return _error_response(
            request.url.path, APIError(405, f"Method {request.method} not allowed on {request.url.path}")
        )

    # Episodes

    def episode_from_key(request: Request) -> EpisodeSession:
        key = _episode_key(request)
        if not key:
            raise APIError(
                401,
                "Missing API key: send the episode key as 'Authorization: Bearer <key>' (or "
                "'x-api-key: <key>', or 'x-goog-api-key: <key>').",
                "authentication_error",
                "missing_api_key",
            )
        session = registry.by_key(key)
        if session is None:
            raise APIError(401, "Unknown or closed episode key.", "authentication_error", "invalid_api_key")
        return session

    def episode_from_path(episode_id: str, request: Request) -> EpisodeSession:
        session = registry.by_id(episode_id)
        if session is None or session.closed:
            raise APIError(
                404, "Unknown or closed episode (the id in the path).", "invalid_request_error", "episode_not_found"
            )
        key = _episode_key(request)
        if key.startswith("sk-ep-") and not secrets.compare_digest(key.encode(), session.key.encode()):
            raise APIError(
                401,
                "This episode key belongs to another episode than the one in the path.",
                "authentication_error",
                "invalid_api_key",
            )
        return session

    def check_admin(request: Request) -> None:
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if not token or not secrets.compare_digest(token.encode(), settings.admin_token.encode()):
            raise APIError(401, "Admin routes need the admin token.", "authentication_error", "invalid_admin_token")

    # Routes

    @app.get("/health")
    async def health():
        return {"status": "ok", "open_episodes": len(registry)}

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root():
        # Claude Code sends `HEAD /` before its first call; a 404 there reads as an endpoint that is down.
        return {"status": "ok"}

    def models_body(request: Request, model: str | None):
        # `/v1/models` is OpenAI's list and the Gemini API's (its SDKs default to v1): a Google client gets Google's.
        if "/v1beta/" in request.url.path or _is_google_client(request):
            if model is None:
                return gemini.models_body(settings.served_model_names, engine.max_context_length)
            service.check_model(model)
            return gemini.model_body(model, engine.max_context_length)
        now = int(time.time())
        if model is not None:
            service.check_model(model)
            return {"id": model, "object": "model", "created": now, "owned_by": "trl-agentic"}
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": now, "owned_by": "trl-agentic"}
                for name in settings.served_model_names
            ],
        }

    @app.get("/v1/models")
    @app.get("/v1/models/{model}")
    @app.get("/v1beta/models")
    @app.get("/v1beta/models/{model}")
    async def models(request: Request, model: str | None = None):
        episode_from_key(request)
        return models_body(request, model)

    @app.get("/episodes/{episode_id}/v1/models")
    @app.get("/episodes/{episode_id}/v1/models/{model}")
    @app.get("/episodes/{episode_id}/v1beta/models")
    @app.get("/episodes/{episode_id}/v1beta/models/{model}")
    async def models_by_path(episode_id: str, request: Request, model: str | None = None):
        episode_from_path(episode_id, request)
        return models_body(request, model)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        session = episode_from_key(request)
        return _answer(await serve_chat_completions(service, session, await service.read_body(request), request))

    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def chat_completions_by_path(episode_id: str, request: Request):
        session = episode_from_path(episode_id, request)
        return _answer(await serve_chat_completions(service, session, await service.read_body(request), request))

    @app.post("/v1/responses")
    async def responses(request: Request):
        session = episode_from_key(request)
        return _answer(await serve_responses(service, session, await service.read_body(request), request))

    @app.post("/episodes/{episode_id}/v1/responses")
    async def responses_by_path(episode_id: str, request: Request):
        session = episode_from_path(episode_id, request)
        return _answer(await serve_responses(service, session, await service.read_body(request), request))

    @app.post("/v1/messages")
    async def messages(request: Request):
        session = episode_from_key(request)
        body = await service.read_body(request)
        return _answer(await anthropic_messages.serve_messages(service, session, body, request))

    @app.post("/episodes/{episode_id}/v1/messages")
    async def messages_by_path(episode_id: str, request: Request):
        session = episode_from_path(episode_id, request)
        body = await service.read_body(request)
        return _answer(await anthropic_messages.serve_messages(service, session, body, request))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        episode_from_key(request)
        return await anthropic_messages.count_tokens(service, await service.read_body(request))

    @app.post("/episodes/{episode_id}/v1/messages/count_tokens")
    async def count_tokens_by_path(episode_id: str, request: Request):
        episode_from_path(episode_id, request)
        return await anthropic_messages.count_tokens(service, await service.read_body(request))

    @app.post("/v1beta/models/{target}")
    @app.post("/v1/models/{target}")
    async def gemini_call(target: str, request: Request):
        session = episode_from_key(request)
        return _answer(await gemini.serve(service, session, target, await service.read_body(request), request))

    @app.post("/episodes/{episode_id}/v1beta/models/{target}")
    @app.post("/episodes/{episode_id}/v1/models/{target}")
    async def gemini_call_by_path(episode_id: str, target: str, request: Request):
        session = episode_from_path(episode_id, request)
        return _answer(await gemini.serve(service, session, target, await service.read_body(request), request))

    @app.post("/admin/episodes")
    async def open_episode(request: Request):
        check_admin(request)
        body = service.validate(OpenEpisodeRequest, await read_json(request, required=False) or {})
        defaults = settings.default_limits
        limits = EpisodeLimits(
            max_turns=_first(body.max_turns, defaults.max_turns, None),
            max_episode_tokens=_first(body.max_episode_tokens, defaults.max_episode_tokens, None),
        )
        try:
            session = registry.open(body.task_index, body.group_index, body.metadata, limits, body.seed)
        except TooManyOpenEpisodesError as error:
            raise APIError(429, str(error), "rate_limit_error", "too_many_open_episodes") from None
        base = str(request.base_url).rstrip("/")
        return {
            "id": session.episode.id,
            "key": session.key,
            "base_url": f"{base}/v1",
            "path_base_url": f"{base}/episodes/{session.episode.id}/v1",
        }

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
        body = service.validate(CloseEpisodeRequest, await read_json(request, required=False) or {})
        if body.status is not None and (body.status not in EPISODE_STATUSES or body.status == "running"):
            raise APIError(
                400,
                f"Unknown episode status {body.status!r}; use one of "
                f"{[s for s in EPISODE_STATUSES if s != 'running']}.",
                param="status",
            )
        try:
            episode = registry.finish(episode_id, body.status, body.result, body.error)
        except KeyError:
            raise APIError(404, f"Unknown or closed episode {episode_id!r}.", code="episode_not_found") from None
        response = trace_response(episode)
        registry.forget(episode_id)  # only once the trace is in hand: a failure above leaves it retrievable
        return response

    def trace_response(episode) -> Response:
        return Response(json_text(episode.to_dict()).encode("utf-8"), media_type="application/json")

    async def read_json(request: Request, required: bool = True) -> Any:
        return service.parse_json(await service.read_body(request), required)

    return app


def _answer(body: dict | Response) -> Response:
    """A model call's answer: a body as JSON (Starlette's encoding, as FastAPI's), or the adapter's own response.

    The adapters build plain JSON values, so FastAPI's `jsonable_encoder` walk of the body is skipped: it cost ~60 us
    of every call (issue 29).
    """
    return JSONResponse(body) if isinstance(body, dict) else body


def _episode_key(request: Request) -> str:
    """The key a request carries: `Authorization: Bearer <key>` (OpenAI clients), `x-api-key` (Anthropic's),
    `x-goog-api-key` (Google's), or the `key` query parameter (Google's REST examples)."""
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer ") and header[7:].strip():
        return header[7:].strip()
    for name in ("x-api-key", "x-goog-api-key"):
        if request.headers.get(name, "").strip():
            return request.headers[name].strip()
    return request.query_params.get("key", "").strip()


def _is_google_client(request: Request) -> bool:
    """Whether the request comes from a Google client (the `google-genai` SDKs send both headers)."""
    return "x-goog-api-key" in request.headers or "x-goog-api-client" in request.headers


def _is_anthropic_route(path: str) -> bool:
    return path.endswith(("/v1/messages", "/v1/messages/count_tokens"))


def _error_response(path: str, error: APIError) -> JSONResponse:
    """`error` in the shape of the route's wire format."""
    if _is_anthropic_route(path):
        body = anthropic_messages.error_body(error.status, error.message)
    elif gemini.is_gemini_route(path):
        body = gemini.error_body(error.status, error.message, error.param)
    else:
        body = error_body(error.message, error.type, error.param, error.code)
    return JSONResponse(body, status_code=error.status)


class _ServerErrors:
    """Answer an unexpected exception with a 500 in the route's format, on a connection that stays usable.

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
            logger.exception(
                "Internal error while serving %s %s", scope.get("method"), redact_episode_ids(scope.get("path", ""))
            )
            response = _error_response(
                scope.get("path", ""),
                APIError(
                    500, f"Internal error: {type(error).__name__}: {error}", "server_error", code="internal_error"
                ),
            )
            await response(scope, receive, send)


async def _reap_idle_episodes(registry: EpisodeRegistry) -> None:
    period = min(max(registry.idle_timeout / 4, 0.05), 5.0)
    while True:
        await asyncio.sleep(period)
        registry.reap_idle()


def _first(*values):
    return next((v for v in values if v is not None), None)
