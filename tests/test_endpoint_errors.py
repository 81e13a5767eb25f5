"""Every client mistake is answered in OpenAI's error format with the right status, never a 5xx or a hang."""

import asyncio
import http.client
import json

import httpx
import openai
import pytest

from conftest import CALCULATOR_TOOL, ScriptedEngine
from trl_agentic.endpoint.sessions import EpisodeLimits
from trl_agentic.tiny_models import build_tiny_tokenizer


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
    "named function not in tools": hello(
        tools=[CALCULATOR_TOOL], tool_choice={"type": "function", "function": {"name": "search"}}
    ),
    "messages not a list": hello(messages="hi"),
    "body is a list": [1, 2],
    "stream not a bool": hello(stream="yes please"),
    # These were answered 500 (an AttributeError in the validator) or broke the engine batch (issue #9).
    "tool_choice function not an object": hello(
        tools=[CALCULATOR_TOOL], tool_choice={"type": "function", "function": "calculator"}
    ),
    "tool_choice without type": hello(tools=[CALCULATOR_TOOL], tool_choice={"function": {"name": "calculator"}}),
    "seed past int64": hello(seed=2**64),
    "seed before int64": hello(seed=-(2**63) - 1),
    "seed + n - 1 past int64": hello(seed=2**63 - 1, n=2),
    "top_p zero": hello(top_p=0),
}


@pytest.mark.parametrize("case", list(SCHEMA_VIOLATIONS))
def test_schema_violations_are_400(server, session, case):
    error = assert_error(
        post(server, "/v1/chat/completions", session.key, SCHEMA_VIOLATIONS[case]), 400, "invalid_request"
    )
    assert error["param"] is None or isinstance(error["param"], str)
    assert session.episode.turns == []


def test_malformed_json_is_400(server, session):
    for content in (b'{"model": "policy", "messages": [', b"not json at all", b"\xff\xfe\x00", b""):
        assert_error(post(server, "/v1/chat/completions", session.key, content=content), 400, "invalid_json")


def test_json_that_cannot_be_written_back_is_400(server, session):
    """Nesting past the limit (5,000 deep raised RecursionError: 500), non-finite numbers, integers past Python's digit
    limit and lone surrogates are refused at the boundary, on every route that reads JSON."""
    body = json.dumps(hello())[:-1]
    for extra in (
        '"x": ' + "[" * 5000 + "]" * 5000,
        '"x": ' + "[" * 65 + "]" * 65,
        '"temperature": NaN',
        '"x": Infinity',
        '"x": 1e400',
        '"x": ' + "9" * 5000,
        '"user": "\\ud800"',
    ):
        content = f"{body}, {extra}}}".encode()
        assert_error(post(server, "/v1/chat/completions", session.key, content=content), 400, "invalid_json")
    nested = ("[" * 5000 + "]" * 5000).encode()
    assert_error(post(server, "/admin/episodes", server.admin_token, content=nested), 400, "invalid_json")
    assert session.episode.turns == []
    assert_still_serves(server)


def test_unknown_model_is_404(server, session):
    client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=10)
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(**hello(model="gpt-9"))
    assert error.value.code == "model_not_found" and error.value.param == "model"


def test_missing_or_wrong_key_is_401(server):
    assert_error(post(server, "/v1/chat/completions", None, hello()), 401, "missing_api_key", "authentication_error")
    assert_error(
        post(server, "/v1/chat/completions", None, hello(), headers={"Authorization": "Basic abc"}),
        401,
        "missing_api_key",
        "authentication_error",
    )
    client = openai.OpenAI(base_url=server.base_url, api_key="sk-ep-guessed", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError) as error:
        client.chat.completions.create(**hello())
    assert error.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    # A closed episode's key stops working.
    session = server.open_episode()
    server.close_episode(session.episode.id)
    assert_error(
        post(server, "/v1/chat/completions", session.key, hello()), 401, "invalid_api_key", "authentication_error"
    )


def test_server_error_keeps_the_keep_alive_connection_usable(start_server):
    """A genuine 500 (here: the engine fails) is answered in OpenAI's format, and the same connection serves the next
    request: uvicorn used to drop it, so a pooled client's next call (another episode's, in a rollout) got a reset."""
    tokenizer = build_tiny_tokenizer("qwen2_5")

    def respond(prompt_ids):
        if "explode" in tokenizer.decode(prompt_ids):
            raise RuntimeError("the engine failed")
        return "Fine."

    server = start_server(ScriptedEngine(tokenizer, respond), tokenizer)
    sessions = [server.open_episode() for _ in range(2)]
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.connect()
    socket_before = connection.sock
    for session, content in ((sessions[0], "explode"), (sessions[1], "hi"), (sessions[0], "hi")):
        connection.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(hello(messages=[{"role": "user", "content": content}])),
            {"Authorization": f"Bearer {session.key}", "Content-Type": "application/json"},
        )
        response = connection.getresponse()
        body = json.loads(response.read())
        if content == "explode":
            assert response.status == 500
            assert body["error"]["type"] == "server_error" and "the engine failed" in body["error"]["message"]
        else:
            assert response.status == 200, body
        # Either the connection stays open, or the server says it closes it (http.client then reconnects).
        assert connection.sock is socket_before or response.getheader("connection") == "close"
    connection.close()
    assert [len(server.close_episode(s.episode.id).turns) for s in sessions] == [1, 1]


def test_path_route_is_a_capability_url_that_refuses_another_episodes_key(server):
    """`/episodes/{id}/v1/...`: the id is the secret; a placeholder key is ignored, another episode's key is 401."""
    mine, other = server.open_episode(), server.open_episode()
    path = f"/episodes/{mine.episode.id}/v1/chat/completions"
    for key in (None, "EMPTY", "sk-placeholder", mine.key):
        assert post(server, path, key, hello()).status_code == 200, key
    for key in (other.key, "sk-ep-guessed"):
        assert_error(post(server, path, key, hello()), 401, "invalid_api_key", "authentication_error")
        response = httpx.get(
            f"{server.url}/episodes/{mine.episode.id}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10
        )
        assert_error(response, 401, "invalid_api_key", "authentication_error")
    assert len(server.close_episode(mine.episode.id).turns) == 4
    assert server.close_episode(other.episode.id).turns == []


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
        assert_error(
            post(server, f"/admin/episodes/{session.episode.id}/close", key, {}),
            401,
            "invalid_admin_token",
            "authentication_error",
        )
    response = httpx.get(
        f"{server.url}/admin/episodes/{session.episode.id}",
        headers={"Authorization": f"Bearer {session.key}"},
        timeout=10,
    )
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
    two_calls = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "calculator", "arguments": "{}"}} for i in range(2)
        ],
    }
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
                send("/v1/chat/completions", session.key, {"body": hello()}) for _ in range(6)
            ]
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
