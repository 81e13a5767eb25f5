"""The app's routes, one router per wire format (`endpoint/routes.py`): the same paths and methods, in the same order,
as the one-function `create_app` they came from (issue 41), and shared admission (`endpoint/admission.py`)."""

import fastapi.routing
import httpx
import pytest

from conftest import ScriptedEngine
from trl_agentic.endpoint.app import create_app
from trl_agentic.endpoint.chat import ChatRenderer
from trl_agentic.endpoint.routes import ROUTERS
from trl_agentic.tiny_models import build_tiny_tokenizer


# Taken from `create_app` before its routes became routers (app.routes of revision b946e1a), in the order the app
# matches a path against them: where two routes share a path, the first one with the request's method serves it.
ROUTES_BEFORE_ROUTERS = [
    ("/openapi.json", ["GET", "HEAD"]),
    ("/docs", ["GET", "HEAD"]),
    ("/docs/oauth2-redirect", ["GET", "HEAD"]),
    ("/redoc", ["GET", "HEAD"]),
    ("/health", ["GET"]),
    ("/", ["GET", "HEAD"]),
    ("/v1beta/models/{model}", ["GET"]),
    ("/v1beta/models", ["GET"]),
    ("/v1/models/{model}", ["GET"]),
    ("/v1/models", ["GET"]),
    ("/episodes/{episode_id}/v1beta/models/{model}", ["GET"]),
    ("/episodes/{episode_id}/v1beta/models", ["GET"]),
    ("/episodes/{episode_id}/v1/models/{model}", ["GET"]),
    ("/episodes/{episode_id}/v1/models", ["GET"]),
    ("/v1/chat/completions", ["POST"]),
    ("/episodes/{episode_id}/v1/chat/completions", ["POST"]),
    ("/v1/responses", ["POST"]),
    ("/episodes/{episode_id}/v1/responses", ["POST"]),
    ("/v1/messages", ["POST"]),
    ("/episodes/{episode_id}/v1/messages", ["POST"]),
    ("/v1/messages/count_tokens", ["POST"]),
    ("/episodes/{episode_id}/v1/messages/count_tokens", ["POST"]),
    ("/v1/models/{target}", ["POST"]),
    ("/v1beta/models/{target}", ["POST"]),
    ("/episodes/{episode_id}/v1/models/{target}", ["POST"]),
    ("/episodes/{episode_id}/v1beta/models/{target}", ["POST"]),
    ("/admin/episodes", ["POST"]),
    ("/admin/episodes/{episode_id}", ["GET"]),
    ("/admin/episodes/{episode_id}/close", ["POST"]),
]
# Added after the routers, for user keys (issue 43, `endpoint/users.py`), after every route above.
ROUTES_ADDED_FOR_USER_KEYS = [
    ("/admin/users", ["POST"]),
    ("/admin/users", ["GET"]),
    ("/admin/users/{name}", ["DELETE"]),
    ("/admin/versions", ["GET"]),
    ("/admin/rewards", ["POST"]),
    ("/v1/feedback", ["POST"]),
    ("/v1/episodes/end", ["POST"]),
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


def flat_routes(app):
    """`app`'s routes as the app matches them, also where FastAPI (>= 0.16x) holds an included router as one route."""
    if hasattr(fastapi.routing, "iter_route_contexts"):
        return list(fastapi.routing.iter_route_contexts(app.routes))
    return list(app.routes)


def test_create_app_serves_the_routes_it_served_before_the_routers(tokenizer):
    app = create_app(ScriptedEngine(tokenizer, lambda prompt: "Fine."), ChatRenderer(tokenizer))
    assert all(getattr(route, "path", None) for route in app.routes)  # flat: create_app says why
    routes = [(route.path, sorted(route.methods or [])) for route in flat_routes(app)]
    assert routes == ROUTES_BEFORE_ROUTERS + ROUTES_ADDED_FOR_USER_KEYS
    assert {(path, method) for path, methods in routes for method in methods} == {
        (path, method) for path, methods in ROUTES_BEFORE_ROUTERS + ROUTES_ADDED_FOR_USER_KEYS for method in methods
    }


def test_one_router_per_wire_format_plus_models_health_admin_and_users():
    served = [sorted({route.path for route in router.routes}) for router in ROUTERS]
    assert [paths[-1] for paths in served] == [
        "/health",
        "/v1beta/models/{model}",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages/count_tokens",
        "/v1beta/models/{target}",
        "/admin/versions",
        "/v1/feedback",  # a user key's own routes (issue 43)
    ]


def test_every_model_route_admits_by_key_and_by_path_alike(start_server, tokenizer):
    """One handler serves `/v1/...` and `/episodes/{id}/v1/...`: no key is a 401 on the first, an unknown id a 404 on
    the second, in the route's error shape; the episode's key, or its id, is admitted on both."""
    server = start_server(ScriptedEngine(tokenizer, lambda prompt: "Fine."), tokenizer)
    session = server.open_episode()
    bodies = {
        "/v1/chat/completions": {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "/v1/responses": {"model": "policy", "input": "hi", "max_output_tokens": 2},
        "/v1/messages": {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "/v1/messages/count_tokens": {"model": "policy", "messages": [{"role": "user", "content": "hi"}]},
        "/v1beta/models/policy:generateContent": {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
    }
    try:
        for path, body in bodies.items():
            missing = httpx.post(f"{server.url}{path}", json=body, timeout=10)
            assert missing.status_code == 401, (path, missing.text)
            unknown = httpx.post(f"{server.url}/episodes/ep-{'0' * 32}{path}", json=body, timeout=10)
            assert unknown.status_code == 404, (path, unknown.text)
            if path.startswith("/v1/messages"):
                assert missing.json()["type"] == unknown.json()["type"] == "error", path  # Anthropic's shape
            else:
                assert "error" in missing.json() and "error" in unknown.json(), path
            by_key = httpx.post(f"{server.url}{path}", json=body, headers={"x-api-key": session.key}, timeout=10)
            by_path = httpx.post(f"{server.url}/episodes/{session.episode.id}{path}", json=body, timeout=10)
            assert by_key.status_code == by_path.status_code == 200, (path, by_key.text, by_path.text)
    finally:
        server.close_episode(session.episode.id)
