"""Lineage (trl_agentic/lineage.py): an episode's main line is the task's conversation, decided when the episode
closes, never by call order (issue 31). A title request first, a sub-agent handed a task by a tool call, through the
real endpoint with the official `openai` and `anthropic` clients; rows checked token for token, and trained.
"""

import json
import os
import shutil
import subprocess

import anthropic
import openai
import pytest
from datasets import Dataset

from conftest import ScriptedEngine
from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.endpoint.chat import ChatRenderer
from trl_agentic.endpoint.protocol import template_message
from trl_agentic.lineage import find_conversations
from trl_agentic.rollout.rows import episode_to_rows
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer
from trl_agentic.trace import Turn


pytestmark = pytest.mark.usefixtures("single_torch_thread")

TASK = "Create a file answer.txt containing 42."
TITLE_SYSTEM = "Generate a title of at most five words for the conversation."
MAIN_SYSTEM = "You are a coding agent. Use the tools."
SUB_SYSTEM = "You are a sub-agent: search the workspace and report."
SUB_PROMPT = "List every file of the workspace and say which one holds 42."
SUB_ANSWER = "No file holds 42 yet."
# What Claude Code 2.1.197 puts before the prompt it hands a sub-agent, in the same string
REMINDER = "<system-reminder>\nAs you answer the user's questions, you can use the following context:\n</system-reminder>\n\n\n"
SHELL = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}
AGENT = {
    "type": "function",
    "function": {
        "name": "agent",
        "description": "Hand a task to a sub-agent.",
        "parameters": {
            "type": "object",
            "properties": {"description": {"type": "string"}, "prompt": {"type": "string"}},
            "required": ["prompt"],
        },
    },
}


