"""Codex CLI through the Responses route (issue 31): the request bodies Codex 0.171.0 sends, as recorded
(tests/data/harness_requests/codex/), are accepted and continue token for token; its `multi_agent_v1` namespace is
shown to the model as flat functions and a call of one goes back with its namespace; the hosted `web_search` tool is
dropped and listed on the turn (or refused, by a setting); our `encrypted_content` brings reasoning back. Then the
real `codex exec` binary, pointed at the endpoint through its config.toml only, creates answer.txt.

A scripted engine plays the model: the tool calls the recording server made (and the same ones for the binary).
"""

import base64
import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from conftest import ScriptedEngine
from test_endpoint_continuation import assert_continues
from trl_agentic.endpoint import responses
from trl_agentic.endpoint.app import EndpointSettings
from trl_agentic.tiny_models import build_tiny_tokenizer


RECORDED = Path(__file__).parent / "data" / "harness_requests" / "codex"
CALLS = ["first_call.json", "after_exec_command.json", "after_namespaced_call.json"]
TASK = "Create a file answer.txt containing 42."
# What the recording server answered each call with (README in RECORDED): the model's side of the conversation.
EXEC = ("exec_command", {"cmd": "echo 42 > answer.txt"})
CLOSE_AGENT = ("multi_agent_v1__close_agent", {"target": "nobody"})  # member close_agent of namespace multi_agent_v1


@pytest.fixture(scope="module")
def tokenizers():
    return {family: build_tiny_tokenizer(family) for family in ("qwen2_5", "qwen3")}


def recorded(name: str) -> dict:
    return json.loads((RECORDED / name).read_text())


def completion(family: str, step: int, tool: tuple[str, dict] | None) -> str:
    """What the model samples at `step`: Qwen3 thinks first (`thinking <step>`, as recorded), then calls `tool` in the
    family's format, or answers."""
    think = f"<think>\nthinking {step}\n</think>\n\n" if family == "qwen3" else ""
    if tool is None:
        return think + "Done."
    name, arguments = tool
    return think + "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def scripted_server(start_server, tokenizer, respond, **settings):
    # Codex's first prompt is ~29k tokens with a tiny tokenizer (its instructions and tools); the fixtures' ~10k.
    return start_server(ScriptedEngine(tokenizer, respond, max_context_length=65536), tokenizer, **settings)


def post_as_codex(server, key: str, call: dict) -> httpx.Response:
    """`call` sent as Codex sent it: its path, headers (the episode's key instead of the placeholder) and body."""
    headers = {**call["headers"], "authorization": f"Bearer {key}"}
    return httpx.post(f"{server.url}{call['path']}", content=json.dumps(call["body"]), headers=headers, timeout=60)


