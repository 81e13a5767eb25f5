"""The calculator's reference agent as a command in the episode's sandbox (`make_calculator_suite(agent="command")`,
`trl-agentic demo --set agent=command`): the same requests, token for token, as the agent in the trainer's process."""

import json
import sys

import pytest

from trl_agentic.rollout.agents import CommandAgent, resolve_agent
from trl_agentic.rollout.runner import run_episodes, run_rollout
from trl_agentic.sandbox import resolve_kind
from trl_agentic.sandbox.bwrap import bwrap_unavailable
from trl_agentic.tasks import agent_loop, calculator_command
from trl_agentic.tasks.calculator import build_calculator_dataset, calculator, calculator_correct, make_calculator_suite
from trl_agentic.tiny_models import build_tiny_tokenizer


BWRAP_MISSING = bwrap_unavailable()


@pytest.mark.parametrize(
    "name, arguments",
    [
        ("calculator", '{"expression": "41 * 73"}'),
        ("calculator", {"expression": "7 / 2"}),
        ("calculator", '{"expression": "2 ** 10"}'),
        ("calculator", '{"expression": "1 // 0"}'),
        ("calculator", "{not json"),
        ("calculator", "[1, 2]"),
        ("calculator", '{"expr": "1 + 1"}'),
        ("calculator", ""),
        ("calculator", None),
        ("python", "{}"),
    ],
)
def test_the_commands_tool_answers_are_the_agent_loops(name, arguments):
    tools = {"calculator": calculator}
    assert calculator_command.call_tool(tools, name, arguments) == agent_loop.call_tool(tools, name, arguments)


def test_the_suite_names_its_agent():
    suite = make_calculator_suite(agent="command")
    assert isinstance(suite.agent, CommandAgent) and suite.agent.command.endswith("calculator_command.py")
    assert suite.agent.command.startswith(sys.executable) and " -I -S " in suite.agent.command
    assert make_calculator_suite().agent.__name__ == "calculator_agent"
    with pytest.raises(ValueError, match="agent='shell': use one of"):
        make_calculator_suite(agent="shell")


@pytest.mark.skipif(BWRAP_MISSING is not None, reason=f"no local sandbox here: {BWRAP_MISSING}")
def test_the_command_agent_plays_the_python_agents_episode_in_the_sandbox(start_server):
    from conftest import ScriptedEngine

    tokenizer = build_tiny_tokenizer("qwen2_5")
    task = build_calculator_dataset("eval", size=1, seed=3, digits=2, ops=("*",))[0]
    call = json.dumps({"name": "calculator", "arguments": {"expression": task["expression"]}})

    def respond(prompt_ids):  # a tool call, then the answer once the tool's result is in the prompt
        text = tokenizer.decode(prompt_ids)
        return f"The answer is {task['answer']}." if "<tool_response>" in text else f"<tool_call>\n{call}\n</tool_call>"

    server = start_server(ScriptedEngine(tokenizer, respond), tokenizer)
    command = make_calculator_suite(digits=2, ops=("*",), agent="command").agent
    assert resolve_kind(command.sandbox) == "bwrap"  # the default: the local sandbox
    episodes = {}
    for name, agent in [("python", make_calculator_suite(digits=2, ops=("*",)).agent), ("command", command)]:
        (episode,) = run_rollout(run_episodes(server, resolve_agent(agent), [{"prompt": task["prompt"]}], timeout=60))
        assert episode.status == "ok", (name, episode.error, episode.metadata)
        episodes[name] = episode
    python, sandboxed = episodes["python"], episodes["command"]
    assert [t.finish_reason for t in sandboxed.turns] == ["tool_calls", "stop"]
    assert [t.prompt_ids for t in sandboxed.turns] == [t.prompt_ids for t in python.turns]
    assert [t.completion_ids for t in sandboxed.turns] == [t.completion_ids for t in python.turns]
    assert sandboxed.result["result"] == python.result == f"The answer is {task['answer']}."
    rewards = calculator_correct([None], [sandboxed.messages], [task["answer"]], episodes=[sandboxed])
    assert rewards == [1.0]


def test_the_demo_config_runs_its_agent_as_a_command_when_told():
    from trl_agentic.pipeline.calculator import CalculatorDemoConfig
    from trl_agentic.pipeline.config import with_overrides

    config = with_overrides(CalculatorDemoConfig(), ["agent=command"])
    assert isinstance(config.suite().agent, CommandAgent)
    assert "agent='command'" in config.task_file_source()  # `trl-agentic eval --task <run>/task.py:TASK` runs it so
    assert not isinstance(CalculatorDemoConfig().suite().agent, CommandAgent)
