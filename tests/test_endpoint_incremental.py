"""O(new) per turn (issue #12 item 3): a continued call renders and tokenizes only a window around the new messages, and
finds its parent by key lookups; the ids, forks, drift and masks are those of rendering whole conversations.

Two real endpoints serve the same scripted episodes, one with `ChatRenderer(incremental=False)` (every call renders
the whole conversation: the reference), one incremental; everything recorded must agree, token for token.
"""

import itertools
import json
import re

import openai
import pytest

from conftest import ScriptedEngine
from test_endpoint_continuation import TOOL, echo, tool_call_text
from trl_agentic.endpoint.app import create_app
from trl_agentic.endpoint.chat import ChatRenderer
from trl_agentic.endpoint.server import EndpointServer
from trl_agentic.rollout.rows import episode_to_rows
from trl_agentic.tiny_models import build_tiny_tokenizer


FAMILIES = ["qwen2_5", "llama3_2", "qwen3"]


@pytest.fixture(scope="module")
def tokenizers():
    return {family: build_tiny_tokenizer(family) for family in FAMILIES}


@pytest.fixture
def serve():
    servers = []

    def start(tokenizer, script, incremental):
        script = iter(script)
        engine = ScriptedEngine(tokenizer, lambda prompt: next(script))
        server = EndpointServer(create_app(engine, ChatRenderer(tokenizer, incremental=incremental))).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def script_for(family):
    reasoning = "Let me see." if family == "qwen3" else None
    calls = [tool_call_text(family, {"expression": f"{k} + 1", "precision": k}, reasoning) for k in range(12)]
    answers = [(f"<think>\nDone {k}.\n</think>\n\n" if family == "qwen3" else "") + f"It is {k}." for k in range(6)]
    return [
        calls[0],
        calls[1],
        answers[0],
        calls[2],
        "A title.",
        calls[3],
        answers[1],
        calls[4],
        "a long answer that max_tokens cuts",
        calls[5],
        calls[6],
        calls[7],
        answers[2],
    ]


def run_episode(server):
    """A tool loop, a new user query, a side call, a cut completion, an edited earlier tool result (a branch from the
    turn before it), an edited question (a rewrite) and a tool change; the agent re-serialises every answer."""
    session = server.open_episode()
    client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=30)

    def call(messages, tools=(TOOL,), **kwargs):
        message = (
            client.chat.completions.create(model="policy", messages=messages, tools=list(tools), **kwargs)
            .choices[0]
            .message
        )
        messages.append(echo(message))
        return message

    def tool_result(messages, message, content):
        messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": content})

    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 1 + 1?"}]
    tool_result(messages, call(messages), "2")  # turn 0
    tool_result(messages, call(messages), "3")  # turn 1: continues 0
    call(messages)  # turn 2: an answer
    messages.append({"role": "user", "content": "And 3 + 4?"})
    tool_result(messages, call(messages), "7")  # turn 3: a new query (Qwen3: a template fork)
    call([{"role": "user", "content": "Title this chat."}])  # turn 4: a side call
    tool_result(messages, call(messages), "8")  # turn 5: continues 3
    call(messages)  # turn 6
    messages.append({"role": "user", "content": "Once more."})
    tool_result(messages, call(messages), "9")  # turn 7
    call(messages, max_tokens=3)  # turn 8: cut by max_tokens
    messages.append({"role": "user", "content": "Go on."})
    edited = json.loads(json.dumps(messages))
    edited[3]["content"] = "two"  # the agent edits the first tool result: a branch from turn 0
    tool_result(edited, call(edited), "10")  # turn 9
    edited[1]["content"] = "What is 1 + 2?"  # ...and then its question: a rewrite, rendered fresh
    tool_result(edited, call(edited), "11")  # turn 10
    tool_result(edited, call(edited), "12")  # turn 11: continues the fork
    call(edited, tools=())  # turn 12: no tools any more
    return server.close_episode(session.episode.id)


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_path_records_what_the_full_path_records(serve, tokenizers, family):
    tokenizer = tokenizers[family]
    full = run_episode(serve(tokenizer, script_for(family), incremental=False))
    incremental_server = serve(tokenizer, script_for(family), incremental=True)
    assert incremental_server.app.state.renderer.incremental
    incremental = run_episode(incremental_server)

    def recorded(episode):
        return [
            (
                t.prompt_ids,
                t.completion_ids,
                t.logprobs,
                t.finish_reason,
                t.prompt_source,
                t.parent_turn,
                t.fork_reason,
                t.drift,
            )
            for t in episode.turns
        ]

    assert recorded(incremental) == recorded(full)
    rows_full, rows_incremental = episode_to_rows(full.turns).rows, episode_to_rows(incremental.turns).rows
    assert [(r.prompt_ids, r.completion_ids, r.env_mask) for r in rows_incremental] == [
        (r.prompt_ids, r.completion_ids, r.env_mask) for r in rows_full
    ]
    # The episode exercises what it claims: continuations, a side call, a rewrite, a tool change, a cut completion.
    reasons = [t.fork_reason for t in incremental.turns]
    assert {"side_call", "history_rewritten", "tools_changed"} <= set(reasons)
    assert ("template_not_append_only" in reasons) == (family == "qwen3")
    assert sum(t.prompt_source == "continued" for t in incremental.turns) >= 6
    assert incremental.turns[8].finish_reason == "length"
    assert incremental.turns[9].parent_turn == 0 and incremental.turns[10].fork_reason == "history_rewritten"


