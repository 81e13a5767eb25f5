"""Replay fidelity (issue 42): branch episodes of real agents replay their parent's first calls token for token, side
by side with the parent in one run, printed with their goals.

```bash
python benchmarks/replay_fidelity.py            # about 1 min on 2 CPU cores
python benchmarks/replay_fidelity.py --tasks 8
```

For each agent, each task: a parent episode, then one branch at every call `k` of it (`branch_episode`, `k` from 1 to
the parent's number of calls). Measured, with the goal each must meet:

- divergences (branches whose replay ended before `k`): goal 0 on agents with deterministic tools;
- token-exact prefixes (branches whose calls `0..k-1` have the parent's prompt ids, completion ids and logprobs, int
  and float lists compared exactly): goal 100%;
- engine calls saved: the replayed calls never reach the engine (calls the engine served for the branches / calls the
  branches made), and sampled tokens of a branch / of its parent;
- a deliberately non-deterministic agent (a request id in its system prompt): every branch detected as diverged
  (goal 100%), each still a trainable episode (status ok, rows whose sampled tokens are its turns', goal 100%).

The agents: the calculator's reference agent (`ToolAgent`'s loop, tool results replayed), the Chat Completions and
Anthropic Messages agents of `examples/agents/`, and the CLI harnesses when installed (`mini-swe-agent`, and the npm
ones: `claude-code`, `codex`, `gemini-cli`, `opencode`; a line says which were skipped). The engine is a toy policy
that samples a calculator call or an answer from a random stream seeded per call (`SamplingParams.seed`), with real
token ids of the tiny qwen2_5 tokenizer: what is measured is the endpoint's replay, not a model's skill.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import time
import uuid
from pathlib import Path

from trl_agentic.endpoint.app import EndpointSettings, create_app
from trl_agentic.endpoint.chat import ChatRenderer
from trl_agentic.endpoint.server import EndpointServer
from trl_agentic.generation.engine import GenerationOutput, SamplingParams
from trl_agentic.rollout.agents import resolve_agent
from trl_agentic.rollout.harnesses import Harness, HarnessNotFoundError
from trl_agentic.rollout.replay import branch_episode
from trl_agentic.rollout.rows import episode_to_rows
from trl_agentic.rollout.runner import run_episode, run_rollout
from trl_agentic.tasks.calculator import CALCULATOR, build_calculator_dataset, calculator_agent
from trl_agentic.tiny_models import build_tiny_tokenizer


ROOT = Path(__file__).resolve().parents[1]
HARNESSES = ("mini-swe-agent", "claude-code", "codex", "gemini-cli", "opencode")


class ToyPolicy:
    """A `GenerationEngine` that samples, from a random stream seeded by the call's seed, either a tool call (the
    calculator's, or a harness's bash command) or a final answer; a third of the calls answer once a tool ran."""

    # Each harness's shell tool (its name in the rendered tool list, its arguments for a command), tried in this order
    SHELL_TOOLS = (
        ("run_shell_command", lambda command: {"command": command, "description": "Write."}),  # Gemini CLI
        ("exec_command", lambda command: {"cmd": command}),  # Codex
        ("Bash", lambda command: {"command": command, "description": "Write."}),  # Claude Code
        ("bash", lambda command: {"command": command, "description": "Write."}),  # opencode, mini-swe-agent
    )

    def __init__(self, tokenizer):
        # Claude Code's first prompt alone is ~44k tokens with the tiny tokenizer, and it asks for up to 32k more
        self.tokenizer, self.policy_version, self.max_context_length = tokenizer, 0, 200_000
        self.calls = 0

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationOutput:
        self.calls += 1
        rng = random.Random(sampling.seed)
        prompt = self.tokenizer.decode(prompt_ids[-4000:])
        ran = prompt.count("<tool_response>")
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if "calculator" not in prompt:  # a harness: its shell tool, then its way of finishing
            tools = self.tokenizer.decode(prompt_ids)
            listed = (shell for shell in self.SHELL_TOOLS if f'"name": "{shell[0]}"' in tools)
            tool, arguments = next(listed, self.SHELL_TOOLS[-1])
            ran = "<tool_response>" in prompt[-1500:]  # the command ran: finish
            if ran and "mini-swe-agent" not in tools and "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" not in tools:
                text = f"Wrote {a} to answer.txt."  # a final message ends the others
            else:
                command = f"echo {a} > answer.txt" if not ran else "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
                text = f"Step {a}.\n<tool_call>\n" + json.dumps({"name": tool, "arguments": arguments(command)})
                text += "\n</tool_call>"
        elif ran >= 3 or (ran and rng.random() < 0.34):
            text = f"The answer is {a * b}."
        else:
            text = "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": f"{a} * {b}"}})
            text += "\n</tool_call>"
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        finish = "stop" if len(ids) <= sampling.max_tokens else "length"
        ids = ids[: sampling.max_tokens]
        return GenerationOutput(ids, [-rng.random() for _ in ids], finish)


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / "agents" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.agent


async def clocked_agent(client, task):
    """The calculator's reference agent with a request id in its system prompt: never the same request twice."""
    prompt = [{"role": "system", "content": f"Request {uuid.uuid4().hex}."}, *task["prompt"][1:]]
    return await calculator_agent(client, {**task, "prompt": prompt})


