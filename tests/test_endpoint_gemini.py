"""The Gemini API (`gemini.py`) with the official `google-genai` client, unmodified, and raw HTTP: chat tool loops on
three template families continue the token history exactly (thoughts round-tripped, streamed or not), automatic
function calling, SSE and JSON-array streams, countTokens, keys, errors in Google's shape, and the requests Gemini CLI
sends (recorded from the real binary, tests/data/harness_requests/gemini_cli/) answered and continued with 0 forks.

A scripted engine makes the model side exact (each family's own tool-call format, Qwen3's reasoning).
"""

import itertools
import json
import random
from pathlib import Path

import httpx
import pytest
from google import genai
from google.genai import errors, types

from conftest import ScriptedEngine
from test_endpoint_continuation import TOOL, tool_call_text
from test_endpoint_fuzz import SEED
from test_endpoint_responses import assert_token_exact, fuzz_cases, scripted_server, tokenizers  # noqa: F401
from trl_agentic.trace import Episode


RECORDED = Path(__file__).parent / "data" / "harness_requests" / "gemini_cli"
# The calculator as a Gemini function declaration: JSON schema, as Gemini CLI sends its tools ...
DECLARATION = {
    "name": "calculator",
    "description": TOOL["function"]["description"],
    "parametersJsonSchema": TOOL["function"]["parameters"],
}
# ... and Google's OpenAPI subset (upper-case types), as the SDKs derive it from a typed function.
OPENAPI_DECLARATION = {
    "name": "calculator",
    "description": TOOL["function"]["description"],
    "parameters": {
        "type": "OBJECT",
        "required": ["expression"],
        "properties": {"expression": {"type": "STRING"}, "precision": {"type": "INTEGER"}},
    },
}
USER = [{"role": "user", "parts": [{"text": "Hi."}]}]


def client_for(base_url, key):
    """The SDK's client (hold it: a client that is dropped closes its connections, even under a chat's feet)."""
    return genai.Client(api_key=key, http_options=types.HttpOptions(base_url=base_url, timeout=30_000))


def generate(server, session, body, method="generateContent", query="", key_header=True):
    headers = {"x-goog-api-key": session.key} if key_header else {}
    return httpx.post(f"{server.url}/v1beta/models/policy:{method}{query}", json=body, headers=headers, timeout=30)


@pytest.mark.parametrize(
    ("family", "stream", "declaration"),
    [
        ("qwen2_5", False, DECLARATION),
        ("llama3_2", False, OPENAPI_DECLARATION),
        ("qwen3", False, DECLARATION),
        ("qwen2_5", True, OPENAPI_DECLARATION),
        ("qwen3", True, DECLARATION),
    ],
)
def test_genai_chat_tool_loop_continues_every_turn(start_server, tokenizers, family, stream, declaration):
    """Two function calls and an answer through the SDK's chat, which sends our parts back (thoughts included, each
    streamed chunk as a content of its own) with function responses: three turns, each continuing the last."""
    tokenizer = tokenizers[family]
    reasoning = "Use the tool." if family == "qwen3" else None
    script = [tool_call_text(family, {"expression": f"{k} + 1"}, reasoning) for k in range(2)]
    script.append(("<think>\nDone.\n</think>\n\n" if reasoning else "") + "The answer is 2.")
    server = scripted_server(start_server, tokenizer, script)
    session = server.open_episode()
    config = types.GenerateContentConfig(
        system_instruction="Use the calculator.",
        tools=[types.Tool(function_declarations=[declaration])],
        thinking_config=types.ThinkingConfig(include_thoughts=True) if reasoning else None,
        max_output_tokens=64,
    )
    client = client_for(server.url, session.key)
    chat = client.chats.create(model="policy", config=config)
    message: list = ["Count to two."]
    for k in range(3):
        if stream:
            chunks = list(chat.send_message_stream(message))
            assert chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP
            parts = [part for chunk in chunks for part in chunk.candidates[0].content.parts]
        else:
            response = chat.send_message(message)
            assert response.candidates[0].finish_reason == types.FinishReason.STOP
            parts = response.candidates[0].content.parts
        assert any(part.thought for part in parts) == bool(reasoning)  # thoughts, as includeThoughts asks
        calls = [part.function_call for part in parts if part.function_call]
        if not calls:
            break
        assert [(call.name, call.args) for call in calls] == [("calculator", {"expression": f"{k} + 1"})]
        message = [types.Part.from_function_response(name="calculator", response={"output": str(k + 2)})]
    assert "".join(part.text for part in parts if part.text and not part.thought) == "The answer is 2."
    assert not stream or len(chunks) > 1  # the text came in pieces
    if reasoning:
        assert "".join(part.text for part in parts if part.thought) == "Done."
    episode = server.close_episode(session.episode.id)
    assert len(episode.turns) == 3 and episode.num_tool_calls == 2
    assert_token_exact(episode, tokenizer, family, "gemini")
    last = episode.turns[-1].request_messages
    assert [m["role"] for m in last] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert last[3] == {
        "role": "tool",
        "tool_call_id": episode.turns[0].response_message["tool_calls"][0]["id"],
        "name": "calculator",
        "content": "2",
    }
    assert episode.turns[0].request_tools[0]["function"]["parameters"] == TOOL["function"]["parameters"]
    if reasoning:
        assert last[2]["reasoning_content"] == "Use the tool."
    assert episode.turns[0].requested_sampling["stream"] is stream


