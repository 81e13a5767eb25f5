"""Branch episodes through the runner (`rollout/replay.py`, issue 42): the calculator's reference agent (the one tool
loop, with tool-result replay), a Chat Completions agent of `examples/agents/`, a harness program, and a deliberately
non-deterministic agent. Real endpoint, official clients; the engine answers from a counter, so every sampled call
differs from every earlier one (a replayed call is the only way two episodes share a completion)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
import uuid
from pathlib import Path

import pytest

from conftest import ScriptedEngine
from trl_agentic.rollout.agents import resolve_agent
from trl_agentic.rollout.replay import Branch, branch_episode, run_branches, tool_replay
from trl_agentic.rollout.rows import episode_to_rows
from trl_agentic.rollout.runner import run_episode, run_rollout
from trl_agentic.rollout.tool_loop import TOOL_REPLAY, ToolLoop
from trl_agentic.sandbox import bwrap_unavailable, resolve_kind
from trl_agentic.tasks.agent_loop import ToolAgent
from trl_agentic.tasks.calculator import CALCULATOR, build_calculator_dataset
from trl_agentic.tiny_models import build_tiny_tokenizer


ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 3  # tool calls before the answer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


def counting_engine(tokenizer, tool="calculator", argument="expression"):
    """Calls `tool` until the prompt holds `ROUNDS` tool results, then answers; each answer carries the engine's call
    count (a sampled call never repeats an earlier one)."""
    count = itertools.count()

    def respond(prompt_ids):
        n = next(count)
        results = tokenizer.decode(prompt_ids).count("<tool_response>")
        if results >= ROUNDS:
            return f"The answer is {n}."
        call = {"name": tool, "arguments": {argument: f"{results} + {n}"}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    return ScriptedEngine(tokenizer, respond)


def assert_branch_of(branch, parent, k):
    """Token-exact with its parent up to the branch point (int lists compared exactly), sampled from it."""
    assert branch.replay["diverged"] is False, branch.replay
    assert branch.replay["replayed_calls"] == k == branch.num_replayed_calls
    for j in range(k):
        assert branch.turns[j].replayed
        assert branch.turns[j].prompt_ids == parent.turns[j].prompt_ids
        assert branch.turns[j].completion_ids == parent.turns[j].completion_ids
        assert branch.turns[j].logprobs == parent.turns[j].logprobs
    if k < len(parent.turns):
        assert not branch.turns[k].replayed
        assert branch.turns[k].prompt_ids == parent.turns[k].prompt_ids  # the same request ...
        assert branch.turns[k].completion_ids != parent.turns[k].completion_ids  # ... sampled anew


def test_calculator_agent_branches_at_every_call_without_divergence(start_server, tokenizer):
    server = start_server(counting_engine(tokenizer), tokenizer)
    agent = resolve_agent(CALCULATOR.agent)
    task = build_calculator_dataset(size=1)[0]
    parent = run_rollout(run_episode(server, agent, task, seed=1))
    assert parent.status == "ok" and len(parent.turns) == ROUNDS + 1
    for k in range(len(parent.turns) + 1):
        branch = branch_episode(server, agent, task, parent, k, seed=100 + k)
        assert branch.status == "ok", branch.error
        assert_branch_of(branch, parent, k)
        assert branch.replay["parent"] == parent.id and branch.replay["branch_point"] == k


def test_branches_of_several_parents_run_concurrently_in_order(start_server, tokenizer):
    server = start_server(counting_engine(tokenizer), tokenizer)
    agent = resolve_agent(CALCULATOR.agent)
    tasks = build_calculator_dataset(size=2)
    parents = [run_rollout(run_episode(server, agent, tasks[i], task_index=i, seed=i)) for i in range(2)]
    wanted = [Branch(tasks[i], parents[i], k, seed=10 * i + k) for i in range(2) for k in (1, 2, 3)]
    branches = run_rollout(run_branches(server, agent, wanted, max_concurrent=3))
    for spec, branch in zip(wanted, branches, strict=True):
        assert branch.task_index == spec.parent.task_index
        assert_branch_of(branch, spec.parent, spec.branch_point)


def test_replayed_tool_results_are_not_run_again(start_server, tokenizer):
    """A tool with a side effect: the parent runs it 3 times; a branch at call 2 gets the results of replies 0 and 1
    from the record and runs it once, for the reply it sampled."""
    runs = []

    def record(note: str) -> str:
        """Append a note to the log.

        Args:
            note: The note.
        """
        runs.append(note)
        return f"logged {len(runs)}"

    server = start_server(counting_engine(tokenizer, tool="record", argument="note"), tokenizer)
    agent = resolve_agent(ToolAgent([record]))
    task = {"prompt": "Log three notes."}
    parent = run_rollout(run_episode(server, agent, task, seed=1))
    assert len(runs) == ROUNDS and len(parent.turns) == ROUNDS + 1
    branch = branch_episode(server, agent, task, parent, 2, seed=2)
    assert_branch_of(branch, parent, 2)
    assert len(runs) == ROUNDS + 1  # one more run: the sampled reply's; replies 0 and 1 were answered from the record
    assert branch.turns[2].request_messages == parent.turns[2].request_messages  # "logged 1", "logged 2": recorded


def test_tool_replay_answers_by_call_index_and_a_loop_may_run_its_tools_again(tokenizer, start_server):
    server = start_server(counting_engine(tokenizer), tokenizer)
    agent = resolve_agent(CALCULATOR.agent)
    task = build_calculator_dataset(size=1)[0]
    parent = run_rollout(run_episode(server, agent, task, seed=1))
    replay = tool_replay(parent, 2)
    assert replay.until == 2 and len(replay.replies) == len(replay.answers) == ROUNDS + 1
    for j in range(ROUNDS):  # what answered reply j: the tool message call j + 1 added
        assert replay.answers[j] == parent.turns[j + 1].request_messages[-1:]
        assert replay.answers[j][0]["role"] == "tool"
    assert replay.answers[ROUNDS] is None  # the answer ended the episode

    class Rerun(ToolLoop):
        replay_tool_results = False  # an environment whose later steps need the state its tools built

        def __init__(self):
            self.answered = 0

        def request(self):
            return {"model": "policy", "tools": CALCULATOR.tools}

        async def env_response(self, message, response):
            self.answered += 1
            return [{"role": "tool", "tool_call_id": c.id, "content": "0"} for c in message.tool_calls]

    async def rerun_agent(client, task):
        hooks = Rerun()
        await hooks.run(client, list(task["prompt"]))
        return hooks.answered

    episode = run_rollout(run_episode(server, resolve_agent(rerun_agent), task))
    assert episode.result == ROUNDS and TOOL_REPLAY.get() is None  # set only in the branch's own context


def load_example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / "agents" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_chat_completions_example_agent_branches_token_exact(start_server, tokenizer):
    """`examples/agents/openai_agent.py`'s agent runs its own tools (not ours): the endpoint's replay alone keeps its
    branches on the parent's line."""
    example = load_example("openai_agent")
    server = start_server(counting_engine(tokenizer), tokenizer)
    agent = resolve_agent(example.agent)
    task = build_calculator_dataset(size=1)[0]
    parent = run_rollout(run_episode(server, agent, task, seed=1))
    assert len(parent.turns) == ROUNDS + 1
    for k in (1, 3):
        assert_branch_of(branch_episode(server, agent, task, parent, k, seed=k), parent, k)


