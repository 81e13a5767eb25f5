"""The runnable examples run as written (`examples/`)."""

import importlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ScriptedEngine
from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer, CommandAgent
from trl_agentic.rewards import cut_off_penalty
from trl_agentic.rollout.agents import resolve_agent
from trl_agentic.rollout.harnesses import Harness, HarnessNotFoundError
from trl_agentic.rollout.runner import run_episodes, run_rollout
from trl_agentic.tasks.calculator import build_calculator_dataset, calculator, calculator_correct
from trl_agentic.tiny_models import build_tiny_tokenizer
from trl_agentic.trace import Episode


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES / "harnesses"))
sys.path.insert(0, str(EXAMPLES / "agents"))

from answer_file import answer_file_correct, answer_file_dataset  # noqa: E402


def test_the_answer_file_checker_reads_the_workspace_the_harness_left():
    dataset = answer_file_dataset(3, seed=1)
    assert dataset[0]["prompt"] == [
        {"role": "user", "content": f"Create a file answer.txt containing {dataset[0]['answer']}."}
    ]
    right = Episode(id="a", status="ok", result={"files": {"answer.txt": dataset[0]["answer"] + "\n"}})
    wrong = Episode(id="b", status="ok", result={"files": {"answer.txt": "nope"}})
    failed = Episode(id="c", status="agent_error")
    assert answer_file_correct(dataset["prompt"], [[]] * 3, dataset["answer"], episodes=[right, wrong, failed]) == [
        1.0,
        0.0,
        None,
    ]


# example -> (the harness preset it trains, the wire format that harness speaks to the endpoint)
HARNESS_EXAMPLES = {
    "mini_swe_agent": ("mini-swe-agent", "chat_completions"),
    "claude_code": ("claude-code", "anthropic_messages"),
    "codex": ("codex", "responses"),
    "gemini_cli": ("gemini-cli", "gemini"),
    "opencode": ("opencode", "chat_completions"),
}


