"""Replay (issue 42): a branch episode's first `k` model calls answered with its parent's recorded completions (token
for token, without the engine), then sampled fresh; a request that does not render to the recorded prompt ends
replay there, and the branch records where and why. Real servers, the official clients of the four wire formats,
streamed and not; the engine answers from a counter, so anything it samples differs from what it sampled before."""

from __future__ import annotations

import itertools
import json
import time

import anthropic
import httpx
import pytest
from google.genai import types

from conftest import ScriptedEngine
from test_endpoint_anthropic_messages import ANTHROPIC_TOOL
from test_endpoint_continuation import TOOL, tool_call_text
from test_endpoint_gemini import DECLARATION
from test_endpoint_gemini import client_for as genai_client
from test_endpoint_responses import RESPONSES_TOOL, client_for, tokenizers  # noqa: F401
from trl_agentic.rollout.rows import episode_to_rows
from trl_agentic.trace import Episode, ReplaySpec


ROUNDS = 3  # tool calls before the answer: 4 model calls per episode


class CountingEngine(ScriptedEngine):
    """Calls the calculator until the prompt holds `ROUNDS` tool results, then answers; every answer carries the
    engine's call count, so a sampled call never repeats an earlier one (as a sampling model would not)."""

    def __init__(self, tokenizer, family):
        self.count = itertools.count()
        self.family = family

        def respond(prompt_ids):
            n = next(self.count)
            results = tokenizer.decode(prompt_ids).count("RESULT")
            if results >= ROUNDS:
                return f"The answer is {n}."
            return tool_call_text(family, {"expression": f"{results} + {n}"})

        super().__init__(tokenizer, respond)


def result_of(arguments) -> str:
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    return f"RESULT {arguments['expression']}"


# One driver per wire format: the agent's usual tool loop with the format's official client. `salt()` (when given)
# goes into the system prompt of every call after the first: a non-deterministic agent (a clock in its prompt).


def drive_chat(server, session, stream, salt=None):
    import openai

    client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=30)
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "Add."}]
    for k in range(ROUNDS + 2):
        if salt and k:
            messages[0] = {"role": "system", "content": f"Use the calculator. Now: {salt()}"}
        if stream:
            events = client.chat.completions.create(model="policy", messages=messages, tools=[TOOL], stream=True)
            content, calls = "", {}
            for chunk in events:
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for call in delta.tool_calls or ():
                    entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                    entry["id"] = call.id or entry["id"]
                    entry["name"] += (call.function.name or "") if call.function else ""
                    entry["arguments"] += (call.function.arguments or "") if call.function else ""
            tool_calls = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls.values()
            ]
            message = {"role": "assistant", "content": content or None}
            if tool_calls:
                message["tool_calls"] = tool_calls
        else:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=[TOOL])
            message = reply.choices[0].message.model_dump(exclude_unset=True)
        messages.append(message)
        if not message.get("tool_calls"):
            return
        for call in message["tool_calls"]:
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": result_of(call["function"]["arguments"])}
            )


def drive_responses(server, session, stream, salt=None):
    client = client_for(server, session)
    items: list = [{"role": "user", "content": "Add."}]
    for k in range(ROUNDS + 2):
        instructions = f"Use the calculator. Now: {salt()}" if salt and k else "Use the calculator."
        kwargs = dict(model="policy", instructions=instructions, input=items, tools=[RESPONSES_TOOL])
        if stream:
            with client.responses.stream(**kwargs) as events:
                list(events)
                response = events.get_final_response()
        else:
            response = client.responses.create(**kwargs)
        items += response.output
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            return
        for call in calls:
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": result_of(call.arguments)})


def drive_anthropic(server, session, stream, salt=None):
    client = anthropic.Anthropic(base_url=server.url, api_key=session.key, max_retries=0, timeout=30)
    messages: list = [{"role": "user", "content": "Add."}]
    for k in range(ROUNDS + 2):
        system = f"Use the calculator. Now: {salt()}" if salt and k else "Use the calculator."
        kwargs = dict(model="policy", max_tokens=64, system=system, messages=messages, tools=[ANTHROPIC_TOOL])
        if stream:
            with client.messages.stream(**kwargs) as events:
                list(events)
                message = events.get_final_message()
        else:
            message = client.messages.create(**kwargs)
        messages.append({"role": "assistant", "content": message.content})
        if message.stop_reason != "tool_use":
            return
        results = [
            {"type": "tool_result", "tool_use_id": block.id, "content": result_of(block.input)}
            for block in message.content
            if block.type == "tool_use"
        ]
        messages.append({"role": "user", "content": results})