def test_a_non_deterministic_agent_is_detected_counted_and_still_trainable(start_server, tokenizer):
    """An agent that puts a random request id in its system prompt: no call of a branch ever matches, so the branch is
    sampled flat from call 0, says so, and is an ordinary episode for training."""

    async def agent(client, task):
        messages = [{"role": "system", "content": f"Request {uuid.uuid4().hex}. Use the calculator."}]
        messages += [m for m in task["prompt"] if m["role"] != "system"]
        for _ in range(6):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=CALCULATOR.tools)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_unset=True))
            if not message.tool_calls:
                return message.content
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "7"} for c in message.tool_calls]

    server = start_server(counting_engine(tokenizer), tokenizer)
    task = build_calculator_dataset(size=1)[0]
    parent = run_rollout(run_episode(server, resolve_agent(agent), task, seed=1))
    branch = branch_episode(server, resolve_agent(agent), task, parent, 2, seed=2)
    assert branch.replay["diverged"] is True and branch.replay["replayed_calls"] == 0
    divergence = branch.turns[0].replay_divergence
    assert divergence["reason"] == "prompt_mismatch" and divergence["call"] == 0
    assert "Request" in divergence["request_context"] or divergence["token_index"] > 0
    assert branch.status == "ok" and not any(turn.replayed for turn in branch.turns)
    rows = episode_to_rows(branch.turns).rows
    assert sum(sum(row.env_mask) for row in rows) == branch.num_sampled_tokens > 0


