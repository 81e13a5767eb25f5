"""Who may call: the episode a request belongs to, and the admin token. Shared by every router (`routes.py`).

A model call names its episode by its key (`Authorization: Bearer <episode key>`, `x-api-key`, `x-goog-api-key` or
`?key=`) or by the id in its path (`/episodes/{episode_id}/...`, a capability URL: the 128-bit id is the secret). A
request on the path route that carries an episode key must carry that episode's key (401 otherwise); placeholder keys
(`EMPTY`, `sk-...`) that agents send when they must send something are ignored.

The app's state holds what these read (`request.app.state.registry`, `.settings`), so the routers hold no closures.
"""

from __future__ import annotations

import secrets

from fastapi import Request

from .service import APIError
from .sessions import EpisodeSession
from .users import TASK_HEADER


def admit(request: Request) -> EpisodeSession:
    """The episode a model call belongs to: the one in its path (`/episodes/{episode_id}/...`), else its key's.

    Raises `APIError` 401 (no key, unknown key, another episode's key on the path route) or 404 (unknown or closed
    episode in the path).
    """
    episode_id = request.path_params.get("episode_id")
    return episode_from_key(request) if episode_id is None else episode_from_path(episode_id, request)


def episode_from_key(request: Request) -> EpisodeSession:
    key = episode_key(request)
    if not key:
        raise APIError(
            401,
            "Missing API key: send the episode key as 'Authorization: Bearer <key>' (or "
            "'x-api-key: <key>', or 'x-goog-api-key: <key>').",
            "authentication_error",
            "missing_api_key",
        )
    session = request.app.state.registry.by_key(key)
    if session is None:
        users = request.app.state.users
        if users is not None and users.is_user_key(key):
            session = users.session_for(user_from_key(request, key))
            task = request.headers.get(TASK_HEADER)
            if task is not None:  # the client names its episode's task (`users.py`)
                try:
                    users.name_task(session, task)
                except ValueError as error:
                    raise APIError(400, f"Header {TASK_HEADER}: {error}", code="invalid_task") from None
            return session
        raise APIError(401, "Unknown or closed episode key.", "authentication_error", "invalid_api_key")
    return session


def admit_user(request: Request) -> str:
    """The user of a request's user key (`users.py`), for the user routes; `APIError` 400 when the endpoint serves
    no user keys (no store), 401 for a missing, unknown or revoked key."""
    if request.app.state.users is None:
        raise APIError(400, NO_STORE, code="user_keys_disabled")
    return user_from_key(request, episode_key(request))


def user_from_key(request: Request, key: str) -> str:
    users = request.app.state.users
    user = users.user(key) if users is not None and users.is_user_key(key) else None
    if user is None:
        raise APIError(401, "Unknown or revoked user key.", "authentication_error", "invalid_api_key")
    return user


NO_STORE = (
    "This endpoint serves no user keys: start it with a store (`trl-agentic serve --store PATH`, or "
    "`create_app(..., store=SQLiteEpisodeStore(path))`)."
)


def episode_from_path(episode_id: str, request: Request) -> EpisodeSession:
    session = request.app.state.registry.by_id(episode_id)
    if session is None or session.closed:
        raise APIError(
            404, "Unknown or closed episode (the id in the path).", "invalid_request_error", "episode_not_found"
        )
    key = episode_key(request)
    users = request.app.state.users
    if users is not None and users.is_user_key(key) and user_from_key(request, key) != session.user:
        raise APIError(
            404, "Unknown or closed episode (the id in the path).", "invalid_request_error", "episode_not_found"
        )
    if key.startswith("sk-ep-") and not secrets.compare_digest(key.encode(), session.key.encode()):
        raise APIError(
            401,
            "This episode key belongs to another episode than the one in the path.",
            "authentication_error",
            "invalid_api_key",
        )
    return session


def check_admin(request: Request) -> None:
    """Raise `APIError` 401 unless the request carries the admin token (`Authorization: Bearer <admin token>`)."""
    header = request.headers.get("authorization", "")
    token = header[7:].strip() if header.lower().startswith("bearer ") else ""
    if not token or not secrets.compare_digest(token.encode(), request.app.state.settings.admin_token.encode()):
        raise APIError(401, "Admin routes need the admin token.", "authentication_error", "invalid_admin_token")


def episode_key(request: Request) -> str:
    """The key a request carries: `Authorization: Bearer <key>` (OpenAI clients), `x-api-key` (Anthropic's),
    `x-goog-api-key` (Google's), or the `key` query parameter (Google's REST examples)."""
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer ") and header[7:].strip():
        return header[7:].strip()
    for name in ("x-api-key", "x-goog-api-key"):
        if request.headers.get(name, "").strip():
            return request.headers[name].strip()
    return request.query_params.get("key", "").strip()
