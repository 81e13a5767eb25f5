"""Every client mistake is answered in OpenAI's error format with the right status, never a 5xx or a hang."""

import asyncio
import json

import httpx
import openai
import pytest

from trl_agentic.endpoint.sessions import EpisodeLimits
from trl_agentic.tiny_models import build_tiny_tokenizer

from conftest import CALCULATOR_TOOL, ScriptedEngine


pytestmark = pytest.mark.usefixtures("single_torch_thread")


CONTEXT = 400  # the scripted engine's context length: a few long messages overflow it
BODY_LIMIT = 16_384  # bytes: small, so a 413 needs no big upload


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


@pytest.fixture(scope="module")
def server(start_server, tokenizer):
    engine = ScriptedEngine(tokenizer, lambda prompt: "Fine.", max_context_length=CONTEXT)
    return start_server(engine, tokenizer, max_body_bytes=BODY_LIMIT)


@pytest.fixture()
def session(server):
    session = server.open_episode()
    yield session
    if server.registry.by_id(session.episode.id) is not None:
        server.close_episode(session.episode.id)


def hello(**extra):
    return {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


def post(server, path, key, body=None, content=None, headers=None):
    headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    if body is not None:
        content = json.dumps(body)
        headers["Content-Type"] = "application/json"
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=10)


def assert_error(response, status, code=None, type_="invalid_request_error"):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == type_
    if code is not None:
        assert error["code"] == code
    return error


def assert_still_serves(server):
    session = server.open_episode()
    client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=10)
    assert client.chat.completions.create(**hello()).choices[0].message.content == "Fine."
    assert len(server.close_episode(session.episode.id).turns) == 1


SCHEMA_VIOLATIONS = {
    "no messages": {"model": "policy"},
    "empty messages": {"model": "policy", "messages": []},
    "no model": {"messages": [{"role": "user", "content": "hi"}]},
    "unknown role": hello(messages=[{"role": "wizard", "content": "hi"}]),
    "user without content": hello(messages=[{"role": "user"}]),
    "assistant without content or calls": hello(messages=[{"role": "user", "content": "a"}, {"role": "assistant"}]),
    "image part": hello(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    "temperature too high": hello(temperature=3.0),
    "max_tokens zero": hello(max_tokens=0),
    "n zero": hello(n=0),
    "top_logprobs without logprobs": hello(top_logprobs=2),
    "five stop strings": hello(stop=["a", "b", "c", "d", "e"]),
    "tools not a list": hello(tools={"type": "function"}),
    "tool without function": hello(tools=[{"type": "function"}]),
    "unknown tool_choice": hello(tool_choice="sometimes", tools=[CALCULATOR_TOOL]),
    "required without tools": hello(tool_choice="required"),
    "named function not in tools": hello(tools=[CALCULATOR_TOOL],
                                         tool_choice={"type": "function", "function": {"name": "search"}}),
    "messages not a list": hello(messages="hi"),
    "body is a list": [1, 2],
    "stream not a bool": hello(stream="yes please"),
}


@pytest.mark.parametrize("case", list(SCHEMA_VIOLATIONS))
def test_schema_violations_are_400(server, session, case):
    error = assert_error(post(server, "/v1/chat/completions", session.key, SCHEMA_VIOLATIONS[case]), 400,
                         "invalid_request")
    assert error["param"] is None or isinstance(error["param"], str)
    assert session.episode.turns == []


def test_malformed_json_is_400(server, session):
    for content in (b'{"model": "policy", "messages": [', b"not json at all", b"\xff\xfe\x00", b""):
        assert_error(post(server, "/v1/chat/completions", session.key, content=content), 400, "invalid_json")


def test_unknown_model_is_404(server, session):
    client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=10)
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(**hello(model="gpt-9"))
    assert error.value.code == "model_not_found" and error.value.param == "model"


def test_missing_or_wrong_key_is_401(server):
    assert_error(post(server, "/v1/chat/completions", None, hello()), 401, "missing_api_key", "authentication_error")
    assert_error(post(server, "/v1/chat/completions", None, hello(), headers={"Authorization": "Basic abc"}), 401,
                 "missing_api_key", "authentication_error")
    client = openai.OpenAI(base_url=server.base_url, api_key="sk-ep-guessed", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError) as error:
        client.chat.completions.create(**hello())
    assert error.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    # A closed episode's key stops working.
    session = server.open_episode()
    server.close_episode(session.episode.id)
    assert_error(post(server, "/v1/chat/completions", session.key, hello()), 401, "invalid_api_key",
                 "authentication_error")


def test_unknown_episode_path_and_route_are_404(server):
    assert_error(post(server, "/episodes/ep-nope/v1/chat/completions", "x", hello()), 404, "episode_not_found")
    assert_error(httpx.get(f"{server.url}/episodes/ep-nope/v1/models", timeout=10), 404, "episode_not_found")
    assert_error(httpx.get(f"{server.url}/v1/completions", timeout=10), 404, "not_found")
    assert_error(httpx.get(f"{server.url}/v1/chat/completions", timeout=10), 405)


def test_prompt_over_the_context_is_400_and_flags_the_episode(server, session):
    client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=10)
    long_text = "the answer is " * 200
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**hello(messages=[{"role": "user", "content": long_text}]))
    assert error.value.code == "context_length_exceeded" and error.value.param == "messages"
    assert str(CONTEXT) in error.value.body["message"]
    assert server.close_episode(session.episode.id).status == "context_overflow"