def sse_events(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text[:500]
    assert response.headers["content-type"].startswith("text/event-stream")
    return [json.loads(line[len("data: ") :]) for line in response.text.splitlines() if line.startswith("data: ")]


def done_items(events: list[dict]) -> list[dict]:
    """The output items as Codex reads them (`response.output_item.done`), checked against `response.completed`."""
    items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["output"] == items
    return items


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3"])
def test_recorded_codex_conversation_continues_token_exact(start_server, tokenizers, family):
    """The three recorded calls, each answered as the recording server answered it: accepted, the namespace call
    returned with its namespace, 0 forks, and web_search listed as dropped on every turn."""
    tokenizer = tokenizers[family]
    script = iter([completion(family, 0, EXEC), completion(family, 1, CLOSE_AGENT), completion(family, 2, None)])
    server = scripted_server(start_server, tokenizer, lambda prompt: next(script))
    session = server.open_episode()
    answers = [done_items(sse_events(post_as_codex(server, session.key, recorded(name)))) for name in CALLS]

    calls = [[item for item in items if item["type"] == "function_call"] for items in answers]
    assert [(c["name"], c.get("namespace"), json.loads(c["arguments"])) for (c,) in calls[:2]] == [
        ("exec_command", None, EXEC[1]),
        ("close_agent", "multi_agent_v1", CLOSE_AGENT[1]),
    ]
    assert "namespace" not in calls[0][0]
    assert answers[2][-1]["content"][0]["text"] == "Done." and not calls[2]
    if family == "qwen3":  # reasoning items, with the encrypted_content Codex asks for (`include`)
        for step, items in enumerate(answers):
            (reasoning,) = [item for item in items if item["type"] == "reasoning"]
            assert reasoning["content"] == [{"type": "reasoning_text", "text": f"thinking {step}"}]
            assert reasoning["encrypted_content"].startswith("trl-agentic.reasoning.v1:")

    episode = server.close_episode(session.episode.id)
    assert len(episode.turns) == 3 and episode.num_forks == 0
    for parent, turn in itertools.pairwise(episode.turns):
        assert_continues(turn, parent, tokenizer, family)
    prompt = tokenizer.decode(episode.turns[0].prompt_ids)
    assert "multi_agent_v1__spawn_agent" in prompt and '"name": "exec_command"' in prompt  # flattened, shown
    assert "web_search" not in prompt and "external_web_access" not in prompt  # dropped, not shown
    for turn in episode.turns:
        requested = turn.requested_sampling
        assert requested["dropped_tools"] == ["web_search"]
        # Codex's other fields, accepted and recorded as sent.
        assert requested["store"] is False and requested["include"] == ["reasoning.encrypted_content"]
        assert requested["reasoning"] == {"summary": "auto"} and requested["prompt_cache_key"]
        assert set(requested["client_metadata"]) >= {"session_id", "thread_id", "turn_id", "x-codex-window-id"}
    # Recorded in the chat shape with the flat name the model sampled, so the history renders as it was sampled.
    last = episode.turns[-1].request_messages
    assert [m["role"] for m in last] == [
        "developer",
        "developer",
        "user",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
    ]
    assert last[6]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__close_agent"


def test_hosted_tools_rejected_under_the_reject_setting(start_server, tokenizers):
    tokenizer = tokenizers["qwen2_5"]
    server = scripted_server(start_server, tokenizer, lambda prompt: "Hi.", hosted_tools="reject")
    session = server.open_episode()
    response = post_as_codex(server, session.key, recorded(CALLS[0]))
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("tools[8]", "unsupported_tool")
    assert "'web_search'" in error["message"] and "hosted_tools='drop'" in error["message"]
    assert not server.close_episode(session.episode.id).turns


def test_hosted_tools_setting_is_checked():
    with pytest.raises(ValueError, match="hosted_tools must be 'drop' or 'reject'"):
        EndpointSettings(hosted_tools="ignore")


def test_request_tools_flatten_namespaces_and_warn_once_per_dropped_type(caplog, monkeypatch):
    monkeypatch.setattr(responses, "_warned_hosted_tools", set())
    tools = recorded(CALLS[0])["body"]["tools"]
    with caplog.at_level(logging.DEBUG, logger=responses.__name__):
        first = responses.request_tools(tools)
        second = responses.request_tools(tools)
    assert first == second and first.dropped == ["web_search"]
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.DEBUG]
    assert "'web_search'" in caplog.records[0].getMessage()
    members = ["close_agent", "resume_agent", "send_input", "spawn_agent", "wait_agent"]
    assert first.namespaced == {f"multi_agent_v1__{name}": ("multi_agent_v1", name) for name in members}
    names = [tool["function"]["name"] for tool in first.chat]
    assert names[:4] == ["exec_command", "write_stdin", "request_user_input", "view_image"]
    assert names[4:9] == [f"multi_agent_v1__{name}" for name in members] and len(names) == 12
    # Codex's own rule: no second separator after a namespace that ends in one (MCP servers: `mcp__<server>__`).
    assert responses.namespaced_name("mcp__docs__", "search") == "mcp__docs__search"


