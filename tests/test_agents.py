"""Agent adapters: what a command agent can reach, and how its end is decided (issue #9).

Real subprocesses against a real endpoint (uvicorn on loopback, a scripted engine), run the way the trainer runs them.
"""

import json
import os
import sys
import textwrap
import time

import anthropic
import pytest

from conftest import ScriptedEngine
from trl_agentic.rollout.agents import CallableAgent, CommandAgent, resolve_agent
from trl_agentic.rollout.runner import run_episodes, run_rollout
from trl_agentic.tiny_models import build_tiny_tokenizer


@pytest.fixture(scope="module")
def server(start_server):
    tokenizer = build_tiny_tokenizer("qwen2_5")
    return start_server(ScriptedEngine(tokenizer, lambda prompt: "Fine."), tokenizer)


def run(server, agent, timeout=60.0, num_episodes=1):
    # A safety net for the agents meant to finish, not what is checked: a command agent starting Python and importing
    # an SDK took over 10 s on a loaded 2-core machine with the suite on 2 xdist workers (tests that time out pass theirs).
    return run_rollout(run_episodes(server, agent, [{"prompt": "p"}] * num_episodes, timeout=timeout))


PRINT_ENVIRONMENT = f"{sys.executable} -c 'import json, os; print(json.dumps(dict(os.environ)))'"


def test_command_agent_gets_a_minimal_environment(server, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws_secret")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")

    (episode,) = run(server, CommandAgent(PRINT_ENVIRONMENT))
    env = episode.result["result"]
    assert episode.status == "ok"
    assert "HF_TOKEN" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert env["PATH"] == os.environ["PATH"] and env["LC_ALL"] == "C.UTF-8"
    assert env["OPENAI_BASE_URL"] == server.base_url and env["OPENAI_API_KEY"].startswith("sk-ep-")
    assert env["ANTHROPIC_BASE_URL"] == server.url and env["ANTHROPIC_API_KEY"] == env["OPENAI_API_KEY"]
    assert json.loads(env["TRL_AGENTIC_TASK"]) == {"prompt": "p"}

    # What the user opts into, and nothing else.
    (episode,) = run(server, CommandAgent(PRINT_ENVIRONMENT, env={"AGENT_STEPS": "3"}, inherit_env=["HF_TOKEN"]))
    env = episode.result["result"]
    assert env["AGENT_STEPS"] == "3" and env["HF_TOKEN"] == "hf_secret" and "AWS_SECRET_ACCESS_KEY" not in env
    (episode,) = run(server, CommandAgent(PRINT_ENVIRONMENT, inherit_env=True))
    assert episode.result["result"]["AWS_SECRET_ACCESS_KEY"] == "aws_secret"


ANTHROPIC_COMMAND = textwrap.dedent("""
    import json, os, anthropic
    client = anthropic.Anthropic(max_retries=0)  # ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY from the environment
    reply = client.messages.create(model=os.environ["ANTHROPIC_MODEL"], max_tokens=8,
                                   messages=[{"role": "user", "content": "Hi."}])
    print(json.dumps(reply.content[0].text))
""")


def test_agents_written_with_the_anthropic_sdk(server, tmp_path):
    """A command agent reads the ANTHROPIC_* variables; a Python agent gets an anthropic client when its first
    parameter says so (async or sync), or when `CallableAgent(client="anthropic")` does."""
    script = tmp_path / "anthropic_agent.py"
    script.write_text(ANTHROPIC_COMMAND)

    async def async_agent(client: anthropic.AsyncAnthropic, task):
        return (
            (
                await client.messages.create(
                    model="policy", max_tokens=8, messages=[{"role": "user", "content": task["prompt"]}]
                )
            )
            .content[0]
            .text
        )

    def sync_agent(client: "anthropic.Anthropic", task):
        return (
            client.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": task["prompt"]}])
            .content[0]
            .text
        )

    def unannotated_agent(client, task):
        return sync_agent(client, task)

    agents = [
        CommandAgent(f"{sys.executable} {script}"),
        async_agent,
        sync_agent,
        CallableAgent(unannotated_agent, client="anthropic"),
    ]
    for agent in agents:
        (episode,) = run(server, resolve_agent(agent))
        assert episode.status == "ok", episode.error
        result = episode.result["result"] if isinstance(agent, CommandAgent) else episode.result
        assert result == "Fine."
        assert [turn.wire_format for turn in episode.turns] == ["anthropic_messages"]
    with pytest.raises(ValueError, match="client='gemini'"):
        CallableAgent(unannotated_agent, client="gemini")


def test_a_proxy_in_the_environment_does_not_carry_the_agents_model_calls(server, monkeypatch):
    """The clients the runner builds for the endpoint ignore HTTP(S)_PROXY / ALL_PROXY: a cluster's proxy, set for the
    agent's other traffic, used to receive every model call (loopback is not exempt unless NO_PROXY says so), and every
    episode failed. Openai and anthropic clients, async and sync."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens on the discard port
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)

    async def openai_async(client, task):
        return (
            (
                await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
            )
            .choices[0]
            .message.content
        )

    def openai_sync(client, task):
        return (
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            .choices[0]
            .message.content
        )

    async def anthropic_async(client: anthropic.AsyncAnthropic, task):
        return (
            (await client.messages.create(model="policy", max_tokens=4, messages=[{"role": "user", "content": "hi"}]))
            .content[0]
            .text
        )

    def anthropic_sync(client: anthropic.Anthropic, task):
        return (
            client.messages.create(model="policy", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
            .content[0]
            .text
        )

    for agent in (openai_async, openai_sync, anthropic_async, anthropic_sync):
        (episode,) = run(server, resolve_agent(agent))
        assert (episode.status, episode.error, episode.result) == ("ok", None, "Fine."), agent.__name__


def process_is_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie waits for its (new) parent
    except FileNotFoundError:
        return True


def test_background_child_neither_hides_the_result_nor_holds_the_step(server, tmp_path):
    # The command answers and exits 0, but leaves a child that keeps its stdout open for 30 s. Unsandboxed (host pids
    # to check; in a sandbox the PID namespace ends with the command, tests/test_sandbox.py).
    script = tmp_path / "agent.sh"
    script.write_text(
        textwrap.dedent("""
        sleep 30 &
        echo "$!" > child.pid
        echo '{"answer": 42}'
    """)
    )
    started = time.monotonic()
    (episode,) = run(server, CommandAgent(f"sh {script}", cwd=str(tmp_path), sandbox="none"), timeout=10)
    assert episode.status == "ok", episode.error
    assert episode.result["result"] == {"answer": 42} and episode.result["exit_code"] == 0
    assert time.monotonic() - started < 20  # not the child's 30 s (a bound, not a timing: loaded machines are slow)
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 5
    while not process_is_gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_is_gone(child)  # what it left running was killed


def test_timed_out_command_is_killed_with_its_process_group(server, tmp_path):
    script = tmp_path / "agent.sh"
    script.write_text('sleep 30 &\necho "$!" > child.pid\nsleep 30\n')
    started = time.monotonic()
    episodes = run(server, CommandAgent(f"sh {script}", cwd=str(tmp_path), sandbox="none"), timeout=1.0)
    assert [e.status for e in episodes] == ["timeout"]
    assert time.monotonic() - started < 20  # the 1 s timeout held, not the command's 30 s
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 5
    while not process_is_gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_is_gone(child)
