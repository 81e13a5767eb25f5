"""O(new) per turn (issue #12 item 3): a continued call renders and tokenizes only a window around the new messages, and
finds its parent by key lookups; the ids, forks, drift and masks are those of rendering whole conversations.

Two real endpoints serve the same scripted episodes, one with `ChatRenderer(incremental=False)` (every call renders
the whole conversation: the reference), one incremental; everything recorded must agree, token for token.
"""

import itertools
import json

import openai
import pytest

from trl_agentic.endpoint.app import create_app
from trl_agentic.endpoint.chat import ChatRenderer
from trl_agentic.endpoint.server import EndpointServer
from trl_agentic.rollout.rows import episode_to_rows
from trl_agentic.tiny_models import build_tiny_tokenizer

from conftest import ScriptedEngine
from test_endpoint_continuation import TOOL, echo, tool_call_text


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
    return [calls[0], calls[1], answers[0], calls[2], "A title.", calls[3], answers[1], calls[4],
            "a long answer that max_tokens cuts", calls[5], calls[6], calls[7], answers[2]]


def run_episode(server):
    """A tool loop, a new user query, a side call, a cut completion, an edited earlier tool result (a branch from the
    turn before it), an edited question (a rewrite) and a tool change; the agent re-serialises every answer."""
    session = server.open_episode()
    client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=30)

    def call(messages, tools=(TOOL,), **kwargs):
        message = client.chat.completions.create(model="policy", messages=messages, tools=list(tools),
                                                 **kwargs).choices[0].message
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
        return [(t.prompt_ids, t.completion_ids, t.logprobs, t.finish_reason, t.prompt_source, t.parent_turn,
                 t.fork_reason, t.drift) for t in episode.turns]

    assert recorded(incremental) == recorded(full)
    rows_full, rows_incremental = episode_to_rows(full.turns).rows, episode_to_rows(incremental.turns).rows
    assert [(r.prompt_ids, r.completion_ids, r.env_mask) for r in rows_incremental] == [
        (r.prompt_ids, r.completion_ids, r.env_mask) for r in rows_full]
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