def call_text(name, arguments):
    """A tool call in Qwen2.5's format, as a model trained on its template samples it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def anthropic_tool(tool):
    function = tool["function"]
    return {"name": function["name"], "description": function["description"], "input_schema": function["parameters"]}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


def scripted_server(start_server, tokenizer, script):
    script = iter(script)
    return start_server(ScriptedEngine(tokenizer, lambda prompt: next(script)), tokenizer)


def sampled(tokenizer, text):
    """The ids the scripted engine samples for `text`: its tokens and the end of turn."""
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


def context_between(turn, parent):
    """What `turn`'s prompt adds to its parent's exact ids (the tool result or user turn, template glue)."""
    exact = parent.prompt_ids + parent.completion_ids
    assert (turn.prompt_source, turn.parent_turn) == ("continued", parent.index)
    assert turn.prompt_ids[: len(exact)] == exact
    return turn.prompt_ids[len(exact) :]


def test_title_call_first_leaves_the_task_conversation_the_main_line(start_server, tokenizer):
    """opencode and Claude Code ask for a title first: that call is a side call, the task's conversation (asked second)
    is the main line, one row with 0 forks; `side_calls="skip"` drops only the title."""
    script = ["Answer file", call_text("shell", {"command": "echo 42 > answer.txt"}), "Done."]
    server = scripted_server(start_server, tokenizer, script)
    session = server.open_episode()
    client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=30)
    title = [{"role": "system", "content": TITLE_SYSTEM}, {"role": "user", "content": TASK}]
    assert client.chat.completions.create(model="policy", messages=title).choices[0].message.content == "Answer file"
    messages = [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": TASK}]
    message = client.chat.completions.create(model="policy", messages=messages, tools=[SHELL]).choices[0].message
    messages += [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": ""},
    ]
    final = client.chat.completions.create(model="policy", messages=messages, tools=[SHELL]).choices[0].message
    assert final.content == "Done."
    episode = server.close_episode(session.episode.id)

    t0, t1, t2 = episode.turns
    assert [(t.role, t.conversation) for t in episode.turns] == [("side_call", 0), ("main", 1), ("main", 1)]
    assert (t1.prompt_source, t1.fork_reason, t1.forked_from) == ("rendered", "side_call", None)
    assert episode.num_main_line_forks == 0
    assert episode.messages == [*t2.request_messages, t2.response_message]
    assert episode.messages[1]["content"] == TASK and episode.messages[-1]["content"] == "Done."

    renderer = ChatRenderer(tokenizer)
    context = context_between(t2, t1)
    main_row, title_row = episode_to_rows(episode.turns).rows
    assert (main_row.kind, main_row.role, main_row.turns) == ("main", "main", [1, 2])
    assert main_row.prompt_ids == renderer.render([template_message(m) for m in messages[:2]], [SHELL])
    assert main_row.completion_ids == sampled(tokenizer, script[1]) + context + sampled(tokenizer, "Done.")
    assert main_row.env_mask == [1] * len(sampled(tokenizer, script[1])) + [0] * len(context) + [1] * len(
        sampled(tokenizer, "Done.")
    )
    assert (title_row.kind, title_row.role, title_row.turns) == ("side_call", "side_call", [0])
    assert title_row.prompt_ids == renderer.render(title, None)
    assert title_row.completion_ids == sampled(tokenizer, "Answer file")
    assert title_row.env_mask == [1] * len(title_row.completion_ids)

    skipped = episode_to_rows(episode.turns, side_calls="skip")
    assert skipped.rows == [main_row] and skipped.skipped_turns == [0]


def test_main_line_sub_agent_and_title_call_are_three_rows(start_server, tokenizer):
    """Claude Code's shape over the Messages API: a title request, the task's conversation, and a sub-agent its
    `agent` tool call hands a task to (its own system prompt and tools; a reminder before the task, as Claude Code
    sends). One main row, one side-call row, one sub-agent row, each token-exact; `sub_agents="skip"` drops only
    the sub-agent."""
    script = [
        "Answer file",  # turn 0: the title
        call_text("agent", {"description": "Look around", "prompt": SUB_PROMPT}),  # turn 1: main
        call_text("shell", {"command": "ls"}),  # turn 2: the sub-agent
        SUB_ANSWER,  # turn 3: the sub-agent's report
        call_text("shell", {"command": "echo 42 > answer.txt"}),  # turn 4: main, given the report
        "Done.",  # turn 5: main
    ]
    server = scripted_server(start_server, tokenizer, script)
    session = server.open_episode()
    client = anthropic.Anthropic(base_url=server.url, api_key=session.key, max_retries=0, timeout=30)
    # Claude Code's session hint rides along; lineage does not need it.
    metadata = {"user_id": "user_0_account__session_1234"}

    def run(system, messages, tools):
        """An agent loop: execute tool calls (the `agent` tool runs a sub-agent) until the model answers."""
        while True:
            kwargs = {"tools": [anthropic_tool(t) for t in tools]} if tools else {}
            message = client.messages.create(
                model="policy", max_tokens=256, system=system, messages=messages, metadata=metadata, **kwargs
            )
            messages.append({"role": "assistant", "content": message.content})
            if message.stop_reason != "tool_use":
                return message.content[-1].text
            results = []
            for block in message.content:
                if block.type == "tool_use":
                    output = (
                        # Claude Code's reminder block comes first, the task in a text block of its own
                        run(SUB_SYSTEM, [{"role": "user", "content": REMINDER + block.input["prompt"]}], [SHELL])
                        if block.name == "agent"
                        else ""
                    )
                    results.append({"type": "tool_result", "tool_use_id": block.id, "content": output})
            messages.append({"role": "user", "content": results})

    assert run(TITLE_SYSTEM, [{"role": "user", "content": TASK}], None) == "Answer file"
    assert run(MAIN_SYSTEM, [{"role": "user", "content": TASK}], [SHELL, AGENT]) == "Done."
    episode = server.close_episode(session.episode.id)

    turns = episode.turns
    assert [t.role for t in turns] == ["side_call", "main", "sub_agent", "sub_agent", "main", "main"]
    assert [t.conversation for t in turns] == [0, 1, 2, 2, 1, 1]
    assert [t.spawned_by for t in turns] == [None, None, 1, 1, None, None]  # the main line's `agent` call
    assert [t.prompt_source for t in turns] == [
        "rendered",
        "rendered",
        "rendered",
        "continued",
        "continued",
        "continued",
    ]
    assert episode.num_main_line_forks == 0
    assert episode.messages == [*turns[5].request_messages, turns[5].response_message]
    assert episode.messages[-1]["content"] == "Done."

    result = episode_to_rows(turns)
    assert [(r.kind, r.role, r.conversation, r.turns) for r in result.rows] == [
        ("main", "main", 1, [1, 4, 5]),
        ("side_call", "side_call", 0, [0]),
        ("sub_agent", "sub_agent", 2, [2, 3]),
    ]
    main_row, title_row, sub_row = result.rows
    ids = [sampled(tokenizer, text) for text in script]
    report, after_shell = context_between(turns[4], turns[1]), context_between(turns[5], turns[4])
    assert SUB_ANSWER in tokenizer.decode(report)  # the main line saw the sub-agent's report as its tool result
    assert main_row.prompt_ids == turns[1].prompt_ids
    assert main_row.completion_ids == ids[1] + report + ids[4] + after_shell + ids[5]
    assert main_row.env_mask == (
        [1] * len(ids[1]) + [0] * len(report) + [1] * len(ids[4]) + [0] * len(after_shell) + [1] * len(ids[5])
    )
    assert title_row.prompt_ids == turns[0].prompt_ids and title_row.completion_ids == ids[0]
    ls_output = context_between(turns[3], turns[2])
    assert sub_row.prompt_ids == turns[2].prompt_ids
    assert tokenizer.decode(sub_row.prompt_ids).count(SUB_PROMPT) == 1 and SUB_SYSTEM in tokenizer.decode(
        sub_row.prompt_ids
    )
    assert sub_row.completion_ids == ids[2] + ls_output + ids[3]
    assert sub_row.env_mask == [1] * len(ids[2]) + [0] * len(ls_output) + [1] * len(ids[3])
    # Every sampled token is trained once, in exactly one row.
    in_rows = sorted(tok for r in result.rows for tok, m in zip(r.completion_ids, r.env_mask, strict=True) if m)
    assert in_rows == sorted(tok for t in turns for tok in t.completion_ids)

    no_sub_agents = episode_to_rows(turns, sub_agents="skip")
    assert [r.kind for r in no_sub_agents.rows] == ["main", "side_call"] and no_sub_agents.skipped_turns == [2, 3]
    no_side_calls = episode_to_rows(turns, side_calls="skip")
    assert [r.kind for r in no_side_calls.rows] == ["main", "sub_agent"] and no_side_calls.skipped_turns == [0]
    capped = episode_to_rows(turns, max_rows=1)  # the main line is kept first, whatever came first
    assert [r.turns for r in capped.rows] == [[1, 4, 5]] and capped.capped_turns == [0, 2, 3]


def turn(
    index, prompt, completion, messages=(), tools=None, answer=None, parent=None, forked_from=None, fork_reason=None
):
    return Turn(
        index,
        list(prompt),
        list(completion),
        [-0.5] * len(completion),
        "stop",
        request_messages=list(messages),
        request_tools=tools,
        response_message=answer or {},
        prompt_source="continued" if parent is not None else "rendered",
        parent_turn=parent,
        forked_from=forked_from,
        fork_reason=fork_reason,
    )


def user(text):
    return {"role": "user", "content": text}


def test_rules_on_plain_turns():
    """Each rule on hand-made turns: a sub-agent is spawned by the tool call whose task is its user message, a retry
    joins the request it repeats, a compaction restart joins its conversation, the task's prompt outranks length and
    order, a short tool argument spawns nothing."""
    system = {"role": "system", "content": MAIN_SYSTEM}

    def calls(name, arguments):
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
            ],
        }

    turns = [
        turn(0, [1, 2], [3], [system, user(TASK)], [SHELL], answer=calls("agent", {"prompt": SUB_PROMPT})),
        turn(1, [4, 5], [6], [user(SUB_PROMPT)], [SHELL]),  # the sub-agent: quotes the open call
        turn(2, [4, 5], [7], [user(SUB_PROMPT)], [SHELL], forked_from=1),  # a retry of the same request
        turn(
            3,
            [1, 2, 3, 8],
            [9],
            [system, user(TASK)],
            [SHELL],
            answer={"role": "assistant", "content": "Done."},
            parent=0,
        ),
        # A compaction restart keeping the system prompt: quotes the sub-agent's task, which hands nothing over.
        turn(
            4,
            [1, 10],
            [11],
            [system, user("Summary: " + SUB_PROMPT)],
            [SHELL],
            forked_from=3,
            fork_reason="history_rewritten",
        ),
        turn(5, [12] * 20, [13], [user("Hi.")], [SHELL]),  # unrelated, the longest, and last
    ]
    found = {c.index: (c.role, c.turns, c.spawned_by) for c in find_conversations(turns, [user(TASK)])}
    assert found == {0: ("main", [0, 3, 4], None), 1: ("sub_agent", [1, 2], 0), 5: ("side_call", [5], None)}
    # Without the task's prompt, the conversation with tools that reaches the episode's end is the main line.
    assert {c.index: c.role for c in find_conversations(turns)} == {0: "side_call", 1: "sub_agent", 5: "main"}
    # Labelled as the endpoint does at close, rows follow: the restart is a fork of the main line.
    for c in find_conversations(turns, TASK):
        for index in c.turns:
            turns[index].conversation, turns[index].role = c.index, c.role
    assert [(r.kind, r.role, r.turns) for r in episode_to_rows(turns).rows] == [
        ("main", "main", [0, 3]),
        ("fork", "main", [4]),
        ("sub_agent", "sub_agent", [1]),
        ("fork", "sub_agent", [2]),
        ("side_call", "side_call", [5]),
    ]

    short = [
        turn(0, [1], [2], [user(TASK)], [SHELL], answer=calls("shell", {"command": "ls"})),
        turn(1, [3], [4], [user("ls the folder, then stop.")], [SHELL]),
    ]
    assert [(c.role, c.spawned_by) for c in find_conversations(short, TASK)] == [("main", None), ("side_call", None)]


def test_a_sub_agent_started_after_its_parent_went_on_is_found_by_its_whole_task():
    """A background sub-agent (Codex's `spawn_agent` answers at once: the sub-agent's first request comes after the
    parent's next call) is spawned by the turn whose call argument is, as a whole, its request's last user message;
    with the parent's history (`fork_context`) as well. A request that only quotes an answered call's argument (a
    compaction summary) stays a fork of its conversation."""
    system = {"role": "system", "content": MAIN_SYSTEM}
    spawn = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "spawn", "arguments": json.dumps({"msg": SUB_PROMPT})}}
        ],
    }
    answered = [system, user(TASK), spawn, {"role": "tool", "tool_call_id": "a", "content": "agent 7"}]
    head = [1, 2, 3, 4]  # the system prompt and the task, shared by every request below
    for history in ([], [spawn]):  # fresh; carrying the parent's history (an assistant message in it)
        turns = [
            turn(0, head, [5], [system, user(TASK)], [SHELL], answer=spawn),
            turn(
                1, [*head, 5, 6], [7], answered, [SHELL], answer={"role": "assistant", "content": "Waiting."}, parent=0
            ),
            turn(
                2,
                [*head, 8],
                [9],
                [system, user(TASK), *history, user(SUB_PROMPT)],
                [SHELL],
                forked_from=1,
                fork_reason="history_rewritten",
            ),
            turn(3, [*head, 8, 9, 10], [11], [system, user(TASK), *history, user(SUB_PROMPT)], [SHELL], parent=2),
            turn(
                4,
                [*head, 12],
                [13],
                [system, user("Summary: " + SUB_PROMPT)],
                [SHELL],
                forked_from=1,
                fork_reason="history_rewritten",
            ),
            turn(
                5,
                [*head, 14],
                [15],
                [system, user(TASK), user(SUB_PROMPT + " Also list the folder.")],
                [SHELL],
                forked_from=1,
                fork_reason="history_rewritten",
            ),
        ]
        found = {c.index: (c.role, c.turns, c.spawned_by) for c in find_conversations(turns, TASK)}
        assert found == {0: ("main", [0, 1, 4, 5], None), 2: ("sub_agent", [2, 3], 0)}, history


SUMMARY_SYSTEM = "You summarize coding sessions so that they can go on from the summary."
HELPER_SYSTEM = "Write a one-line commit message for the diff."
FILE_PATH = "/workspace/src/answer_module/answer.txt"  # a tool argument of 30+ characters, quoted by helper requests
EDIT = {
    "type": "function",
    "function": {
        "name": "edit",
        "description": "Write a file.",
        "parameters": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["file_path", "content"],
        },
    },
}


def answered(message, output):
    """The assistant `message` as the agent sends it back, and the result of its (first) tool call."""
    return [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": output},
    ]


@pytest.mark.parametrize("summary_system", [SUMMARY_SYSTEM, MAIN_SYSTEM], ids=["own_system", "main_system"])
def test_a_compaction_restart_continues_the_main_line(start_server, tokenizer, summary_system):
    """A harness compacts its history: a summary request carrying the whole history and the tools (the longest call,
    holding the task), then a restart with the system prompt, the tools and the summary, which quotes the `edit`
    call's file path. The restart and what follows are the main line, whose last answer is the episode's; the summary
    request is a side call (or, sent with the main system prompt, a continuation of the main line); nothing is a
    sub-agent, so `sub_agents="skip"` still trains the work after the compaction."""
    summary = f"Summary: the task is to write 42; I wrote it into {FILE_PATH}, check it."
    script = [
        call_text("edit", {"file_path": FILE_PATH, "content": "42"}),
        summary,
        call_text("shell", {"command": f"cat {FILE_PATH}"}),
        "Done: answer.txt holds 42.",
    ]
    server = scripted_server(start_server, tokenizer, script)
    session = server.open_episode(metadata={"task_prompt": [user(TASK)]})
    client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=30)
    tools = [SHELL, EDIT]
    history = [{"role": "system", "content": MAIN_SYSTEM}, user(TASK)]
    history += answered(
        client.chat.completions.create(model="policy", messages=history, tools=tools).choices[0].message, ""
    )
    compact = [{"role": "system", "content": summary_system}, *history[1:], user("Summarize the session so far.")]
    said = client.chat.completions.create(model="policy", messages=compact, tools=tools).choices[0].message.content
    assert said == summary
    restart = [{"role": "system", "content": MAIN_SYSTEM}, user("This session goes on from a summary:\n" + said)]
    restart += answered(
        client.chat.completions.create(model="policy", messages=restart, tools=tools).choices[0].message, "42"
    )
    final = client.chat.completions.create(model="policy", messages=restart, tools=tools).choices[0].message
    assert final.content == "Done: answer.txt holds 42."
    episode = server.close_episode(session.episode.id)

    turns = episode.turns
    own = summary_system == SUMMARY_SYSTEM
    assert [t.prompt_source for t in turns] == ["rendered", "rendered" if own else "continued", "rendered", "continued"]
    assert [t.role for t in turns] == ["main", "side_call" if own else "main", "main", "main"]
    assert [t.conversation for t in turns] == [0, 1 if own else 0, 0, 0]
    assert [t.spawned_by for t in turns] == [None] * 4
    assert episode.messages == [*turns[3].request_messages, turns[3].response_message]
    assert episode.messages[-1]["content"] == "Done: answer.txt holds 42."
    rows = [(r.kind, r.role, r.turns) for r in episode_to_rows(turns).rows]
    if own:
        assert rows == [("main", "main", [0]), ("fork", "main", [2, 3]), ("side_call", "side_call", [1])]
    else:
        assert rows == [("main", "main", [0, 1]), ("fork", "main", [2, 3])]
    no_sub_agents = episode_to_rows(turns, sub_agents="skip")
    assert [(r.kind, r.turns) for r in no_sub_agents.rows] == [(kind, ts) for kind, _, ts in rows]
    assert no_sub_agents.skipped_turns == []


def test_a_helper_call_quoting_a_tool_argument_is_a_side_call(start_server, tokenizer):
    """A commit-message request while the main line's `edit` call runs quotes that call's 30+ character file path: it
    is a side call (no tool call handed it its task), not a sub-agent."""
    script = [call_text("edit", {"file_path": FILE_PATH, "content": "42"}), "Write 42 to answer.txt", "Done."]
    server = scripted_server(start_server, tokenizer, script)
    session = server.open_episode(metadata={"task_prompt": TASK})
    client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=30)
    history = [{"role": "system", "content": MAIN_SYSTEM}, user(TASK)]
    call = client.chat.completions.create(model="policy", messages=history, tools=[EDIT]).choices[0].message
    helper = [{"role": "system", "content": HELPER_SYSTEM}, user(f"--- a/{FILE_PATH}\n+++ b/{FILE_PATH}\n+42")]
    assert client.chat.completions.create(model="policy", messages=helper).choices[0].message.content == script[1]
    history += answered(call, "Edited.")
    assert client.chat.completions.create(model="policy", messages=history, tools=[EDIT]).choices[
        0
    ].message.content == ("Done.")
    episode = server.close_episode(session.episode.id)

    assert [(t.role, t.conversation, t.spawned_by) for t in episode.turns] == [
        ("main", 0, None),
        ("side_call", 1, None),
        ("main", 0, None),
    ]
    assert [(r.kind, r.turns) for r in episode_to_rows(episode.turns).rows] == [("main", [0, 2]), ("side_call", [1])]


def test_parallel_sub_agents_with_the_same_task_are_two_conversations(start_server, tokenizer):
    """Two `agent` calls with the same prompt in one answer run two sub-agents whose first requests are identical, and
    so are their answers (a tool call each, with its own id): each is a conversation of its own, spawned by the main
    line's turn, and each continuation continues its own sub-agent's call (the endpoint tells them apart by the
    tool-call ids), so neither is a fork that `forks="skip"` would drop."""
    spawn = {"description": "Look around", "prompt": SUB_PROMPT}
    script = [
        call_text("agent", spawn) + "\n" + call_text("agent", spawn),  # turn 0: main, two sub-agents
        call_text("shell", {"command": "ls"}),  # turn 1: the first sub-agent
        call_text("shell", {"command": "ls"}),  # turn 2: the second, the same request and answer
        SUB_ANSWER,  # turn 3: the first sub-agent's report
        SUB_ANSWER,  # turn 4: the second's
        "Done.",  # turn 5: main
    ]
    server = scripted_server(start_server, tokenizer, script)
    session = server.open_episode(metadata={"task_prompt": TASK})
    client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=30)

    def create(messages, tools):
        return client.chat.completions.create(model="policy", messages=messages, tools=tools).choices[0].message

    main = [{"role": "system", "content": MAIN_SYSTEM}, user(TASK)]
    spawning = create(main, [SHELL, AGENT])
    assert [json.loads(c.function.arguments) for c in spawning.tool_calls] == [spawn, spawn]
    subs = [[{"role": "system", "content": SUB_SYSTEM}, user(REMINDER + SUB_PROMPT)] for _ in range(2)]  # Claude Code's
    for sub in subs:  # both start before either goes on
        sub += answered(create(sub, [SHELL]), "answer.txt")
    assert subs[0][2]["tool_calls"][0]["id"] != subs[1][2]["tool_calls"][0]["id"]
    reports = [create(sub, [SHELL]).content for sub in subs]
    main.append(spawning.model_dump(exclude_none=True))
    main += [{"role": "tool", "tool_call_id": c.id, "content": r} for c, r in zip(spawning.tool_calls, reports)]
    assert create(main, [SHELL, AGENT]).content == "Done."
    episode = server.close_episode(session.episode.id)

    turns = episode.turns
    assert [(t.prompt_source, t.parent_turn) for t in turns] == [
        ("rendered", None),
        ("rendered", None),
        ("rendered", None),
        ("continued", 1),
        ("continued", 2),
        ("continued", 0),
    ]
    assert [t.role for t in turns] == ["main", "sub_agent", "sub_agent", "sub_agent", "sub_agent", "main"]
    assert [t.conversation for t in turns] == [0, 1, 2, 1, 2, 0]
    assert [t.spawned_by for t in turns] == [None, 0, 0, 0, 0, None]
    rows = episode_to_rows(turns, forks="skip")
    assert [(r.kind, r.conversation, r.turns) for r in rows.rows] == [
        ("main", 0, [0, 5]),
        ("sub_agent", 1, [1, 3]),
        ("sub_agent", 2, [2, 4]),
    ]
    assert rows.skipped_turns == []


def calls(*arguments, name="agent", ids=None):
    """An assistant message calling `name` once per arguments dict (ids `c0`, `c1`, ... unless given)."""
    ids = ids or [f"c{k}" for k in range(len(arguments))]
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": i, "type": "function", "function": {"name": name, "arguments": json.dumps(a)}}
            for i, a in zip(ids, arguments, strict=True)
        ],
    }


def test_sub_agents_are_spawned_by_a_call_handing_them_their_task():
    """On hand-made turns: each spawning call starts one sub-agent (a second call with the same task, a second
    sub-agent; a retry of a request whose call already started one, that one); the task may be one text part of the
    first user message (Claude Code puts a reminder before it); a request that only quotes a call's task is that call's
    sub-agent when its answer comes back as the call's result, and a side call when it does not."""
    system, sub_system = {"role": "system", "content": MAIN_SYSTEM}, {"role": "system", "content": SUB_SYSTEM}
    other, third = "Count the lines of every file of the workspace.", "Find the largest file of the workspace."
    reminder = {"type": "text", "text": "<system-reminder>Today is Monday.</system-reminder>"}
    report = {"role": "assistant", "content": SUB_ANSWER}
    largest = "README.md is the largest."

    def result(call_id, content):
        return {"role": "tool", "tool_call_id": call_id, "content": content}

    m3 = [system, user(TASK), calls({"prompt": SUB_PROMPT}), result("c0", SUB_ANSWER)]
    m6 = [*m3, calls({"prompt": SUB_PROMPT}, {"prompt": other}, ids=["c1", "c2"]), result("c1", "-"), result("c2", "-")]
    m9 = [*m6, calls({"prompt": third}, ids=["c3"]), result("c3", largest)]
    turns = [
        turn(0, [1, 2], [3], m3[:2], [SHELL, AGENT], answer=m3[2]),
        turn(1, [4, 5], [6], [sub_system, user(SUB_PROMPT)], [SHELL], answer=report),  # turn 0's call's sub-agent
        turn(2, [4, 5], [6], [sub_system, user(SUB_PROMPT)], [SHELL], answer=report, forked_from=1),  # its retry
        turn(3, [1, 2, 3, 7], [8], m3, [SHELL, AGENT], answer=m6[4], parent=0),
        # The same task again, by turn 3's first call: a second sub-agent, although the request is turn 1's
        turn(4, [4, 5], [6], [sub_system, user(SUB_PROMPT)], [SHELL], answer=report, forked_from=2),
        # Turn 3's second call's task, as the second text part of the first user message
        turn(
            5,
            [9],
            [10],
            [sub_system, {"role": "user", "content": [reminder, {"type": "text", "text": other}]}],
            [SHELL],
            answer=report,
        ),
        turn(6, [1, 2, 3, 7, 8, 11], [12], m6, [SHELL, AGENT], answer=m9[-2], parent=3),
        # Quotes turn 6's task, and its answer comes back as that call's result: its sub-agent
        turn(
            7,
            [13],
            [14],
            [sub_system, user(f"The main agent asks: {third} Be brief.")],
            [SHELL],
            answer={"role": "assistant", "content": largest},
        ),
        # Quotes it too, but its answer comes back nowhere: a side call (a title, a commit message)
        turn(8, [15], [16], [user(f"A title for: {third}")], None, answer={"role": "assistant", "content": "Sizes"}),
        turn(
            9,
            [1, 2, 3, 7, 8, 11, 12, 17],
            [18],
            m9,
            [SHELL, AGENT],
            answer={"role": "assistant", "content": "Done."},
            parent=6,
        ),
    ]
    found = {c.index: (c.role, c.turns, c.spawned_by) for c in find_conversations(turns, TASK)}
    assert found == {
        0: ("main", [0, 3, 6, 9], None),
        1: ("sub_agent", [1, 2], 0),
        4: ("sub_agent", [4], 3),
        5: ("sub_agent", [5], 3),
        7: ("sub_agent", [7], 6),
        8: ("side_call", [8], None),
    }


def test_the_main_line_holds_the_task_and_reaches_the_end_whatever_its_length():
    """A summary request that carries the whole history (the longest call, with the task and the tools) and a title
    request recorded last (the task, no tools) are side calls: the main line is the conversation that holds the task
    and reaches the episode's end, through the compaction restart that keeps its system prompt. Without the task, the
    same."""
    system = {"role": "system", "content": MAIN_SYSTEM}
    shell = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "shell", "arguments": json.dumps({"command": "ls"})}}
        ],
    }
    done = {"role": "assistant", "content": "Done."}
    history = [system, user(TASK), shell, {"role": "tool", "tool_call_id": "c0", "content": "answer.txt"}]
    summary = [{"role": "system", "content": SUMMARY_SYSTEM}, *history[1:], user("Summarize the session so far.")]
    turns = [
        turn(0, [1, 2], [3], history[:2], [SHELL], answer=shell),
        turn(1, [4] * 30, [5] * 20, summary, [SHELL], answer={"role": "assistant", "content": "Summary: ls ran."}),
        turn(
            2,
            [1, 6],
            [7],
            [system, user("Summary: ls ran.")],
            [SHELL],
            answer=done,
            forked_from=0,
            fork_reason="history_rewritten",
        ),
        turn(3, [8], [9], [user(TASK)], None, answer={"role": "assistant", "content": "Answer file"}),
    ]
    expected = {0: ("main", [0, 2]), 1: ("side_call", [1]), 3: ("side_call", [3])}
    for task in (TASK, None):
        assert {c.index: (c.role, c.turns) for c in find_conversations(turns, task)} == expected, task


