"""TRL's `environment_factory` under AgenticGRPOTrainer (issue 32, item 1): the same environment trains as it does
under `trl.GRPOTrainer(environment_factory=...)`.

- Parity: our episodes (the tool model sampling through the endpoint, the environment's tools run by the built-in
  agent) are replayed into TRL's own `environment_factory` loop token by token (its `_generate_single_turn` answers
  each prompt TRL builds with what our episode sampled from that exact prompt): TRL's prompts, tool-result tokens,
  masks, rewards (reward functions given `environments=`, `get_reward`), advantages, old/ref logps, loss and
  gradients equal ours, at beta 0 and 0.1.
- The dict form (an `environment` column), `reset` text, tool errors (TRL's exact text), `max_tool_calling_iterations`,
  against TRL's own loop with a scripted policy.
- `get_reward` logged under the class name; a `HarborSpec` (local task directory, no Docker) plugged in unchanged;
  2 training steps on the tiny model; `Evaluator` on an environment suite.
"""

import copy
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from conftest import TOOL_SYSTEM_PROMPT, ScriptedEngine
from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.envs.environment_factory import (
    EnvironmentAgent,
    environment_methods,
    environment_of,
    environment_suite,
)
from trl_agentic.evaluation import Evaluator
from trl_agentic.rollout.agents import resolve_agent
from trl_agentic.rollout.producer import RolloutProducer
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL warns that environment_factory is experimental


def evaluate(expression: str) -> str:
    if not re.fullmatch(r"[0-9+\-*/(). ]+", expression):
        raise ValueError(f"cannot evaluate {expression!r}")
    return str(eval(expression))  # digits and operators only  # noqa: S307


class CalculatorEnv:
    """What the tool model learned to call (conftest's `CALCULATOR_TOOL`), as a TRL environment."""

    def reset(self, **row):
        self.row = row
        self.expressions = []

    def calculator(self, expression: str):
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression.
        """
        self.expressions.append(expression)
        return evaluate(expression)

    def get_reward(self) -> float:
        return float(len(self.expressions))


def ids_reward(prompts, completions, completion_ids, **kwargs):
    # Deterministic in the sampled ids, and varied: the groups split.
    return [float(sum(ids) % 7) for ids in completion_ids]


def answered(prompts, completions, environments, answer, **kwargs):
    # Reads the live instances, as TRL reward functions do.
    return [
        float(bool(env.expressions) and str(a) in (c[-1].get("content") or ""))
        for env, c, a in zip(environments, completions, answer, strict=True)
    ]


def calculator_dataset():
    return Dataset.from_list(
        [
            {
                "prompt": [
                    {"role": "system", "content": TOOL_SYSTEM_PROMPT},
                    {"role": "user", "content": "What is 2 + 3?"},
                ],
                "answer": 5,
            },
            {
                "prompt": [
                    {"role": "system", "content": TOOL_SYSTEM_PROMPT},
                    {"role": "user", "content": "What is (2 + 3) * 4?"},
                ],
                "answer": 20,
            },
        ]
    )


KNOBS = dict(
    num_generations=2,
    per_device_train_batch_size=2,
    use_cpu=True,
    bf16=False,
    report_to="none",
    save_strategy="no",
    seed=0,
)


@pytest.fixture(scope="module")
def tool_policy(tool_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("tool_policy")  # both arms (and the KL reference) load these weights
    tool_model.model.save_pretrained(path)
    tool_model.tokenizer.save_pretrained(path)
    return str(path)


def replaying(episodes):
    """TRL's `_generate_single_turn`, answering each prompt with what our episode sampled from exactly that prompt
    (two samplers never draw the same random numbers; everything around the sampler is TRL's)."""
    turns = [(e, k, t) for e, ep in enumerate(episodes) for k, t in enumerate(ep.turns)]
    asked = []

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        used, completion_ids, logprobs = set(), [], []
        for ids in prompt_ids:
            match = next(((e, k, t) for e, k, t in turns if (e, k) not in used and t.prompt_ids == list(ids)), None)
            assert match is not None, "TRL built a prompt that none of our turns sampled from"
            used.add(match[:2])
            asked.append(match[:2])
            completion_ids.append(list(match[2].completion_ids))
            logprobs.append(list(match[2].logprobs))
        return completion_ids, logprobs

    return generate, asked


def capture_per_token_logps(trainer):
    captured = []
    original = trainer._get_per_token_logps_and_entropies

    def wrapped(*args, **kwargs):
        logps, entropies, aux = original(*args, **kwargs)
        if torch.is_grad_enabled() and logps.requires_grad:
            logps.retain_grad()
            captured.append(logps)
        return logps, entropies, aux

    trainer._get_per_token_logps_and_entropies = wrapped
    return captured


def micro_batches(trainer, generation_output, inputs, steps_per_generation):
    trainer._generate_and_score_completions = lambda batch: copy.copy(generation_output)
    trainer._step, trainer._buffered_inputs = 0, None
    chunks = []
    torch.manual_seed(1234)  # the same shuffle in both trainers
    for step in range(steps_per_generation):
        trainer._step = step
        chunks.append(trainer._prepare_inputs([dict(x) for x in inputs]))
    return chunks


def loss_and_gradients(trainer, chunk):
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.zero_grad()
    captured = capture_per_token_logps(trainer)
    loss = trainer.compute_loss(trainer.model, chunk)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), captured[0].grad.clone(), grads


