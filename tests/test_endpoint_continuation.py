"""Token-in continuation over real HTTP, per template family: long tool episodes chain token for token; history
rewrites, side calls, tool changes and templates that are not append-only are recorded as forks, never merged.

A scripted engine makes the model side exact (real tool calls and reasoning in each family's format); a random tiny
model per family shows the same with real sampling, truncated completions included.
"""

import itertools
import json

import openai
import pytest

from conftest import ScriptedEngine
from trl_agentic.endpoint.chat import ChatRenderer
from trl_agentic.endpoint.protocol import template_message
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


pytestmark = pytest.mark.usefixtures("single_torch_thread")


FAMILIES = ["qwen2_5", "llama3_2", "qwen3"]
END_OF_TURN = {"qwen2_5": "<|im_end|>", "llama3_2": "<|eot_id|>", "qwen3": "<|im_end|>"}
# What the template puts between the end-of-turn of an assistant message and the next message's header.
JUNCTION = {"qwen2_5": "\n<|im_start|>", "llama3_2": "<|start_header_id|>", "qwen3": "\n<|im_start|>"}
TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "required": ["expression"],
            "properties": {"expression": {"type": "string"}, "precision": {"type": "integer"}},
        },
    },
}


@pytest.fixture(scope="module")
def tokenizers():
    return {family: build_tiny_tokenizer(family) for family in FAMILIES}


def tool_call_text(family, arguments, reasoning=None):
    """A completion in the family's own tool-call format (what a model trained on the template samples)."""
    if family == "llama3_2":
        return json.dumps({"name": "calculator", "parameters": arguments})
    think = f"<think>\n{reasoning}\n</think>\n\n" if reasoning else ""
    return think + "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": arguments}) + "\n</tool_call>"


def scripted_server(start_server, tokenizer, script, **settings):
    script = iter(script)
    return start_server(ScriptedEngine(tokenizer, lambda prompt: next(script)), tokenizer, **settings)


def client_for(server, session):
    return openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=30)


def echo(message):
    """What an agent sends back for our answer: the client's full dump (`refusal: null`, `audio: null`, ...; for
    Qwen3 the `reasoning_content` extra field too), arguments re-encoded with the keys reversed and no spaces."""
    echoed = message.model_dump()
    for call in echoed.get("tool_calls") or []:
        arguments = json.loads(call["function"]["arguments"])
        call["function"]["arguments"] = json.dumps(dict(reversed(list(arguments.items()))), separators=(",", ":"))
    return echoed


def assert_continues(turn, parent, tokenizer, family):
    """`turn` continues `parent`: exact ids, then glue (the end-of-turn, only if the parent was cut), then the
    newly rendered messages starting with the template's junction."""
    assert (turn.prompt_source, turn.parent_turn, turn.fork_reason, turn.drift) == ("continued", parent.index, None, 0)
    exact = parent.prompt_ids + parent.completion_ids
    assert turn.prompt_ids[: len(exact)] == exact
    rest = turn.prompt_ids[len(exact) :]
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN[family])
    if parent.completion_ids[-1] == end_of_turn:
        assert rest[0] != end_of_turn
    else:  # cut by max_tokens: the end-of-turn the model did not sample is glue
        assert parent.finish_reason == "length" and rest[0] == end_of_turn
        rest = rest[1:]
    assert tokenizer.decode(rest).startswith(JUNCTION[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_long_tool_episode_continues_every_turn(start_server, tokenizers, family):
    """Five tool calls and an answer, sent back re-serialised each time: six turns, each continuing the last."""
    tokenizer = tokenizers[family]
    reasoning = "Use the tool." if family == "qwen3" else None
    script = [tool_call_text(family, {"expression": f"{k} + 1", "precision": k}, reasoning) for k in range(5)]
    script.append("The answer is 5.")
    server = scripted_server(start_server, tokenizer, script)
    session = server.open_episode()
    client = client_for(server, session)
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "Count to five."}]
    while True:
        message = client.chat.completions.create(model="policy", messages=messages, tools=[TOOL]).choices[0].message
        messages.append(echo(message))
        if not message.tool_calls:
            break
        (call,) = message.tool_calls
        assert json.loads(call.function.arguments)["expression"].endswith("+ 1")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "ok"})
    if family == "qwen3":
        assert messages[2]["reasoning_content"] == "Use the tool."
    episode = server.close_episode(session.episode.id)
    assert len(episode.turns) == 6 and episode.num_tool_calls == 5 and episode.num_forks == 0
    for parent, turn in itertools.pairwise(episode.turns):
        assert_continues(turn, parent, tokenizer, family)
    # The final prompt spells what the template renders for the conversation with our answers as we returned them
    # (not as re-serialised by the agent: the model saw and sampled its own spelling).
    ours = iter(turn.response_message for turn in episode.turns)
    returned = [next(ours) if m["role"] == "assistant" else m for m in messages[:-1]]
    if family != "qwen3":  # Qwen3 renders earlier reasoning differently from what the model saw, see below
        reference = ChatRenderer(tokenizer).render_text([template_message(m) for m in returned], [TOOL])
        assert tokenizer.decode(episode.turns[-1].prompt_ids) == reference