def test_a_compaction_restart_right_after_a_sub_agent_with_the_main_system_prompt_continues_the_main_line():
    """opencode's sub-agents keep the main line's system prompt: a compaction restart sent right after one ran (its
    summary request has a system prompt of its own) shares only the system prompt with the sub-agent's last call, the
    latest turn it shares a prefix with. It carries none of the sub-agent's task, so it continues the main line, whose
    system prompt it keeps; the summary request is a side call."""
    system = {"role": "system", "content": MAIN_SYSTEM}
    spawn = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c0",
                "type": "function",
                "function": {"name": "task", "arguments": json.dumps({"prompt": SUB_PROMPT})},
            }
        ],
    }
    history = [system, user(TASK), spawn, {"role": "tool", "tool_call_id": "c0", "content": SUB_ANSWER}]
    done = {"role": "assistant", "content": "Done."}
    turns = [
        turn(0, [1, 2], [3], history[:2], [SHELL, AGENT], answer=spawn),
        turn(
            1,
            [1, 4],
            [5],
            [system, user(SUB_PROMPT)],
            [SHELL],
            answer=calls({"command": "ls -la"}, name="shell"),
            forked_from=0,
            fork_reason="history_rewritten",
        ),
        turn(
            2,
            [1, 4, 5, 6],
            [7],
            [
                system,
                user(SUB_PROMPT),
                calls({"command": "ls -la"}, name="shell"),
                {"role": "tool", "tool_call_id": "c0", "content": ""},
            ],
            [SHELL],
            answer=report_of(SUB_ANSWER),
            parent=1,
        ),
        turn(
            3,
            [8],
            [9],
            [{"role": "system", "content": SUMMARY_SYSTEM}, *history[1:], user("Summarize.")],
            [SHELL, AGENT],
            answer=report_of("Summary: no file holds 42."),
        ),
        turn(
            4,
            [1, 10],
            [11],
            [system, user("Summary: no file holds 42.")],
            [SHELL, AGENT],
            answer=done,
            forked_from=2,
            fork_reason="history_rewritten",
        ),
    ]
    found = {c.index: (c.role, c.turns, c.spawned_by) for c in find_conversations(turns, TASK)}
    assert found == {0: ("main", [0, 4], None), 1: ("sub_agent", [1, 2], 0), 3: ("side_call", [3], None)}