@pytest.mark.parametrize("beta,max_length", [(0.0, 160), (0.1, 160), (0.0, 56), (0.0, 32)])
def test_parity_with_trl_environment_factory(tmp_path, tool_policy, beta, max_length):
    steps_per_generation = 2  # two micro-batches per generation: TRL computes old logps
    settings = dict(
        KNOBS,
        beta=beta,
        loss_type="grpo",
        steps_per_generation=steps_per_generation,
        gradient_accumulation_steps=1,
        temperature=TEMPERATURE,
        max_completion_length=max_length,
        max_tool_calling_iterations=2,
    )
    train = calculator_dataset()
    inputs = [dict(train[i]) for i in (0, 0, 1, 1)]  # RepeatSampler order: each task num_generations times
    reward_funcs = [ids_reward, answered]

    agentic = AgenticGRPOTrainer(
        tool_policy,
        environment_factory=CalculatorEnv,
        reward_funcs=reward_funcs,
        args=AgenticGRPOConfig(output_dir=str(tmp_path / "a"), **settings),
        train_dataset=train,
    )
    batch = [dict(x) for x in inputs]
    try:
        agentic.model.train()
        ours = agentic._generate_and_score_completions(batch)  # fills batch[i]["episodes"]
    finally:
        agentic.close()
    episodes = [x["episodes"] for x in batch]
    # What the episodes hold, so the comparison is not vacuous: tool calls run (one episode calls twice), one reply
    # whose tool call did not parse, the tool-result tokens masked in the rows.
    finishes = sorted(tuple(t.finish_reason for t in ep.turns) + (ep.result["cut_at_budget"],) for ep in episodes)
    assert finishes == EXPECTED_EPISODES[max_length]
    assert all(ep.status == "ok" for ep in episodes) and (ours["tool_mask"] == 0).any() == (max_length > 32)
    assert ours["advantages"].abs().sum() > 0, "the groups did not split: the comparison would be vacuous"

    vanilla = GRPOTrainer(
        tool_policy,
        reward_funcs=reward_funcs,
        train_dataset=train,
        environment_factory=CalculatorEnv,
        args=GRPOConfig(output_dir=str(tmp_path / "v"), **settings),
    )
    vanilla._generate_single_turn, asked = replaying(episodes)
    vanilla.model.train()
    theirs = vanilla._generate_and_score_completions([dict(x) for x in inputs])
    assert sorted(asked) == sorted((e, k) for e, ep in enumerate(episodes) for k in range(len(ep.turns)))

    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", "num_items_in_batch"):
        assert torch.equal(ours[key], theirs[key]), key
    for key in ("advantages", "sampling_per_token_logps", "old_per_token_logps", "ref_per_token_logps"):
        assert (key in ours) == (key in theirs), key
        if key in ours:
            torch.testing.assert_close(ours[key], theirs[key], msg=key)

    our_chunks = micro_batches(agentic, ours, inputs, steps_per_generation)
    their_chunks = micro_batches(vanilla, theirs, inputs, steps_per_generation)
    for our_chunk, their_chunk in zip(our_chunks, their_chunks, strict=True):
        for key, value in their_chunk.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(our_chunk[key], value, msg=key)
        our_loss, our_token_grads, our_grads = loss_and_gradients(agentic, our_chunk)
        their_loss, their_token_grads, their_grads = loss_and_gradients(vanilla, their_chunk)
        torch.testing.assert_close(our_loss, their_loss)
        torch.testing.assert_close(our_token_grads, their_token_grads)
        assert our_grads.keys() == their_grads.keys() and len(our_grads) > 0
        for name, grad in our_grads.items():
            torch.testing.assert_close(grad, their_grads[name], msg=name)
    # The rewards, each logged under the same name (`get_reward` under the class name).
    for name in ("ids_reward", "answered", "CalculatorEnv"):
        key = f"rewards/{name}/mean"
        assert agentic._metrics["train"][key] == vanilla._metrics["train"][key], key