@pytest.mark.parametrize("family", FAMILIES)
def test_random_model_episode_with_truncations(start_server, tokenizers, family):
    """Real sampling, 6 turns alternating tool results and user messages, most completions cut by max_tokens: every
    turn continues, with the end-of-turn glued in after a cut."""
    tokenizer = tokenizers[family]
    server = start_server(build_tiny_model(tokenizer).eval(), tokenizer)
    session = server.open_episode()
    client = client_for(server, session)
    messages = [{"role": "user", "content": "Let us begin."}]
    for k in range(6):
        response = client.chat.completions.create(model="policy", messages=messages, tools=[TOOL], max_tokens=5, seed=k)
        messages.append(echo(response.choices[0].message))
        messages.append(
            {"role": "tool", "tool_call_id": f"call_{k}", "content": f"result {k}"}
            if k % 2 == 0
            else {"role": "user", "content": f"Go on ({k})."}
        )
    episode = server.close_episode(session.episode.id)
    assert len(episode.turns) == 6 and episode.num_forks == 0
    assert any(t.finish_reason == "length" for t in episode.turns[:-1])
    for parent, turn in itertools.pairwise(episode.turns):
        assert_continues(turn, parent, tokenizer, family)


def test_qwen3_new_user_message_after_reasoning_forks(start_server, tokenizers):
    """Qwen3's template drops the reasoning of assistant turns before the last user message. A tool loop keeps it
    (continued); a new user message after two reasoning turns changes how the first renders: a recorded fork."""
    tokenizer = tokenizers["qwen3"]
    script = [
        tool_call_text("qwen3", {"expression": "1 + 1"}, "Think first."),
        "<think>\nDone.\n</think>\n\nIt is 2.",
        tool_call_text("qwen3", {"expression": "2 + 2"}, "Again."),
        "<think>\nDone.\n</think>\n\nIt is 4.",
    ]
    server = scripted_server(start_server, tokenizer, script)
    session = server.open_episode()
    client = client_for(server, session)
    messages = [{"role": "user", "content": "What is 1 + 1?"}]

    def call():
        message = client.chat.completions.create(model="policy", messages=messages, tools=[TOOL]).choices[0].message
        messages.append(echo(message))
        return message

    tool_call = call().tool_calls[0]
    messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": "2"})
    assert call().content == "It is 2."
    messages.append({"role": "user", "content": "And 2 + 2?"})
    tool_call = call().tool_calls[0]
    messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": "4"})
    call()
    episode = server.close_episode(session.episode.id)
    t0, t1, t2, t3 = episode.turns
    assert_continues(t1, t0, tokenizer, "qwen3")
    assert (t2.prompt_source, t2.fork_reason, t2.parent_turn) == ("rendered", "template_not_append_only", None)
    assert t2.drift > 0 and episode.num_forks == 1
    assert t2.prompt_ids == ChatRenderer(tokenizer).render([template_message(m) for m in messages[:5]], [TOOL])
    assert_continues(t3, t2, tokenizer, "qwen3")  # the new line continues from the fork