def test_per_call_work_does_not_grow_with_the_episode(serve, tokenizers):
    """40 tool turns: a continued call renders the same number of messages and tokenizes the same number of characters
    at turn 40 as at turn 3; rendering whole conversations grows by the two messages each turn adds."""
    tokenizer = tokenizers["qwen2_5"]
    work = {}
    for incremental in (True, False):
        script = (tool_call_text("qwen2_5", {"expression": "1 + 1"}) for _ in itertools.count())
        server = serve(tokenizer, script, incremental=incremental)
        renderer = server.app.state.renderer
        session = server.open_episode()
        client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=30)
        messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "Add."}]
        per_call = []
        for _ in range(40):
            before = (renderer.rendered_messages, renderer.encoded_chars)
            message = client.chat.completions.create(model="policy", messages=messages, tools=[TOOL]).choices[0].message
            per_call.append((renderer.rendered_messages - before[0], renderer.encoded_chars - before[1]))
            messages += [echo(message), {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "2"}]
        episode = server.close_episode(session.episode.id)
        assert episode.num_forks == 0 and all(t.prompt_source == "continued" for t in episode.turns[1:])
        work[incremental] = per_call
    # The same work at every continued turn; the first window also asks the template whether its first user message
    # is a plain query (renders of it alone and with an answer: 3 messages, once per distinct message).
    assert work[True][3] == (work[True][4][0] + 3, work[True][4][1])  # turn 3: the first window
    assert len(set(work[True][4:])) == 1
    rendered, encoded = work[True][-1]
    assert rendered <= 12 and encoded < 150  # two windows of at most 6 messages; the new tool result tokenized
    full_rendered = [r for r, _ in work[False][1:]]
    assert all(b == a + 4 for a, b in itertools.pairwise(full_rendered))  # parent + request each grow by 2 messages


def respond_by_prompt(tokenizer):
    """A deterministic model: a tool call or an answer, chosen and worded by the prompt's length."""

    def respond(prompt):
        if len(prompt) % 3 == 0:
            return f"It is {len(prompt)}."
        return tool_call_text("qwen2_5", {"expression": f"{len(prompt)} + 1"})

    return respond