# A harness program (a real process run by the harness machinery, as the presets are): two model calls with the
# official client, a file written in its workspace between them.
MULTI_CALL_HARNESS = r"""
import json, os, pathlib, sys
import openai
client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"], max_retries=0)
messages = [{"role": "user", "content": sys.argv[1]}]
for k in range(2):
    reply = client.chat.completions.create(model="policy", messages=messages)
    messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    listing = sorted(p.name for p in pathlib.Path(".").iterdir())
    pathlib.Path(f"step{k}.txt").write_text(reply.choices[0].message.content)
    messages.append({"role": "user", "content": f"Files before step {k}: {listing}. Go on."})
print(json.dumps({"files": sorted(p.name for p in pathlib.Path(".").iterdir())}))
"""


def script_harness(name, source, tmp_path, monkeypatch, start_server, tokenizer):
    """A preset `name` that runs the Python program `source` with the episode's Chat Completions URL and key, episode
    directories under `tmp_path`, and a server whose engine answers "Step N." (N its call count)."""
    from trl_agentic.rollout.harnesses import HARNESS_PRESETS, HarnessPreset

    script = tmp_path / f"{name}_harness.py"
    script.write_text(source)

    def prepare(binary, task, context, work, home):
        return [binary, str(script), task], {"OPENAI_BASE_URL": context.base_url, "OPENAI_API_KEY": context.api_key}

    monkeypatch.setitem(HARNESS_PRESETS, name, HarnessPreset(Path(sys.executable).name, "nothing", prepare))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    count = itertools.count()
    return script, start_server(ScriptedEngine(tokenizer, lambda ids: f"Step {next(count)}."), tokenizer)


@pytest.mark.slow
def test_a_harness_branch_runs_again_in_a_fresh_workspace(tmp_path, monkeypatch, start_server, tokenizer):
    from trl_agentic.rollout.harnesses import Harness

    script, server = script_harness("multi", MULTI_CALL_HARNESS, tmp_path, monkeypatch, start_server, tokenizer)
    harness = Harness(
        "multi", binary=sys.executable, keep_workspaces=True, binds=[str(script)]
    )  # (sandboxed by default)
    task = {"prompt": "Write two steps."}
    parent = run_rollout(run_episode(server, harness, task, timeout=120))
    assert parent.status == "ok", (parent.error, parent.metadata)
    branch = branch_episode(server, harness, task, parent, 1, timeout=120)
    assert branch.status == "ok", (branch.error, branch.metadata)
    assert_branch_of(branch, parent, 1)
    assert branch.result["workspace"] != parent.result["workspace"]  # a fresh workspace, the harness run again
    assert branch.result["files"]["step0.txt"] == parent.result["files"]["step0.txt"] == "Step 0."  # replayed
    assert branch.result["files"]["step1.txt"] != parent.result["files"]["step1.txt"]  # sampled
    harness.keep_workspaces = False
    harness.release([parent, branch])


# A harness program that writes where it runs into its first message, as Claude Code, Codex, Gemini CLI and opencode
# do (their working directory, their home)
WHERE_HARNESS = r"""
import os, sys
import openai
client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"], max_retries=0)
messages = [{"role": "system", "content": f"Working directory: {os.getcwd()}. Home: {os.environ['HOME']}."}]
messages.append({"role": "user", "content": sys.argv[1]})
for k in range(2):
    reply = client.chat.completions.create(model="policy", messages=messages)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "Go on."}]
"""


