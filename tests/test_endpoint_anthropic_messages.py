"""`POST /v1/messages` with the official `anthropic` client, unmodified: `messages.create` and `messages.stream` tool
loops on three template families continue the token history exactly (thinking blocks round-tripped); stop reasons,
count_tokens, keys; errors in Anthropic's shape.

A scripted engine makes the model side exact (each family's own tool-call format, Qwen3's reasoning).
"""

import itertools
import random

import anthropic
import httpx
import pytest

from conftest import ScriptedEngine
from test_endpoint_continuation import TOOL, tool_call_text
from test_endpoint_fuzz import SEED
from test_endpoint_responses import assert_token_exact, fuzz_cases, scripted_server, tokenizers  # noqa: F401
from trl_agentic.trace import Episode


# The calculator as an Anthropic tool.
ANTHROPIC_TOOL = {
    "name": "calculator",
    "description": TOOL["function"]["description"],
    "input_schema": TOOL["function"]["parameters"],
}


def client_for(server, session):
    return anthropic.Anthropic(base_url=server.url, api_key=session.key, max_retries=0, timeout=30)


@pytest.mark.parametrize(
    ("family", "stream"),
    [("qwen2_5", False), ("llama3_2", False), ("qwen3", False), ("qwen2_5", True), ("qwen3", True)],
)
def test_messages_tool_loop_continues_every_turn(start_server, tokenizers, family, stream):
    """Two tool calls and an answer; the agent sends our content blocks back (thinking included) with tool_result
    blocks: three turns, each continuing the last."""
    tokenizer = tokenizers[family]
    reasoning = "Use the tool." if family == "qwen3" else None
    script = [tool_call_text(family, {"expression": f"{k} + 1"}, reasoning) for k in range(2)]
    script.append(("<think>\nDone.\n</think>\n\n" if reasoning else "") + "The answer is 2.")
    server = scripted_server(start_server, tokenizer, script)
    session = server.open_episode()
    client = client_for(server, session)
    messages: list = [{"role": "user", "content": "Count to two."}]
    while True:
        kwargs = dict(
            model="policy", max_tokens=64, system="Use the calculator.", messages=messages, tools=[ANTHROPIC_TOOL]
        )
        if stream:
            with client.messages.stream(**kwargs) as events:
                kinds = [event.type for event in events]
                message = events.get_final_message()
            assert kinds[0] == "message_start" and "content_block_delta" in kinds
        else:
            message = client.messages.create(**kwargs)
        messages.append({"role": "assistant", "content": message.content})  # as returned
        if message.stop_reason != "tool_use":
            break
        results = [
            {"type": "tool_result", "tool_use_id": block.id, "content": "ok"}
            for block in message.content
            if block.type == "tool_use"
        ]
        assert [block.input["expression"] for block in message.content if block.type == "tool_use"] == [
            f"{len(messages) // 2 - 1} + 1"
        ]
        messages.append({"role": "user", "content": results})
    assert message.stop_reason == "end_turn"
    assert [block.type for block in message.content] == (["thinking", "text"] if reasoning else ["text"])
    assert message.content[-1].text == "The answer is 2."
    assert message.usage.input_tokens == len(server.app.state.engine.prompts[-1])
    episode = server.close_episode(session.episode.id)
    assert len(episode.turns) == 3 and episode.num_tool_calls == 2
    assert_token_exact(episode, tokenizer, family, "anthropic_messages")
    last = episode.turns[-1].request_messages
    assert [m["role"] for m in last] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert last[2]["tool_calls"][0]["id"] == episode.turns[0].response_message["tool_calls"][0]["id"]
    if reasoning:
        assert last[2]["reasoning_content"] == "Use the tool."


def test_stop_reasons_count_tokens_and_keys(start_server, tokenizers):
    tokenizer = tokenizers["qwen2_5"]
    server = scripted_server(start_server, tokenizer, itertools.repeat("One. Two. Three."))
    session = server.open_episode()
    client = client_for(server, session)
    user = [{"role": "user", "content": [{"type": "text", "text": "Count."}, {"type": "text", "text": "Go."}]}]
    cut = client.messages.create(model="policy", max_tokens=2, messages=user)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    stopped = client.messages.create(model="policy", max_tokens=50, messages=user, stop_sequences=["Two"])
    assert (stopped.stop_reason, stopped.stop_sequence, stopped.content[0].text) == ("stop_sequence", "Two", "One. ")
    counted = client.messages.count_tokens(model="policy", messages=user, system="Be brief.")
    reference = server.app.state.renderer.render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count.\nGo."}], None
    )
    assert counted.input_tokens == len(reference)
    # The key as a bearer token, and the path route with a placeholder key.
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=session.key, max_retries=0)
    assert bearer.messages.create(model="policy", max_tokens=50, messages=user).stop_reason == "end_turn"
    by_path = anthropic.Anthropic(
        base_url=server.episode_base_url(session).removesuffix("/v1"), api_key="EMPTY", max_retries=0
    )
    assert by_path.messages.create(model="policy", max_tokens=50, messages=user).content[0].text == "One. Two. Three."
    with pytest.raises(anthropic.AuthenticationError) as error:
        anthropic.Anthropic(base_url=server.url, api_key="sk-ep-wrong", max_retries=0).messages.create(
            model="policy", max_tokens=5, messages=user
        )
    assert error.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Unknown or closed episode key."},
    }
    episode = server.close_episode(session.episode.id)
    assert len(episode.turns) == 4 and {t.wire_format for t in episode.turns} == {"anthropic_messages"}
    assert episode.turns[0].request_messages == [{"role": "user", "content": "Count.\nGo."}]