def test_automatic_function_calling_with_a_python_function(start_server, tokenizers):
    """The SDK derives the declaration from a typed function, calls it and sends its result back by itself."""
    tokenizer = tokenizers["qwen2_5"]
    server = scripted_server(
        start_server, tokenizer, [tool_call_text("qwen2_5", {"expression": "1 + 1"}), "The answer is 2."]
    )
    session = server.open_episode()

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return str(eval(expression))  # noqa: S307 - the scripted model's own expression

    client = client_for(server.url, session.key)
    response = client.models.generate_content(
        model="policy",
        contents="What is 1 + 1?",
        config=types.GenerateContentConfig(system_instruction="Use the calculator.", tools=[calculator]),
    )
    assert response.text == "The answer is 2."
    episode = server.close_episode(session.episode.id)
    assert_token_exact(episode, tokenizer, "qwen2_5", "gemini")
    assert episode.turns[1].request_messages[-1]["content"] == '{"result": "2"}'  # the SDK's own wrapping, as JSON
    assert episode.turns[0].request_tools[0]["function"]["parameters"]["properties"] == {
        "expression": {"type": "string"}
    }


def test_streams_sse_and_json_array_count_tokens_and_keys(start_server, tokenizers):
    tokenizer = tokenizers["qwen2_5"]
    server = scripted_server(start_server, tokenizer, itertools.repeat("One. Two. Three."))
    session = server.open_episode()
    body = {
        "contents": [{"role": "user", "parts": [{"text": "Count."}, {"text": "Go."}]}],
        "system_instruction": {"parts": [{"text": "Be brief."}]},
    }  # snake_case, as Google's curl examples
    sse = generate(server, session, body, "streamGenerateContent", "?alt=sse")
    assert sse.status_code == 200 and sse.headers["content-type"].startswith("text/event-stream")
    events = sse.text.split("\r\n\r\n")
    assert events[-1] == "" and all(event.startswith("data: ") for event in events[:-1])
    chunks = [json.loads(event[6:]) for event in events[:-1]]
    array = generate(server, session, body, "streamGenerateContent").json()  # no alt=sse: one JSON array
    for stream in (chunks, array):
        assert len(stream) > 1 and "finishReason" not in stream[0]["candidates"][0]
        assert "".join(p["text"] for c in stream for p in c["candidates"][0]["content"]["parts"]) == "One. Two. Three."
        assert stream[-1]["candidates"][0]["finishReason"] == "STOP" and stream[-1]["candidates"][0]["content"]["parts"]
        assert stream[-1]["usageMetadata"]["promptTokenCount"] == len(server.app.state.engine.prompts[-1])
    reference = server.app.state.renderer.render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count.\nGo."}], None
    )
    client = client_for(server.url, session.key)
    counted = client.models.count_tokens(model="policy", contents=body["contents"])
    assert counted.total_tokens == len(
        server.app.state.renderer.render([{"role": "user", "content": "Count.\nGo."}], None)
    )
    wrapped = generate(server, session, {"generateContentRequest": {"model": "models/policy", **body}}, "countTokens")
    assert wrapped.json()["totalTokens"] == len(reference)
    # The key as ?key=, as a bearer token, and the path route with a placeholder key.
    by_query = httpx.post(f"{server.url}/v1beta/models/policy:generateContent?key={session.key}", json=body)
    assert by_query.json()["candidates"][0]["content"]["parts"] == [{"text": "One. Two. Three."}]
    by_bearer = httpx.post(
        f"{server.url}/v1/models/policy:generateContent", json=body, headers={"authorization": f"Bearer {session.key}"}
    )
    assert by_bearer.json()["usageMetadata"]["promptTokenCount"] == len(reference)
    by_path = client_for(server.episode_base_url(session).removesuffix("/v1"), "EMPTY")
    assert by_path.models.generate_content(model="policy", contents="Count.").text == "One. Two. Three."
    assert [m.name for m in by_path.models.list()] == ["models/policy"]
    wrong = client_for(server.url, "sk-ep-wrong")
    with pytest.raises(errors.ClientError) as error:
        wrong.models.generate_content(model="policy", contents="Count.")
    assert error.value.code == 401 and error.value.status == "UNAUTHENTICATED"
    episode = server.close_episode(session.episode.id)
    assert len(episode.turns) == 5 and {t.wire_format for t in episode.turns} == {"gemini"}
    assert episode.turns[0].request_messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Count.\nGo."},
    ]


