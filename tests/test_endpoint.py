"""The endpoint end to end: a real uvicorn server, the official `openai` client, and the Turns it records.

Two policies: a random tiny model (sampling, logprobs, streaming) and a tiny model fine-tuned to call the calculator
(`tool_model` in conftest), so that tool calls round-trip for real.
"""

import json

import httpx
import openai
import pytest
import torch

from conftest import CALCULATOR_TOOL, ScriptedEngine
from trl_agentic.endpoint.app import SamplingOverrides
from trl_agentic.endpoint.chat import ChatRenderer
from trl_agentic.generation.engine import derive_seed
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def random_policy():
    tokenizer = build_tiny_tokenizer("qwen2_5")
    return build_tiny_model(tokenizer).eval(), tokenizer


@pytest.fixture(scope="module")
def random_server(start_server, random_policy):
    return start_server(*random_policy)


@pytest.fixture(scope="module")
def tool_server(start_server, tool_model):
    return start_server(tool_model.model, tool_model.tokenizer)


def episode_client(server, async_client=False):
    session = server.open_episode()
    cls = openai.AsyncOpenAI if async_client else openai.OpenAI
    return session, cls(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=60)


def calculator(expression: str) -> str:
    return str(eval(expression, {"__builtins__": {}}))  # the tasks' expressions only