def random_episode_bodies(rng, answer_of):
    """Calls of an agent that also rewrites its history: `answer_of(body) -> (status, answer message)`. Each step
    continues, retries, makes a side call, edits the last or an old message (content, a declared field, an extra field: string, number,
    bool, nested, two at once), reorders an old message's keys, goes back, or sends an invalid old message (a 400,
    then undone). Returns nothing: `answer_of` sees (and records) every call."""
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 1 + 1?"}]
    ops = (
        ["continue"] * 5
        + ["retry", "edit_last", "rewrite", "declared", "extra", "reorder", "back", "invalid", "parts", "side"]
        + rng.choice([["retype"] * 3, ["swap"] * 3])
    )
    for step in range(16):
        op = rng.choice(ops)
        body = json.loads(json.dumps(messages))
        old = rng.randrange(len(body)) if op not in ("retype", "swap") else max(0, len(body) - 1 - rng.randrange(6))
        if op == "edit_last":
            body[-1]["content"] = f"{body[-1].get('content')} (edited {step})"
        elif op == "rewrite" and body[old]["role"] in ("tool", "user"):
            body[old]["content"] = f"rewritten {step}"
        elif op == "declared":
            body[old]["name"] = f"n{step}"
        elif op == "extra":
            body[old].update(
                rng.choice(
                    [
                        {"x": "a"},
                        {"x": 1},
                        {"x": 1.0},
                        {"x": True},
                        {"x": ["a"]},
                        {"x": {"y": 1}},
                        {"x": "a", "y": "b"},
                        {"y": "b", "x": "a"},
                        {"refusal": None},
                    ]
                )
            )
        elif op == "retype":  # equal in Python, not in JSON: 1 == 1.0 == True
            body[old]["x"] = {"int": 1.0, "float": True}.get(type(body[old].get("x")).__name__, 1)
        elif op == "swap":  # two extra fields, then the same two in the other order
            swapped = [k for k, message in enumerate(body) if "y" in message]
            if swapped and rng.random() < 0.7:
                k = rng.choice(swapped)
                body[k] = dict(reversed(list(body[k].items())))
            else:
                body[old] = {**body[old], "x": "a", "y": "b"}
        elif op == "side":  # a call outside the conversation (a title), then the conversation goes on
            answer_of([{"role": "user", "content": f"Title this chat ({step})."}])
        elif op == "reorder":
            body[old] = dict(reversed(list(body[old].items())))
        elif op == "back" and len(body) > 4:
            body = body[:-2]
        elif op == "parts" and body[old]["role"] == "user":
            body[old]["content"] = [{"type": "text", "text": body[old]["content"]}]
        elif op == "invalid":
            body[old][rng.choice(["content", "role", "tool_calls"])] = rng.choice([5, "bogus", [{"type": "image"}]])
        status, answer = answer_of(body)
        if status != 200:
            continue  # the agent undoes what was refused
        messages = body
        # The agent sends the answer back as it got it (or with a null extra), its call ids its own.
        echoed = {**answer, "refusal": None} if rng.random() < 0.5 else dict(answer)
        if echoed.get("tool_calls"):
            echoed["tool_calls"] = [{**call, "id": f"call_{step}"} for call in echoed["tool_calls"]]
            messages += [echoed, {"role": "tool", "tool_call_id": f"call_{step}", "content": f"{step * 7}"}]
        else:
            messages += [echoed, {"role": "user", "content": f"Next {step}."}]