# The tool model reproduces its transcripts at temperature 1 with some variety (seed 0: one malformed call, one wrong
# expression, one second round). TRL's completion budget, tool results included: 160 holds every episode whole; at
# 56 the last reply of the two-round episode is cut ("length"); at 32 the tool results of every episode that called a
# tool would overflow it and are dropped, ending the episode (`cut_at_budget`), as TRL drops them.
TEMPERATURE = 1.0
EXPECTED_EPISODES = {
    160: [
        ("stop", False),
        ("tool_calls", "stop", False),
        ("tool_calls", "stop", False),
        ("tool_calls", "tool_calls", "stop", False),
    ],
    56: [
        ("stop", False),
        ("tool_calls", "length", False),
        ("tool_calls", "stop", False),
        ("tool_calls", "stop", False),
    ],
    32: [("stop", False), ("tool_calls", True), ("tool_calls", True), ("tool_calls", True)],
}


# --- The dict form, `reset` text, tool errors and the iteration limit, against TRL's loop with a scripted policy ---


class AdderEnv:
    def reset(self, a, b, **row):
        self.numbers = (a, b)
        self.total = None
        return f" Numbers: {a} and {b}."  # appended to the last user message

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        self.total = a + b
        return self.total

    async def slow_add(self, a: int, b: int) -> int:
        """Add two integers, asynchronously.

        Args:
            a: The first.
            b: The second.
        """
        return a + b

    def get_reward(self) -> float:
        return float(self.total == sum(self.numbers))


class EchoEnv:
    def reset(self, **row):
        return None

    def echo(self, text: str) -> str:
        """Repeat a text.

        Args:
            text: What to repeat.
        """
        if not text:
            raise ValueError("nothing to echo")
        return text


def call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def scripted_policy(tokenizer):
    """A policy answering by the prompt: the adder calls a sync tool, an async one, an unknown one and one with a bad
    argument in its first reply, then calls again (past `max_tool_calling_iterations=1`); the echo environment's tool
    raises, then it answers."""

    def respond(prompt_ids):
        text = tokenizer.decode(prompt_ids)
        rounds = text.count("<tool_response>")
        if "Numbers:" in text:
            if rounds == 0:
                return "\n".join(
                    [call("slow_add", a=2, b=2), call("add", a=1, b=2), call("nope"), call("add", a=1, c=2)]
                )
            return call("add", a=3, b=4)
        return call("echo", text="") if rounds == 0 else "Done."

    return respond


def router_dataset():
    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": "Add the numbers."}], "environment": "adder", "a": 1, "b": 2},
            {"prompt": [{"role": "user", "content": "Echo something."}], "environment": "echo", "a": 0, "b": 0},
        ]
    )


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    tokenizer = build_tiny_tokenizer("qwen2_5")
    path = tmp_path_factory.mktemp("tiny_policy")
    build_tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