def test_generation_config_stops_lengths_candidates_and_logprobs(start_server, tokenizers):
    tokenizer = tokenizers["qwen2_5"]
    server = scripted_server(start_server, tokenizer, itertools.repeat("One. Two. Three."))
    session = server.open_episode()
    client = client_for(server.url, session.key)
    cut = client.models.generate_content(
        model="policy", contents="Count.", config=types.GenerateContentConfig(max_output_tokens=2)
    )
    assert cut.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
    assert cut.usage_metadata.candidates_token_count == 2
    stopped = client.models.generate_content(
        model="policy",
        contents="Count.",
        config=types.GenerateContentConfig(
            stop_sequences=["Two"], temperature=0.5, top_p=0.9, top_k=5, seed=7, response_logprobs=True, logprobs=2
        ),
    )
    assert (stopped.text, stopped.candidates[0].finish_reason) == ("One. ", types.FinishReason.STOP)
    chosen = stopped.candidates[0].logprobs_result.chosen_candidates
    assert [c.log_probability for c in chosen] == [-0.5] * len(chosen) and chosen
    two = client.models.generate_content(
        model="policy", contents="Count.", config=types.GenerateContentConfig(candidate_count=2)
    )
    assert [c.index for c in two.candidates] == [0, 1]
    episode = server.close_episode(session.episode.id)
    assert len(episode.turns) == 4
    assert episode.turns[1].requested_sampling["generationConfig"] == {
        "temperature": 0.5,
        "topP": 0.9,
        "topK": 5,
        "stopSequences": ["Two"],
        "seed": 7,
        "responseLogprobs": True,
        "logprobs": 2,
    }
    assert episode.turns[1].sampling["seed"] == 7 and episode.turns[1].sampling["top_k"] == 5


def test_tool_config_forces_a_function(start_server, tokenizers):
    tokenizer = tokenizers["qwen2_5"]
    arguments = '{"expression": "2 + 3"}}\n</tool_call>'  # what follows the forced opening
    server = scripted_server(start_server, tokenizer, [arguments])
    session = server.open_episode()
    body = {
        "contents": USER,
        "tools": [{"functionDeclarations": [DECLARATION]}],
        "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["calculator"]}},
    }
    parts = generate(server, session, body).json()["candidates"][0]["content"]["parts"]
    assert parts[0]["functionCall"]["name"] == "calculator" and parts[0]["functionCall"]["args"] == {
        "expression": "2 + 3"
    }
    assert server.close_episode(session.episode.id).turns[0].forced_tokens > 0


def recorded(name):
    return json.loads((RECORDED / name).read_text())