@pytest.mark.parametrize("example", list(HARNESS_EXAMPLES))
def test_each_harness_example_names_its_preset(example):
    preset, _ = HARNESS_EXAMPLES[example]
    assert f'train(Harness("{preset}"))' in (EXAMPLES / "harnesses" / f"{example}.py").read_text()


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("example", list(HARNESS_EXAMPLES))
def test_each_harness_example_trains_a_step_on_a_tiny_model(example, tmp_path):
    """The file runs as written with the real harness (installed by .ci/run; skipped with how to install it): one
    step, both episodes logged with their turns in the harness's wire format, scored, and every sampled token trained
    on. The harnesses open with 2k-46k-token prompts (tiny tokenizer): `--max-context-length` lifts the tiny model's
    4096 positions, or every call overflows and nothing is scored. A random model runs each call into the 16-token
    limit; a harness then ends `ok` (scored by the checker) or exits non-zero after the cut call (scored -1 by
    `cut_off_penalty`)."""
    preset, wire_format = HARNESS_EXAMPLES[example]
    try:
        binary = Harness(preset).find_binary()
    except HarnessNotFoundError as error:
        pytest.skip(str(error))
    env = {**os.environ, Harness(preset).binary_env_var: binary, "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "harnesses" / f"{example}.py"), "--model", "tiny:qwen2_5", "--steps", "1"]
        + ["--num-generations", "2", "--max-tokens", "16", "--max-turns", "2", "--max-context-length", "65536"]
        + ["--output-dir", str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"step 1/1  (reward -?\d|split )", done.stdout + done.stderr)  # the step line: a step was logged
    records = [json.loads(line) for line in (tmp_path / "out" / "episodes" / "episodes-rank0.jsonl").open()]
    assert [r["step"] for r in records] == [0, 0]
    for record in records:
        episode = record["episode"]
        assert episode["turns"] and {t["wire_format"] for t in episode["turns"]} == {
            wire_format
        }  # it called the policy
        sampled = sum(len(t["completion_ids"]) for t in episode["turns"])
        assert sum(sum(row["env_mask"]) for row in record["rows"]) == sampled  # every sampled token is trained on
        rewards = episode["metadata"]["rewards"]
        if episode["status"] == "ok":
            assert rewards["answer_file_correct"] is not None
            assert episode["result"]["harness"] == preset and not Path(episode["result"]["workspace"]).exists()
        elif episode["status"] == "limit_exceeded":  # it kept asking past --max-turns (and may have exited 1)
            assert all(value is None for value in rewards.values())  # unscorable: the limit ended it
        else:  # it exited on an answer cut at --max-tokens (Codex): cut_off_penalty scores it
            assert episode["status"] == "agent_error", (episode["status"], episode["error"])
            assert episode["turns"][-1]["finish_reason"] == "length" and rewards["cut_off_penalty"] == -1.0
    assert not list(tmp_path.glob(f"trl-agentic-{preset}-*"))  # every workspace removed once scored


# ---------------------------------------------------------------------------------------------------------------------
# examples/agents: one agent per SDK or language, each trained on the bundled calculator task

# example -> the wire format its agent speaks
AGENT_EXAMPLES = {
    "openai_agent": "chat_completions",
    "agents_sdk_agent": "responses",
    "langgraph_agent": "chat_completions",
    "anthropic_agent": "anthropic_messages",
    "node_agent": "chat_completions",
}
NODE_HINT = "node (Node.js 18+) is not installed: apt-get install nodejs, or see https://nodejs.org"


def example_agent(name: str):
    if name == "node_agent":
        if shutil.which("node") is None:
            pytest.skip(NODE_HINT)
        return CommandAgent(f"node {EXAMPLES / 'agents' / 'node_agent.mjs'}")
    return importlib.import_module(name).agent


@pytest.mark.slow
@pytest.mark.parametrize("example", list(AGENT_EXAMPLES))
def test_each_agent_example_trains_two_steps_on_a_tiny_model(example, tmp_path):
    """The file runs as written: two steps, every episode logged with its rewards and the rows trained. A random tiny
    model runs every call into the 16-token limit: the Agents SDK raises on the Responses API's `incomplete`, and
    `cut_off_penalty` still scores those episodes (-1), where they used to be unscorable and train nothing."""
    if example == "node_agent" and shutil.which("node") is None:
        pytest.skip(NODE_HINT)
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "agents" / f"{example}.py"), "--model", "tiny:qwen2_5", "--steps", "2"]
        + ["--num-generations", "2", "--max-tokens", "16", "--output-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"step 2/2  reward -?\d", done.stdout + done.stderr)  # the step line: a step was logged, scored
    records = [json.loads(line) for line in (tmp_path / "out" / "episodes" / "episodes-rank0.jsonl").open()]
    assert sorted(r["step"] for r in records) == [0, 0, 1, 1]
    for record in records:
        episode = record["episode"]
        assert episode["turns"] and {t["wire_format"] for t in episode["turns"]} == {AGENT_EXAMPLES[example]}
        sampled = sum(len(t["completion_ids"]) for t in episode["turns"])
        assert sum(sum(row["env_mask"]) for row in record["rows"]) == sampled  # every sampled token is trained on
        rewards = episode["metadata"]["rewards"]
        if episode["turns"][-1]["finish_reason"] == "length":
            assert rewards["cut_off_penalty"] == -1.0
        if example == "agents_sdk_agent" and episode["status"] != "ok":
            assert episode["status"] == "agent_error" and "incomplete" in episode["error"]
            assert rewards == {"calculator_correct": None, "cut_off_penalty": -1.0}  # scored: not unscorable
        else:
            assert episode["status"] == "ok" and rewards["calculator_correct"] is not None


def scripted_calculator_policy(tokenizer, cut_first_calls: int = 0):
    """A policy that solves the calculator task with one tool call: it calls `calculator` on the question's
    expression, then answers with the tool's result. Its first `cut_first_calls` calls ramble into the token limit."""
    calls = itertools.count()

    def respond(prompt_ids: list[int]) -> str:
        if next(calls) < cut_first_calls:
            return "Let me think about this for a long while. " * 20
        prompt = tokenizer.decode(prompt_ids)
        if "<tool_response>" in prompt:
            result = prompt.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0].strip()
            return f"The answer is {result}."
        expression = re.findall(r"What is (.+?)\?", prompt)[-1]
        call = {"name": "calculator", "arguments": {"expression": expression}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    return respond


@pytest.mark.parametrize("example", list(AGENT_EXAMPLES))
def test_each_agent_example_calls_its_tool_and_answers(example, start_server):
    """Each example's agent against a scripted policy: the tool call is run, its result sent back, the answer
    returned; the checker scores it 1.0, and the episode's two calls continue each other token for token."""
    agent = example_agent(example)
    tokenizer = build_tiny_tokenizer("qwen2_5")
    server = start_server(ScriptedEngine(tokenizer, scripted_calculator_policy(tokenizer)), tokenizer)
    task = build_calculator_dataset("train", size=1, seed=3)[0]
    (episode,) = run_rollout(run_episodes(server, resolve_agent(agent), [{"prompt": task["prompt"]}], timeout=60))
    assert episode.status == "ok", episode.error
    assert [t.finish_reason for t in episode.turns] == ["tool_calls", "stop"]
    assert {t.wire_format for t in episode.turns} == {AGENT_EXAMPLES[example]}
    tool_messages = [m for m in episode.turns[1].request_messages if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages] == [calculator(task["expression"])]
    assert episode.turns[1].prompt_source == "continued"
    completion = [m for m in episode.messages if m["role"] != "system"]
    assert calculator_correct([task["prompt"]], [completion], [task["answer"]], episodes=[episode]) == [1.0]


@pytest.mark.slow
def test_the_agents_sdk_example_learns_from_an_answer_cut_at_the_token_limit(tmp_path):
    """The Agents SDK raises `ModelBehaviorError` on the Responses API's `status: "incomplete"` (an answer cut at
    `max_completion_length`), so the episode ends `agent_error`. With `cut_off_penalty` it is scored -1 against its
    group's solved episode (1.0): a non-zero advantage, and the policy moves. It used to be unscorable."""
    from agents_sdk_agent import agent

    tokenizer = build_tiny_tokenizer("qwen2_5")
    trainer = AgenticGRPOTrainer(
        "tiny:qwen2_5",
        agent=agent,
        reward_funcs=[calculator_correct, cut_off_penalty],
        args=AgenticGRPOConfig(
            output_dir=str(tmp_path),
            max_steps=1,
            num_generations=2,
            per_device_train_batch_size=2,  # one task, two episodes
            max_completion_length=48,  # fits the tool call and the answer, not the rambling
            learning_rate=1e-2,  # big lr: params must move
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            log_episodes=True,
            logging_steps=1,
        ),
        train_dataset=build_calculator_dataset("train", size=8),
        engine=ScriptedEngine(tokenizer, scripted_calculator_policy(tokenizer, cut_first_calls=1)),
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    try:
        trainer.train()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / "episodes" / "episodes-rank0.jsonl").open()]
    by_status = {r["episode"]["status"]: r for r in records}
    assert sorted(by_status) == ["agent_error", "ok"]
    cut, solved = by_status["agent_error"], by_status["ok"]
    assert "incomplete" in cut["episode"]["error"] and cut["episode"]["turns"][-1]["finish_reason"] == "length"
    assert cut["episode"]["metadata"]["rewards"] == {"calculator_correct": None, "cut_off_penalty": -1.0}
    assert solved["episode"]["metadata"]["rewards"] == {"calculator_correct": 1.0, "cut_off_penalty": 0.0}
    assert cut["advantage"] < 0 < solved["advantage"] and cut["rows"]
    assert trainer.state.log_history[0]["episodes/unscorable"] == 0.0
    assert any(not p.equal(before[name]) for name, p in trainer.model.named_parameters())