def test_dict_form_reset_text_tool_errors_and_iteration_limit_match_trl(tmp_path, tiny_policy):
    path, tokenizer = tiny_policy
    respond = scripted_policy(tokenizer)
    factories = {"adder": AdderEnv, "echo": EchoEnv}
    # A budget that holds every episode whole (the parity test checks the cuts TRL's budget makes).
    settings = dict(KNOBS, max_completion_length=512, max_tool_calling_iterations=1, steps_per_generation=2)
    train = router_dataset()
    inputs = [dict(train[i]) for i in (0, 0, 1, 1)]
    seen = {}

    def recorder(prompts, completions, environments, **kwargs):
        seen.setdefault("environments", []).append([type(env).__name__ for env in environments])
        seen.setdefault("completions", []).append(completions)
        seen.setdefault("prompts", []).append(prompts)
        return [0.0] * len(prompts)

    agentic = AgenticGRPOTrainer(
        path,
        environment_factory=factories,
        reward_funcs=recorder,
        args=AgenticGRPOConfig(output_dir=str(tmp_path / "a"), **settings),
        train_dataset=train,
        engine=ScriptedEngine(tokenizer, respond),
    )
    batch = [dict(x) for x in inputs]
    try:
        agentic.model.train()
        ours = agentic._generate_and_score_completions(batch)
    finally:
        agentic.close()
    episodes = [x["episodes"] for x in batch]

    vanilla = GRPOTrainer(
        path,
        reward_funcs=recorder,
        train_dataset=train,
        environment_factory=factories,
        args=GRPOConfig(output_dir=str(tmp_path / "v"), **settings),
    )

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        ids = [tokenizer.encode(respond(p), add_special_tokens=False) + [tokenizer.eos_token_id] for p in prompt_ids]
        return ids, [[-0.5] * len(i) for i in ids]

    vanilla._generate_single_turn = generate
    vanilla.model.train()
    theirs = vanilla._generate_and_score_completions([dict(x) for x in inputs])

    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask"):
        assert torch.equal(ours[key], theirs[key]), key
    # Reward functions got the same live environments, and the same tool messages (TRL's error text included).
    our_completions, their_completions = seen["completions"]
    assert seen["environments"] == [["AdderEnv", "AdderEnv", "EchoEnv", "EchoEnv"]] * 2

    def tool_messages(completions):
        return [[(m["name"], m["content"]) for m in c if m["role"] == "tool"] for c in completions]

    assert tool_messages(our_completions) == tool_messages(their_completions)
    our_prompts, their_prompts = seen["prompts"]
    assert our_prompts == their_prompts and our_prompts[0][-1]["content"] == "Add the numbers. Numbers: 1 and 2."
    assert tool_messages(our_completions)[0] == [
        ("add", "3"),
        ("nope", "{'error': 'Tool nope not found.'}"),
        ("add", "{'error': \"AdderEnv.add() got an unexpected keyword argument 'c'\"}"),
        ("slow_add", "4"),
    ]
    assert tool_messages(our_completions)[2] == [("echo", "{'error': 'nothing to echo'}")]
    # The reset text reached the prompt; the adder stopped after one round with its second call not run.
    assert episodes[0].messages[0]["content"] == "Add the numbers. Numbers: 1 and 2."
    assert len(episodes[0].turns) == 2 and episodes[0].messages[-1]["tool_calls"]
    assert [ep.result["tool_failures"] for ep in episodes] == [2, 2, 1, 1]
    # `get_reward` scores the adder's episodes only, logged under its class name as in TRL.
    for key in ("rewards/AdderEnv/mean", "rewards/recorder/mean"):
        assert agentic._metrics["train"][key] == vanilla._metrics["train"][key], key
    assert agentic._metrics["train"]["rewards/AdderEnv/mean"] == [1.0]
    # TRL's tool metrics, from what our episodes counted.
    calls, failures = (sum(ep.result[k] for ep in episodes) for k in ("tool_calls", "tool_failures"))
    assert vanilla._metrics["train"]["tools/call_frequency"] == [calls / len(episodes)]
    assert vanilla._metrics["train"]["tools/failure_frequency"] == [pytest.approx(failures / calls)]
    assert [environment_of(ep).numbers for ep in episodes[:2]] == [(1, 2), (1, 2)]


# --- Training, the HarborSpec, evaluation, configuration errors ---