def drive_gemini(server, session, stream, salt=None):
    client = genai_client(server.url, session.key)
    contents: list = [types.Content(role="user", parts=[types.Part(text="Add.")])]
    for k in range(ROUNDS + 2):
        config = types.GenerateContentConfig(
            system_instruction=f"Use the calculator. Now: {salt()}" if salt and k else "Use the calculator.",
            tools=[types.Tool(function_declarations=[DECLARATION])],
            max_output_tokens=64,
        )
        if stream:
            chunks = list(client.models.generate_content_stream(model="policy", contents=contents, config=config))
            parts = [part for chunk in chunks for part in chunk.candidates[0].content.parts]
        else:
            response = client.models.generate_content(model="policy", contents=contents, config=config)
            parts = response.candidates[0].content.parts
        contents.append(types.Content(role="model", parts=parts))
        calls = [part.function_call for part in parts if part.function_call]
        if not calls:
            return
        contents.append(
            types.Content(
                role="user",
                parts=[
                    types.Part.from_function_response(name=call.name, response={"output": result_of(call.args)})
                    for call in calls
                ],
            )
        )


DRIVERS = {
    "chat_completions": drive_chat,
    "responses": drive_responses,
    "anthropic_messages": drive_anthropic,
    "gemini": drive_gemini,
}


def run(server, drive, stream, replay=None, salt=None) -> Episode:
    session = server.open_episode(replay=replay)
    drive(server, session, stream, salt)
    return server.close_episode(session.episode.id)


def assert_replayed_prefix(branch: Episode, parent: Episode, k: int) -> None:
    """The branch's first `k` calls are the parent's, int lists compared exactly, and marked replayed."""
    for j in range(k):
        ours, theirs = branch.turns[j], parent.turns[j]
        assert ours.replayed and not theirs.replayed
        assert ours.prompt_ids == theirs.prompt_ids
        assert ours.completion_ids == theirs.completion_ids
        assert ours.logprobs == theirs.logprobs
        assert ours.response_message == theirs.response_message
        assert ours.request_messages == theirs.request_messages


@pytest.mark.parametrize("wire_format", list(DRIVERS))
@pytest.mark.parametrize("stream", [False, True])
def test_branch_replays_the_parent_then_samples(start_server, tokenizers, wire_format, stream):
    """Parent: 3 tool calls and an answer. Branch at k=2: calls 0 and 1 are the parent's token for token and never
    reach the engine; call 2 renders to the parent's prompt but is sampled (a new tool call), and the agent goes on."""
    family = "qwen2_5"
    engine = CountingEngine(tokenizers[family], family)
    server = start_server(engine, tokenizers[family])
    drive = DRIVERS[wire_format]
    parent = run(server, drive, stream)
    assert len(parent.turns) == ROUNDS + 1 and parent.num_replayed_calls == 0 and parent.replay is None
    sampled_before = len(engine.prompts)

    branch = run(server, drive, stream, replay=ReplaySpec.from_episode(parent, 2))
    assert {turn.wire_format for turn in branch.turns} == {wire_format}
    assert_replayed_prefix(branch, parent, 2)
    fresh = branch.turns[2]
    assert not fresh.replayed and fresh.replay_divergence is None
    assert fresh.prompt_ids == parent.turns[2].prompt_ids  # the same request, token for token ...
    assert fresh.completion_ids != parent.turns[2].completion_ids  # ... sampled anew
    assert len(engine.prompts) - sampled_before == len(branch.turns) - 2  # replayed calls never reached the engine
    assert engine.prompts[sampled_before] == parent.turns[2].prompt_ids
    assert branch.replay == {
        "parent": parent.id,
        "branch_point": 2,
        "replayed_calls": 2,
        "diverged": False,
        "divergence": None,
    }
    assert branch.num_forks == 0  # the replayed turns are continued as sampled ones are: one token-exact row
    (row,) = episode_to_rows(branch.turns).rows
    last = branch.turns[-1]
    assert row.prompt_ids + row.completion_ids == last.prompt_ids + last.completion_ids


