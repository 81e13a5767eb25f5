"""The endpoint's routes: one `APIRouter` per wire format, plus the models list, health and admin (`ROUTERS`).

As vLLM's OpenAI server keeps `api_server.py` thin over one serving class per API, each router here maps HTTP onto
its format's adapter (`chat_completions.py`, `responses.py`, `anthropic_messages.py`, `gemini.py`) and holds no
request logic of its own. Who may call is decided in one place (`admission.py`): every model route is served twice,
at `/v1/...` (the episode by its key) and at `/episodes/{episode_id}/v1/...` (the episode by its path), by one
handler that asks `admit(request)` for its episode. What the handlers share (the `CompletionService`, the registry,
the settings) lives on `request.app.state`, set by `create_app`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..trace import EPISODE_STATUSES, ReplaySpec, json_text
from . import anthropic_messages, gemini
from .admission import NO_STORE, admit, admit_user, check_admin
from .chat_completions import serve_chat_completions
from .protocol import (
    AddUserRequest,
    AdminRewardRequest,
    CloseEpisodeRequest,
    EndEpisodeRequest,
    FeedbackRequest,
    OpenEpisodeRequest,
)
from .responses import serve_responses
from .service import APIError
from .sessions import EpisodeLimits, TooManyOpenEpisodesError
from .users import EPISODE_HEADER
from .versions import VERSION_HEADER


# Health: `GET /health`; `GET /` and `HEAD /` answer 200 (harnesses probe the base URL before their first call).

health_router = APIRouter()


@health_router.get("/health")
async def health(request: Request):
    return {"status": "ok", "open_episodes": len(request.app.state.registry)}


@health_router.api_route("/", methods=["GET", "HEAD"])
async def root():
    # Claude Code sends `HEAD /` before its first call; a 404 there reads as an endpoint that is down.
    return {"status": "ok"}


# Models: `GET /v1/models[/{model}]` and `GET /v1beta/models[/{model}]`, the served model names in Google's shape on
# `/v1beta` and to Google's clients, else in OpenAI's. (Decorators register bottom-up: this order is the app's.)

models_router = APIRouter()


@models_router.get("/episodes/{episode_id}/v1/models")
@models_router.get("/episodes/{episode_id}/v1/models/{model}")
@models_router.get("/episodes/{episode_id}/v1beta/models")
@models_router.get("/episodes/{episode_id}/v1beta/models/{model}")
@models_router.get("/v1/models")
@models_router.get("/v1/models/{model}")
@models_router.get("/v1beta/models")
@models_router.get("/v1beta/models/{model}")
async def models(request: Request, model: str | None = None):
    admit(request)
    return models_body(request, model)


def models_body(request: Request, model: str | None):
    service, settings = request.app.state.service, request.app.state.settings
    max_context_length = request.app.state.engine.max_context_length
    # `/v1/models` is OpenAI's list and the Gemini API's (its SDKs default to v1): a Google client gets Google's.
    if "/v1beta/" in request.url.path or _is_google_client(request):
        if model is None:
            return gemini.models_body(settings.served_model_names, max_context_length)
        service.check_model(model)
        return gemini.model_body(model, max_context_length)
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


# Chat Completions: `POST /v1/chat/completions` (`chat_completions.py`).

chat_completions_router = APIRouter()


@chat_completions_router.post("/episodes/{episode_id}/v1/chat/completions")
@chat_completions_router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    session, service = admit(request), request.app.state.service
    body = await service.read_body(request)
    return _answer(await serve_chat_completions(service, session, body, request), session)


# Responses: `POST /v1/responses` (`responses.py`).

responses_router = APIRouter()


@responses_router.post("/episodes/{episode_id}/v1/responses")
@responses_router.post("/v1/responses")
async def responses(request: Request):
    session, service = admit(request), request.app.state.service
    return _answer(await serve_responses(service, session, await service.read_body(request), request), session)


# Anthropic Messages: `POST /v1/messages` and `POST /v1/messages/count_tokens` (`anthropic_messages.py`).

anthropic_messages_router = APIRouter()


@anthropic_messages_router.post("/episodes/{episode_id}/v1/messages")
@anthropic_messages_router.post("/v1/messages")
async def messages(request: Request):
    session, service = admit(request), request.app.state.service
    body = await service.read_body(request)
    return _answer(await anthropic_messages.serve_messages(service, session, body, request), session)


@anthropic_messages_router.post("/episodes/{episode_id}/v1/messages/count_tokens")
@anthropic_messages_router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    admit(request)
    service = request.app.state.service
    return await anthropic_messages.count_tokens(service, await service.read_body(request))


# Gemini: `POST /v1beta/models/{model}:generateContent`, `:streamGenerateContent` and `:countTokens`, the same under
# `/v1/models/...` (`gemini.py`).

gemini_router = APIRouter()


@gemini_router.post("/episodes/{episode_id}/v1beta/models/{target}")
@gemini_router.post("/episodes/{episode_id}/v1/models/{target}")
@gemini_router.post("/v1beta/models/{target}")
@gemini_router.post("/v1/models/{target}")
async def gemini_call(target: str, request: Request):
    session, service = admit(request), request.app.state.service
    body = await service.read_body(request)
    return _answer(await gemini.serve(service, session, target, body, request), session)


# Admin: `POST /admin/episodes`, `GET /admin/episodes/{id}`, `POST /admin/episodes/{id}/close`, guarded by the admin
# token (the agent only ever holds its episode key or id).

admin_router = APIRouter()


@admin_router.post("/admin/episodes")
async def open_episode(request: Request):
    check_admin(request)
    service, settings, registry = request.app.state.service, request.app.state.settings, request.app.state.registry
    body = service.validate(OpenEpisodeRequest, await _read_json(request, required=False) or {})
    defaults = settings.default_limits
    limits = EpisodeLimits(
        max_turns=_first(body.max_turns, defaults.max_turns, None),
        max_episode_tokens=_first(body.max_episode_tokens, defaults.max_episode_tokens, None),
    )
    replay = None
    if body.replay is not None:
        try:
            replay = ReplaySpec.from_dict(body.replay)
        except (TypeError, ValueError, KeyError) as error:
            raise APIError(400, f"Invalid request: replay: {error}", param="replay", code="invalid_request") from None
    try:
        session = registry.open(body.task_index, body.group_index, body.metadata, limits, body.seed, replay)
    except TooManyOpenEpisodesError as error:
        raise APIError(429, str(error), "rate_limit_error", "too_many_open_episodes") from None
    base = str(request.base_url).rstrip("/")
    return {
        "id": session.episode.id,
        "key": session.key,
        "base_url": f"{base}/v1",
        "path_base_url": f"{base}/episodes/{session.episode.id}/v1",
    }


@admin_router.get("/admin/episodes/{episode_id}")
async def get_episode(episode_id: str, request: Request):
    check_admin(request)
    registry = request.app.state.registry
    session = registry.by_id(episode_id)
    episode = session.episode if session is not None else registry.reaped(episode_id)
    store = request.app.state.store
    if episode is None and store is not None and store.owner(episode_id)[0]:
        episode = store.get_episode(episode_id)[0]
    if episode is None:
        raise APIError(404, f"Unknown or closed episode {episode_id!r}.", code="episode_not_found")
    return _trace_response(episode)


@admin_router.post("/admin/episodes/{episode_id}/close")
async def close_episode(episode_id: str, request: Request):
    check_admin(request)
    service, registry = request.app.state.service, request.app.state.registry
    body = service.validate(CloseEpisodeRequest, await _read_json(request, required=False) or {})
    if body.status is not None and (body.status not in EPISODE_STATUSES or body.status == "running"):
        raise APIError(
            400,
            f"Unknown episode status {body.status!r}; use one of {[s for s in EPISODE_STATUSES if s != 'running']}.",
            param="status",
        )
    try:
        episode = registry.finish(episode_id, body.status, body.result, body.error)
    except KeyError:
        raise APIError(404, f"Unknown or closed episode {episode_id!r}.", code="episode_not_found") from None
    response = _trace_response(episode)
    registry.forget(episode_id)  # only once the trace is in hand: a failure above leaves it retrievable
    return response


# Users (with a store, `users.py`): `POST /admin/users` issues a key (shown once), `GET /admin/users` lists them (never
# a key), `DELETE /admin/users/{name}` revokes one at once; `POST /admin/rewards` rewards any episode stored or open.


@admin_router.post("/admin/users")
async def add_user(request: Request):
    check_admin(request)
    store = _store(request)
    body = request.app.state.service.validate(AddUserRequest, await _read_json(request))
    try:
        key = store.add_user(body.name)
    except ValueError as error:
        raise APIError(409, str(error), code="user_exists") from None
    base = str(request.base_url).rstrip("/")
    return {"name": body.name, "key": key, "base_url": f"{base}/v1"}


@admin_router.get("/admin/users")
async def list_users(request: Request):
    check_admin(request)
    return {"users": _store(request).users()}


@admin_router.delete("/admin/users/{name}")
async def revoke_user(name: str, request: Request):
    check_admin(request)
    if not _store(request).revoke_user(name):
        raise APIError(404, f"No active user {name!r}.", code="user_not_found")
    return {"name": name, "revoked": True}


@admin_router.get("/admin/versions")
async def list_versions(request: Request):
    check_admin(request)
    versions = request.app.state.versions
    if versions is None:
        raise APIError(400, "This endpoint serves one version (no rollout).", code="versions_disabled")
    decisions = [{"action": d.action, "version": d.version, "reason": d.reason} for d in versions.decisions]
    policy = versions.policy
    rule = {"candidate_share": policy.candidate_share, "min_episodes": policy.min_episodes, "margin": policy.margin}
    return {"versions": versions.describe(), "decisions": decisions, "policy": rule}


@admin_router.post("/admin/rewards")
async def admin_reward(request: Request):
    check_admin(request)
    _store(request)
    body = request.app.state.service.validate(AdminRewardRequest, await _read_json(request))
    return await _reward(request, body.episode_id, body.value, body.source, "admin", body.note)


# A user key's own routes: `POST /v1/feedback` (a reward for one of its episodes, rate-limited) and
# `POST /v1/episodes/end` (its open episode ends now and is stored, with the task its client names, if any).

users_router = APIRouter()


@users_router.post("/v1/feedback")
async def feedback(request: Request):
    user, users = admit_user(request), request.app.state.users
    body = request.app.state.service.validate(FeedbackRequest, await _read_json(request))
    episode_id = body.episode_id or _latest_episode(users, user)
    if episode_id is None or not users.owns(user, episode_id):
        raise APIError(404, "Unknown episode (a user gives feedback on its own episodes).", code="episode_not_found")
    if not users.allow_feedback(user):
        raise APIError(
            429, f"At most {users.feedback_per_minute} feedback calls a minute.", "rate_limit_error", "rate_limited"
        )
    return await _reward(request, episode_id, body.value, "feedback", user, body.note)


@users_router.post("/v1/episodes/end")
async def end_episode(request: Request):
    user, users = admit_user(request), request.app.state.users
    body = request.app.state.service.validate(EndEpisodeRequest, await _read_json(request, required=False) or {})
    return {"episode_id": await asyncio.to_thread(users.end, user, None, body.task)}


# In the order the app registers them (the order a request's path is matched in).
ROUTERS = (
    health_router,
    models_router,
    chat_completions_router,
    responses_router,
    anthropic_messages_router,
    gemini_router,
    admin_router,
    users_router,
)


def _answer(body: dict | Response, session=None) -> Response:
    """A model call's answer: a body as JSON (Starlette's encoding, as FastAPI's), or the adapter's own response; to
    a user key, with its episode's id (`users.EPISODE_HEADER`), which its feedback names.

    The adapters build plain JSON values, so FastAPI's `jsonable_encoder` walk of the body is skipped: it cost ~60 us
    of every call (issue 29).
    """
    response = JSONResponse(body) if isinstance(body, dict) else body
    if session is not None and session.user is not None:
        response.headers[EPISODE_HEADER] = session.episode.id
    if session is not None and session.version is not None:
        response.headers[VERSION_HEADER] = str(session.version)
    return response


def _is_google_client(request: Request) -> bool:
    """Whether the request comes from a Google client (the `google-genai` SDKs send both headers)."""
    return "x-goog-api-key" in request.headers or "x-goog-api-client" in request.headers


def _trace_response(episode) -> Response:
    return Response(json_text(episode.to_dict()).encode("utf-8"), media_type="application/json")


async def _read_json(request: Request, required: bool = True) -> Any:
    service = request.app.state.service
    return service.parse_json(await service.read_body(request), required)


def _store(request: Request):
    store = request.app.state.store
    if store is None:
        raise APIError(400, NO_STORE, code="user_keys_disabled")
    return store


def _latest_episode(users, user: str) -> str | None:
    current = users.current(user)
    if current is not None:
        return current.episode.id
    stored = users.store.episodes_of(user)
    return stored[-1] if stored else None


async def _reward(request: Request, episode_id: str, value: float, source: str, giver: str, note: str | None):
    """Store a reward (off the event loop: a durable disk write) and answer its id."""
    users = request.app.state.users
    try:
        reward_id = await asyncio.to_thread(users.reward, episode_id, value, source, giver, note)
    except KeyError:
        raise APIError(404, f"Unknown episode {episode_id!r}.", code="episode_not_found") from None
    return {"id": reward_id, "episode_id": episode_id, "source": source}


def _first(*values):
    return next((v for v in values if v is not None), None)