@pytest.mark.slow
def test_two_training_steps_log_get_reward_under_the_class_name(tmp_path, tiny_policy):
    path, tokenizer = tiny_policy
    model = build_tiny_model(tokenizer)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    class LengthEnv:
        def reset(self, **row):
            self.row = row

        def count(self, text: str) -> int:
            """Count the characters of a text.

            Args:
                text: The text.
            """
            return len(text)

        def get_reward(self) -> float:
            return float(len(self.row["prompt"][-1]["content"]) % 3)

    def length_reward(prompts, completions, environments, **kwargs):
        assert all(isinstance(env, LengthEnv) for env in environments)
        return [float(len(c[-1].get("content") or "") % 5) for c in completions]

    train = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"Count {'x' * i}."}], "secret": i} for i in range(4)]
    )
    trainer = AgenticGRPOTrainer(
        model,
        environment_factory=LengthEnv,
        reward_funcs=length_reward,
        train_dataset=train,
        processing_class=tokenizer,
        args=AgenticGRPOConfig(
            output_dir=str(tmp_path),
            max_steps=2,
            max_completion_length=6,
            learning_rate=1e-2,
            logging_steps=1,
            log_episodes=True,
            reward_weights=[0.5],
            **KNOBS,
        ),
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters()), "parameters did not change"
    assert trainer.args.agent_columns == ["prompt", "secret"]  # `reset` gets the whole row, as in TRL
    assert trainer.reward_func_names == ["length_reward", "LengthEnv"]
    assert trainer.reward_weights.tolist() == [0.5, 1.0]
    for logs in trainer.state.log_history[:2]:
        assert "rewards/LengthEnv/mean" in logs and "rewards/length_reward/mean" in logs
    records = [json.loads(line) for line in (tmp_path / "episodes" / "episodes-rank0.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(set(r["episode"]["result"]) >= {"answer", "tool_calls"} for r in records)


def make_harbor_tasks(root: Path) -> None:
    for i, (question, answer) in enumerate([("What is 2 + 3?", "5"), ("What is 4 * 5?", "20")]):
        task = root / "tasks" / f"task-{i}"
        (task / "environment").mkdir(parents=True)
        (task / "tests").mkdir()
        (task / "instruction.md").write_text(question)
        (task / "task.toml").write_text(f'version = "1.0"\n\n[metadata]\ngold_answer = "{answer}"\n')


def local_harbor_env():
    """A Harbor harness whose sandbox is a local directory (what the Docker sandbox is to `HarborBashEnv`)."""
    import tempfile

    import tomllib
    from trl.experimental.harbor import HarborBashEnv

    class LocalBashEnv(HarborBashEnv):
        async def _start(self, task_dir: str) -> str:
            self._task = Path(task_dir)
            self._env = Path(tempfile.mkdtemp(prefix="harbor-local-"))
            return (self._task / "instruction.md").read_text()

        def _exec(self, command: str, timeout: int = 10) -> str:
            done = subprocess.run(
                ["bash", "-c", command],
                cwd=self._env,
                capture_output=True,
                text=True,
                timeout=timeout,
                env={"PATH": os.environ["PATH"], "HOME": str(self._env)},
            )
            return (done.stdout + done.stderr) or f"(empty output, rc={done.returncode})"

        async def _verify(self) -> float:
            gold = tomllib.loads((self._task / "task.toml").read_text())["metadata"]["gold_answer"]
            answer = self._env / "answer.txt"
            return float(answer.exists() and answer.read_text().strip() == gold)

        async def _stop(self) -> None:
            self._env = None

    return LocalBashEnv


def test_harbor_spec_plugs_in_unchanged(tmp_path, tiny_policy):
    from trl.experimental.harbor import HarborSpec

    path, tokenizer = tiny_policy
    make_harbor_tasks(tmp_path / "suite")
    spec = HarborSpec(str(tmp_path / "suite"), agent=local_harbor_env())

    def respond(prompt_ids):
        text = tokenizer.decode(prompt_ids)
        if "<tool_response>" in text:
            return "Submitted."
        answer = "5" if "2 + 3" in text else "21"  # the second task is answered wrong
        return call("bash", command=f"echo -n {answer} > answer.txt")

    trainer = AgenticGRPOTrainer(
        path,
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        reward_funcs=spec.reward_funcs,
        engine=ScriptedEngine(tokenizer, respond),
        args=AgenticGRPOConfig(
            output_dir=str(tmp_path / "out"),
            max_steps=1,
            steps_per_generation=2,
            max_completion_length=64,
            logging_steps=1,
            log_episodes=True,
            **KNOBS,
        ),
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    records = [
        json.loads(line) for line in (tmp_path / "out" / "episodes" / "episodes-rank0.jsonl").read_text().splitlines()
    ]
    rewards = sorted(r["episode"]["metadata"]["rewards"]["_outcome_reward_func"] for r in records)
    assert rewards == [0.0, 0.0, 1.0, 1.0]
    first = records[0]["episode"]["messages"][0]["content"]
    assert first.startswith("What is") and "single `bash` tool" in first  # the instruction and harness text, by reset


def test_evaluator_runs_an_environment_suite(tool_model):
    """`trl-agentic eval` / `Evaluator` on an environment: the agent and reward sources training uses."""
    suite = environment_suite(CalculatorEnv, calculator_dataset(), reward_funcs=[answered], name="calculator-env")
    assert suite.agent_columns == ("prompt", "answer")
    assert [t["function"]["name"] for t in suite.tools] == ["calculator"]
    evaluator = Evaluator(
        tool_model.model,
        tool_model.tokenizer,
        suite,
        calculator_dataset(),
        num_samples=2,
        temperature=0.0,
        max_tokens=64,
    )  # greedy: the tool model's transcripts
    try:
        summary = evaluator.evaluate(seed=0)
    finally:
        evaluator.close()
    # Both tasks solved with the calculator: `answered` 1, `get_reward` = the expressions evaluated (1 and 2).
    assert summary["scored_reward_funcs"] == {"answered": 1.0, "CalculatorEnv": 1.5}


def test_configuration_errors_say_how_to_fix_them(tmp_path, tiny_policy):
    path, _ = tiny_policy
    args = AgenticGRPOConfig(output_dir=str(tmp_path), max_completion_length=8, **KNOBS)

    class NoReset:
        def act(self) -> str:
            """Act."""

    class NoReward:
        def reset(self, **row):
            pass

    with pytest.raises(ValueError, match="has no `reset` method"):
        EnvironmentAgent(NoReset)
    with pytest.raises(ValueError, match="No reward source provided"):
        AgenticGRPOTrainer(path, environment_factory=NoReward, args=args, train_dataset=calculator_dataset())
    with pytest.raises(ValueError, match="not both"):
        AgenticGRPOTrainer(
            path,
            agent=lambda client, task: None,
            environment_factory=CalculatorEnv,
            args=args,
            train_dataset=calculator_dataset(),
        )
    with pytest.raises(ValueError, match="`environment` column"):
        AgenticGRPOTrainer(
            path, environment_factory={"calc": CalculatorEnv}, args=args, train_dataset=calculator_dataset()
        )
    with pytest.raises(ValueError, match="No reward source provided"):
        AgenticGRPOTrainer(path, agent=lambda client, task: None, args=args, train_dataset=calculator_dataset())
    with pytest.raises(ValueError, match="or `environment_factory=`"):
        AgenticGRPOTrainer(path, reward_funcs=ids_reward, args=args, train_dataset=calculator_dataset())
    assert [m.__name__ for m in environment_methods(AdderEnv())] == ["add", "slow_add"]


@pytest.mark.slow
def test_the_example_trains_two_steps_on_a_tiny_model(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "envs" / "environment_factory.py"
    done = subprocess.run(
        [
            sys.executable,
            str(example),
            "--model",
            "tiny:qwen2_5",
            "--steps",
            "2",
            "--num-generations",
            "2",
            "--max-tokens",
            "32",
            "--output-dir",
            str(tmp_path / "out"),
        ],
        env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "episodes" / "episodes-rank0.jsonl").open()]
    assert len(records) == 4
    for record in records:
        assert record["episode"]["status"] == "ok"
        assert set(record["episode"]["metadata"]["rewards"]) == {"few_guesses", "GuessEnv"}
        assert record["episode"]["messages"][0]["content"].endswith("tool. You have 5 guesses.")  # reset's text


def test_a_crashing_reset_costs_only_its_episode(tmp_path, tiny_policy):
    path, tokenizer = tiny_policy

    class FragileEnv:
        def reset(self, a, **row):
            self.a = a
            if a == 0:
                raise RuntimeError("no sandbox for task 0")

        def get_reward(self) -> float:
            return 1.0

    seen = []

    def recorder(prompts, completions, environments, **kwargs):
        seen.extend(env.a for env in environments)
        return [0.0] * len(prompts)

    train = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Task {a}."}], "a": a} for a in (0, 1)])
    trainer = AgenticGRPOTrainer(
        path,
        environment_factory=FragileEnv,
        reward_funcs=recorder,
        train_dataset=train,
        engine=ScriptedEngine(tokenizer, lambda ids: "Done."),
        args=AgenticGRPOConfig(output_dir=str(tmp_path), max_completion_length=8, steps_per_generation=2, **KNOBS),
    )
    batch = [dict(train[i]) for i in (0, 0, 1, 1)]
    try:
        trainer.model.train()
        trainer._generate_and_score_completions(batch)
    finally:
        trainer.close()
    episodes = [x["episodes"] for x in batch]
    assert [ep.status for ep in episodes] == ["agent_error", "agent_error", "ok", "ok"]
    assert "no sandbox for task 0" in episodes[0].error and not episodes[0].turns
    assert seen == [0, 0, 1, 1]  # the failed episodes' instances still reach the reward functions...
    assert [ep.metadata["rewards"] for ep in episodes] == [{"recorder": None, "FragileEnv": None}] * 2 + [
        {"recorder": 0.0, "FragileEnv": 1.0}
    ] * 2  # ... which are unscorable there


@pytest.mark.slow
def test_asynchronous_rollouts_run_environments_too(tmp_path, tiny_policy):
    path, tokenizer = tiny_policy
    trainer = AgenticGRPOTrainer(
        path,
        environment_factory={"adder": AdderEnv, "echo": EchoEnv},
        train_dataset=router_dataset(),
        engine=ScriptedEngine(tokenizer, scripted_policy(tokenizer)),
        args=AgenticGRPOConfig(
            output_dir=str(tmp_path),
            async_rollouts=True,
            max_staleness=1,
            max_steps=2,
            max_completion_length=128,
            max_tool_calling_iterations=1,
            log_episodes=True,
            logging_steps=1,
            **dict(KNOBS, per_device_train_batch_size=4),
        ),
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / "episodes" / "episodes-rank0.jsonl").open()]
    assert len(records) == 8 and all(r["episode"]["status"] == "ok" for r in records)
    by_environment = {r["episode"]["result"]["environment_name"]: r["episode"]["metadata"]["rewards"] for r in records}
    assert by_environment == {"adder": {"AdderEnv": 1.0}, "echo": {"AdderEnv": None}}


def test_reward_functions_never_see_an_episode_without_an_instance():
    """An episode that timed out before its agent returned has no instance: reward functions are called without it
    (it gets None, unscorable), so `env.attribute` never meets a None."""
    from trl_agentic.envs.environment_factory import EnvironmentResult, with_environments
    from trl_agentic.trace import Episode

    def result_of(environment):
        result = EnvironmentResult(answer="")
        result.environment = environment
        return result

    env_a, env_b = AdderEnv(), AdderEnv()
    env_a.reset(a=1, b=2), env_b.reset(a=2, b=2)
    episodes = [
        Episode(id="a", status="ok", result=result_of(env_a)),
        Episode(id="t", status="timeout"),
        Episode(id="b", status="ok", result=result_of(env_b)),
    ]

    def numbers(prompts, completions, environments, answer, **kwargs):
        assert len(prompts) == len(completions) == len(answer) == 2
        return [float(sum(env.numbers)) + a for env, a in zip(environments, answer, strict=True)]

    rewards = with_environments(numbers)(
        prompts=[[], [], []], completions=[[], [], []], answer=[10, 20, 30], episodes=episodes, trainer_state=None
    )
    assert rewards == [13.0, None, 34.0]


def test_resets_that_hang_cost_only_their_episodes_and_never_the_batches_after_them(start_server):
    # A hung sync `reset` held a thread of the producer's default pool (min(32, cpus + 4) threads) for good: once
    # enough had hung, every later episode of the run waited for a thread and timed out (issue 40).
    tokenizer = build_tiny_tokenizer("qwen2_5")
    server = start_server(ScriptedEngine(tokenizer, lambda ids: "Done."), tokenizer)
    release = threading.Event()

    class HangingEnv:
        def reset(self, hang: bool = False, **row):
            if hang:
                release.wait(60)  # a sandbox that never comes up

        def echo(self, text: str) -> str:
            """Repeat a text.

            Args:
                text: What to repeat.
            """
            return text

    hung = min(32, (os.cpu_count() or 1) + 4)
    prompt = [{"role": "user", "content": "Go."}]
    producer = RolloutProducer(server, resolve_agent(EnvironmentAgent(HangingEnv)), max_staleness=1, timeout=1.0)
    try:
        producer.submit(0, [{"prompt": prompt, "hang": True}] * hung, [0] * hung, 0, 1)
        first, _ = producer.result(0, timeout=60)
        producer.submit(1, [{"prompt": prompt, "hang": False}] * 4, [0] * 4, 0, 1)
        second, _ = producer.result(1, timeout=60)
    finally:
        release.set()
        producer.close()
    assert {e.status for e in first} == {"timeout"}
    assert [e.status for e in second] == ["ok"] * 4, [e.error for e in second]
    assert [e.result["answer"] for e in second] == ["Done."] * 4