@pytest.mark.parametrize("wire_format", list(DRIVERS))
@pytest.mark.parametrize("stream", [False, True])
def test_a_clock_in_the_prompt_ends_replay_and_is_recorded(start_server, tokenizers, wire_format, stream):
    """A non-deterministic agent (the time in its system prompt from its second call on): call 0 is replayed, call 1
    renders to another prompt, so replay ends there: sampled, its turn says at which token and why, the episode counts
    it, and the branch still makes a trainable row."""
    family = "qwen2_5"
    engine = CountingEngine(tokenizers[family], family)
    server = start_server(engine, tokenizers[family])
    drive = DRIVERS[wire_format]
    clock = lambda: f"{time.time_ns()}"  # noqa: E731
    parent = run(server, drive, stream, salt=clock)
    branch = run(server, drive, stream, replay=ReplaySpec.from_episode(parent, 3), salt=clock)
    assert_replayed_prefix(branch, parent, 1)
    diverged = branch.turns[1]
    assert not diverged.replayed and not any(turn.replayed for turn in branch.turns[1:])
    divergence = diverged.replay_divergence
    assert divergence["call"] == 1 and divergence["reason"] == "prompt_mismatch"
    at = divergence["token_index"]
    assert diverged.prompt_ids[:at] == parent.turns[1].prompt_ids[:at]
    assert diverged.prompt_ids[at] != parent.turns[1].prompt_ids[at]
    # A short decoded context each side of the first differing token: the clock's digits.
    assert divergence["request_context"] != divergence["recorded_context"]
    assert tokenizers[family].decode(diverged.prompt_ids[at : at + 1]) in divergence["request_context"]
    assert branch.replay["replayed_calls"] == 1 and branch.replay["diverged"] is True
    assert branch.replay["divergence"] == divergence
    assert branch.status == "ok" and all(turn.completion_ids for turn in branch.turns)
    rows = episode_to_rows(branch.turns).rows
    assert rows and sum(sum(row.env_mask) for row in rows) == sum(len(t.completion_ids) for t in branch.turns)


def test_replay_spec_round_trips_and_checks_its_branch_point(start_server, tokenizers):
    family = "qwen2_5"
    server = start_server(CountingEngine(tokenizers[family], family), tokenizers[family])
    parent = run(server, drive_chat, False)
    spec = ReplaySpec.from_episode(parent, len(parent.turns))
    again = ReplaySpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert [t.completion_ids for t in again.calls] == [t.completion_ids for t in parent.turns]
    assert again.branch_point == len(parent.turns) and again.parent_id == parent.id
    with pytest.raises(ValueError, match=r"branch point is an int in \[0, 4\]"):
        ReplaySpec.from_episode(parent, 5)
    # Over the admin route: the same replay, and a bad one answered 400.
    token = server.admin_token
    opened = httpx.post(
        f"{server.url}/admin/episodes",
        json={"replay": ReplaySpec.from_episode(parent, 4).to_dict()},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert opened.status_code == 200, opened.text
    session = server.registry.by_id(opened.json()["id"])
    drive_chat(server, session, False)
    branch = server.close_episode(session.episode.id)
    assert branch.num_replayed_calls == 4 and branch.replay["diverged"] is False
    assert_replayed_prefix(branch, parent, 4)
    bad = httpx.post(
        f"{server.url}/admin/episodes",
        json={"replay": {"calls": [], "branch_point": 2}},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert bad.status_code == 400 and "branch_point" in bad.json()["error"]["message"]


def test_a_branch_that_stops_early_or_asks_for_n_choices_is_counted_diverged(start_server, tokenizers):
    family = "qwen2_5"
    server = start_server(CountingEngine(tokenizers[family], family), tokenizers[family])
    parent = run(server, drive_chat, False)
    # The agent gives up after one call: the branch never reached its branch point.
    session = server.open_episode(replay=ReplaySpec.from_episode(parent, 3))
    import openai

    client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=30)
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "Add."}]
    client.chat.completions.create(model="policy", messages=messages, tools=[TOOL])
    early = server.close_episode(session.episode.id)
    assert early.replay["replayed_calls"] == 1 and early.replay["diverged"] is True
    assert early.replay["divergence"]["reason"] == "ended_before_branch_point"
    # n=2 on a replayed call: replay ends, both choices are sampled.
    session = server.open_episode(replay=ReplaySpec.from_episode(parent, 3))
    client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=30)
    reply = client.chat.completions.create(model="policy", messages=messages, tools=[TOOL], n=2)
    assert len(reply.choices) == 2
    forked = server.close_episode(session.episode.id)
    assert [turn.replayed for turn in forked.turns] == [False, False]
    assert forked.turns[0].replay_divergence["reason"] == "choices"
    assert forked.replay["diverged"] is True and forked.replay["replayed_calls"] == 0