def exact_prefix(branch, parent, k: int) -> bool:
    return all(
        branch.turns[j].replayed
        and branch.turns[j].prompt_ids == parent.turns[j].prompt_ids
        and branch.turns[j].completion_ids == parent.turns[j].completion_ids
        and branch.turns[j].logprobs == parent.turns[j].logprobs
        for j in range(k)
    )


def measure(server, engine, agent, tasks, timeout: float) -> dict:
    stats = dict(parents=0, branches=0, diverged=0, exact=0, calls=0, engine_calls=0, tokens=0, parent_tokens=0)
    stats["reasons"] = {}
    for i, task in enumerate(tasks):
        parent = run_rollout(run_episode(server, agent, task, task_index=i, seed=1000 + i, timeout=timeout))
        if parent.status != "ok" or not parent.turns:
            stats["reasons"]["parent " + parent.status] = stats["reasons"].get("parent " + parent.status, 0) + 1
            continue
        stats["parents"] += 1
        for k in range(1, len(parent.turns) + 1):
            before = engine.calls
            branch = branch_episode(server, agent, task, parent, k, seed=2000 + 31 * i + k, timeout=timeout)
            stats["branches"] += 1
            stats["calls"] += len(branch.turns)
            stats["engine_calls"] += engine.calls - before
            stats["tokens"] += sum(len(t.completion_ids) for t in branch.turns if not t.replayed)
            stats["parent_tokens"] += parent.num_sampled_tokens
            if branch.replay["diverged"]:
                stats["diverged"] += 1
                reason = branch.replay["divergence"]["reason"]
                stats["reasons"][reason] = stats["reasons"].get(reason, 0) + 1
                stats.setdefault("example", branch.replay["divergence"])
            stats["exact"] += not branch.replay["diverged"] and exact_prefix(branch, parent, k)
            stats.setdefault("trainable", 0)
            rows = episode_to_rows(branch.turns).rows
            stats["trainable"] += branch.status == "ok" and sum(sum(r.env_mask) for r in rows) == sum(
                len(t.completion_ids) for t in branch.turns
            )
            if isinstance(branch.result, dict) and isinstance(agent, Harness):
                agent.release([branch])
        if isinstance(agent, Harness):
            agent.release([parent])
    return stats


def share(part: int, whole: int) -> str:
    return f"{part}/{whole} ({100 * part / whole:.0f}%)" if whole else "-"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=4, help="tasks per agent (a parent and its branches each)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per episode (harnesses)")
    args = parser.parse_args(argv)

    tokenizer = build_tiny_tokenizer("qwen2_5")
    engine = ToyPolicy(tokenizer)
    server = EndpointServer(create_app(engine, ChatRenderer(tokenizer), EndpointSettings())).start()
    tasks = list(build_calculator_dataset(size=args.tasks, seed=3))
    agents = {
        "calculator ToolAgent (chat completions)": resolve_agent(CALCULATOR.agent),
        "examples/agents/openai_agent.py (chat completions)": resolve_agent(load_example("openai_agent")),
        "examples/agents/anthropic_agent.py (anthropic messages)": resolve_agent(load_example("anthropic_agent")),
    }
    skipped = []
    for name in HARNESSES:
        harness = Harness(name)
        try:
            harness.find_binary()
        except HarnessNotFoundError:
            skipped.append(name)
            continue
        agents[f"harness {name}"] = harness
    harness_tasks = [{"prompt": "Create a file answer.txt containing a number."}] * max(1, args.tasks // 2)

    print(f"Replay fidelity: {args.tasks} tasks per agent, a branch at every call k >= 1 of each parent.")
    print(
        f"{'agent':58} {'branches':>8} {'diverged':>10} {'token-exact':>14} {'engine calls':>14} {'tokens':>8} {'s':>6}"
    )
    try:
        for name, agent in agents.items():
            started = time.perf_counter()
            stats = measure(server, engine, agent, harness_tasks if name.startswith("harness") else tasks, args.timeout)
            seconds = time.perf_counter() - started
            ratio = stats["tokens"] / stats["parent_tokens"] if stats["parent_tokens"] else float("nan")
            print(
                f"{name:58} {stats['branches']:>8} {stats['diverged']:>10} "
                f"{share(stats['exact'], stats['branches']):>14} {share(stats['engine_calls'], stats['calls']):>14} "
                f"{ratio:>8.2f} {seconds:>6.1f}" + (f"  reasons {stats['reasons']}" if stats["reasons"] else "")
            )
            if "request_context" in stats.get("example", {}):
                example = stats["example"]
                print(
                    f"    first divergence: call {example['call']}, token {example['token_index']}: request "
                    f"{example['request_context']!r}, recorded {example['recorded_context']!r}"
                )
        print("  goals: diverged 0; token-exact 100%; engine calls = the branches' sampled calls only (< 100%);")
        print("  tokens: sampled tokens of a branch / of its parent (< 1: the replayed prefix is not sampled again).")
        if skipped:
            print(f"  harnesses not installed, skipped: {', '.join(skipped)} (`.ci/run` installs them)")

        stats = measure(server, engine, resolve_agent(clocked_agent), tasks, args.timeout)
        print(
            "Non-deterministic agent (a request id in its system prompt): "
            f"detected {share(stats['diverged'], stats['branches'])} (goal 100%), "
            f"trainable {share(stats.get('trainable', 0), stats['branches'])} (goal 100%), "
            f"reasons {stats['reasons']}"
        )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