@pytest.mark.skipif(bwrap_unavailable() is not None, reason=f"no local sandbox here: {bwrap_unavailable()}")
def test_a_harness_that_names_its_paths_replays_at_the_same_paths(tmp_path, monkeypatch, start_server, tokenizer):
    """`Harness.same_paths` (default): every episode's workspace and home at the same paths inside its sandbox, so a
    harness that writes them into its prompt replays its branch token for token; with each episode's own paths the
    branch diverges at call 0, at the path, and is sampled whole."""
    from trl_agentic.rollout.harnesses import Harness

    script, server = script_harness("where", WHERE_HARNESS, tmp_path, monkeypatch, start_server, tokenizer)
    task = {"prompt": "Write two steps."}
    for same_paths in (True, False):
        harness = Harness("where", binary=sys.executable, binds=[str(script)], sandbox="bwrap", same_paths=same_paths)
        parent = run_rollout(run_episode(server, harness, task, timeout=120))
        assert parent.status == "ok", (parent.error, parent.metadata)
        branch = branch_episode(server, harness, task, parent, 1, timeout=120)
        assert branch.status == "ok", (branch.error, branch.metadata)
        assert branch.result["workspace"] != parent.result["workspace"]  # each its own directory on the host
        if same_paths:
            assert_branch_of(branch, parent, 1)
            assert "Working directory: /tmp/trl-agentic-where/work." in tokenizer.decode(parent.turns[0].prompt_ids)
        else:
            divergence = branch.turns[0].replay_divergence
            assert branch.replay["diverged"] and divergence["call"] == 0 and divergence["reason"] == "prompt_mismatch"
            assert not any(turn.replayed for turn in branch.turns)
        harness.release([parent, branch])


@pytest.mark.slow
def test_mini_swe_agent_branches_token_exact(tmp_path, monkeypatch, start_server, tokenizer):
    """mini-swe-agent (skipped when it is not installed): a bash command, then its submission; the branch at call 1
    replays the command, runs it again in its own workspace, and samples the submission."""
    from test_harnesses import harness_or_skip, tool_call

    harness = harness_or_skip("mini-swe-agent")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    count = itertools.count()

    def respond(ids):
        n = next(count)
        if "<tool_response>" in tokenizer.decode(ids[-400:]):  # the command ran: submit
            return f"Done {n}.\n" + tool_call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"})
        return "I will write the file.\n" + tool_call("bash", {"command": "echo 42 > answer.txt"})

    server = start_server(ScriptedEngine(tokenizer, respond, max_context_length=32768), tokenizer)
    task = {"prompt": "Create a file answer.txt containing 42."}
    parent = run_rollout(run_episode(server, harness, task, timeout=120))
    assert parent.status == "ok", (parent.error, parent.metadata)
    assert len(parent.turns) == 2 and parent.result["files"] == {"answer.txt": "42\n"}
    branch = branch_episode(server, harness, task, parent, 1, timeout=120)
    assert branch.status == "ok", (branch.error, branch.metadata)
    assert_branch_of(branch, parent, 1)
    assert branch.result["files"] == {"answer.txt": "42\n"}  # the replayed command, run again in a new workspace
    assert branch.result["workspace"] != parent.result["workspace"]
    harness.release([parent, branch])