def report_of(text):
    return {"role": "assistant", "content": text}


def respond_by_role(tokenizer):
    """The scripted model of a harness-like agent, answering by what the prompt is (episodes run concurrently)."""

    def respond(prompt_ids):
        prompt = tokenizer.decode(prompt_ids)
        answered = "<tool_response>" in prompt.rsplit("<|im_start|>assistant", 1)[0].rsplit("<|im_start|>user", 1)[-1]
        if TITLE_SYSTEM in prompt:
            return "Answer file"
        if SUB_SYSTEM in prompt:
            return SUB_ANSWER if answered else call_text("shell", {"command": "ls"})
        return "Done." if answered else call_text("agent", {"prompt": SUB_PROMPT})

    return respond


async def harness_agent(client, task):
    """What opencode and Claude Code do: a title request first, then the task, whose `agent` call runs a sub-agent."""
    task_text = task["prompt"][-1]["content"]
    await client.chat.completions.create(
        model="policy", messages=[{"role": "system", "content": TITLE_SYSTEM}, {"role": "user", "content": task_text}]
    )

    async def run(messages, tools):
        while True:
            response = await client.chat.completions.create(model="policy", messages=messages, tools=tools)
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return message.content
            for call in message.tool_calls:
                arguments = json.loads(call.function.arguments)
                output = (
                    await run(
                        [{"role": "system", "content": SUB_SYSTEM}, {"role": "user", "content": arguments["prompt"]}],
                        [SHELL],
                    )
                    if call.function.name == "agent"
                    else ""
                )
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})

    return await run([{"role": "system", "content": MAIN_SYSTEM}, *task["prompt"]], [SHELL, AGENT])