def run_tool_loop(client, question, max_calls=5, **kwargs):
    """A hand-written agent: call the model, run its tool calls, send everything back re-serialised the way agents
    do (the client's full model_dump with its `null` fields, arguments re-encoded), until it answers."""
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": question}]
    for _ in range(max_calls):
        response = client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR_TOOL], temperature=0.0, max_tokens=48, **kwargs
        )
        message = response.choices[0].message
        echoed = message.model_dump()  # refusal/audio/function_call/annotations: None
        messages.append(echoed)
        if not message.tool_calls:
            return messages
        for call in echoed["tool_calls"]:
            arguments = json.loads(call["function"]["arguments"])
            call["function"]["arguments"] = json.dumps(arguments, indent=2, sort_keys=True)  # other spelling
            result = calculator(arguments["expression"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return messages


def score(model, prompt, completion, temperature):
    """The model's own logprobs of `completion` after `prompt`: one fp32 forward, log_softmax(logits / T)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
    logps = torch.log_softmax(logits / temperature, dim=-1)
    return logps.gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1).tolist()


def assert_chained(episode):
    """Every turn after the first continues its predecessor: its prompt starts with the exact previous ids."""
    for k, turn in enumerate(episode.turns[1:], start=1):
        parent = episode.turns[k - 1]
        assert (turn.prompt_source, turn.parent_turn, turn.fork_reason) == ("continued", k - 1, None)
        exact = parent.prompt_ids + parent.completion_ids
        assert turn.prompt_ids[: len(exact)] == exact
    assert episode.num_forks == 0


def test_plain_chat(random_server, random_policy):
    _, tokenizer = random_policy
    session, client = episode_client(random_server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there."}]
    response = client.chat.completions.create(model="policy", messages=messages, max_tokens=6, seed=0)
    assert response.object == "chat.completion" and response.model == "policy"
    (choice,) = response.choices
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    episode = random_server.close_episode(session.episode.id)
    (turn,) = episode.turns
    assert turn.prompt_ids == ChatRenderer(tokenizer).render(messages, None)
    assert turn.prompt_source == "rendered" and turn.parent_turn is None
    assert len(turn.completion_ids) == len(turn.logprobs) == response.usage.completion_tokens
    assert response.usage.prompt_tokens == len(turn.prompt_ids)
    assert turn.response_message == choice.message.model_dump(exclude_none=True)
    assert turn.request_messages == messages
    assert turn.requested_sampling["max_tokens"] == 6 and turn.requested_sampling["seed"] == 0
    assert episode.status == "ok" and episode.messages == messages + [turn.response_message]


def test_tool_loop_round_trip(tool_server, tool_model):
    """The fine-tuned model calls the calculator twice, the agent sends the calls back re-serialised with the tool
    results, and every call continues the previous one token for token: no fork."""
    session, client = episode_client(tool_server)
    messages = run_tool_loop(client, "What is (2 + 3) * 4?")
    assert messages[-1]["content"] == "The answer is 20."
    episode = tool_server.close_episode(session.episode.id)
    assert [t.finish_reason for t in episode.turns] == ["tool_calls", "tool_calls", "stop"]
    assert episode.num_tool_calls == 2 and episode.num_malformed_tool_calls == 0
    first_call = json.loads(episode.turns[0].response_message["tool_calls"][0]["function"]["arguments"])
    assert first_call == {"expression": "2 + 3"}
    assert_chained(episode)
    # Between two turns sits exactly the tool result rendered by the template (env tokens, never sampled).
    t0, t1 = episode.turns[:2]
    between = t1.prompt_ids[len(t0.prompt_ids) + len(t0.completion_ids) :]
    assert tool_model.tokenizer.decode(between) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def collect_stream(stream):
    """Join a streamed completion back into a message (content and tool-call deltas) and its last chunks."""
    content, calls, finish, usage, chunks = "", {}, None, None, 0
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, usage, chunks


@pytest.mark.parametrize("policy", ["random", "tool"])
def test_stream_equals_non_stream(request, policy):
    """Same request and seed, streamed and not: the joined deltas equal the message and the recorded Turns are
    identical (what is recorded never depends on streaming)."""
    server = request.getfixturevalue(f"{policy}_server")
    kwargs = {
        "model": "policy",
        "max_tokens": 24,
        "seed": 7,
        "messages": [
            {"role": "system", "content": "Use the calculator."},
            {"role": "user", "content": "What is 2 + 3?"},
        ],
    }
    if policy == "tool":
        kwargs.update(tools=[CALCULATOR_TOOL], temperature=0.0)
    plain_session, client = episode_client(server)
    plain = client.chat.completions.create(**kwargs).choices[0]
    stream_session, client = episode_client(server)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    content, calls, finish, usage, chunks = collect_stream(stream)

    assert content == (plain.message.content or "") and finish == plain.finish_reason
    expected_calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in plain.message.tool_calls or []
    ]
    assert [{k: v for k, v in c.items() if k != "id"} for c in calls] == [
        {k: v for k, v in c.items() if k != "id"} for c in expected_calls
    ]
    if policy == "tool":
        assert finish == "tool_calls" and calls[0]["name"] == "calculator"
        assert json.loads(calls[0]["arguments"]) == {"expression": "2 + 3"}
    else:
        assert chunks > 3  # really streamed in pieces
    (plain_turn,) = server.close_episode(plain_session.episode.id).turns
    (stream_turn,) = server.close_episode(stream_session.episode.id).turns
    assert stream_turn.prompt_ids == plain_turn.prompt_ids
    assert stream_turn.completion_ids == plain_turn.completion_ids
    # The second call reuses the first one's cached prompt states (KV prefix reuse, issue #12): fp32 rounding apart.
    assert stream_turn.logprobs == pytest.approx(plain_turn.logprobs, abs=1e-5)
    assert usage.completion_tokens == len(stream_turn.completion_ids)
    assert usage.prompt_tokens == len(stream_turn.prompt_ids)


def test_stream_splits_non_ascii_text_in_pieces(start_server, random_policy):
    """Tokens that end inside a UTF-8 character are held back until it completes: the stream still arrives in
    pieces, and they join to the content exactly."""
    _, tokenizer = random_policy
    text = "Le café est à côté — naïve 🙂 fin. " * 3
    server = start_server(ScriptedEngine(tokenizer, lambda prompt: text), tokenizer)
    session, client = episode_client(server)
    stream = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], stream=True)
    content, _, finish, _, chunks = collect_stream(stream)
    assert content == text and finish == "stop" and chunks > 20
    server.close_episode(session.episode.id)


def test_stream_wire_format(random_server):
    """Raw SSE: `data:` lines of chat.completion.chunk, a usage chunk only when asked for, then `data: [DONE]`."""
    for include_usage in (True, False):
        session = random_server.open_episode()
        body = {
            "model": "policy",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": include_usage},
        }
        headers = {"Authorization": f"Bearer {session.key}"}
        with httpx.stream("POST", f"{random_server.base_url}/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.iter_lines() if line]
        assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        usage_chunks = [c for c in chunks if c.get("usage")]
        assert len(usage_chunks) == int(include_usage)
        if include_usage:
            assert usage_chunks[0]["choices"] == [] and chunks[-1] is usage_chunks[0]
        random_server.close_episode(session.episode.id)


def test_content_parts_and_null_assistant_content(random_server):
    """Content as a list of text parts renders like the joined string; an assistant message with `content: null`
    and tool_calls is accepted (what agents send back after a tool call)."""
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 3?"}]
    as_parts = [{"role": "user", "content": parts}]
    as_text = [{"role": "user", "content": "What is 2 + 3?"}]
    prompts = []
    for messages in (as_parts, as_text):
        session, client = episode_client(random_server)
        client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
        prompts.append(random_server.close_episode(session.episode.id).turns[0].prompt_ids)
    assert prompts[0] == prompts[1]

    session, client = episode_client(random_server)
    history = as_text + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2 + 3"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "5"}]},
    ]
    response = client.chat.completions.create(model="policy", messages=history, tools=[CALCULATOR_TOOL], max_tokens=2)
    assert response.choices[0].message.role == "assistant"
    random_server.close_episode(session.episode.id)


def test_tool_choice(tool_server, tool_model):
    question = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 2 + 3?"}]
    named = {"type": "function", "function": {"name": "calculator"}}
    session, client = episode_client(tool_server)
    results = {}
    for choice in ("auto", "none", "required", named):
        response = client.chat.completions.create(
            model="policy",
            messages=question,
            tools=[CALCULATOR_TOOL],
            tool_choice=choice,
            temperature=0.0,
            max_tokens=48,
        )
        results[json.dumps(choice)] = response.choices[0]
    assert results['"auto"'].message.tool_calls[0].function.name == "calculator"
    # "none": the model's text comes back as content, never parsed into a call.
    assert results['"none"'].message.tool_calls is None and "<tool_call>" in results['"none"'].message.content
    assert results['"none"'].finish_reason == "stop"
    assert results['"required"'].message.tool_calls and results[json.dumps(named)].message.tool_calls
    episode = tool_server.close_episode(session.episode.id)
    assert [t.requested_sampling["tool_choice"] for t in episode.turns] == ["auto", "none", "required", named]
    # "required" / named: the server appended the template's tool-call opening to the prompt (not sampled).
    assert [t.forced_tokens for t in episode.turns[:2]] == [0, 0]
    forced_text = tool_model.tokenizer.decode(episode.turns[3].prompt_ids[-episode.turns[3].forced_tokens :])
    assert '<tool_call>\n{"name": "calculator", "arguments":'.startswith(forced_text) and "calculator" in forced_text
    assert episode.turns[3].prompt_ids[: -episode.turns[3].forced_tokens] == episode.turns[0].prompt_ids
    assert episode.turns[2].forced_tokens > 0

    session, client = episode_client(tool_server)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model="policy",
            messages=question,
            tools=[CALCULATOR_TOOL],
            tool_choice={"type": "function", "function": {"name": "search"}},
        )
    assert error.value.status_code == 400 and "search" in error.value.body["message"]
    assert tool_server.close_episode(session.episode.id).turns == []


def test_named_tool_choice_is_enforced_where_the_model_would_answer(tool_server, tool_model):
    """After the tool result the model answers in text; a named tool_choice makes it call the tool anyway, and the
    next call still continues token-exactly from the forced turn."""
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 2 + 3?"}]
    session, client = episode_client(tool_server)
    first = (
        client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR_TOOL], temperature=0.0, max_tokens=48
        )
        .choices[0]
        .message
    )
    assert first.tool_calls
    messages += [
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "5"},
    ]
    free = client.chat.completions.create(
        model="policy", messages=messages, tools=[CALCULATOR_TOOL], temperature=0.0, max_tokens=48
    ).choices[0]
    assert free.message.tool_calls is None  # on its own the model answers
    forced = client.chat.completions.create(
        model="policy",
        messages=messages,
        tools=[CALCULATOR_TOOL],
        temperature=0.0,
        max_tokens=48,
        tool_choice={"type": "function", "function": {"name": "calculator"}},
    ).choices[0]
    assert forced.finish_reason == "tool_calls" and forced.message.tool_calls[0].function.name == "calculator"
    messages += [
        forced.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": forced.message.tool_calls[0].id, "content": "5"},
    ]
    client.chat.completions.create(
        model="policy", messages=messages, tools=[CALCULATOR_TOOL], temperature=0.0, max_tokens=8
    )
    episode = tool_server.close_episode(session.episode.id)
    forced_turn, last = episode.turns[2], episode.turns[3]
    assert forced_turn.forced_tokens > 0 and not forced_turn.malformed_tool_call
    assert last.prompt_source == "continued" and last.parent_turn == 2
    assert last.prompt_ids[: len(forced_turn.prompt_ids) + len(forced_turn.completion_ids)] == (
        forced_turn.prompt_ids + forced_turn.completion_ids
    )


def test_n_choices_record_one_turn_each(random_server):
    session, client = episode_client(random_server)
    messages = [{"role": "user", "content": "Tell me something."}]
    response = client.chat.completions.create(model="policy", messages=messages, n=2, max_tokens=8, seed=3)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.choices[0].message.content != response.choices[1].message.content  # seeds 3 and 4
    assert response.usage.completion_tokens == 16
    # The agent continues from the second choice: its parent is that choice's turn.
    second_answer = response.choices[1].message.model_dump(exclude_none=True)
    follow_up = messages + [second_answer, {"role": "user", "content": "More."}]
    client.chat.completions.create(model="policy", messages=follow_up, max_tokens=4)
    episode = random_server.close_episode(session.episode.id)
    assert len(episode.turns) == 3
    first, second, third = episode.turns
    assert first.prompt_ids == second.prompt_ids and first.completion_ids != second.completion_ids
    assert (third.prompt_source, third.parent_turn) == ("continued", 1)
    exact = second.prompt_ids + second.completion_ids
    assert third.prompt_ids[: len(exact)] == exact


def test_an_episode_opened_with_a_seed_samples_from_it_whatever_else_runs(random_server):
    """An episode opened with a `seed` (the admin route's, as the runner's) samples its calls that bring no seed from
    seeds derived from it and the call's index: not from the engine's own seeds, handed out in arrival order."""
    admin = {"Authorization": f"Bearer {random_server.admin_token}"}

    def open_episode(body):
        return httpx.post(f"{random_server.url}/admin/episodes", headers=admin, json=body, timeout=10)

    first = [{"role": "user", "content": "Tell me something."}]
    opened = {name: open_episode({"seed": seed}).json() for name, seed in (("a", 5), ("b", 5), ("c", 6))}
    clients = {
        name: openai.OpenAI(base_url=o["base_url"], api_key=o["key"], max_retries=0, timeout=60)
        for name, o in opened.items()
    }
    answers = {name: [] for name in opened}

    def call(name, **kwargs):
        messages = (
            first
            if not answers[name]
            else first + [{"role": "assistant", "content": answers[name][-1]}, {"role": "user", "content": "More."}]
        )
        reply = clients[name].chat.completions.create(model="policy", messages=messages, max_tokens=6, **kwargs)
        answers[name].append(reply.choices[0].message.content)

    # The two episodes seeded alike call in opposite orders, with another episode's calls in between.
    for name, kwargs in (("a", {"n": 2}), ("c", {"n": 2}), ("c", {}), ("b", {"n": 2}), ("b", {}), ("a", {})):
        call(name, **kwargs)
    call("a", seed=3)  # a request's own seed wins
    loose = random_server.open_episode()  # no seed: the engine's
    repeated = first + [{"role": "assistant", "content": answers["a"][1]}, {"role": "user", "content": "More."}]
    openai.OpenAI(base_url=random_server.base_url, api_key=loose.key, max_retries=0).chat.completions.create(
        model="policy", messages=repeated, max_tokens=6, seed=3
    )  # a's last request
    episodes = {name: random_server.close_episode(o["id"]) for name, o in opened.items()}
    loose = random_server.close_episode(loose.episode.id)

    def ids(name):
        return [turn.completion_ids for turn in episodes[name].turns]

    assert ids("b") == ids("a")[:3] and ids("c") != ids("b")
    assert ids("a")[0] != ids("a")[1]  # the choices of a call sample apart
    assert [turn.sampling["seed"] for turn in episodes["a"].turns] == [
        derive_seed(5, 0),
        derive_seed(5, 0),
        derive_seed(5, 1),
        3,
    ]  # recorded: each call's first choice's seed
    assert loose.turns[0].prompt_ids == episodes["a"].turns[3].prompt_ids
    assert loose.turns[0].completion_ids == ids("a")[3]
    # The seed is an int64, as a request's is.
    refused = open_episode({"seed": 2**64})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "seed"


def test_stop_strings(random_server, random_policy):
    _, tokenizer = random_policy
    messages = [{"role": "user", "content": "Write a few words."}]
    session, client = episode_client(random_server)
    full = client.chat.completions.create(model="policy", messages=messages, max_tokens=24, seed=11)
    text = full.choices[0].message.content
    # A stop string from the middle of what this seed samples (ASCII, so it decodes the same token by token).
    start = next(
        i
        for i in range(4, len(text) - 2)
        if text[i : i + 2].isascii() and not text[i : i + 2].isspace() and text[i : i + 2].strip() == text[i : i + 2]
    )
    stop = text[start : start + 2]
    stopped = client.chat.completions.create(
        model="policy", messages=messages, max_tokens=24, seed=11, stop=["@@never@@", stop]
    )
    assert stopped.choices[0].message.content == text[: text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model="policy",
        messages=messages,
        max_tokens=24,
        seed=11,
        stop=stop,
        stream=True,
        stream_options={"include_usage": True},
    )
    content, _, finish, usage, chunks = collect_stream(streamed)
    assert (content, finish) == (stopped.choices[0].message.content, "stop") and chunks > 3
    assert usage.completion_tokens == stopped.usage.completion_tokens
    episode = random_server.close_episode(session.episode.id)
    unstopped, cut, cut_streamed = episode.turns
    assert cut_streamed.completion_ids == cut.completion_ids
    assert stopped.usage.completion_tokens == len(cut.completion_ids)
    # The sampled ids are kept up to the token that completes the stop string; the stop string is not returned.
    assert cut.completion_ids == unstopped.completion_ids[: len(cut.completion_ids)]
    assert stop in tokenizer.decode(cut.completion_ids) and stop not in tokenizer.decode(cut.completion_ids[:-1])
    # Up to float rounding: the second call may reuse the first one's cached prefix (other kernels, ~5e-7 apart).
    assert cut.logprobs == pytest.approx(unstopped.logprobs[: len(cut.completion_ids)], abs=1e-5)
    assert cut.finish_reason == "stop"


def test_logprobs_and_top_logprobs(random_server):
    session, client = episode_client(random_server)
    response = client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        seed=5,
    )
    content = response.choices[0].logprobs.content
    (turn,) = random_server.close_episode(session.episode.id).turns
    assert [entry.logprob for entry in content] == turn.logprobs
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
    session, client = episode_client(random_server)
    response = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert response.choices[0].logprobs is None
    random_server.close_episode(session.episode.id)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recorded_logprobs_match_the_models_scoring(random_server, random_policy, temperature):
    """Behaviour logprobs recorded for continued turns too agree with an fp32 forward of prompt + completion."""
    model, _ = random_policy
    session, client = episode_client(random_server)
    messages = [{"role": "user", "content": "Count with me."}]
    for k in range(3):
        response = client.chat.completions.create(
            model="policy", messages=messages, max_tokens=10, temperature=temperature, seed=k
        )
        messages += [response.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"{k}"}]
    episode = random_server.close_episode(session.episode.id)
    assert_chained(episode)
    for turn in episode.turns:
        assert turn.sampling["temperature"] == temperature
        expected = score(model, turn.prompt_ids, turn.completion_ids, temperature)
        assert turn.logprobs == pytest.approx(expected, abs=1e-3)


def test_models_route_and_episode_path(random_server):
    session, client = episode_client(random_server)
    assert [m.id for m in client.models.list().data] == ["policy"]
    # The episode can also be addressed by URL (for agents that cannot set a key); the key is then not checked.
    by_path = openai.OpenAI(base_url=random_server.episode_base_url(session), api_key="unused", max_retries=0)
    assert [m.id for m in by_path.models.list().data] == ["policy"]
    by_path.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert len(random_server.close_episode(session.episode.id).turns) == 1


def test_trainer_sampling_overrides_the_request(start_server, random_policy):
    server = start_server(*random_policy, overrides=SamplingOverrides(temperature=0.0, top_p=0.9, max_tokens=3))
    session, client = episode_client(server)
    response = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}], temperature=1.7, top_p=0.5, max_tokens=50
    )
    (turn,) = server.close_episode(session.episode.id).turns
    assert response.usage.completion_tokens <= 3
    assert (turn.sampling["temperature"], turn.sampling["top_p"], turn.sampling["max_tokens"]) == (0.0, 0.9, 3)
    assert (turn.requested_sampling["temperature"], turn.requested_sampling["top_p"]) == (1.7, 0.5)
