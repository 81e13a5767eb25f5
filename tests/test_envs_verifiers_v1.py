"""verifiers 0.4 environments (issue 45, item 1) with the real `verifiers` 0.4 package: `from_verifiers(env)` on a
`vf.SingleAgentEnv` whose taskset is defined here (`TinySums`, loaded by verifiers by this module's name), played by
verifiers' `null` harness (its plain chat program, prepared by `uv`) in the `subprocess` runtime, behind verifiers'
interception proxy, against the real endpoint answered by a scripted engine.

- Fast: the version dispatch, the dataset rows (and the task rebuilt from one), the reward functions' names and
  weights, the held-out split refused without held-out tasks, misuse refused saying how to fix.
- Slow (each episode starts the harness program, seconds): three concurrent episodes on their own path URLs, each
  recorded token for token (the prompt the engine saw is the chat template of the task's messages, the sampled tokens
  the row's mask-1 tokens), rewards function by function equal to verifiers' own trace rewards, weighted sums equal
  to `trace.reward`; an endpoint refusal fails the episode, unscored; one training step of `AgenticGRPOTrainer`.

Runs where verifiers 0.4 is installed (.ci/run: `.venv-vf`, with `uv` on PATH); skipped elsewhere.
"""

import asyncio
import json
import re
import shutil

import pytest
import torch


vf_root = pytest.importorskip("verifiers", reason="needs verifiers 0.4: pip install 'trl-agentic[verifiers]'")
if not vf_root.__version__.startswith("0.4"):
    pytest.skip(f"needs verifiers 0.4 (installed: {vf_root.__version__})", allow_module_level=True)
import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness

from conftest import ScriptedEngine
from test_agentic_grpo_trainer import config as grpo_config
from trl_agentic import AgenticGRPOTrainer
from trl_agentic.endpoint.sessions import EpisodeLimits
from trl_agentic.envs import from_verifiers
from trl_agentic.envs.verifiers import (
    TASK_COLUMN,
    VerifiersResult,
    load_verifiers_suite,
    require_supported_verifiers,
    task_from_row,
    uses_legacy_api,
    verifiers_trace,
)
from trl_agentic.evaluation import score_episodes
from trl_agentic.rollout.agents import EpisodeContext, resolve_agent
from trl_agentic.rollout.rows import episode_to_rows
from trl_agentic.rollout.runner import run_episodes, run_rollout
from trl_agentic.tasks import get_task
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer
from trl_agentic.trace import Episode


# --- the taskset, loaded by verifiers as the module named like its id ---------------------------------------------

SUMS = {"train": [(2, 3), (4, 5), (1, 1)], "eval": [(6, 1), (3, 3)]}


class SumData(vf.TaskData):
    answer: str


class SumsConfig(vf.TasksetConfig):
    split: str = "train"


class SumTask(vf.Task[SumData, vf.State]):
    @vf.reward(weight=1.0)
    async def correct(self, task, trace) -> float:
        return 1.0 if trace.last_reply.strip() == f"The answer is {task.answer}." else 0.0

    @vf.reward(weight=0.5)
    async def short(self, trace) -> float:
        return 1.0 if len(trace.last_reply) <= 16 else 0.0

    @vf.metric
    async def length(self, trace) -> float:
        return float(len(trace.last_reply))


class TinySums(vf.Taskset[SumTask, SumsConfig]):
    def load(self):
        for a, b in SUMS[self.config.split]:
            data = SumData(prompt=f"What is {a} + {b}?", answer=str(a + b), system_prompt="Answer briefly.")
            yield SumTask(data, self.config.task)


class SumsHarness(NullHarness):
    """The taskset's own harness (verifiers' plain chat program): what an agent of an environment loaded by id plays."""


# verifiers finds a taskset module's Taskset, and its default Harness, through __all__
__all__ = ["SumsHarness", "TinySums"]
TASKSET_ID = __name__


def sums_env(**env):
    config = {"taskset": {"id": TASKSET_ID}, "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}}
    return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(**config, **env))