def test_encrypted_reasoning_is_read_back(start_server, tokenizers):
    """A client that sends our reasoning item back with only its `encrypted_content` (Codex's serializer left
    `reasoning_text` content out in earlier versions) gets the reasoning into its history; an altered one is a 400."""
    tokenizer = tokenizers["qwen3"]
    script = iter([completion("qwen3", 0, EXEC), completion("qwen3", 1, None)])
    server = scripted_server(start_server, tokenizer, lambda prompt: next(script))
    session = server.open_episode()
    first = done_items(sse_events(post_as_codex(server, session.key, recorded(CALLS[0]))))
    reasoning, call = first
    follow_up = recorded(CALLS[1])
    items = follow_up["body"]["input"]
    assert [item["type"] for item in items[4:]] == ["reasoning", "function_call", "function_call_output"]
    altered = {**reasoning, "encrypted_content": reasoning["encrypted_content"][:-3] + "%%%"}
    items[4] = {**altered, "content": None}
    response = post_as_codex(server, session.key, follow_up)
    assert response.status_code == 400 and response.json()["error"]["param"] == "input[4].encrypted_content"
    items[4] = {
        "type": "reasoning",
        "id": reasoning["id"],
        "summary": [],
        "encrypted_content": reasoning["encrypted_content"],
    }
    done_items(sse_events(post_as_codex(server, session.key, follow_up)))
    episode = server.close_episode(session.episode.id)
    assert episode.num_forks == 0
    assert episode.turns[1].request_messages[4]["reasoning_content"] == "thinking 0"
    assert base64.urlsafe_b64decode(reasoning["encrypted_content"].split(":", 1)[1]) == b"thinking 0"


# End to end: the real binary.


def codex_binary() -> str | None:
    return os.environ.get("TRL_AGENTIC_CODEX_BIN") or shutil.which("codex")


CODEX_CONFIG = """\
model = "policy"
model_provider = "trl-agentic"
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.trl-agentic]
name = "trl-agentic"
base_url = "{base_url}"
env_key = "TRL_AGENTIC_API_KEY"
wire_api = "responses"
"""


needs_codex = pytest.mark.skipif(
    codex_binary() is None,
    reason="Codex CLI not found: set TRL_AGENTIC_CODEX_BIN or put `codex` on "
    "PATH (npm install --prefix <dir> @openai/codex)",
)