USER = [{"role": "user", "content": "Hi."}]


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ({"model": "policy", "messages": USER}, 400, "invalid_request_error"),  # max_tokens is required
        ({"model": "claude-x", "max_tokens": 5, "messages": USER}, 404, "not_found_error"),
        ({"model": "policy", "max_tokens": 0, "messages": USER}, 400, "invalid_request_error"),
        ({"model": "policy", "max_tokens": 5, "messages": []}, 400, "invalid_request_error"),
        (
            {
                "model": "policy",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
                        ],
                    }
                ],
            },
            400,
            "invalid_request_error",
        ),
        (
            {
                "model": "policy",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}
                        ],
                    }
                ],
            },
            400,
            "invalid_request_error",
        ),
        (
            {"model": "policy", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
            400,
            "invalid_request_error",
        ),
        (
            {"model": "policy", "max_tokens": 5, "messages": USER + [{"role": "assistant", "content": "Pre"}]},
            400,
            "invalid_request_error",
        ),  # prefill
        (
            {
                "model": "policy",
                "max_tokens": 5,
                "messages": USER,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            400,
            "invalid_request_error",
        ),
        (
            {
                "model": "policy",
                "max_tokens": 5,
                "messages": USER,
                "tools": [ANTHROPIC_TOOL],
                "tool_choice": {"type": "tool", "name": "other"},
            },
            400,
            "invalid_request_error",
        ),
        ({"model": "policy", "max_tokens": 5, "messages": USER, "temperature": 1.5}, 400, "invalid_request_error"),
    ],
)
def test_bad_requests_get_a_4xx_in_anthropic_shape(start_server, tokenizers, body, status, kind):
    server = scripted_server(start_server, tokenizers["qwen2_5"], itertools.repeat("Hi."))
    session = server.open_episode()
    response = httpx.post(
        f"{server.url}/v1/messages", json=body, headers={"x-api-key": session.key, "anthropic-version": "2023-06-01"}
    )
    assert response.status_code == status
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and error["error"]["message"]
    assert not server.close_episode(session.episode.id).turns


def test_invalid_json_and_missing_key_in_anthropic_shape(start_server, tokenizers):
    server = scripted_server(start_server, tokenizers["qwen2_5"], itertools.repeat("Hi."))
    session = server.open_episode()
    response = httpx.post(f"{server.url}/v1/messages", content=b'{"model": NaN}', headers={"x-api-key": session.key})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    response = httpx.post(f"{server.url}/v1/messages", json={"model": "policy", "max_tokens": 5, "messages": USER})
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    response = httpx.post(
        f"{server.url}/v1/messages/count_tokens", json={"model": "policy"}, headers={"x-api-key": session.key}
    )
    assert response.status_code == 400 and response.json()["type"] == "error"


def test_server_error_in_anthropic_shape(start_server, tokenizers):
    def broken(prompt):
        raise RuntimeError("engine down")

    tokenizer = tokenizers["qwen2_5"]
    server = start_server(ScriptedEngine(tokenizer, broken), tokenizer)
    session = server.open_episode()
    with pytest.raises(anthropic.InternalServerError) as error:
        client_for(server, session).messages.create(model="policy", max_tokens=5, messages=USER)
    assert error.value.body["type"] == "error" and error.value.body["error"]["type"] == "api_error"
    assert "engine down" in error.value.body["error"]["message"]


def test_fuzzed_messages_bodies_never_get_a_5xx(start_server, tokenizers):
    tokenizer = tokenizers["qwen2_5"]
    server = scripted_server(start_server, tokenizer, itertools.repeat(tool_call_text("qwen2_5", {"expression": "1"})))
    session = server.open_episode()
    bodies = [
        {"model": "policy", "max_tokens": 8, "messages": USER},
        {
            "model": "policy",
            "max_tokens": 8,
            "system": [{"type": "text", "text": "Use tools."}],
            "tools": [ANTHROPIC_TOOL],
            "tool_choice": {"type": "auto"},
            "stream": True,
            "stop_sequences": ["\n"],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "2+3"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "t", "signature": "s"},
                        {"type": "tool_use", "id": "toolu_0", "name": "calculator", "input": {"expression": "1"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_0", "content": "1", "is_error": False}],
                },
            ],
        },
    ]
    fields = [
        "model",
        "max_tokens",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "metadata",
        "thinking",
        "extra",
    ]
    refused = 0
    with httpx.Client(base_url=server.url, timeout=30) as client:  # one keep-alive connection throughout
        for k, content in enumerate(fuzz_cases(random.Random(SEED), bodies, fields, "messages", 150)):
            path = "/v1/messages/count_tokens" if k % 10 == 9 else "/v1/messages"
            response = client.post(path, content=content, headers={"x-api-key": session.key})
            assert response.status_code < 500, (content[:300], response.text[:500])
            refused += response.status_code >= 400
            if response.status_code >= 400:
                body = response.json()
                assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    episode = server.close_episode(session.episode.id)
    assert Episode.from_json(episode.to_json()).turns  # some calls were served, and the trace serialises
    assert refused  # and some refused