def scripted_model(tokenizer, alternate=False):
    """The right sum for every question but 4 + 5 (answered 10, at length: "correct" and "short" both 0);
    `alternate`: every other reply is "I do not know." instead (so a group's rewards differ)."""
    calls = []

    def respond(prompt_ids):
        a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", tokenizer.decode(prompt_ids))[-1])
        calls.append((a, b))
        if alternate and len(calls) % 2 == 0:
            return "I do not know."
        return "The answer is 10, I think." if (a, b) == (4, 5) else f"The answer is {a + b}."

    return respond


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


@pytest.fixture(scope="module")
def suite():
    suite = from_verifiers(sums_env(), eval_taskset=TinySums(SumsConfig(id=TASKSET_ID, split="eval")))
    yield suite
    suite.agent.close()


def run(endpoint, suite, rows, timeout=300.0):
    tasks = [{column: row[column] for column in suite.agent_columns} for row in rows]
    episodes = run_rollout(run_episodes(endpoint, resolve_agent(suite.agent), tasks, timeout=timeout))
    rewards, per_func, _ = score_episodes(suite.reward_funcs, rows, episodes, suite.reward_weights)
    return episodes, rewards, per_func


# --- fast ------------------------------------------------------------------------------------------------------------


def test_the_installed_release_picks_the_adapter():
    require_supported_verifiers(vf_root.__version__)  # this module imported: 0.4 is accepted
    for version in ("0.3.1", "0.3.10.post1", "0.4.0", "0.4.0rc1", "0.4.7"):
        require_supported_verifiers(version)
    assert [uses_legacy_api(v) for v in ("0.3.1", "0.3.9", "0.4.0rc1", "0.4.0")] == [True, True, False, False]
    for version in ("0.5.0", "1.0"):
        with pytest.raises(ImportError, match=r"runs verifiers >=0\.3\.1,<0\.5 .*trl-agentic\[verifiers\]"):
            require_supported_verifiers(version)
    with pytest.raises(ImportError, match=r"older releases .*trl-agentic\[verifiers-legacy\]"):
        require_supported_verifiers("0.3.0")


def test_tasks_become_rows_and_rows_become_the_same_tasks(suite):
    rows = suite.build_dataset("train", size=3, seed=0).to_list()
    assert sorted(row["example_id"] for row in rows) == [0, 1, 2]
    by_id = {row["example_id"]: row for row in rows}
    assert by_id[1]["prompt"] == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 4 + 5?"},
    ]
    for row in rows:
        task = task_from_row(suite.env, row)
        assert type(task) is SumTask and task.config == suite.env.config.taskset.task
        original = list(suite.env.taskset)[row["example_id"]]
        assert task.data == original.data and task.key == original.key
    assert len(suite.build_dataset("train", size=2, seed=1)) == 2
    # The held-out split is the held-out taskset's tasks, never the training ones.
    held_out = suite.build_dataset("eval", size=8, seed=0).to_list()
    assert sorted(json.loads(row[TASK_COLUMN])["answer"] for row in held_out) == ["6", "7"]
    assert not {row[TASK_COLUMN] for row in held_out} & {row[TASK_COLUMN] for row in rows}
    with pytest.raises(ValueError, match="verifiers 0.4 tasksets have no splits, so pass them"):
        from_verifiers(sums_env()).build_dataset("eval")
    everything = suite.build_dataset("all", size=10).to_list()
    assert [json.loads(row[TASK_COLUMN])["answer"] for row in everything] == ["5", "9", "2", "7", "6"]
    with pytest.raises(ValueError, match="split must be 'train', 'eval' or 'all'"):
        suite.build_dataset("test")


def test_reward_functions_are_the_tasks_rewards_then_its_metrics(suite):
    assert [f.__name__ for f in suite.reward_funcs] == ["correct", "short", "length"]
    assert suite.reward_weights == [1.0, 0.5, 0.0]
    assert suite.agent_columns == ("prompt", TASK_COLUMN, "example_id")
    reward = suite.reward_funcs[0]
    with pytest.raises(ValueError, match="needs `episodes=`"):
        reward([[]], [[]])
    with pytest.raises(ValueError, match="no VerifiersAgent ran"):
        reward([[]], [[]], episodes=[Episode(id="a", status="ok", result="The answer is 5.")])
    assert reward([[]], [[]], episodes=[Episode(id="b", status="timeout")]) == [None]


