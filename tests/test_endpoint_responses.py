"""`POST /v1/responses` with the official `openai` client, unmodified: tool loops on three template families (plain and
streamed) continue the token history exactly, as through Chat Completions; `previous_response_id`; errors in OpenAI's
shape.

A scripted engine makes the model side exact (each family's own tool-call format, Qwen3's reasoning).
"""

import itertools
import json
import random

import httpx
import openai
import pytest

from conftest import ScriptedEngine
from test_endpoint_continuation import TOOL, assert_continues, tool_call_text
from test_endpoint_fuzz import SEED, encode, hostile_value
from trl_agentic.rollout.rows import episode_to_rows
from trl_agentic.tiny_models import build_tiny_tokenizer
from trl_agentic.trace import Episode


# The calculator as a Responses function tool (the chat-completions `TOOL`, flattened).
RESPONSES_TOOL = {"type": "function", **TOOL["function"]}


@pytest.fixture(scope="module")
def tokenizers():
    return {family: build_tiny_tokenizer(family) for family in ("qwen2_5", "llama3_2", "qwen3")}


def scripted_server(start_server, tokenizer, script, **settings):
    script = iter(script)
    return start_server(ScriptedEngine(tokenizer, lambda prompt: next(script)), tokenizer, **settings)


def client_for(server, session):
    return openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=30)


def assert_token_exact(episode, tokenizer, family, wire_format):
    """Every turn continues the previous one token for token (0 forks), and the episode is one row whose env_mask
    is 1 on exactly the sampled tokens."""
    assert episode.num_forks == 0
    assert {turn.wire_format for turn in episode.turns} == {wire_format}
    for parent, turn in itertools.pairwise(episode.turns):
        assert_continues(turn, parent, tokenizer, family)
    (row,) = episode_to_rows(episode.turns).rows
    last = episode.turns[-1]
    assert row.prompt_ids + row.completion_ids == last.prompt_ids + last.completion_ids
    assert [t for t, mask in zip(row.completion_ids, row.env_mask) if mask] == [
        t for turn in episode.turns for t in turn.completion_ids
    ]
    assert [lp for lp, mask in zip(row.logprobs, row.env_mask) if mask] == [
        lp for turn in episode.turns for lp in turn.logprobs
    ]


@pytest.mark.parametrize(
    ("family", "stream"), [("qwen2_5", False), ("llama3_2", True), ("qwen3", False), ("qwen3", True)]
)
def test_responses_tool_loop_continues_every_turn(start_server, tokenizers, family, stream):
    """Two tool calls and an answer; the agent sends our output items back (reasoning included) with its
    function_call_output items: three turns, each continuing the last."""
    tokenizer = tokenizers[family]
    reasoning = "Use the tool." if family == "qwen3" else None
    script = [tool_call_text(family, {"expression": f"{k} + 1"}, reasoning) for k in range(2)]
    script.append(("<think>\nDone.\n</think>\n\n" if reasoning else "") + "The answer is 2.")
    server = scripted_server(start_server, tokenizer, script)
    session = server.open_episode()
    client = client_for(server, session)
    items: list = [{"role": "user", "content": "Count to two."}]
    while True:
        kwargs = dict(model="policy", instructions="Use the calculator.", input=items, tools=[RESPONSES_TOOL])
        if stream:
            with client.responses.stream(**kwargs) as events:
                kinds = [event.type for event in events]
                response = events.get_final_response()
            assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
            assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
        else:
            response = client.responses.create(**kwargs)
        assert response.status == "completed"
        items += response.output  # what agents do: the output items, as returned, are the next input
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            break
        (call,) = calls
        assert json.loads(call.arguments)["expression"].endswith("+ 1")
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "ok"})
    assert response.output_text == "The answer is 2."
    kinds = [item.type for item in response.output]
    assert kinds == (["reasoning", "message"] if reasoning else ["message"])
    if reasoning:
        assert response.output[0].content[0].text == "Done."
    assert response.usage.input_tokens == len(server.app.state.engine.prompts[-1])
    episode = server.close_episode(session.episode.id)
    assert len(episode.turns) == 3 and episode.num_tool_calls == 2
    assert_token_exact(episode, tokenizer, family, "responses")
    # Recorded in the chat shape: the instructions as the system message, our calls echoed back, the tool results.
    last = episode.turns[-1].request_messages
    assert last[0] == {"role": "system", "content": "Use the calculator."}
    assert [m["role"] for m in last] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert last[2]["tool_calls"][0]["id"] == episode.turns[0].response_message["tool_calls"][0]["id"]
    if reasoning:
        assert last[2]["reasoning_content"] == "Use the tool."


def test_previous_response_id_continues_within_the_episode(start_server, tokenizers):
    tokenizer = tokenizers["qwen2_5"]
    script = [tool_call_text("qwen2_5", {"expression": "1 + 1"}), "It is 2.", "Bye."]
    server = scripted_server(start_server, tokenizer, script)
    session = server.open_episode()
    client = client_for(server, session)
    first = client.responses.create(model="policy", input="What is 1 + 1?", tools=[RESPONSES_TOOL])
    (call,) = first.output
    second = client.responses.create(
        model="policy",
        previous_response_id=first.id,
        tools=[RESPONSES_TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "2"}],
    )
    assert second.output_text == "It is 2." and second.previous_response_id == first.id
    third = client.responses.create(
        model="policy", previous_response_id=second.id, tools=[RESPONSES_TOOL], input="Thanks.", store=False
    )
    with pytest.raises(openai.BadRequestError) as error:  # not stored: not retrievable
        client.responses.create(model="policy", previous_response_id=third.id, input="Again.")
    assert error.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="policy", previous_response_id="resp_unknown", input="Hi.")
    episode = server.close_episode(session.episode.id)
    assert len(episode.turns) == 3
    assert_token_exact(episode, tokenizer, "qwen2_5", "responses")
    assert [m["role"] for m in episode.turns[2].request_messages] == ["user", "assistant", "tool", "assistant", "user"]