def test_history_rewrite_side_call_and_tool_change_are_forks(start_server, tokenizers):
    tokenizer = tokenizers["qwen2_5"]
    server = scripted_server(start_server, tokenizer, itertools.cycle(["Sure.", "Noted.", "A title."]))
    session = server.open_episode()
    client = client_for(server, session)

    def call(messages, tools=None):
        kwargs = {"tools": tools} if tools else {}
        return echo(client.chat.completions.create(model="policy", messages=messages, **kwargs).choices[0].message)

    main = [{"role": "system", "content": "Be helpful."}, {"role": "user", "content": "First question."}]
    main.append(call(main))  # turn 0
    main.append({"role": "user", "content": "Second question."})
    main.append(call(main))  # turn 1: continues 0
    # A side call (a title request sharing nothing with the episode).
    call(
        [{"role": "system", "content": "Write a title."}, {"role": "user", "content": "A chat about questions."}]
    )  # turn 2
    # The main line goes on from its own parent, not from the side call.
    main.append({"role": "user", "content": "Third question."})
    main.append(call(main))  # turn 3: continues 1
    # The agent compacts its history: it drops the first exchange.
    compacted = [main[0]] + main[3:] + [{"role": "user", "content": "Fourth question."}]
    call(compacted)  # turn 4: fork
    # Same conversation, new tools: the system block changes.
    call(main + [{"role": "user", "content": "Use a tool."}], tools=[TOOL])  # turn 5: fork
    episode = server.close_episode(session.episode.id)
    turns = episode.turns
    assert [t.prompt_source for t in turns] == [
        "rendered",
        "continued",
        "rendered",
        "continued",
        "rendered",
        "rendered",
    ]
    assert [t.parent_turn for t in turns] == [None, 0, None, 1, None, None]
    assert [t.fork_reason for t in turns] == [None, None, "side_call", None, "history_rewritten", "tools_changed"]
    assert turns[2].drift == 0  # nothing shared: nothing to drift from
    assert turns[4].drift > 0 and turns[5].drift > 0
    assert episode.num_forks == 3
    assert turns[3].prompt_ids[: len(turns[1].prompt_ids) + len(turns[1].completion_ids)] == (
        turns[1].prompt_ids + turns[1].completion_ids
    )
    # A rewritten history is rendered fresh: exactly what the template gives for the messages sent.
    renderer = ChatRenderer(tokenizer)
    expected = renderer.render([{"role": m["role"], "content": m["content"]} for m in compacted], None)
    assert turns[4].prompt_ids == expected


def test_changed_answer_is_a_rewrite_not_a_continuation(start_server, tokenizers):
    """An agent that edits our answer before sending it back (other arguments) does not continue from it."""
    tokenizer = tokenizers["qwen2_5"]
    script = [tool_call_text("qwen2_5", {"expression": "1 + 1"}), "Done."]
    server = scripted_server(start_server, tokenizer, script)
    session = server.open_episode()
    client = client_for(server, session)
    messages = [{"role": "user", "content": "Add."}]
    answer = echo(client.chat.completions.create(model="policy", messages=messages, tools=[TOOL]).choices[0].message)
    answer["tool_calls"][0]["function"]["arguments"] = '{"expression": "1 + 2"}'
    messages += [answer, {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": "3"}]
    client.chat.completions.create(model="policy", messages=messages, tools=[TOOL])
    t0, t1 = server.close_episode(session.episode.id).turns
    assert (t1.prompt_source, t1.fork_reason) == ("rendered", "history_rewritten") and t1.drift > 0


def test_of_two_alike_turns_the_one_whose_tool_call_ids_come_back_is_continued(start_server, tokenizers):
    """Two requests alike, answered alike but for the tool-call ids (two sub-agents handed the same task): a call that
    sends one answer back continues that turn, not the latest alike one (issue 40); an agent that regenerates the ids
    continues the latest, as before."""
    tokenizer = tokenizers["qwen2_5"]
    script = [tool_call_text("qwen2_5", {"expression": "1 + 1"})] * 2 + ["2"] * 3
    server = scripted_server(start_server, tokenizer, script)
    session = server.open_episode()
    client = client_for(server, session)
    request = [{"role": "user", "content": "Add 1 and 1."}]
    answers = [
        echo(client.chat.completions.create(model="policy", messages=request, tools=[TOOL]).choices[0].message)
        for _ in range(2)
    ]
    assert answers[0]["tool_calls"][0]["id"] != answers[1]["tool_calls"][0]["id"]
    regenerated = json.loads(json.dumps(answers[0]))
    regenerated["tool_calls"][0]["id"] = "call_mine"
    for answer in (answers[0], answers[1], regenerated):
        result = {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": "2"}
        client.chat.completions.create(model="policy", messages=[*request, answer, result], tools=[TOOL])
    turns = server.close_episode(session.episode.id).turns
    assert [(t.prompt_source, t.parent_turn) for t in turns] == [
        ("rendered", None),
        ("rendered", None),
        ("continued", 0),
        ("continued", 1),
        ("continued", 1),
    ]
