"""CLI coding harnesses as episode agents (issue 31): `Harness(...)` finds the program, gives each episode a workspace
and home of its own, points the harness at the episode, records its exit and files, and removes the workspace once
the episode is scored.

The end-to-end tests run the real harness (installed from its registry; `.ci/run` installs them) against the real
endpoint, driven by a scripted engine that answers with the harness's own tool calls. Without the harness they skip
and say how to install it.
"""

import asyncio
import json
import shutil
import sys
from pathlib import Path

import pytest

from conftest import ScriptedEngine
from trl_agentic.rollout.harnesses import HARNESS_PRESETS, Harness, HarnessNotFoundError, HarnessPreset
from trl_agentic.rollout.runner import run_episodes
from trl_agentic.sandbox import bwrap_unavailable
from trl_agentic.tiny_models import build_tiny_tokenizer


DEFAULT_SANDBOX = "bwrap" if bwrap_unavailable() is None else "none"
# Each episode's sandbox: the default (bubblewrap) where it works here, and unsandboxed.
SANDBOXES = [
    pytest.param("none", marks=pytest.mark.filterwarnings("ignore:sandbox='none'")),
    pytest.param("bwrap", marks=pytest.mark.skipif(bwrap_unavailable() is not None, reason=str(bwrap_unavailable()))),
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


def tool_call(name, arguments):
    """A tool call as the qwen2_5 template writes it (what the endpoint parses back into `tool_calls`)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_an_unknown_preset_or_a_missing_program_says_what_to_do(monkeypatch):
    with pytest.raises(ValueError, match="presets are.*mini-swe-agent"):
        Harness("mini-swe")
    monkeypatch.setenv("TRL_AGENTIC_MINI_SWE_AGENT_BIN", "/nonexistent/mini")
    with pytest.raises(HarnessNotFoundError, match=r"pip install mini-swe-agent.*TRL_AGENTIC_MINI_SWE_AGENT_BIN"):
        Harness("mini-swe-agent").find_binary()
    assert Harness("mini-swe-agent", binary=sys.executable).find_binary() == shutil.which(sys.executable)


# A harness of our own, a real program run by the same machinery as the presets: it calls the endpoint with the
# official `openai` client from the environment the preset gives it, writes what the model said into the workspace,
# and reports its HOME and environment.
FAKE_HARNESS = r"""
import json, os, pathlib, sys, time
import openai
task = sys.argv[1]
client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"], max_retries=0)
reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task}])
pathlib.Path("answer.txt").write_text(reply.choices[0].message.content)
print(json.dumps({"home": os.environ["HOME"], "cwd": os.getcwd(), "secret": os.environ.get("HF_TOKEN"),
                  "seed_file": pathlib.Path("notes/seed.txt").read_text() if pathlib.Path("notes/seed.txt").exists() else None}))
if "crash" in task:
    sys.exit(3)
if "hang" in task:
    time.sleep(60)