def test_a_taskset_by_id_is_a_task(suite):
    by_id = get_task(f"verifiers:{TASKSET_ID}")  # the taskset's default harness (its own), in the subprocess runtime
    assert by_id.name == TASKSET_ID and by_id.reward_weights == suite.reward_weights
    assert [f.__name__ for f in by_id.reward_funcs] == [f.__name__ for f in suite.reward_funcs]
    assert by_id.env.config.agent.runtime.type == "subprocess" and by_id.env.config.agent.harness is None
    assert type(by_id.env._harnesses["agent"]) is SumsHarness
    null = load_verifiers_suite(TASKSET_ID, harness="null")
    assert null.env.config.agent.harness.id == "null"
    with pytest.raises(ValueError, match="verifiers:<taskset-id>"):
        get_task("verifiers:")


def test_misuse_is_refused_with_how_to_fix(suite, monkeypatch):
    with pytest.raises(ValueError, match=r"needs a verifiers 0.4 `vf.Env`"):
        from_verifiers(object())
    context = EpisodeContext("http://127.0.0.1:1/v1", "key", "policy", 10.0, episode_id="e1")
    assert context.path_base_url == "http://127.0.0.1:1/episodes/e1/v1"
    with pytest.raises(ValueError, match=r"agent_columns=list\(suite.agent_columns\)"):
        asyncio.run(suite.agent.run(context, {"prompt": "What is 2 + 3?"}))
    monkeypatch.setenv("PATH", "/nonexistent")
    assert shutil.which("uv") is None
    with pytest.raises(ValueError, match="`uv` is not on PATH: pip install uv"):
        from_verifiers(sums_env())


# --- slow: episodes through the endpoint, training ---------------------------------------------------------------


@pytest.mark.slow
def test_episodes_through_the_proxy_are_recorded_token_for_token_and_scored(start_server, tokenizer, suite):
    engine = ScriptedEngine(tokenizer, scripted_model(tokenizer))
    endpoint = start_server(engine, tokenizer)
    rows = sorted(suite.build_dataset("train", size=3).to_list(), key=lambda row: row["example_id"])
    episodes, rewards, per_func = run(endpoint, suite, rows)  # 3 at once, each on its own path URL

    assert [e.status for e in episodes] == ["ok"] * 3, [e.error for e in episodes]
    replies = ["The answer is 5.", "The answer is 10, I think.", "The answer is 2."]
    assert per_func == {"correct": [1.0, 0.0, 1.0], "short": [1.0, 0.0, 1.0], "length": [16.0, 26.0, 16.0]}
    assert rewards == [1.5, 0.0, 1.5]
    for episode, row, reply, reward in zip(episodes, rows, replies, rewards, strict=True):
        trace = verifiers_trace(episode)
        # verifiers' own scoring of its own trace: the rewards reached the trainer unchanged.
        assert trace.ok and trace.last_reply == reply and trace.reward == reward
        assert {name: r.score for name, r in trace.rewards.items()} == {
            name: per_func[name][row["example_id"]] for name in ("correct", "short")
        }
        assert episode.result["rewards"] == {"correct": per_func["correct"][row["example_id"]]} | {
            "short": per_func["short"][row["example_id"]]
        }
        # Token-exact: the one call the proxy forwarded is this episode's, rendered from the task's messages; its
        # sampled tokens are exactly the row's mask-1 tokens.
        (turn,) = episode.turns
        expected_prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        expected_prompt = list(getattr(expected_prompt, "input_ids", expected_prompt))
        assert turn.prompt_ids == expected_prompt and turn.prompt_source == "rendered"
        assert turn.completion_ids == tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        assert turn.prompt_ids in engine.prompts
        (train_row,) = episode_to_rows(episode.turns).rows
        assert train_row.prompt_ids == turn.prompt_ids
        assert [
            t for t, m in zip(train_row.completion_ids, train_row.env_mask, strict=True) if m
        ] == turn.completion_ids
    # The episode log keeps the summary; the trace stays in memory.
    logged = Episode.from_json(episodes[0].to_json()).result
    assert set(logged) == {"reply", "num_turns", "stop_condition", "is_truncated", "rewards", "reward"}
    assert isinstance(episodes[0].result, VerifiersResult) and not isinstance(logged, VerifiersResult)

    # The endpoint refuses every call (max_turns=0): verifiers reports the episode failed; unscorable, not a 0.
    refusing = start_server(ScriptedEngine(tokenizer, scripted_model(tokenizer)), tokenizer,
                            default_limits=EpisodeLimits(max_turns=0))  # fmt: skip
    episodes, rewards, per_func = run(refusing, suite, rows[:1])
    assert episodes[0].status in ("agent_error", "limit_exceeded") and rewards == [None]
    assert "The verifiers episode failed" in episodes[0].error and per_func["correct"] == [None]


