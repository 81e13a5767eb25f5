"""opencode against the endpoint (issue 31): the Chat Completions requests opencode 1.18.33 sends, as recorded
(tests/data/harness_requests/opencode/), are accepted and continue token for token, and the real `opencode run`
completes a task through `Harness("opencode")`.

opencode asks for a session title first (a system prompt and two user messages, no tools), then runs the task's
conversation: its system prompt, the task as a user message (the preset writes it to opencode's stdin: as an argument
with spaces, `opencode run` would send it in quotes, as the recording shows), 9
tools, `max_tokens` 32000, `stream_options.include_usage`, `tool_choice: "auto"`; an assistant tool call comes back
with `content: ""` (and `reasoning_content` when the model reasoned). The title is a side call of the episode, the
task's conversation its main line (decided by lineage when the episode closes).

The end-to-end tests need the binary (`npm install --prefix <dir> opencode-ai`): it is found through
`TRL_AGENTIC_OPENCODE_BIN`, else `opencode` on PATH, and skipped otherwise. A scripted engine plays the model.
"""

import asyncio
import itertools
import json
import re
from pathlib import Path

import httpx
import pytest

from conftest import ScriptedEngine
from test_endpoint_continuation import assert_continues
from test_harnesses import harness_or_skip
from trl_agentic.rollout.agents import EpisodeContext
from trl_agentic.rollout.harnesses import HARNESS_PRESETS
from trl_agentic.rollout.rows import episode_to_rows
from trl_agentic.rollout.runner import run_episodes
from trl_agentic.tiny_models import build_tiny_tokenizer


RECORDED = Path(__file__).parent / "data" / "harness_requests" / "opencode"
CALLS = ["01_title_call.json", "02_first_call.json", "03_after_tool_result.json"]
TASK = "Create a file answer.txt containing 42."
TITLE = "Create answer.txt with 42"  # what the recording's model answered each call with (README in RECORDED)
BASH = ("bash", {"command": "echo 42 > answer.txt", "description": "Write 42 to answer.txt"})
DONE = "Done: answer.txt contains 42."
CONTEXT = 65536  # opencode's first prompt is ~15.6k tokens with a tiny tokenizer


@pytest.fixture(scope="module")
def tokenizers():
    return {family: build_tiny_tokenizer(family) for family in ("qwen2_5", "qwen3")}


def recorded(name: str) -> dict:
    return json.loads((RECORDED / name).read_text())


def call_text(name: str, arguments: dict, reasoning: str | None = None) -> str:
    """A tool call in the Qwen format (what the endpoint parses back into `tool_calls`), after Qwen3's reasoning."""
    think = f"<think>\n{reasoning}\n</think>\n\n" if reasoning else ""
    return think + "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def post_as_opencode(server, key: str, call: dict) -> httpx.Response:
    """`call` sent as opencode sent it: its path, headers (the episode's key instead of the placeholder) and body."""
    headers = {**call["headers"], "authorization": f"Bearer {key}"}
    headers.pop("accept-encoding", None)  # httpx negotiates its own
    return httpx.post(
        f"{server.url}{call['path']}", content=json.dumps(call["body"]).encode(), headers=headers, timeout=60
    )


