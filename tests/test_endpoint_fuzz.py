"""A seeded, bounded fuzz of request bodies: whatever an agent sends, the endpoint answers 200 or a 4xx in OpenAI's
error format, never a 5xx, on a connection that stays usable, and the episode's trace stays intact (issue #9).

Each case mutates a valid request (a field set to a hostile value, deleted, or added; a message corrupted; the bytes
truncated). Hostile values include seeds past int64, NaN/Infinity, lone surrogates, 5,000-deep nesting, huge integers
and wrong types. 300 cases against a scripted engine take a few seconds.
"""

import json
import random

import httpx
import pytest

from conftest import CALCULATOR_TOOL, ScriptedEngine
from trl_agentic.tiny_models import build_tiny_tokenizer
from trl_agentic.trace import Episode


NUM_CASES = 300
SEED = 1234

FIELDS = [
    "model",
    "messages",
    "tools",
    "tool_choice",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "n",
    "seed",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "parallel_tool_calls",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "response_format",
    "metadata",
    "extra",
]


def base_bodies() -> list[dict]:
    call = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1"}'}}
    return [
        {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
        {
            "model": "policy",
            "messages": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "2+3"}],
            "tools": [CALCULATOR_TOOL],
            "tool_choice": "auto",
            "max_tokens": 8,
        },
        {
            "model": "policy",
            "messages": [
                {"role": "user", "content": "2+3"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": "1"},
            ],
            "tools": [CALCULATOR_TOOL],
            "max_tokens": 8,
            "seed": 7,
            "n": 2,
        },
        {
            "model": "policy",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 2,
            "stop": ["\n"],
            "max_tokens": 8,
        },
    ]


def hostile_value(rng: random.Random):
    choices = [
        lambda: None,
        lambda: True,
        lambda: 0,
        lambda: -1,
        lambda: 2**63,
        lambda: 2**64,
        lambda: -(2**63) - 1,
        lambda: 10**30,
        lambda: "__HUGE_INT__",
        lambda: 0.5,
        lambda: -1e308,
        lambda: float("nan"),
        lambda: float("inf"),
        lambda: "",
        lambda: "x" * rng.randint(1, 3000),
        lambda: "\ud800",
        lambda: "é🙂\u0000",
        lambda: [],
        lambda: {},
        lambda: [rng.randint(0, 9)] * rng.randint(1, 5),
        lambda: {"type": "function"},
        lambda: {"type": "function", "function": "calculator"},
        lambda: {"function": {"name": 3}},
        lambda: f"__DEEP_{rng.choice([10, 63, 64, 65, 200, 999, 5000])}__",
        lambda: ["auto", "none", "required"],
        lambda: [{"role": "user"}],
        lambda: [{"role": "tool", "content": "x"}],
        lambda: {"include_usage": "x"},
    ]
    return rng.choice(choices)()


def mutate(rng: random.Random, body: dict) -> dict:
    body = json.loads(json.dumps(body))
    for _ in range(rng.randint(1, 3)):
        action = rng.random()
        if action < 0.45:
            body[rng.choice(FIELDS)] = hostile_value(rng)
        elif action < 0.6 and body:
            body.pop(rng.choice(sorted(body)))
        elif isinstance(body.get("messages"), list) and body["messages"]:
            message = rng.choice(body["messages"])
            if isinstance(message, dict):
                message[rng.choice(["role", "content", "tool_calls", "name", "tool_call_id", "x"])] = hostile_value(rng)
    return body


def encode(rng: random.Random, body: dict) -> bytes:
    text = json.dumps(body)  # NaN/Infinity tokens and "\ud800" escapes come out as such
    text = text.replace('"__HUGE_INT__"', "9" * 5000)
    for depth in (10, 63, 64, 65, 200, 999, 5000):
        text = text.replace(f'"__DEEP_{depth}__"', "[" * depth + "]" * depth)
    data = text.encode()
    if rng.random() < 0.05:
        data = data[: rng.randint(0, len(data))]  # truncated
    elif rng.random() < 0.05:
        position = rng.randrange(len(data))
        data = data[:position] + bytes([rng.randrange(256)]) + data[position + 1 :]
    return data


def sampled_choices(response: httpx.Response) -> int:
    if response.headers["content-type"].startswith("text/event-stream"):
        chunks = [
            json.loads(line[6:])
            for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        return sum(1 for chunk in chunks for choice in chunk["choices"] if choice["finish_reason"] is not None)
    return len(response.json()["choices"])


@pytest.fixture(scope="module")
def server(start_server):
    tokenizer = build_tiny_tokenizer("qwen2_5")
    return start_server(ScriptedEngine(tokenizer, lambda prompt: "Fine. 5"), tokenizer)


def test_fuzzed_request_bodies_never_get_a_5xx_and_leave_the_trace_intact(server):
    rng = random.Random(SEED)
    session = server.open_episode()
    admin = {"Authorization": f"Bearer {server.admin_token}"}
    routes = [
        ("/v1/chat/completions", {"Authorization": f"Bearer {session.key}"}),
        (f"/episodes/{session.episode.id}/v1/chat/completions", {}),
        ("/admin/episodes", admin),
    ]
    statuses, recorded = [], 0
    with httpx.Client(base_url=server.url, timeout=30) as client:  # one keep-alive connection throughout
        bodies = base_bodies()
        for case in range(NUM_CASES):
            path, headers = routes[0] if case % 10 < 7 else routes[1] if case % 10 < 9 else routes[2]
            content = encode(rng, mutate(rng, rng.choice(bodies)))
            response = client.post(path, content=content, headers={**headers, "Content-Type": "application/json"})
            statuses.append(response.status_code)
            assert response.status_code < 500, (case, content[:300], response.text[:500])
            if response.status_code == 200 and path != "/admin/episodes":
                recorded += sampled_choices(response)
            elif response.status_code >= 400:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text
            if case % 50 == 0:
                trace = client.get(f"/admin/episodes/{session.episode.id}", headers=admin)
                assert trace.status_code == 200 and len(trace.json()["turns"]) == recorded
        closed = client.post(f"/admin/episodes/{session.episode.id}/close", headers=admin, json={})
    assert closed.status_code == 200
    episode = Episode.from_dict(json.loads(closed.content, parse_constant=pytest.fail))  # strict JSON
    assert len(episode.turns) == recorded
    # The fuzz did reach both sides: served calls and refusals.
    assert statuses.count(200) > 20 and sum(400 <= s < 500 for s in statuses) > 100, sorted(set(statuses))