def test_body_too_large_is_413(server, session):
    big = hello(messages=[{"role": "user", "content": "x" * (2 * BODY_LIMIT)}])
    assert_error(post(server, "/v1/chat/completions", session.key, big), 413, "request_too_large")

    def chunks():  # no Content-Length: the limit is enforced while reading
        data = json.dumps(big).encode()
        for i in range(0, len(data), 4096):
            yield data[i : i + 4096]

    assert_error(post(server, "/v1/chat/completions", session.key, content=chunks()), 413, "request_too_large")


def test_admin_routes_need_the_admin_token(server, session):
    for key in (session.key, None, "sk-admin-wrong"):
        assert_error(post(server, "/admin/episodes", key, {}), 401, "invalid_admin_token", "authentication_error")
        assert_error(post(server, f"/admin/episodes/{session.episode.id}/close", key, {}), 401, "invalid_admin_token",
                     "authentication_error")
    response = httpx.get(f"{server.url}/admin/episodes/{session.episode.id}",
                         headers={"Authorization": f"Bearer {session.key}"}, timeout=10)
    assert_error(response, 401, "invalid_admin_token", "authentication_error")
    assert server.registry.by_id(session.episode.id) is session  # still open


def test_bad_admin_bodies_are_400(server):
    admin = server.admin_token
    for body in ([1], {"max_turns": "many"}, {"max_turns": 0}, {"task_index": "a"}, {"surprise": 1}):
        assert_error(post(server, "/admin/episodes", admin, body), 400, "invalid_request")
    assert_error(post(server, "/admin/episodes", admin, content=b"{oops"), 400, "invalid_json")
    opened = post(server, "/admin/episodes", admin, {"max_turns": 3}).json()
    assert_error(post(server, f"/admin/episodes/{opened['id']}/close", admin, {"status": "great"}), 400)
    assert post(server, f"/admin/episodes/{opened['id']}/close", admin, {"status": "ok"}).status_code == 200
    assert_error(post(server, f"/admin/episodes/{opened['id']}/close", admin, {}), 404, "episode_not_found")


def test_episode_limits_are_400(server, tokenizer):
    session = server.open_episode(limits=EpisodeLimits(max_turns=2))
    client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=10)
    client.chat.completions.create(**hello())
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**hello(n=2))  # would make 3 turns
    assert error.value.code == "episode_limit_exceeded"
    client.chat.completions.create(**hello())
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**hello())
    assert error.value.code == "episode_limit_exceeded"
    episode = server.close_episode(session.episode.id)
    assert len(episode.turns) == 2 and episode.status == "limit_exceeded"

    # A budget of one whole answer + 2 tokens serves one call whole, cuts the next to 2 tokens, then refuses.
    answer = len(tokenizer.encode("Fine.", add_special_tokens=False)) + 1  # + end-of-turn
    session = server.open_episode(limits=EpisodeLimits(max_episode_tokens=answer + 2))
    client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=10)
    assert client.chat.completions.create(**hello(max_tokens=20)).choices[0].finish_reason == "stop"
    assert client.chat.completions.create(**hello(max_tokens=20)).choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**hello())
    assert error.value.code == "episode_limit_exceeded"
    episode = server.close_episode(session.episode.id)
    assert episode.num_sampled_tokens == answer + 2 and episode.status == "limit_exceeded"


def test_template_errors_are_400(start_server):
    tokenizer = build_tiny_tokenizer("llama3_2")
    server = start_server(ScriptedEngine(tokenizer, lambda prompt: "ok"), tokenizer)
    session = server.open_episode()
    two_calls = {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": "calculator", "arguments": "{}"}} for i in range(2)]}
    body = hello(messages=[{"role": "user", "content": "a"}, two_calls], tools=[CALCULATOR_TOOL])
    error = assert_error(post(server, "/v1/chat/completions", session.key, body), 400, "template_error")
    assert "single tool-calls" in error["message"]


def test_error_storm_then_normal_service(server):
    """Many bad requests at once (and good ones among them): every answer is a 4xx in OpenAI's format or a 200,
    nothing hangs, and the server serves normally afterwards."""
    session = server.open_episode()
    bad = [
        ("/v1/chat/completions", session.key, {"content": b"{"}),
        ("/v1/chat/completions", session.key, {"body": {"model": "policy"}}),
        ("/v1/chat/completions", session.key, {"body": hello(model="nope")}),
        ("/v1/chat/completions", "sk-wrong", {"body": hello()}),
        ("/v1/chat/completions", None, {"body": hello()}),
        ("/episodes/ep-x/v1/chat/completions", None, {"body": hello()}),
        ("/v1/chat/completions", session.key, {"body": hello(messages=[{"role": "user", "content": "a " * 500}])}),
        ("/v1/chat/completions", session.key, {"content": b"x" * (BODY_LIMIT + 1)}),
        ("/admin/episodes", session.key, {"body": {}}),
    ]

    async def storm():
        async with httpx.AsyncClient(timeout=20) as client:
            async def send(path, key, kwargs):
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                content = json.dumps(kwargs["body"]).encode() if "body" in kwargs else kwargs["content"]
                return await client.post(f"{server.url}{path}", content=content, headers=headers)

            requests = [send(*b) for b in bad * 6] + [
                send("/v1/chat/completions", session.key, {"body": hello()}) for _ in range(6)]
            return await asyncio.gather(*requests)

    responses = asyncio.run(storm())
    statuses = [r.status_code for r in responses]
    assert all(s < 500 for s in statuses), statuses
    assert statuses[-6:] == [200] * 6
    for response in responses[:-6]:
        assert 400 <= response.status_code < 500
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert len(server.close_episode(session.episode.id).turns) == 6
    assert_still_serves(server)