def streamed_message(response: httpx.Response) -> tuple[dict, dict]:
    """The assistant message a Chat Completions stream spells (what the AI SDK assembles), and its usage chunk."""
    assert response.status_code == 200, response.text[:1000]
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    message, calls = {"content": ""}, {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            message["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"id": call.get("id"), "name": "", "arguments": ""})
                entry["name"] += call.get("function", {}).get("name") or ""
                entry["arguments"] += call.get("function", {}).get("arguments") or ""
    message["tool_calls"] = [calls[i] for i in sorted(calls)]
    (usage,) = [chunk["usage"] for chunk in chunks if chunk.get("usage")]  # stream_options.include_usage
    return message, usage


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3"])
def test_recorded_opencode_requests_are_accepted_and_the_task_conversation_is_the_main_line(
    start_server, tokenizers, family
):
    """The three recorded calls (title, task, follow-up after the bash tool's result), each answered as the recording
    server answered it: accepted, the follow-up continues the task's call token for token, and the title call is a
    side-call row beside the main line (0 forks inside it)."""
    tokenizer = tokenizers[family]
    script = iter([TITLE, call_text(*BASH), DONE])
    server = start_server(ScriptedEngine(tokenizer, lambda prompt: next(script), max_context_length=CONTEXT), tokenizer)
    session = server.open_episode()
    answers = [streamed_message(post_as_opencode(server, session.key, recorded(name))) for name in CALLS]

    (title, title_usage), (task, _), (final, _) = answers
    assert title == {"content": TITLE, "tool_calls": []}
    [call] = task["tool_calls"]
    assert (call["name"], json.loads(call["arguments"])) == BASH
    assert final == {"content": DONE, "tool_calls": []}
    episode = server.close_episode(session.episode.id)
    turns = episode.turns
    assert title_usage["prompt_tokens"] == len(turns[0].prompt_ids)
    assert title_usage["completion_tokens"] == len(turns[0].completion_ids)

    # The title call first, then the task's conversation: lineage makes the latter the main line.
    assert [(t.role, t.conversation) for t in turns] == [("side_call", 0), ("main", 1), ("main", 1)]
    assert turns[1].prompt_source == "rendered" and turns[1].forked_from is None
    assert_continues(turns[2], turns[1], tokenizer, family)
    assert episode.num_main_line_forks == 0
    assert episode.messages == [*turns[2].request_messages, turns[2].response_message]
    assert episode.messages[1] == {"role": "user", "content": f'"{TASK}"'}
    assert [m["role"] for m in turns[0].request_messages] == ["system", "user", "user"]
    assert not turns[0].request_tools and len(turns[1].request_tools) == 9
    assert "You are a title generator" in turns[0].request_messages[0]["content"]
    # opencode's fields beside the conversation are accepted and recorded as sent.
    for turn in turns:
        assert turn.requested_sampling["max_tokens"] == 32000
        assert turn.requested_sampling["stream_options"] == {"include_usage": True}

    main_row, title_row = episode_to_rows(turns).rows
    assert (main_row.kind, main_row.role, main_row.turns) == ("main", "main", [1, 2])
    assert (title_row.kind, title_row.role, title_row.turns) == ("side_call", "side_call", [0])
    assert title_row.prompt_ids == turns[0].prompt_ids and title_row.completion_ids == turns[0].completion_ids
    skipped = episode_to_rows(turns, side_calls="skip")
    assert skipped.rows == [main_row] and skipped.skipped_turns == [0]


def test_the_recorded_shapes():
    """What the fixtures pin: opencode's request fields and message shapes (a newer opencode that changes them shows
    up here first)."""
    title, first, follow_up = (recorded(name) for name in CALLS)
    assert title["body"].keys() == {"model", "max_tokens", "messages", "stream", "stream_options"}
    assert (
        first["body"].keys()
        == follow_up["body"].keys()
        == {"model", "max_tokens", "messages", "tools", "tool_choice", "stream", "stream_options"}
    )
    assert [m["role"] for m in follow_up["body"]["messages"]] == ["system", "user", "assistant", "tool"]
    assistant = follow_up["body"]["messages"][2]
    assert assistant["content"] == "" and assistant["tool_calls"][0]["function"]["name"] == "bash"
    assert follow_up["body"]["messages"][:2] == first["body"]["messages"]
    assert [t["function"]["name"] for t in first["body"]["tools"]] == [
        "bash",
        "edit",
        "glob",
        "grep",
        "read",
        "skill",
        "task",
        "todowrite",
        "write",
    ]
    assert first["headers"]["user-agent"].startswith("opencode/1.18.33 ")


def test_the_preset_writes_its_config_under_the_episode_home(tmp_path):
    """No binary needed: the provider points at the episode (its key read from the environment, not written to disk),
    and the settings that keep opencode off the network and out of the user's own directories are there."""
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    context = EpisodeContext(
        base_url="http://127.0.0.1:9/episodes/e1/v1", api_key="sk-ep-secret", model="policy", timeout=60
    )
    argv, env = HARNESS_PRESETS["opencode"].prepare("/bin/opencode", TASK, context, work, home)
    assert argv == ["/bin/opencode", "run", "--model", "trl-agentic/policy"]  # the task goes on its stdin
    assert HARNESS_PRESETS["opencode"].task_on_stdin
    config_file = home / ".config" / "opencode" / "opencode.json"
    config = json.loads(config_file.read_text())
    provider = config["provider"]["trl-agentic"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"] == {"baseURL": context.base_url, "apiKey": "{env:TRL_AGENTIC_API_KEY}"}
    assert env["TRL_AGENTIC_API_KEY"] == "sk-ep-secret" and "sk-ep-secret" not in config_file.read_text()
    assert (config["autoupdate"], config["share"]) == (False, "disabled")
    assert config["permission"] == {"edit": "allow", "bash": "allow", "webfetch": "deny"}
    assert env["XDG_CONFIG_HOME"] == str(home / ".config") and all(
        env[name].startswith(str(home)) for name in ("XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME")
    )
    assert {
        env[name]
        for name in ("OPENCODE_DISABLE_AUTOUPDATE", "OPENCODE_DISABLE_MODELS_FETCH", "OPENCODE_DISABLE_LSP_DOWNLOAD")
    } == {"1"}
    assert (home / ".npmrc").read_text() == "offline=true\n"  # its background plugin install: no request


# End to end: the real binary through its preset.


def opencode_model(tokenizer, tool: str, reasoning: str | None = None):
    """A scripted model: a title for the title request; in the task's conversation, one call of opencode's own `bash`
    or `write` tool (its `filePath` must be absolute: taken from the working directory opencode's system prompt
    names), then an answer once a tool result is in the prompt."""

    def respond(prompt_ids):
        prompt = tokenizer.decode(prompt_ids)
        if "You are a title generator" in prompt:
            return TITLE
        if "<tool_response>" in prompt[-2000:]:
            return (f"<think>\n{reasoning}\n</think>\n\n" if reasoning else "") + DONE
        if tool == "bash":
            return call_text(*BASH, reasoning)
        work = re.search(r"Working directory: (\S+)", prompt).group(1)
        return call_text("write", {"filePath": f"{work}/answer.txt", "content": "42\n"}, reasoning)

    return respond


@pytest.mark.slow
@pytest.mark.parametrize(("family", "tool"), [("qwen2_5", "bash"), ("qwen3", "write")])
def test_opencode_completes_a_task_through_its_preset(start_server, tokenizers, tmp_path, monkeypatch, family, tool):
    """`opencode run` with its defaults (title request on, its sub-agent `task` tool offered): it runs the scripted
    tool call, answers, exits 0; answer.txt holds 42; the task's conversation is the main line with 0 forks and the
    title call a side call; nothing but the endpoint was asked for (no models.dev fetch; the plugin install found no
    cached package and made no request)."""
    harness = harness_or_skip("opencode")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    tokenizer = tokenizers[family]
    reasoning = "The file needs 42." if family == "qwen3" else None
    engine = ScriptedEngine(tokenizer, opencode_model(tokenizer, tool, reasoning), max_context_length=CONTEXT)
    server = start_server(engine, tokenizer)
    [episode] = asyncio.run(run_episodes(server, harness, [{"prompt": TASK}], timeout=180))
    assert episode.status == "ok", (episode.error, episode.metadata)
    assert episode.result["files"] == {"answer.txt": "42\n"}
    assert DONE in episode.result["output"]

    turns = episode.turns
    # opencode makes its title call beside the main loop: before or after the first main call reaches the endpoint
    [title] = [t for t in turns if t.role == "side_call"]
    main = [t for t in turns if t.role == "main"]
    assert len(turns) == 3 and title.conversation == title.index and {t.conversation for t in main} == {main[0].index}
    assert episode.num_main_line_forks == 0
    for parent, turn in itertools.pairwise(main):
        assert_continues(turn, parent, tokenizer, family)
    assert not title.request_tools and title.response_message["content"] == TITLE
    # The task as written: from the command line, opencode would have quoted it (the recording's '"..."')
    assert episode.messages[1]["content"] == TASK and episode.messages[-1]["content"] == DONE
    assert episode.messages[2]["tool_calls"][0]["function"]["name"] == tool
    if reasoning:  # sent back as `reasoning_content`, continued
        assert episode.messages[2]["reasoning_content"] == reasoning

    logs = Path(episode.result["workspace"]).parent / "home" / ".local" / "share" / "opencode" / "log"
    log = "".join(path.read_text() for path in logs.glob("*.log"))
    assert "models.dev" not in log
    assert "only-if-cached" in log or "background dependency install" not in log
    harness.release([episode])
    assert list(tmp_path.glob("trl-agentic-opencode-*")) == []
    print(
        f"opencode run: first prompt {len(main[0].prompt_ids)} tokens (tiny {family} tokenizer), title call "
        f"{len(title.prompt_ids)} tokens, {len(turns)} calls, {episode.num_main_line_forks} forks in the main line"
    )


HANDOFF = "Create a file answer.txt containing 42 in the working directory."


@pytest.mark.slow
def test_opencode_sub_agent_is_a_row_of_its_own(start_server, tokenizers, tmp_path, monkeypatch):
    """opencode's `task` tool hands a prompt to its `general` sub-agent, which runs in a conversation of its own (its
    own system prompt and 7 tools): the scripted sub-agent runs `bash` and reports, the main line answers. One main
    line (0 forks), one side-call row (the title) and one sub-agent row, spawned by the main line's `task` call."""
    harness = harness_or_skip("opencode")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    tokenizer = tokenizers["qwen2_5"]

    def respond(prompt_ids):
        prompt = tokenizer.decode(prompt_ids)
        if "You are a title generator" in prompt:
            return TITLE
        last_user = prompt.rsplit("<|im_start|>user", 1)[-1]  # tool results are user turns in Qwen's template
        if "<tool_response>" in last_user:  # the sub-agent's bash result, or its report back in the main line
            return DONE if "Wrote answer.txt." in last_user else "Wrote answer.txt."
        if HANDOFF in last_user:  # the sub-agent's first call
            return call_text(*BASH)
        return call_text(
            "task", {"description": "Write the answer file", "prompt": HANDOFF, "subagent_type": "general"}
        )

    server = start_server(ScriptedEngine(tokenizer, respond, max_context_length=CONTEXT), tokenizer)
    [episode] = asyncio.run(run_episodes(server, harness, [{"prompt": TASK}], timeout=180))
    assert episode.status == "ok", (episode.error, episode.metadata)
    assert episode.result["files"] == {"answer.txt": "42\n"} and DONE in episode.result["output"]

    turns = episode.turns
    # opencode makes its title call beside the main loop: it may reach the endpoint before or after the first main
    # call, so the turns are found by role, and a conversation is named by its first turn's index.
    [title] = [t for t in turns if t.role == "side_call"]
    main = [t for t in turns if t.role == "main"]
    sub = [t for t in turns if t.role == "sub_agent"]
    assert "You are a title generator" in tokenizer.decode(title.prompt_ids) and len(turns) == 5
    assert len(main) == len(sub) == 2 and main[0].index < sub[0].index < sub[1].index < main[1].index
    assert {t.conversation for t in main} == {main[0].index} and title.conversation == title.index
    assert {(t.conversation, t.spawned_by) for t in sub} == {(sub[0].index, main[0].index)}
    assert_continues(sub[1], sub[0], tokenizer, "qwen2_5")
    assert_continues(main[1], main[0], tokenizer, "qwen2_5")
    assert episode.num_main_line_forks == 0
    assert sub[0].request_messages[1]["content"] == HANDOFF and len(sub[0].request_tools) == 7
    assert episode.messages[-1]["content"] == DONE
    rows = episode_to_rows(turns).rows
    assert sorted((row.kind, row.role, row.turns) for row in rows) == [
        ("main", "main", [main[0].index, main[1].index]),
        ("side_call", "side_call", [title.index]),
        ("sub_agent", "sub_agent", [sub[0].index, sub[1].index]),
    ]
    harness.release([episode])
