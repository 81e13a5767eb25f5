"""Claude Code against the endpoint: the requests it sends (recorded from the real harness, `tests/data/
harness_requests/claude_code/`) are accepted and continue token for token, and the real `claude -p` completes a task.

Claude Code's Messages requests carry a `system` message inside `messages` (kept at index 1 for the whole episode),
`thinking: {"type": "adaptive"}`, `context_management`, `output_config`, `metadata.user_id`, `max_tokens` 32000 and 24
tools, posted to `/v1/messages?beta=true` as a stream (issue 31). A scripted engine makes the model side exact.

The end-to-end test needs the binary (`npm install --prefix <dir> @anthropic-ai/claude-code`): it is found through
`TRL_AGENTIC_CLAUDE_CODE_BIN`, else `claude` on PATH, and skipped otherwise.
"""

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from conftest import ScriptedEngine
from test_endpoint_responses import assert_token_exact, tokenizers  # noqa: F401
from trl_agentic.endpoint.protocol import template_message


RECORDED = Path(__file__).parent / "data" / "harness_requests" / "claude_code"
TASK = "Create a file answer.txt containing 42."
# Claude Code's first prompt is ~58k tokens with the tiny tokenizer; the trimmed fixtures are shorter.
CONTEXT = 200_000


def recorded(name: str) -> dict:
    return json.loads((RECORDED / name).read_text())


def bash_call_text(family: str, arguments: dict) -> str:
    """A call of Claude Code's `Bash` tool in the family's own tool-call format."""
    if family == "llama3_2":
        return json.dumps({"name": "Bash", "parameters": arguments})
    return "<tool_call>\n" + json.dumps({"name": "Bash", "arguments": arguments}) + "\n</tool_call>"


def scripted_server(start_server, tokenizer, script):
    script = iter(script)
    return start_server(ScriptedEngine(tokenizer, lambda prompt: next(script), max_context_length=CONTEXT), tokenizer)


def post_recorded(server, session, request: dict, body: dict) -> httpx.Response:
    """POST `body` the way Claude Code did: its path and query (`?beta=true`), its headers, the episode's key."""
    headers = {**request["headers"], "x-api-key": session.key}
    headers.pop("accept-encoding", None)  # httpx negotiates its own
    url = f"{server.url}{request['path']}?{request['query']}"
    return httpx.post(url, content=json.dumps(body).encode(), headers=headers, timeout=60)