def test_reused_message_prefix_records_and_answers_what_validating_every_message_does(monkeypatch, tokenizers):
    """A call that re-sends the episode's messages validates only the ones it adds (`REUSE_VALIDATED_PREFIX`):
    random episodes that also rewrite, reorder, extend and break their history get the same answers, the same 400s
    and the same recorded turns (as JSON, key order included) with the reuse on and off."""
    import random

    import httpx

    from trl_agentic.endpoint import chat_completions

    tokenizer = tokenizers["qwen2_5"]
    server = EndpointServer(
        create_app(ScriptedEngine(tokenizer, respond_by_prompt(tokenizer)), ChatRenderer(tokenizer))
    ).start()
    try:
        with httpx.Client(timeout=30) as http:
            statuses, longest = [], 0
            for seed in range(10):
                runs = {}
                for reuse in (False, True):
                    monkeypatch.setattr(chat_completions, "REUSE_VALIDATED_PREFIX", reuse)
                    session, answers, reused = server.open_episode(), [], []

                    def answer_of(messages):
                        body = {"model": "policy", "messages": messages, "tools": [TOOL], "max_tokens": 64}
                        response = http.post(
                            f"{server.base_url}/chat/completions",
                            json=body,
                            headers={"Authorization": f"Bearer {session.key}"},
                        )
                        answer = response.json()
                        answers.append(
                            (response.status_code, {k: v for k, v in answer.items() if k not in ("id", "created")})
                        )
                        message = answer["choices"][0]["message"] if response.status_code == 200 else None
                        reused.append(len(session.chat_prefix.raw) if session.chat_prefix else 0)
                        return response.status_code, message

                    random_episode_bodies(random.Random(seed), answer_of)
                    episode = server.close_episode(session.episode.id)
                    turns = [{k: v for k, v in turn.to_dict().items() if k != "wall_time"} for turn in episode.turns]
                    # The endpoint's tool-call ids are random: the agent replaces them, and they are masked here.
                    runs[reuse] = [re.sub(r"call_[0-9a-f]{24}", "call_?", json.dumps(x)) for x in (answers, turns)]
                    runs[reuse].append(reused)
                    statuses += [status for status, _ in answers]
                assert runs[True][:2] == runs[False][:2], f"seed {seed}"
                assert not any(runs[False][2])  # the switch switches
                longest = max(longest, *runs[True][2])
    finally:
        server.stop()
    assert statuses.count(400) >= 3 and statuses.count(200) >= 80 and longest >= 10  # broken, continued, reused


def test_an_invalid_message_in_the_resent_prefix_is_the_400_it_was_without_the_reuse(monkeypatch, tokenizers):
    """Messages taken from the validated prefix are those `==` to what validated before; one that changed is
    validated again, and an error anywhere names its index in the whole list, as without the reuse."""
    import httpx

    from trl_agentic.endpoint import chat_completions

    tokenizer = tokenizers["qwen2_5"]
    script = (tool_call_text("qwen2_5", {"expression": "1 + 1"}) for _ in itertools.count())
    server = EndpointServer(
        create_app(ScriptedEngine(tokenizer, lambda prompt: next(script)), ChatRenderer(tokenizer))
    ).start()
    try:
        with httpx.Client(timeout=30) as http:
            errors = {}
            for reuse in (True, False):
                monkeypatch.setattr(chat_completions, "REUSE_VALIDATED_PREFIX", reuse)
                session = server.open_episode()

                def post(messages):
                    return http.post(
                        f"{server.base_url}/chat/completions",
                        headers={"Authorization": f"Bearer {session.key}"},
                        json={"model": "policy", "messages": messages, "tools": [TOOL]},
                    )

                messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "Add."}]
                for k in range(4):
                    message = post(messages).json()["choices"][0]["message"]
                    messages += [
                        message,
                        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": str(k)},
                    ]
                turns = session.episode.turns
                if reuse:  # the later turns record the very dicts the earlier ones did, not copies
                    assert turns[3].request_messages[2] is turns[1].request_messages[2]
                    assert post([{"role": "user", "content": "Title this chat."}]).status_code == 200
                    assert len(session.chat_prefix.raw) == len(messages) - 2  # a side call keeps the conversation's
                broken = [json.loads(json.dumps(messages)) for _ in range(4)]
                broken[0][3]["content"] = 5  # an old tool result
                broken[1][2]["tool_calls"][0]["function"]["arguments"] = 7  # an old answer's arguments
                broken[2][1]["role"] = "agent"  # the question
                broken[3][-1]["content"] = None  # the new tool result
                errors[reuse] = [post(body) for body in broken]
                assert [r.status_code for r in errors[reuse]] == [400] * 4
                assert post(messages).status_code == 200  # still the same episode, unharmed
            assert [r.json() for r in errors[True]] == [r.json() for r in errors[False]]
            assert [r.json()["error"]["param"] for r in errors[True]] == [
                "messages.3.content.str",
                "messages.2.tool_calls.0.function.arguments.str",
                "messages.1.role",
                "messages.9",
            ]
    finally:
        server.stop()