def test_sub_agent_and_side_call_rows_train_with_the_episodes_advantage(tmp_path, tokenizer):
    """In training: each episode gives one main, one side-call and one sub-agent row; the extra rows carry the
    episode's advantage (`loss_type="dapo"`: every row the full advantage), and reward functions see the main line."""
    seen = []

    def reward(prompts, completions, episodes, **kwargs):
        seen.extend(completions)
        return [float(episode.group_index) for episode in episodes]  # advantages of both signs in each group

    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        num_generations=2,
        per_device_train_batch_size=2,  # 1 task x 2 episodes
        max_steps=1,
        max_completion_length=64,
        loss_type="dapo",
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        log_episodes=True,
        episode_timeout=30,
        seed=0,
    )
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": TASK}]}])
    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=harness_agent,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        engine=ScriptedEngine(tokenizer, respond_by_role(tokenizer)),
    )
    appended = []
    append_rows = trainer._append_rows

    def record_rows(output, rows, advantages):  # what the loss gets for the rows after each episode's first
        appended.append(([row.kind for row in rows], advantages.tolist()))
        return append_rows(output, rows, advantages)

    trainer._append_rows = record_rows
    try:
        trainer.train()
    finally:
        trainer.close()

    records = [json.loads(line) for line in (tmp_path / "episodes" / "episodes-rank0.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        turns = record["episode"]["turns"]
        assert [t["role"] for t in turns] == ["side_call", "main", "sub_agent", "sub_agent", "main"]
        assert [(r["kind"], r["turns"]) for r in record["rows"]] == [
            ("main", [1, 4]),
            ("side_call", [0]),
            ("sub_agent", [2, 3]),
        ]
        assert record["episode"]["messages"][-1]["content"] == "Done."
    assert [c[-1]["content"] for c in seen] == ["Done.", "Done."]  # the main line's answer, not the title
    ((kinds, advantages),) = appended
    assert kinds == ["side_call", "sub_agent"] * 2
    expected = [record["advantage"] for record in records for _ in range(2)]
    assert advantages == pytest.approx(expected) and all(a != 0 for a in expected)


def test_sub_agents_setting_is_checked(tmp_path):
    with pytest.raises(ValueError, match="sub_agents must be one of"):
        AgenticGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", sub_agents="drop")


def claude_code_binary() -> str | None:
    return os.environ.get("TRL_AGENTIC_CLAUDE_CODE_BIN") or shutil.which("claude")


@pytest.mark.skipif(
    claude_code_binary() is None,
    reason=(
        "Claude Code is not installed: `npm install --prefix <dir> @anthropic-ai/claude-code`, then set "
        "TRL_AGENTIC_CLAUDE_CODE_BIN=<dir>/node_modules/.bin/claude (or put `claude` on PATH)"
    ),
)
def test_claude_code_with_its_title_call_and_a_sub_agent(start_server, tokenizer, tmp_path):
    """The real `claude -p` with its defaults (title request on) and its `Agent` tool: the scripted model hands a
    sub-agent a task, then writes the file. One main line with 0 forks, one side-call row, one sub-agent row."""

    def call(name, arguments):
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"

    def respond(prompt_ids):
        prompt = tokenizer.decode(prompt_ids)
        if "<tools>" not in prompt:  # the title request
            return "Answer file"
        if SUB_PROMPT in prompt.split("<|im_start|>assistant", 1)[0]:  # handed the task before it said anything
            answered = "<tool_response>" in prompt.rsplit("<|im_start|>user", 1)[-1]
            return SUB_ANSWER if answered else call("Bash", {"command": "ls", "description": "List files"})
        return [
            call("Agent", {"description": "Look around", "prompt": SUB_PROMPT, "subagent_type": "general-purpose"}),
            call("Bash", {"command": "echo 42 > answer.txt", "description": "Write 42"}),
            "Done: answer.txt contains 42.",
        ][prompt.count("<tool_response>")]

    server = start_server(ScriptedEngine(tokenizer, respond, max_context_length=200_000), tokenizer)
    session = server.open_episode()
    home, workspace = tmp_path / "home", tmp_path / "workspace"
    home.mkdir()
    workspace.mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": server.url,
        "ANTHROPIC_API_KEY": session.key,
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }  # not CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC: it turns titles off
    command = [claude_code_binary(), "-p", TASK, "--model", "policy", "--allowedTools", "Bash", "Agent"]
    done = subprocess.run(
        command, cwd=workspace, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240
    )
    episode = server.close_episode(session.episode.id)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert (workspace / "answer.txt").read_text() == "42\n"

    turns = episode.turns
    assert [t.role for t in turns] == ["side_call", "main", "sub_agent", "sub_agent", "main", "main"]
    assert [t.spawned_by for t in turns] == [None, None, 1, 1, None, None]
    assert episode.num_main_line_forks == 0 and TASK in turns[0].request_messages[-1]["content"]
    assert episode.messages[-1]["content"] == "Done: answer.txt contains 42."
    rows = episode_to_rows(turns).rows
    assert [(r.kind, r.turns) for r in rows] == [("main", [1, 4, 5]), ("side_call", [0]), ("sub_agent", [2, 3])]
    assert rows[0].prompt_ids + rows[0].completion_ids == turns[5].prompt_ids + turns[5].completion_ids
    assert rows[2].prompt_ids + rows[2].completion_ids == turns[3].prompt_ids + turns[3].completion_ids


def test_the_runner_hands_the_task_prompt_so_the_task_conversation_wins_over_a_longer_one(start_server, tokenizer):
    """Without the task, the conversation with tools (a longer warm-up) would be the main line; the runner opens each
    episode with its task's prompt (trainer-side metadata, dropped at close), so the conversation that holds it is the
    main line."""
    import asyncio

    from trl_agentic.rollout.agents import CallableAgent
    from trl_agentic.rollout.runner import run_episodes

    script = [call_text("shell", {"command": "ls"}), "Nothing here.", "42 it is."]
    server = scripted_server(start_server, tokenizer, script)

    async def agent(client, task):
        # A warm-up conversation of its own, with tools and two calls, before the task's (one call, no tools)
        chat = [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": "Look around first."}]
        reply = (await client.chat.completions.create(model="policy", messages=chat, tools=[SHELL])).choices[0].message
        chat += [
            reply.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "answer.txt"},
        ]
        await client.chat.completions.create(model="policy", messages=chat, tools=[SHELL])
        answer = await client.chat.completions.create(model="policy", messages=task["prompt"])
        return answer.choices[0].message.content

    task = {"prompt": [{"role": "user", "content": TASK}]}
    [episode] = asyncio.run(run_episodes(server, CallableAgent(agent), [task], timeout=30))
    assert episode.status == "ok", episode.error
    assert [turn.role for turn in episode.turns] == ["side_call", "side_call", "main"]
    assert episode.messages == [{"role": "user", "content": TASK}, {"role": "assistant", "content": "42 it is."}]
    assert "task_prompt" not in episode.metadata
    assert [row.kind for row in episode_to_rows(episode.turns).rows] == ["main", "side_call"]