def run_codex_exec(server, tmp_path):
    """`codex exec` on TASK in a fresh home and workspace, pointed at a new episode of `server` through its
    config.toml only; checks it exited 0 and wrote answer.txt with 42, and returns the closed episode."""
    session = server.open_episode()
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".codex").mkdir(parents=True)
    work.mkdir()
    (home / ".codex" / "config.toml").write_text(CODEX_CONFIG.format(base_url=server.base_url))
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CODEX_HOME": str(home / ".codex"),
        "TRL_AGENTIC_API_KEY": session.key,
    }
    result = subprocess.run(
        [codex_binary(), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", TASK],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
    )
    episode = server.close_episode(session.episode.id)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    assert (work / "answer.txt").read_text().strip() == "42"
    return episode


@pytest.mark.slow
@needs_codex
@pytest.mark.parametrize("family", ["qwen2_5", "qwen3"])
def test_codex_exec_creates_answer_txt_through_the_endpoint(start_server, tokenizers, tmp_path, family):
    """`codex exec` with its defaults (sub-agents, web_search) and a custom provider: the scripted model runs
    `exec_command`, then calls a namespaced sub-agent tool (Codex must route it by its namespace: its handler answers,
    not "unsupported call"), then answers. Codex exits 0, answer.txt holds 42, the episode has 0 forks."""
    tokenizer = tokenizers[family]

    def respond(prompt_ids):
        step = tokenizer.decode(prompt_ids).count("<tool_response>")
        return completion(family, step, [EXEC, CLOSE_AGENT, None][min(step, 2)])

    server = scripted_server(start_server, tokenizer, respond)
    started = time.monotonic()
    episode = run_codex_exec(server, tmp_path)
    elapsed = time.monotonic() - started
    assert len(episode.turns) == 3 and episode.num_forks == 0
    for parent, turn in itertools.pairwise(episode.turns):
        assert_continues(turn, parent, tokenizer, family)
    tool_results = [m["content"] for m in episode.turns[-1].request_messages if m["role"] == "tool"]
    assert "exited with code 0" in tool_results[0]
    assert "invalid agent id" in tool_results[1] and "unsupported call" not in tool_results[1]
    assert all(turn.requested_sampling["dropped_tools"] == ["web_search"] for turn in episode.turns)
    print(
        f"codex exec: {elapsed:.1f} s, first prompt {len(episode.turns[0].prompt_ids)} tokens "
        f"(tiny {family} tokenizer), {len(episode.turns)} turns, {episode.num_forks} forks"
    )


HANDOFF = "Create a file answer.txt containing 42 in the working directory."


@pytest.mark.slow
@needs_codex
@pytest.mark.parametrize("fork_context", [False, True], ids=["fresh", "fork_context"])
def test_codex_sub_agent_is_a_row_of_its_own(start_server, tokenizers, tmp_path, fork_context):
    """`codex exec` whose model spawns a sub-agent (`multi_agent_v1.spawn_agent`, answered at once with the agent's id),
    waits for it (`wait_agent`), then answers; the sub-agent writes answer.txt. The sub-agent's first request keeps the
    parent's instructions (and, with `fork_context`, its task) and races the parent's `wait_agent` call (it came after
    it in ~3 runs of 4 here): either way lineage makes it a sub-agent conversation spawned by the `spawn_agent` turn,
    the parent the main line, 0 forks."""
    tokenizer = tokenizers["qwen2_5"]
    said: list[str] = []

    def respond(prompt_ids):
        prompt = tokenizer.decode(prompt_ids)
        blocks = prompt.split("<|im_start|>")
        users = [b for b in blocks if b.startswith("user\n") and not b.startswith("user\n<tool_response>")]
        if HANDOFF in users[-1]:  # the sub-agent: runs the command, then reports
            answered = "<tool_response>" in blocks[-2]
            said.append("sub")
            return completion("qwen2_5", 0, None if answered else EXEC)
        if "spawn" not in said:
            said.append("spawn")
            arguments = {"message": HANDOFF, **({"fork_context": True} if fork_context else {})}
            return completion("qwen2_5", 0, ("multi_agent_v1__spawn_agent", arguments))
        if "wait" not in said:  # the spawn call's result names the agent
            said.append("wait")
            [agent_id] = set(re.findall(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", blocks[-2]))
            return completion(
                "qwen2_5", 0, ("multi_agent_v1__wait_agent", {"targets": [agent_id], "timeout_ms": 60000})
            )
        return completion("qwen2_5", 0, None)

    episode = run_codex_exec(scripted_server(start_server, tokenizer, respond), tmp_path)

    # The parent's `wait_agent` call and the sub-agent's first request race (spawn_agent answers at once): by content
    def called(turn):
        return [c["function"]["name"] for c in turn.response_message.get("tool_calls") or []]

    main, *later = episode.turns
    assert called(main) == ["multi_agent_v1__spawn_agent"] and len(later) == 4
    [wait] = [t for t in later if called(t) == ["multi_agent_v1__wait_agent"]]
    [sub] = [t for t in later if called(t) == ["exec_command"]]
    [sub_done] = [t for t in later if t.parent_turn == sub.index]
    [done] = [t for t in later if t not in (wait, sub, sub_done)]
    assert sub.prompt_source == "rendered" and sub.request_messages[-1] == {"role": "user", "content": HANDOFF}
    assert (TASK in [m.get("content") for m in sub.request_messages]) == fork_context
    assert {t.index: (t.conversation, t.role, t.spawned_by) for t in episode.turns} == {
        **{t.index: (0, "main", None) for t in (main, wait, done)},
        **{t.index: (sub.index, "sub_agent", 0) for t in (sub, sub_done)},
    }
    assert episode.num_main_line_forks == 0 and episode.messages[-1]["content"] == "Done."
    for parent, turn in ((main, wait), (wait, done), (sub, sub_done)):
        assert_continues(turn, parent, tokenizer, "qwen2_5")