@pytest.mark.slow
def test_one_training_step_on_a_verifiers_taskset(tmp_path, tokenizer, suite):
    model = build_tiny_model(tokenizer)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = grpo_config(
        tmp_path,
        max_steps=1,
        max_completion_length=32,
        episode_timeout=300,
        reward_weights=suite.reward_weights,
        agent_columns=list(suite.agent_columns),
    )
    trainer = AgenticGRPOTrainer(
        model,
        agent=suite.agent,
        reward_funcs=suite.reward_funcs,
        args=config,
        train_dataset=suite.build_dataset("train", size=3),
        processing_class=tokenizer,
        engine=ScriptedEngine(tokenizer, scripted_model(tokenizer, alternate=True)),
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters()), "parameters did not change"
    (metrics, *_) = trainer.state.log_history
    means = {name: metrics[f"rewards/{name}/mean"] for name in ("correct", "short", "length")}
    # One task, two replies: the right one (or 4 + 5's long wrong one) and "I do not know." (short, wrong).
    assert means["correct"] in (0.0, 0.5) and means["short"] in (0.5, 1.0) and metrics["reward_std"] > 0
    assert metrics["reward"] == pytest.approx(means["correct"] + 0.5 * means["short"])
    records = [json.loads(line) for line in (tmp_path / "episodes" / "episodes-rank0.jsonl").open()]
    assert len(records) == 2 and all(r["episode"]["status"] == "ok" for r in records)
    for record in records:
        (row,) = record["rows"]
        (turn,) = record["episode"]["turns"]
        assert [t for t, m in zip(row["completion_ids"], row["env_mask"]) if m] == turn["completion_ids"]


@pytest.mark.slow
def test_trl_agentic_eval_by_taskset_id(tmp_path):
    from trl_agentic.scripts.eval import main

    output, episodes_path = tmp_path / "eval.json", tmp_path / "episodes.jsonl"
    args = ["--task", f"verifiers:{TASKSET_ID}", "--split", "train", "--size", "2", "--num-samples", "1"]
    args += ["--model", "tiny:qwen2_5:64x2", "--max-tokens", "8", "--max-turns", "2", "--no-progress"]
    assert main([*args, "--output", str(output), "--episodes", str(episodes_path)]) == 0
    written = json.loads(output.read_text())
    assert written["episodes"] == 2 and written["status"]["ok"] == 2, written["status"]
    records = [json.loads(line) for line in episodes_path.read_text().splitlines()]
    for record in records:  # a random tiny model: whatever it said, weighted with the task's weights
        assert record["reward"] == pytest.approx(record["rewards"]["correct"] + 0.5 * record["rewards"]["short"])
    with pytest.raises(ValueError, match="verifiers 0.4 tasksets have no splits"):
        main([*args[:2], "--model", "tiny:qwen2_5:64x2", "--no-progress"])  # the eval split: no held-out tasks