def test_length_cut_is_incomplete(start_server, tokenizers):
    tokenizer = tokenizers["qwen2_5"]
    server = scripted_server(start_server, tokenizer, ["A long answer that will be cut short."])
    session = server.open_episode()
    response = client_for(server, session).responses.create(model="policy", input="Talk.", max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3
    assert server.close_episode(session.episode.id).turns[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "Hi."}, 400, "model"),
        ({"model": "gpt-4o", "input": "Hi."}, 404, "model"),
        (
            {"model": "policy", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            400,
            "input[0].content[0]",
        ),
        ({"model": "policy", "input": [{"type": "item_reference", "id": "x"}]}, 400, "input[0].type"),
        ({"model": "policy", "input": [{"type": "function_call", "call_id": "c"}]}, 400, "input[0].name"),
        ({"model": "policy", "input": [{"role": "tool", "content": "x"}]}, 400, "input[0].role"),
        (
            {
                "model": "policy",
                "input": "Hi.",
                "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}],
            },
            400,
            "tools[0].tools[0]",
        ),
        (
            {
                "model": "policy",
                "input": "Hi.",
                "tools": [RESPONSES_TOOL],
                "tool_choice": {"type": "function", "name": "x"},
            },
            400,
            "tool_choice",
        ),
        ({"model": "policy", "input": "Hi.", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"model": "policy", "input": "Hi.", "temperature": 3}, 400, "temperature"),
        ({"model": "policy", "input": []}, 400, "input"),
        ({"model": "policy", "input": "Hi.", "conversation": "conv_1"}, 400, "conversation"),
    ],
)
def test_bad_requests_get_a_4xx_in_openai_shape(start_server, tokenizers, body, status, param):
    tokenizer = tokenizers["qwen2_5"]
    server = scripted_server(start_server, tokenizer, itertools.repeat("Hi."))
    session = server.open_episode()
    response = httpx.post(f"{server.base_url}/responses", json=body, headers={"Authorization": f"Bearer {session.key}"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert not server.close_episode(session.episode.id).turns


def test_keys_and_path_route(start_server, tokenizers):
    tokenizer = tokenizers["qwen2_5"]
    server = scripted_server(start_server, tokenizer, itertools.repeat("Hi."))
    session = server.open_episode()
    by_path = openai.OpenAI(base_url=server.episode_base_url(session), api_key="EMPTY", max_retries=0)
    assert by_path.responses.create(model="policy", input="Hello.").output_text == "Hi."
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="sk-ep-wrong", max_retries=0).responses.create(
            model="policy", input="Hello."
        )
    episode = server.close_episode(session.episode.id)
    assert [t.wire_format for t in episode.turns] == ["responses"]


def fuzz_cases(rng, bodies, fields, nested_key, num_cases):
    """Mutated copies of valid bodies: a top-level field set hostile, deleted or added, or an item of `nested_key`
    (input items / messages) and one of its content parts corrupted; then encoded as `test_endpoint_fuzz` does."""
    for _ in range(num_cases):
        body = json.loads(json.dumps(rng.choice(bodies)))
        for _ in range(rng.randint(1, 3)):
            action = rng.random()
            items = body.get(nested_key)
            if action < 0.4:
                body[rng.choice(fields)] = hostile_value(rng)
            elif action < 0.5 and body:
                body.pop(rng.choice(sorted(body)))
            elif isinstance(items, list) and items and isinstance(item := rng.choice(items), dict):
                target = item
                parts = item.get("content")
                if isinstance(parts, list) and parts and isinstance(parts[0], dict) and rng.random() < 0.5:
                    target = rng.choice(parts)
                target[rng.choice(sorted(target) + ["type", "x"])] = hostile_value(rng)
        yield encode(rng, body)


def test_fuzzed_responses_bodies_never_get_a_5xx(start_server, tokenizers):
    tokenizer = tokenizers["qwen2_5"]
    server = scripted_server(start_server, tokenizer, itertools.repeat(tool_call_text("qwen2_5", {"expression": "1"})))
    session = server.open_episode()
    call = {"type": "function_call", "call_id": "call_0", "name": "calculator", "arguments": '{"expression": "1"}'}
    bodies = [
        {"model": "policy", "input": "hi", "max_output_tokens": 8},
        {
            "model": "policy",
            "instructions": "Use tools.",
            "tools": [RESPONSES_TOOL],
            "tool_choice": "auto",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "2+3"}]},
                {"type": "reasoning", "id": "rs_0", "summary": [{"type": "summary_text", "text": "t"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}]},
                call,
                {"type": "function_call_output", "call_id": "call_0", "output": "1"},
            ],
            "stream": True,
            "max_output_tokens": 8,
        },
    ]
    fields = [
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "temperature",
        "top_p",
        "store",
        "stream",
        "previous_response_id",
        "parallel_tool_calls",
        "include",
        "text",
        "extra",
    ]
    refused = 0
    with httpx.Client(base_url=server.url, timeout=30) as client:  # one keep-alive connection throughout
        for content in fuzz_cases(random.Random(SEED), bodies, fields, "input", 150):
            response = client.post("/v1/responses", content=content, headers={"Authorization": f"Bearer {session.key}"})
            assert response.status_code < 500, (content[:300], response.text[:500])
            refused += response.status_code >= 400
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    episode = server.close_episode(session.episode.id)
    assert Episode.from_json(episode.to_json()).turns  # some calls were served, and the trace serialises
    assert refused  # and some refused