def test_recorded_gemini_cli_requests_are_answered_and_continued(start_server, tokenizers):
    """Gemini CLI's first call (15 function declarations as parametersJsonSchema, a 30k-character system instruction,
    thinkingConfig) and its follow-up after the shell tool's response, as the real binary sent them: the follow-up,
    whose model content carries a call id and thoughtSignature of the CLI's own, continues the first turn's ids."""
    tokenizer = tokenizers["qwen2_5"]
    first, second = recorded("01_first_call.json"), recorded("02_after_function_response.json")
    assert (first["path"], first["query"], second["query"]) == (
        "/v1beta/models/policy:streamGenerateContent",
        "alt=sse",
        "alt=sse",
    )
    call = second["body"]["contents"][1]["parts"][0]["functionCall"]  # what the scripted model said the first time
    script = [
        "<tool_call>\n" + json.dumps({"name": call["name"], "arguments": call["args"]}) + "\n</tool_call>",
        "Created answer.txt containing 42.",
    ]
    replies = iter(script)
    server = start_server(ScriptedEngine(tokenizer, lambda prompt: next(replies), max_context_length=65536), tokenizer)
    session = server.open_episode()
    answers = []
    for request in (first, second):
        headers = {**request["headers"], "x-goog-api-key": session.key}
        response = httpx.post(
            f"{server.url}{request['path']}?{request['query']}", json=request["body"], headers=headers, timeout=60
        )
        assert response.status_code == 200, response.text[:500]
        answers.append([json.loads(event[6:]) for event in response.text.split("\r\n\r\n") if event])
    parts = [p for chunk in answers[0] for p in chunk["candidates"][0]["content"]["parts"]]
    assert [p["functionCall"]["name"] for p in parts] == ["run_shell_command"]
    assert parts[0]["functionCall"]["args"] == call["args"]
    assert "".join(p["text"] for chunk in answers[1] for p in chunk["candidates"][0]["content"]["parts"]) == (
        "Created answer.txt containing 42."
    )
    episode = server.close_episode(session.episode.id)
    assert episode.num_forks == 0
    turn0, turn1 = episode.turns
    assert (turn1.prompt_source, turn1.parent_turn) == ("continued", 0)
    assert turn1.prompt_ids[: len(turn0.prompt_ids) + len(turn0.completion_ids)] == (
        turn0.prompt_ids + turn0.completion_ids
    )
    assert len(turn0.request_tools) == 15 and len(turn0.prompt_ids) > 10_000
    assert [m["role"] for m in turn1.request_messages] == ["system", "user", "assistant", "tool"]
    assert turn1.request_messages[-1]["tool_call_id"] == call["id"]
    assert turn0.requested_sampling["generationConfig"]["thinkingConfig"] == {"includeThoughts": True}