"""


@pytest.fixture
def fake_preset(tmp_path, monkeypatch):
    script = tmp_path / "fake_harness.py"
    script.write_text(FAKE_HARNESS)

    def prepare(binary, task, context, work, home):
        (home / ".fake").write_text("config")
        return [binary, str(script), task], {"OPENAI_BASE_URL": context.base_url, "OPENAI_API_KEY": context.api_key}

    monkeypatch.setitem(HARNESS_PRESETS, "fake", HarnessPreset(Path(sys.executable).name, "nothing", prepare))
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where the episodes' directories are made
    return tmp_path


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_a_harness_runs_in_a_workspace_and_home_of_its_own_until_its_episode_is_scored(
    fake_preset, tokenizer, start_server, sandbox
):
    server = start_server(ScriptedEngine(tokenizer, lambda ids: "42"), tokenizer)
    script = str(fake_preset / "fake_harness.py")  # outside its install folder: bound by name
    harness = Harness("fake", binary=sys.executable, files_column="files", sandbox=sandbox, binds=[script])
    tasks = [
        {
            "prompt": [{"role": "system", "content": "ignored"}, {"role": "user", "content": "Write 42."}],
            "files": json.dumps({"notes/seed.txt": "seed"}),
        }
    ]
    [episode] = asyncio.run(run_episodes(server, harness, tasks, timeout=60))
    assert episode.status == "ok", episode.error
    result = episode.result
    assert result["harness"] == "fake" and result["exit_code"] == 0 and result["sandbox"]["kind"] == sandbox
    assert result["files"] == {"answer.txt": "42", "notes/seed.txt": "seed"}
    report = json.loads(result["output"].strip().splitlines()[-1])
    work = Path(result["workspace"])
    # where it ran: in bubblewrap at the paths every episode of the harness gets (`same_paths`), else its own
    seen = Path("/tmp/trl-agentic-fake/work") if sandbox == "bwrap" else work
    assert report == {"home": str(seen.parent / "home"), "cwd": str(seen), "secret": None, "seed_file": "seed"}
    assert (work.parent / "home" / ".fake").read_text() == "config"  # its config in its own home
    # The model saw the task's last user message, nothing of the dataset's system prompt
    assert [m["content"] for m in episode.messages] == ["Write 42.", "42"]
    harness.release([episode])
    assert not work.parent.exists()
    assert list(fake_preset.glob("trl-agentic-fake-*")) == []


@pytest.mark.slow
def test_a_crashed_or_hanging_harness_costs_its_episode_only_and_leaves_nothing(fake_preset, tokenizer, start_server):
    server = start_server(ScriptedEngine(tokenizer, lambda ids: "no"), tokenizer)
    harness = Harness("fake", binary=sys.executable, binds=[str(fake_preset / "fake_harness.py")])
    tasks = [{"prompt": "crash now"}, {"prompt": "hang for ever"}, {"prompt": "fine"}]
    crashed, hung, fine = asyncio.run(run_episodes(server, harness, tasks, timeout=8))
    assert crashed.status == "agent_error" and "exited with status 3" in crashed.error
    assert hung.status == "timeout"
    assert fine.status == "ok"
    harness.release([crashed, hung, fine])
    assert list(fake_preset.glob("trl-agentic-fake-*")) == []  # failed episodes' directories went at once


def test_kept_workspaces_stay_after_scoring(fake_preset, tokenizer, start_server):
    server = start_server(ScriptedEngine(tokenizer, lambda ids: "7"), tokenizer)
    harness = Harness("fake", binary=sys.executable, keep_workspaces=True, binds=[str(fake_preset / "fake_harness.py")])
    [episode] = asyncio.run(run_episodes(server, harness, [{"prompt": "Write 7."}], timeout=60))
    harness.release([episode])
    assert (Path(episode.result["workspace"]) / "answer.txt").read_text() == "7"


# The real harnesses


def harness_or_skip(name):
    harness = Harness(name)
    try:
        harness.find_binary()
    except HarnessNotFoundError as error:
        pytest.skip(str(error))
    return harness


@pytest.mark.slow
def test_mini_swe_agent_completes_a_task_through_its_preset(tokenizer, start_server, tmp_path, monkeypatch):
    harness = harness_or_skip("mini-swe-agent")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    replies = iter(
        [
            "I will write the file.\n" + tool_call("bash", {"command": "echo 42 > answer.txt"}),
            "Done.\n" + tool_call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}),
        ]
    )
    engine = ScriptedEngine(tokenizer, lambda ids: next(replies, "Nothing more."), max_context_length=32768)
    server = start_server(engine, tokenizer)
    [episode] = asyncio.run(
        run_episodes(server, harness, [{"prompt": "Create a file answer.txt containing 42."}], timeout=120)
    )
    assert episode.status == "ok", (episode.error, episode.metadata)
    assert episode.result["files"] == {"answer.txt": "42\n"}
    assert episode.result["sandbox"]["kind"] == DEFAULT_SANDBOX  # bubblewrap, where it works here
    assert len(episode.turns) == 2 and episode.num_forks == 0
    assert episode.turns[1].prompt_source == "continued"  # token-in continuation: the second call extends the first
    assert "Create a file answer.txt containing 42." in episode.messages[1]["content"]
    assert episode.num_tool_calls == 2
    assert {turn.role for turn in episode.turns} == {"main"} and episode.num_main_line_forks == 0  # the task's line
    harness.release([episode])
    assert list(tmp_path.glob("trl-agentic-mini-swe-agent-*")) == []


def test_a_recipe_names_a_harness_by_its_preset():
    from trl_agentic.recipes import ScriptArguments, agent_from_recipe
    from trl_agentic.tasks import get_task

    agent = agent_from_recipe(
        ScriptArguments(task="calculator", agent="harness:mini-swe-agent"), get_task("calculator")
    )
    assert isinstance(agent, Harness) and agent.name == "mini-swe-agent" and agent.sandbox == "auto"
    with pytest.raises(ValueError, match="presets are"):
        agent_from_recipe(ScriptArguments(task="calculator", agent="harness:nope"), get_task("calculator"))


def test_a_recipe_names_the_agents_sandbox():
    from trl_agentic.recipes import ScriptArguments, agent_from_recipe
    from trl_agentic.rollout.agents import CommandAgent
    from trl_agentic.tasks import get_task

    args = ScriptArguments(task="calculator", agent_command="node agent.js", sandbox="none", sandbox_binds=["/opt/a"])
    agent = agent_from_recipe(args, get_task("calculator"))
    assert isinstance(agent, CommandAgent) and (agent.sandbox, agent.binds) == ("none", ("/opt/a",))
    args = ScriptArguments(task="calculator", agent="harness:codex")
    assert agent_from_recipe(args, get_task("calculator")).sandbox == "auto"
    with pytest.raises(ValueError, match=r"sandbox='jail': use one of \['auto', 'bwrap', 'docker', 'none'\]"):
        ScriptArguments(task="calculator", sandbox="jail")


def test_an_agent_whose_sandbox_cannot_run_here_fails_when_made(monkeypatch):
    import trl_agentic.sandbox.bwrap as bwrap
    from trl_agentic.rollout.agents import CommandAgent

    monkeypatch.setattr(bwrap, "bwrap_unavailable", lambda: "bubblewrap (`bwrap`) is not installed")
    for make in (lambda: CommandAgent("true", sandbox="bwrap"), lambda: Harness("codex", sandbox="bwrap")):
        with pytest.raises(ValueError, match=r"sandbox='bwrap': bubblewrap \(`bwrap`\) is not installed\. Install"):
            make()


@pytest.mark.slow
def test_claude_code_completes_a_task_through_its_preset(tokenizer, start_server, tmp_path, monkeypatch):
    harness = harness_or_skip("claude-code")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    call = {"command": "echo 42 > answer.txt", "description": "Write 42 to answer.txt"}

    def respond(prompt_ids):
        after_tool = "</tool_response>" in tokenizer.decode(prompt_ids[-40:])  # the prompt ends with a tool result
        return "Done: answer.txt contains 42." if after_tool else tool_call("Bash", call)

    server = start_server(ScriptedEngine(tokenizer, respond, max_context_length=200_000), tokenizer)
    [episode] = asyncio.run(
        run_episodes(server, harness, [{"prompt": "Create a file answer.txt containing 42."}], timeout=180)
    )
    assert episode.status == "ok", (episode.error, episode.metadata)
    assert episode.result["files"] == {"answer.txt": "42\n"}
    assert "Done: answer.txt contains 42." in episode.result["output"]
    assert len(episode.turns) == 2 and episode.num_forks == 0 and episode.turns[1].prompt_source == "continued"
    assert {turn.role for turn in episode.turns} == {"main"} and episode.num_main_line_forks == 0  # the task's line
    harness.release([episode])
    assert list(tmp_path.glob("trl-agentic-claude-code-*")) == []


@pytest.mark.slow
def test_codex_completes_a_task_through_its_preset(tokenizer, start_server, tmp_path, monkeypatch):
    harness = harness_or_skip("codex")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))

    def respond(prompt_ids):
        after_tool = "</tool_response>" in tokenizer.decode(prompt_ids[-40:])
        return "Done." if after_tool else tool_call("exec_command", {"cmd": "echo 42 > answer.txt"})

    server = start_server(ScriptedEngine(tokenizer, respond, max_context_length=200_000), tokenizer)
    [episode] = asyncio.run(
        run_episodes(server, harness, [{"prompt": "Create a file answer.txt containing 42."}], timeout=180)
    )
    assert episode.status == "ok", (episode.error, episode.metadata)
    assert episode.result["files"] == {"answer.txt": "42\n"}
    assert len(episode.turns) == 2 and episode.num_forks == 0 and episode.turns[1].prompt_source == "continued"
    assert all(turn.requested_sampling["dropped_tools"] == ["web_search"] for turn in episode.turns)
    assert {turn.role for turn in episode.turns} == {"main"} and episode.num_main_line_forks == 0  # the task's line
    harness.release([episode])
    assert list(tmp_path.glob("trl-agentic-codex-*")) == []


@pytest.mark.slow
def test_gemini_cli_completes_a_task_through_its_preset(tokenizer, start_server, tmp_path, monkeypatch):
    harness = harness_or_skip("gemini-cli")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))

    def respond(prompt_ids):
        if "<tool_response>" in tokenizer.decode(prompt_ids[-400:]):
            return "Created answer.txt containing 42."
        return tool_call("run_shell_command", {"command": "echo 42 > answer.txt", "description": "Write the file."})

    server = start_server(ScriptedEngine(tokenizer, respond, max_context_length=65536), tokenizer)
    [episode] = asyncio.run(
        run_episodes(server, harness, [{"prompt": "Create a file answer.txt containing 42."}], timeout=180)
    )
    assert episode.status == "ok", (episode.error, episode.metadata)
    assert episode.result["files"] == {"answer.txt": "42\n"}
    assert all(turn.wire_format == "gemini" for turn in episode.turns)
    assert len(episode.turns) == 2 and episode.num_forks == 0 and episode.turns[1].prompt_source == "continued"
    assert {turn.role for turn in episode.turns} == {"main"} and episode.num_main_line_forks == 0  # the task's line
    harness.release([episode])
    assert list(tmp_path.glob("trl-agentic-gemini-cli-*")) == []


# mini-swe-agent's requests as recorded (tests/data/harness_requests/mini_swe_agent/): the shape it sends, and that
# its follow-up continues the first call token for token

RECORDED = Path(__file__).parent / "data" / "harness_requests" / "mini_swe_agent"


def test_mini_swe_agents_recorded_requests_continue_token_for_token(tokenizer, start_server):
    import httpx

    first, second = (
        json.loads((RECORDED / name).read_text()) for name in ("01_first_call.json", "02_after_tool_result.json")
    )
    assert set(first["body"]) == {"model", "messages", "tools"} and first["body"]["model"] == "policy"
    assert [m["role"] for m in second["body"]["messages"]] == ["system", "user", "assistant", "tool"]
    assert [t["function"]["name"] for t in first["body"]["tools"]] == ["bash"]
    assert first["headers"]["user-agent"].startswith("OpenAI/Python")
    recorded_call = second["body"]["messages"][2]
    arguments = json.loads(recorded_call["tool_calls"][0]["function"]["arguments"])
    reply = recorded_call["content"] + "\n" + tool_call("bash", arguments)
    server = start_server(ScriptedEngine(tokenizer, lambda ids: reply), tokenizer)
    session = server.open_episode()
    headers = {
        **{k: v for k, v in first["headers"].items() if k != "authorization"},
        "authorization": f"Bearer {session.key}",
    }
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
        answer = http.post("/v1/chat/completions", json=first["body"])
        assert answer.status_code == 200, answer.text
        message = answer.json()["choices"][0]["message"]
        assert message["content"] == recorded_call["content"]
        # mini-swe-agent sends back what it got: the recorded follow-up with this call's id in place of the recorder's
        follow_up = json.loads(json.dumps(second["body"]).replace("call_1", message["tool_calls"][0]["id"]))
        assert http.post("/v1/chat/completions", json=follow_up).status_code == 200
    episode = server.close_episode(session.episode.id)
    assert [turn.prompt_source for turn in episode.turns][1:] == ["continued"] and episode.num_forks == 0
    assert episode.turns[1].prompt_ids[: len(episode.turns[0].prompt_ids)] == episode.turns[0].prompt_ids
