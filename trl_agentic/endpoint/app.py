"""The OpenAI-, Anthropic- and Gemini-compatible endpoint that records every token: `create_app(...) -> FastAPI`.

Routes (each wire format is an adapter over one format-neutral model call, `service.py`; one router per format in
`routes.py`, who may call decided in one place, `admission.py`):
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

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..generation.engine import GenerationEngine
from ..store import EpisodeStore
from . import anthropic_messages, gemini
from .chat import ChatRenderer
from .protocol import error_body
from .routes import ROUTERS
from .service import APIError, CompletionService, EndpointSettings, SamplingOverrides
from .sessions import EpisodeRegistry, redact_episode_ids
from .users import UserEpisodes
from .versions import VersionManager


logger = logging.getLogger(__name__)


__all__ = ["APIError", "EndpointSettings", "SamplingOverrides", "create_app"]  # settings live in service.py


def create_app(
    engine: GenerationEngine,
    renderer: ChatRenderer,
    settings: EndpointSettings | None = None,
    registry: EpisodeRegistry | None = None,
    store: EpisodeStore | None = None,
    versions: VersionManager | None = None,
) -> FastAPI:
    """Build the endpoint app: the routers of `routes.py` over one `CompletionService`, errors in each route's shape.
    With a `store`, user keys work too (`users.py`): their episodes, feedback and the admin's users and rewards. With
    `versions`, several policy versions serve side by side, each episode on one (`versions.py`).

    Example:

    ```python
    >>> app = create_app(TransformersEngine(model, tokenizer.pad_token_id), ChatRenderer(tokenizer))
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)
    ```
    """
    settings = settings or EndpointSettings()
    registry = registry or EpisodeRegistry(settings.max_open_episodes, settings.episode_idle_timeout)
    app = FastAPI(title="trl-agentic endpoint", lifespan=_lifespan)
    app.add_middleware(_ServerErrors)
    app.state.engine, app.state.renderer, app.state.settings, app.state.registry = engine, renderer, settings, registry
    app.state.service = CompletionService(engine, renderer, settings)
    app.state.store, app.state.versions, registry.versions = store, versions, versions
    users = None
    if store is not None:
        users = UserEpisodes(
            store, registry, settings.user_episode_idle_timeout, settings.feedback_per_minute, settings.default_limits
        )
        users.versions = versions
    app.state.users = users
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(404, _not_found)
    app.add_exception_handler(405, _bad_method)
    # The routers' routes go on the app's own table: FastAPI >= 0.16x's `include_router` nests each router as one
    # route, matched and then matched again inside, which cost 15-50 us of every call here (issue 29's budget).
    for route in (route for router in ROUTERS for route in router.routes):
        app.add_api_route(route.path, route.endpoint, methods=route.methods, name=route.name)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    registry, users, versions = app.state.registry, app.state.users, app.state.versions
    periods = [t / 4 for t in (registry.idle_timeout, users and users.idle_timeout) if t]
    reaper = asyncio.create_task(_reap_idle_episodes(registry, users, periods)) if periods else None
    sweeper = asyncio.create_task(_sweep_versions(versions)) if versions is not None else None
    yield
    for task in (reaper, sweeper):
        if task is not None:
            task.cancel()
    if users is not None:
        users.close_all()


async def _api_error(request: Request, error: APIError):
    return _error_response(request.url.path, error)


async def _not_found(request: Request, _):
    return _error_response(request.url.path, APIError(404, f"Unknown route {request.url.path}", code="not_found"))


async def _bad_method(request: Request, _):
    return _error_response(
        request.url.path, APIError(405, f"Method {request.method} not allowed on {request.url.path}")
    )


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


async def _sweep_versions(versions: VersionManager) -> None:
    while True:
        await asyncio.sleep(0.1)
        await versions.sweep()


async def _reap_idle_episodes(registry: EpisodeRegistry, users: UserEpisodes | None, periods: list[float]) -> None:
    period = min(max(min(periods), 0.05), 5.0)
    while True:
        await asyncio.sleep(period)
        if users is not None:
            await asyncio.to_thread(users.reap)  # stores what it ends: a disk write, off the event loop
        registry.reap_idle()