def test_replay_metrics_and_the_sampled_flat_alarm(start_server, tokenizer):
    """`tree/*` metrics come from the episodes (logged only when a branch ran), and `sampled_flat` fires on a batch
    whose task's branches never replayed, not on one whose branches did."""
    from collections import defaultdict

    from trl_agentic.alarms import check_alarms
    from trl_agentic.episode_log import log_episode_metrics

    server = start_server(counting_engine(tokenizer), tokenizer)
    agent = resolve_agent(CALCULATOR.agent)
    tasks = build_calculator_dataset(size=2)
    parents = [run_rollout(run_episode(server, agent, tasks[i], task_index=i, seed=i)) for i in range(2)]
    branches = [branch_episode(server, agent, tasks[i], parents[i], 2, seed=10 + i) for i in range(2)]

    async def clocked(client, task):  # the calculator agent with a request id in its prompt
        from trl_agentic.tasks.calculator import calculator_agent

        task = {**task, "prompt": [{"role": "system", "content": f"Request {uuid.uuid4().hex}."}, *task["prompt"][1:]]}
        return await calculator_agent(client, task)

    flat_parent = run_rollout(run_episode(server, resolve_agent(clocked), tasks[1], task_index=1, seed=5))
    flat_branch = branch_episode(server, resolve_agent(clocked), tasks[1], flat_parent, 2, seed=6)

    def log(episodes):
        metrics = defaultdict(list)
        log_episode_metrics(episodes, [episode_to_rows(e.turns) for e in episodes], metrics)
        return {k: v[0] for k, v in metrics.items()}

    assert not any(k.startswith("tree/") for k in log(parents))  # no branch: the logs are as before
    good = log(parents + branches)
    assert good["tree/replayed_calls"] == 2.0 and good["tree/replay_diverged"] == 0.0
    assert good["tree/sampled_flat_tasks"] == 0.0
    mixed = log([parents[0], branches[0], flat_parent, flat_branch])
    assert mixed["tree/replayed_calls"] == 1.0 and mixed["tree/replay_diverged"] == 0.5
    assert mixed["tree/sampled_flat_tasks"] == 0.5  # task 1 of the two branched tasks
    history = {key: [(1, good[key]), (2, mixed[key])] for key in good if key.startswith("tree/")}
    (alarm,) = check_alarms(history)
    assert alarm.name == "sampled_flat" and alarm.step == 2 and alarm.evidence["sampled_flat_tasks"] == 0.5
    assert check_alarms({key: points[:1] for key, points in history.items()}) == []


@pytest.mark.slow
def test_gemini_cli_branches_replay_token_exact(tmp_path, monkeypatch, start_server, tokenizer):
    """Gemini CLI (an npm harness, the Gemini wire format; skipped when it is not installed) writes the paths of its
    home and working directory into its first prompt: with every episode's at the same paths (`same_paths`, in
    bubblewrap) its branch replays call 0 token for token and runs the replayed command again in its own workspace;
    with each episode's own paths (`same_paths=False`, as unsandboxed) replay says where it diverged (the first
    differing token, the two paths around it) and the branch is an ordinary episode."""
    from test_harnesses import harness_or_skip, tool_call

    harness = harness_or_skip("gemini-cli")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    count = itertools.count()

    def respond(prompt_ids):
        n = next(count)
        if "<tool_response>" in tokenizer.decode(prompt_ids[-400:]):
            return f"Created answer.txt ({n})."
        return tool_call("run_shell_command", {"command": "echo 42 > answer.txt", "description": "Write the file."})

    server = start_server(ScriptedEngine(tokenizer, respond, max_context_length=65536), tokenizer)
    task = {"prompt": "Create a file answer.txt containing 42."}
    same = resolve_kind(harness.sandbox) == "bwrap"  # same paths need a bubblewrap sandbox
    for same_paths in (True, False) if same else (False,):
        harness.same_paths = same_paths
        parent = run_rollout(run_episode(server, harness, task, timeout=180))
        assert parent.status == "ok", (parent.error, parent.metadata)
        branch = branch_episode(server, harness, task, parent, 1, timeout=180)
        assert branch.status == "ok", (branch.error, branch.metadata)
        assert all(turn.wire_format == "gemini" for turn in branch.turns)
        assert branch.result["files"] == {"answer.txt": "42\n"}
        if same_paths:
            assert_branch_of(branch, parent, 1)
        else:
            divergence = branch.turns[0].replay_divergence
            assert branch.replay["diverged"] and divergence["call"] == 0 and divergence["reason"] == "prompt_mismatch"
            assert "gemini-cli-" in divergence["request_context"] and "gemini-cli-" in divergence["recorded_context"]
        harness.release([parent, branch])