@pytest.mark.parametrize(
    ("body", "status", "google_status"),
    [
        ({}, 400, "INVALID_ARGUMENT"),  # contents are required
        ({"contents": []}, 400, "INVALID_ARGUMENT"),
        (
            {"contents": [{"role": "user", "parts": [{"inlineData": {"mimeType": "image/png", "data": "AAAA"}}]}]},
            400,
            "INVALID_ARGUMENT",
        ),
        (
            {"contents": [{"role": "user", "parts": [{"text": "a", "functionCall": {"name": "f"}}]}]},
            400,
            "INVALID_ARGUMENT",
        ),
        ({"contents": [{"role": "system", "parts": [{"text": "x"}]}]}, 400, "INVALID_ARGUMENT"),
        ({"contents": USER + [{"role": "model", "parts": [{"text": "Pre"}]}]}, 400, "INVALID_ARGUMENT"),  # prefill
        ({"contents": USER, "tools": [{"googleSearch": {}}]}, 400, "INVALID_ARGUMENT"),
        (
            {
                "contents": USER,
                "tools": [{"functionDeclarations": [{**DECLARATION, "parameters": {"type": "OBJECT"}}]}],
            },
            400,
            "INVALID_ARGUMENT",
        ),
        (
            {
                "contents": USER,
                "tools": [{"functionDeclarations": [DECLARATION]}],
                "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["other"]}},
            },
            400,
            "INVALID_ARGUMENT",
        ),
        ({"contents": USER, "generationConfig": {"temperature": 3}}, 400, "INVALID_ARGUMENT"),
        ({"contents": USER, "generation_config": {}, "generationConfig": {}}, 400, "INVALID_ARGUMENT"),
        ({"contents": USER, "cachedContent": "cachedContents/abc"}, 400, "INVALID_ARGUMENT"),
        (
            {
                "contents": [
                    {"role": "user", "parts": [{"functionResponse": {"name": "f", "response": "not an object"}}]}
                ]
            },
            400,
            "INVALID_ARGUMENT",
        ),
    ],
)
def test_bad_requests_get_a_4xx_in_google_shape(start_server, tokenizers, body, status, google_status):
    server = scripted_server(start_server, tokenizers["qwen2_5"], itertools.repeat("Hi."))
    session = server.open_episode()
    response = generate(server, session, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert (error["code"], error["status"]) == (status, google_status) and error["message"]
    assert not server.close_episode(session.episode.id).turns


def test_routes_keys_and_server_errors_in_google_shape(start_server, tokenizers):
    def broken(prompt):
        raise RuntimeError("engine down")

    tokenizer = tokenizers["qwen2_5"]
    server = start_server(ScriptedEngine(tokenizer, broken), tokenizer)
    session = server.open_episode()
    body = {"contents": USER}
    missing = generate(server, session, body, key_header=False)
    assert missing.status_code == 401 and missing.json()["error"]["status"] == "UNAUTHENTICATED"
    unknown_model = httpx.post(
        f"{server.url}/v1beta/models/gemini-2.5-pro:generateContent", json=body, headers={"x-goog-api-key": session.key}
    )
    assert unknown_model.status_code == 404 and unknown_model.json()["error"]["status"] == "NOT_FOUND"
    unknown_method = generate(server, session, body, "embedContent")
    assert unknown_method.status_code == 404 and unknown_method.json()["error"]["status"] == "NOT_FOUND"
    invalid = httpx.post(
        f"{server.url}/v1beta/models/policy:generateContent",
        content=b'{"contents": NaN}',
        headers={"x-goog-api-key": session.key},
    )
    assert invalid.status_code == 400 and invalid.json()["error"]["status"] == "INVALID_ARGUMENT"
    unrouted = httpx.get(f"{server.url}/v1beta/files", headers={"x-goog-api-key": session.key})
    assert unrouted.status_code == 404 and unrouted.json()["error"]["code"] == 404
    client = client_for(server.url, session.key)
    with pytest.raises(errors.ServerError) as error:
        client.models.generate_content(model="policy", contents="Hi.")
    assert error.value.code == 500 and error.value.status == "INTERNAL" and "engine down" in error.value.message
    failed = generate(server, session, body, "streamGenerateContent", "?alt=sse")  # the engine fails mid-stream
    assert failed.status_code == 200 and json.loads(failed.text.split("\r\n\r\n")[0][6:])["error"]["code"] == 500
    # Probes: `GET /` and `HEAD /` answer 200 without a key.
    assert httpx.get(f"{server.url}/").status_code == 200 and httpx.head(f"{server.url}/").status_code == 200


def test_fuzzed_gemini_bodies_never_get_a_5xx(start_server, tokenizers):
    tokenizer = tokenizers["qwen2_5"]
    server = scripted_server(start_server, tokenizer, itertools.repeat(tool_call_text("qwen2_5", {"expression": "1"})))
    session = server.open_episode()
    bodies = [
        {"contents": USER, "generationConfig": {"maxOutputTokens": 8}},
        {
            "systemInstruction": {"parts": [{"text": "Use tools."}]},
            "tools": [{"functionDeclarations": [DECLARATION]}],
            "toolConfig": {"functionCallingConfig": {"mode": "AUTO"}},
            "generationConfig": {
                "maxOutputTokens": 8,
                "stopSequences": ["\n"],
                "thinkingConfig": {"includeThoughts": True},
            },
            "contents": [
                {"role": "user", "parts": [{"text": "2+3"}]},
                {
                    "role": "model",
                    "parts": [
                        {"text": "t", "thought": True},
                        {
                            "functionCall": {"id": "c0", "name": "calculator", "args": {"expression": "1"}},
                            "thoughtSignature": "sig",
                        },
                    ],
                },
                {
                    "role": "user",
                    "parts": [{"functionResponse": {"id": "c0", "name": "calculator", "response": {"output": "1"}}}],
                },
            ],
        },
    ]
    fields = [
        "contents",
        "systemInstruction",
        "tools",
        "toolConfig",
        "generationConfig",
        "safetySettings",
        "cachedContent",
        "extra",
    ]
    refused = 0
    methods = ["generateContent", "streamGenerateContent?alt=sse", "countTokens"]
    with httpx.Client(base_url=server.url, timeout=30) as client:  # one keep-alive connection throughout
        for k, content in enumerate(fuzz_cases(random.Random(SEED), bodies, fields, "contents", 150)):
            response = client.post(
                f"/v1beta/models/policy:{methods[k % 3]}", content=content, headers={"x-goog-api-key": session.key}
            )
            assert response.status_code < 500, (content[:300], response.text[:500])
            refused += response.status_code >= 400
            if response.status_code >= 400:
                error = response.json()["error"]
                assert error["code"] == response.status_code and error["status"] and error["message"]
    episode = server.close_episode(session.episode.id)
    assert Episode.from_json(episode.to_json()).turns  # some calls were served, and the trace serialises
    assert refused  # and some refused