def streamed_message(response: httpx.Response) -> dict:
    """The message an Anthropic event stream spells (what Claude Code assembles from it)."""
    assert response.status_code == 200, response.text[:1000]
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: ") :]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events][0] == "message_start" and events[-1]["type"] == "message_stop"
    message = events[0]["message"]
    partial: dict[int, str] = {}
    for event in events:
        if event["type"] == "content_block_start":
            message["content"].append(event["content_block"])
        elif event["type"] == "content_block_delta":
            block, delta = message["content"][event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
        elif event["type"] == "message_delta":
            message["stop_reason"] = event["delta"]["stop_reason"]
    for index, text in partial.items():
        message["content"][index]["input"] = json.loads(text)
    return message


def with_answer(body: dict, answer: dict, result: str) -> dict:
    """`body` followed by our `answer` and a tool result, as Claude Code sends the next call (`cache_control` moves
    to the newest block)."""
    body = copy.deepcopy(body)
    for message in body["messages"]:
        for block in message["content"] if isinstance(message["content"], list) else []:
            block.pop("cache_control", None)
    (call,) = [block for block in answer["content"] if block["type"] == "tool_use"]
    body["messages"].append({"role": "assistant", "content": answer["content"]})
    body["messages"].append(
        {
            "role": "user",
            "content": [
                {
                    "tool_use_id": call["id"],
                    "type": "tool_result",
                    "content": result,
                    "is_error": False,
                    "cache_control": {"type": "ephemeral"},
                }
            ],
        }
    )
    return body


def test_recorded_requests_have_claude_codes_shape():
    """The fixtures hold what made the endpoint answer 400 before (issue 31), so the tests below exercise it."""
    probe, first, second = (
        recorded(name) for name in ("00_probe.json", "01_first_call.json", "02_after_tool_result.json")
    )
    assert (probe["method"], probe["path"]) == ("HEAD", "/")
    for request in (first, second):
        body = request["body"]
        assert (request["path"], request["query"]) == ("/v1/messages", "beta=true")
        assert request["headers"]["user-agent"].startswith("claude-cli/2.1.197")
        assert body["messages"][1]["role"] == "system"
        assert body["thinking"] == {"type": "adaptive"} and body["output_config"] == {"effort": "high"}
        assert body["context_management"]["edits"] and "session_id" in json.loads(body["metadata"]["user_id"])
        assert body["max_tokens"] == 32000 and body["stream"] is True
        assert len(body["tools"]) == 24 and {"Agent", "Bash", "Write"} <= {tool["name"] for tool in body["tools"]}
    # The follow-up is the first call + the answer + its tool result, the system message still at index 1.
    assert [m["role"] for m in second["body"]["messages"]] == ["user", "system", "assistant", "user"]
    assert second["body"]["messages"][1] == first["body"]["messages"][1]


@pytest.mark.parametrize("family", ["qwen2_5", "llama3_2", "qwen3"])
def test_recorded_episode_continues_token_exact(start_server, tokenizers, family):
    """The recorded first call, then the recorded follow-up (our own tool_use id in it, as Claude Code sends it
    back), then one more tool round of the same shape: three turns, each continuing the last (0 forks), the system
    message rendered at its place every time."""
    tokenizer = tokenizers[family]
    first, second = recorded("01_first_call.json"), recorded("02_after_tool_result.json")
    recorded_call = second["body"]["messages"][2]["content"][0]
    script = [
        bash_call_text(family, recorded_call["input"]),
        bash_call_text(family, {"command": "cat answer.txt", "description": "Show answer.txt"}),
        "Done: answer.txt contains 42.",
    ]
    server = scripted_server(start_server, tokenizer, script)
    session = server.open_episode()

    answer = streamed_message(post_recorded(server, session, first, first["body"]))
    assert answer["stop_reason"] == "tool_use"
    (call,) = answer["content"]
    assert (call["name"], call["input"]) == ("Bash", recorded_call["input"])
    body = copy.deepcopy(second["body"])  # the recording, with the id we returned in place of the recorder's
    body["messages"][2]["content"][0]["id"] = call["id"]
    body["messages"][3]["content"][0]["tool_use_id"] = call["id"]
    answer = streamed_message(post_recorded(server, session, second, body))
    assert answer["content"][0]["input"]["command"] == "cat answer.txt"
    body = with_answer(body, answer, "42")
    answer = streamed_message(post_recorded(server, session, second, body))
    assert (answer["stop_reason"], answer["content"]) == (
        "end_turn",
        [{"type": "text", "text": "Done: answer.txt contains 42."}],
    )

    episode = server.close_episode(session.episode.id)
    assert len(episode.turns) == 3
    assert_token_exact(episode, tokenizer, family, "anthropic_messages")
    last = episode.turns[-1]
    assert [m["role"] for m in last.request_messages] == [
        "system",
        "user",
        "system",
        "assistant",
        "tool",
        "assistant",
        "tool",
    ]
    assert last.request_messages[2]["content"] == first["body"]["messages"][1]["content"]
    # What the template renders for the whole conversation, the system message where it stood (compared as text: the
    # sampled ids are kept, and a fresh tokenization may merge differently across a turn's boundary).
    renderer = server.app.state.renderer
    fresh = renderer.render_text([template_message(m) for m in last.request_messages], last.request_tools)
    assert tokenizer.decode(last.prompt_ids) == fresh
    # The fields Claude Code sends beside the conversation are recorded with each turn, not applied.
    for turn in episode.turns:
        requested = turn.requested_sampling
        assert requested["thinking"] == {"type": "adaptive"} and requested["output_config"] == {"effort": "high"}
        assert requested["context_management"] == first["body"]["context_management"]
        assert requested["metadata"] == first["body"]["metadata"] and requested["max_tokens"] == 32000


def test_recorded_first_call_counts_and_serves_the_same_prompt(start_server, tokenizers):
    """`count_tokens` on the recorded body counts the prompt its call is served with."""
    tokenizer = tokenizers["qwen2_5"]
    first = recorded("01_first_call.json")
    server = scripted_server(start_server, tokenizer, ["Hello."])
    session = server.open_episode()
    body = {k: first["body"][k] for k in ("model", "messages", "system", "tools")}
    counted = httpx.post(
        f"{server.url}/v1/messages/count_tokens?beta=true",
        json=body,
        headers={"x-api-key": session.key, "anthropic-version": "2023-06-01"},
        timeout=60,
    )
    assert counted.status_code == 200, counted.text
    answer = streamed_message(post_recorded(server, session, first, first["body"]))
    assert answer["content"] == [{"type": "text", "text": "Hello."}]
    assert answer["usage"]["input_tokens"] == counted.json()["input_tokens"] == len(server.app.state.engine.prompts[0])


@pytest.mark.parametrize(
    ("change", "param"),
    [
        (
            lambda body: body["messages"].__setitem__(
                1, {"role": "system", "content": [{"type": "image", "source": {}}]}
            ),
            "messages.1.content.0",
        ),
        (lambda body: body.__setitem__("messages", [body["messages"][1]]), "messages"),
        (lambda body: body.__setitem__("thinking", "adaptive"), "thinking"),
        (lambda body: body.__setitem__("context_management", ["clear"]), "context_management"),
        (lambda body: body["messages"].__setitem__(1, {"role": "developer", "content": "x"}), "messages.1.role"),
    ],
)
def test_bad_variants_of_the_recorded_call_get_a_400_naming_the_field(start_server, tokenizers, change, param):
    first = recorded("01_first_call.json")
    server = scripted_server(start_server, tokenizers["qwen2_5"], [])
    session = server.open_episode()
    body = copy.deepcopy(first["body"])
    change(body)
    response = post_recorded(server, session, first, body)
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert param in error["error"]["message"]
    assert not server.close_episode(session.episode.id).turns


def claude_code_binary() -> str | None:
    return os.environ.get("TRL_AGENTIC_CLAUDE_CODE_BIN") or shutil.which("claude")


@pytest.mark.slow
@pytest.mark.skipif(
    claude_code_binary() is None,
    reason=(
        "Claude Code is not installed: `npm install --prefix <dir> @anthropic-ai/claude-code`, then set "
        "TRL_AGENTIC_CLAUDE_CODE_BIN=<dir>/node_modules/.bin/claude (or put `claude` on PATH)"
    ),
)
def test_claude_code_completes_the_task_with_zero_forks(start_server, tokenizers, tmp_path):
    """The real `claude -p`, configured only through its documented settings (base URL, key, model, headless
    permissions, no telemetry or auto-update) in a fresh HOME and workspace: the scripted model calls its Bash tool,
    Claude Code runs it and finishes; the episode is two turns, the second continuing the first."""
    tokenizer = tokenizers["qwen2_5"]
    call = {"command": "echo 42 > answer.txt", "description": "Write 42 to answer.txt"}

    def respond(prompt_ids):
        after_tool = "</tool_response>" in tokenizer.decode(prompt_ids[-40:])  # the prompt ends with a tool result
        return "Done: answer.txt contains 42." if after_tool else bash_call_text("qwen2_5", call)

    server = start_server(ScriptedEngine(tokenizer, respond, max_context_length=CONTEXT), tokenizer)
    session = server.open_episode()
    home, workspace = tmp_path / "home", tmp_path / "workspace"
    home.mkdir()
    workspace.mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": server.url,
        "ANTHROPIC_API_KEY": session.key,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }
    # `--allowedTools Bash` is the headless permission rule (`--dangerously-skip-permissions` refuses to run as root).
    command = [claude_code_binary(), "-p", TASK, "--model", "policy", "--allowedTools", "Bash"]
    done = subprocess.run(
        command, cwd=workspace, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180
    )
    episode = server.close_episode(session.episode.id)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert "Done: answer.txt contains 42." in done.stdout
    assert (workspace / "answer.txt").read_text() == "42\n"
    assert len(episode.turns) == 2 and episode.num_tool_calls == 1
    assert_token_exact(episode, tokenizer, "qwen2_5", "anthropic_messages")
    first = episode.turns[0]
    assert [m["role"] for m in first.request_messages] == ["system", "user", "system"]
    assert len(first.request_tools) >= 20 and len(first.prompt_ids) > 20_000  # the real prompt: long, many tools
    assert first.requested_sampling["thinking"] == {"type": "adaptive"}
