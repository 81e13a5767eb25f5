"""verifiers environments (issue 32, item 2) with the real `verifiers` package: `from_verifiers(env)` and
`get_task("verifiers:<env-id>")`.

- A `SingleTurnEnv` and a `ToolEnv` (a Python tool) over tiny in-memory datasets, each with a rubric of two weighted
  functions, run their own rollout loops through the real endpoint, answered by a scripted engine: every reward is
  known, and equals what verifiers' own `Rubric.score_rollout` records for the same rollout, function by function.
- The ToolEnv's and a MultiTurnEnv's episodes are one token-exact row each (0 forks): the row trains the sampled tokens.
- Group reward functions score the rollouts of one `example_id` together; errors: the policy's are scored, the
  endpoint's fail the episode.
- 2 training steps of `AgenticGRPOTrainer` (tiny model), `Evaluator`, `trl-agentic eval` and `trl-agentic train` by
  environment id (the example, a Hub-style module), the example trained 2 steps.
"""

import json
import re
import sys
import threading
from pathlib import Path

import pytest
import torch


vf = pytest.importorskip(
    "verifiers", reason="needs verifiers 0.3: pip install 'trl-agentic[verifiers-legacy]' (.ci/run: .venv-envs)"
)
if not vf.__version__.startswith("0.3"):
    pytest.skip(f"needs verifiers 0.3 (installed: {vf.__version__})", allow_module_level=True)

from datasets import Dataset

from conftest import ScriptedEngine  # noqa: E402
from test_agentic_grpo_trainer import config as grpo_config  # noqa: E402
from trl_agentic import AgenticGRPOTrainer
from trl_agentic.endpoint.sessions import EpisodeLimits
from trl_agentic.envs import from_verifiers, verifiers_legacy
from trl_agentic.envs.verifiers import (
    VerifiersResult,
    require_supported_verifiers,
    rubric_reward_funcs,
    uses_legacy_api,
    verifiers_state,
)
from trl_agentic.evaluation import Evaluator, score_episodes
from trl_agentic.rollout.agents import resolve_agent
from trl_agentic.rollout.rows import episode_to_rows
from trl_agentic.rollout.runner import run_episodes, run_rollout
from trl_agentic.tasks import get_task
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer
from trl_agentic.trace import Episode


EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "envs"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression.
    """
    if not set(expression) <= set("0123456789+-* "):
        raise ValueError(f"cannot evaluate {expression!r}")
    return str(eval(expression))  # digits and operators only  # noqa: S307


def correct_answer(parser, completion, answer) -> float:
    return 1.0 if (parser.parse_answer(completion) or "").endswith(f" {answer}.") else 0.0


def concise(completion) -> float:
    return 1.0 / len(completion)  # 1 message: 1.0; tool call, tool result, answer: 1/3


def group_size(states) -> list[float]:
    # A group reward function (plural arguments): the number of rollouts scored together.
    return [float(len(states))] * len(states)


# Row 1's answer is wrong on purpose (4 * 5 is 20): the scripted model is right, so the checker says 0.
QUESTIONS = Dataset.from_list(
    [
        {"question": "What is 2 + 3?", "answer": "5"},
        {"question": "What is 4 * 5?", "answer": "21"},
        {"question": "Say nothing.", "answer": "0"},
    ]
)


def single_turn_env():
    return vf.SingleTurnEnv(
        dataset=QUESTIONS,
        system_prompt="Answer.",
        rubric=vf.Rubric(funcs=[correct_answer, concise], weights=[1.0, 0.5]),
    )


def tool_env(**rubric):
    rubric = rubric or dict(funcs=[correct_answer, concise], weights=[1.0, 0.5])
    return vf.ToolEnv(
        dataset=QUESTIONS.select(range(2)),
        system_prompt="Use the calculator.",
        tools=[calculator],
        max_turns=4,
        rubric=vf.Rubric(**rubric),
    )


def scripted_model(tokenizer, wrong_every: int = 0):
    """With tools offered: a `calculator` call on the question, then "The answer is <tool result>."; without:
    "The answer is <value>." at once. "Say nothing." gets an empty reply. `wrong_every=k`: every k-th final answer
    is off by one (so a group's rewards differ)."""
    answers = []

    def respond(prompt_ids):
        text = tokenizer.decode(prompt_ids)
        question = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", text, re.S)[0]  # the task's
        if question == "Say nothing.":
            return ""
        expression = question.removeprefix("What is ").removesuffix("?")
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)
        if "<tools>" in text and not results:
            return (
                f"<tool_call>\n{json.dumps({'name': 'calculator', 'arguments': {'expression': expression}})}\n"
                "</tool_call>"
            )
        value = int(results[-1] if results else calculator(expression))
        answers.append(value)
        if wrong_every and len(answers) % wrong_every == 0:
            value += 1
        return f"The answer is {value}."

    return respond


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


@pytest.fixture
def example_on_path(monkeypatch):
    """The example, a Hub-style module (`load_environment()`), importable as the environment `verifiers-env`."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield
    sys.modules.pop("verifiers_env", None)


@pytest.fixture(scope="module")
def endpoint(start_server, tokenizer):
    return start_server(ScriptedEngine(tokenizer, scripted_model(tokenizer)), tokenizer)


def run(endpoint, suite, rows, timeout=60.0):
    """Episodes of the suite's agent on `rows` (each seeing the suite's `agent_columns`), scored with its reward
    functions as the trainer scores them."""
    tasks = [{column: row[column] for column in suite.agent_columns} for row in rows]
    episodes = run_rollout(run_episodes(endpoint, resolve_agent(suite.agent), tasks, timeout=timeout))
    rewards, per_func, _ = score_episodes(suite.reward_funcs, rows, episodes, suite.reward_weights)
    return episodes, rewards, per_func


async def verifiers_score(env, state):
    """What verifiers itself records for a rollout: `state["reward"]` and `state["metrics"]`."""
    await env.rubric.score_rollout(state)
    return state["reward"], dict(state["metrics"])


def test_single_turn_env_rewards_are_its_rubrics_function_by_function(endpoint):
    env = single_turn_env()
    suite = from_verifiers(env)
    assert [f.__name__ for f in suite.reward_funcs] == ["correct_answer", "concise", "num_turns"]
    assert suite.reward_weights == [1.0, 0.5, 0.0]  # MultiTurnEnv's `num_turns` metric has weight 0
    assert suite.agent_columns == ("question", "answer", "example_id", "prompt")
    rows = env.get_dataset().to_list()
    episodes, rewards, per_func = run(endpoint, suite, rows)

    assert [e.status for e in episodes] == ["ok"] * 3
    # The empty reply left no turn in verifiers' trajectory and an empty completion: `concise` divides by zero,
    # which scores 0.0 (verifiers logs the error), as in `Rubric.score_rollout`.
    assert per_func == {"correct_answer": [1.0, 0.0, 0.0], "concise": [1.0, 1.0, 0.0], "num_turns": [1.0, 1.0, 0.0]}
    assert rewards == [1.5, 0.5, 0.0]
    # An empty reply is the policy's doing: verifiers records EmptyModelResponseError and still scores the rollout.
    assert episodes[2].result["error"].startswith("EmptyModelResponseError")
    assert episodes[0].result["stop_condition"] == "max_turns_reached" and episodes[0].result["error"] is None
    for i, episode in enumerate(episodes):
        reward, metrics = run_rollout(verifiers_score(env, verifiers_state(episode)))
        assert reward == rewards[i] and metrics == {name: values[i] for name, values in per_func.items()}
    # What the model saw: the row's prompt, as the environment built it; never the checker's answer.
    for episode, row in zip(episodes, rows, strict=True):
        assert episode.turns[0].request_messages == row["prompt"]
    assert "21" not in json.dumps([t.request_messages for t in episodes[1].turns])


def test_tool_env_episodes_are_one_token_exact_row_each(endpoint, tokenizer):
    env = tool_env()
    suite = from_verifiers(env)
    assert [f.__name__ for f in suite.reward_funcs] == [
        "correct_answer",
        "concise",
        "num_turns",
        "total_tool_calls",
        "calculator_calls",
    ]
    assert suite.reward_weights == [1.0, 0.5, 0.0, 0.0, 0.0]
    assert suite.tools[0]["function"]["name"] == "calculator"
    rows = env.get_dataset().to_list()
    episodes, rewards, per_func = run(endpoint, suite, rows)

    assert per_func == {
        "correct_answer": [1.0, 0.0],
        "concise": [1 / 3, 1 / 3],
        "num_turns": [2.0, 2.0],
        "total_tool_calls": [1.0, 1.0],
        "calculator_calls": [1.0, 1.0],
    }
    assert rewards == [1.0 + 0.5 / 3, 0.5 / 3]
    for i, episode in enumerate(episodes):
        assert episode.status == "ok" and episode.result["stop_condition"] == "no_tools_called"
        reward, metrics = run_rollout(verifiers_score(env, verifiers_state(episode)))
        assert reward == rewards[i] and metrics == {name: values[i] for name, values in per_func.items()}
        # The tool ran in the environment, and its result reached the model.
        assert episode.result["completion"][1] == {
            "role": "tool",
            "tool_call_id": episode.result["completion"][0]["tool_calls"][0]["id"],
            "content": calculator(rows[i]["question"][8:-1]),
        }
        # Token-exact: the second call continued the first, 0 forks, one row whose mask-1 tokens are the sampled ones.
        turns = episode.turns
        assert [t.prompt_source for t in turns] == ["rendered", "continued"] and episode.num_forks == 0
        (row,) = episode_to_rows(turns).rows
        assert row.prompt_ids == turns[0].prompt_ids
        assert row.prompt_ids + row.completion_ids == turns[1].prompt_ids + turns[1].completion_ids
        sampled = [(tok, lp) for t in turns for tok, lp in zip(t.completion_ids, t.logprobs, strict=True)]
        assert [
            (tok, lp) for tok, m, lp in zip(row.completion_ids, row.env_mask, row.logprobs, strict=True) if m
        ] == sampled
        masked = [tok for tok, m in zip(row.completion_ids, row.env_mask, strict=True) if not m]
        assert masked == turns[1].prompt_ids[len(turns[0].prompt_ids) + len(turns[0].completion_ids) :]
        assert calculator(rows[i]["question"][8:-1]) in tokenizer.decode(masked)  # the tool result, not trained
    # The episode log keeps the summary; the live state stays in memory.
    logged = Episode.from_json(episodes[0].to_json()).result
    assert set(logged) == {"completion", "num_turns", "stop_condition", "is_truncated", "error"}
    assert isinstance(episodes[0].result, VerifiersResult) and not isinstance(logged, VerifiersResult)


class AreYouSure(vf.MultiTurnEnv):
    """A MultiTurnEnv written in Python: after the first answer the environment asks again, once."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "Are you sure?"}]


def test_a_multi_turn_env_continues_its_conversation_token_for_token(endpoint):
    env = AreYouSure(
        dataset=QUESTIONS.select(range(1)),
        max_turns=2,
        rubric=vf.Rubric(funcs=[correct_answer, concise], weights=[1.0, 0.5]),
    )
    suite = from_verifiers(env)
    episodes, rewards, per_func = run(endpoint, suite, env.get_dataset().to_list())
    (episode,) = episodes
    assert [t.prompt_source for t in episode.turns] == ["rendered", "continued"] and episode.num_forks == 0
    assert episode.turns[1].request_messages[-1] == {"role": "user", "content": "Are you sure?"}
    assert per_func == {"correct_answer": [1.0], "concise": [1 / 3], "num_turns": [2.0]}
    assert rewards == [1.0 + 0.5 / 3] and len(episode_to_rows(episode.turns).rows) == 1


def test_group_reward_functions_score_the_rollouts_of_one_example_together(endpoint):
    env = tool_env(funcs=[correct_answer, group_size], weights=[1.0, 0.25])
    suite = from_verifiers(env)
    rows = [row for row in env.get_dataset().to_list() for _ in range(2)]  # 2 examples x 2 rollouts
    rows = rows[::2] + rows[1::2]  # interleaved: the groups are found by example_id, not by position
    episodes, rewards, per_func = run(endpoint, suite, rows)
    assert [r["example_id"] for r in rows] == [0, 1, 0, 1]
    assert per_func["group_size"] == [2.0] * 4 and per_func["correct_answer"] == [1.0, 0.0, 1.0, 0.0]
    assert rewards == [1.5, 0.5, 1.5, 0.5]


def test_an_endpoint_failure_fails_the_episode_and_is_not_scored(start_server, tokenizer):
    # The endpoint refuses the second call (max_turns=1): the rollout aborts, so the episode ends limit_exceeded (the
    # refusal the endpoint saw, its error kept) and has no state to score.
    limited = start_server(
        ScriptedEngine(tokenizer, scripted_model(tokenizer)), tokenizer, default_limits=EpisodeLimits(max_turns=1)
    )
    suite = from_verifiers(tool_env())
    episodes, rewards, per_func = run(limited, suite, tool_env().get_dataset().to_list())
    assert [e.status for e in episodes] == ["limit_exceeded"] * 2 and rewards == [None, None]
    assert "ModelError" in episodes[0].error and per_func["correct_answer"] == [None, None]


def test_misuse_is_refused_with_how_to_fix():
    with pytest.raises(ValueError, match="needs a verifiers Environment"):
        from_verifiers(object())
    with pytest.raises(ValueError, match="no reward function with a non-zero weight"):
        from_verifiers(vf.SingleTurnEnv(dataset=QUESTIONS))  # only MultiTurnEnv's num_turns metric
    (reward, *_), _ = rubric_reward_funcs(vf.Rubric(funcs=[correct_answer]))
    ran_by_another_agent = Episode(id="a", status="ok", result="The answer is 5.")
    with pytest.raises(ValueError, match="no VerifiersAgent ran"):
        run_rollout(reward([[]], [[]], episodes=[ran_by_another_agent], example_id=[0]))
    assert run_rollout(reward([[]], [[]], episodes=[Episode(id="b", status="timeout")], example_id=[0])) == [None]


def test_only_the_verifiers_releases_an_adapter_runs_are_accepted():
    # The installed release (CI: 0.3.1, with its own requirements) is accepted and runs the 0.3 adapter.
    require_supported_verifiers(vf.__version__)
    assert uses_legacy_api(vf.__version__) and from_verifiers is verifiers_legacy.from_verifiers
    for version in (
        "0.3.1",
        "0.3.2",
        "0.3.10.post1",
        "0.4.0",
    ):  # 0.4: verifiers_v1.py (tests/test_envs_verifiers_v1.py)
        require_supported_verifiers(version)
    for version in ("0.5.2", "1.0"):
        with pytest.raises(
            ImportError,
            match=r"verifiers .* is installed, but .* runs verifiers >=0\.3\.1,<0\.5 .*pip install 'trl-agentic\[verifiers\]'",
        ):
            require_supported_verifiers(version)
    with pytest.raises(ImportError, match="older releases lack the verifiers.legacy clients"):
        require_supported_verifiers("0.3.0")


def test_an_agent_not_given_every_column_fails_its_episodes_saying_how_to_fix(endpoint):
    suite = from_verifiers(single_turn_env())
    (episode,) = run_rollout(run_episodes(endpoint, resolve_agent(suite.agent), [{"prompt": QUESTIONS[0]["question"]}]))
    assert episode.status == "agent_error" and "agent_columns=list(suite.agent_columns)" in episode.error
    assert not episode.turns  # refused before any model call: never scored without its `answer`
    with pytest.raises(ValueError, match="verifiers:<env-id>"):
        get_task("verifiers:")
    with pytest.raises(ValueError, match="Could not import 'no-such-env'"):
        get_task("verifiers:no-such-env")


# --- training and evaluation ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_training_steps_log_each_rubric_function(tmp_path, tokenizer):
    suite = from_verifiers(tool_env())
    model = build_tiny_model(tokenizer)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = grpo_config(
        tmp_path,
        max_completion_length=64,
        episode_timeout=60,
        reward_weights=suite.reward_weights,
        agent_columns=list(suite.agent_columns),
    )  # 2 episodes a step, room for a scripted tool call
    trainer = AgenticGRPOTrainer(
        model,
        agent=suite.agent,
        reward_funcs=suite.reward_funcs,
        args=config,
        train_dataset=suite.build_dataset("train", size=2),
        processing_class=tokenizer,
        engine=ScriptedEngine(tokenizer, scripted_model(tokenizer, wrong_every=2)),
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters()), "parameters did not change"
    records = [json.loads(line) for line in (tmp_path / "episodes" / "episodes-rank0.jsonl").open()]
    assert len(records) == 4
    for record in records:
        episode = record["episode"]
        assert episode["status"] == "ok" and episode["result"]["stop_condition"] == "no_tools_called"
        turns = episode["turns"]
        assert [t["prompt_source"] for t in turns] == ["rendered", "continued"]
        (row,) = record["rows"]
        sampled = [(tok, lp) for t in turns for tok, lp in zip(t["completion_ids"], t["logprobs"])]
        assert [
            (tok, lp) for tok, m, lp in zip(row["completion_ids"], row["env_mask"], row["logprobs"]) if m
        ] == sampled
    for metrics in trainer.state.log_history[:2]:
        # Each rubric function logged under its own name; the reward is their sum with the rubric's weights.
        means = {
            name: metrics[f"rewards/{name}/mean"]
            for name in ("correct_answer", "concise", "num_turns", "total_tool_calls", "calculator_calls")
        }
        assert means["num_turns"] == 2.0 and means["total_tool_calls"] == means["calculator_calls"] == 1.0
        assert means["correct_answer"] == 0.5  # one of the two answers of each step is off by one
        assert metrics["reward"] == pytest.approx(means["correct_answer"] + 0.5 * means["concise"])


def test_evaluator_and_trl_agentic_eval_by_environment_id(tmp_path, tokenizer, example_on_path):
    suite = get_task("verifiers:verifiers-env")
    assert suite.name == "verifiers-env" and suite.reward_weights == [1.0, 0.2, 0.0, 0.0, 0.0]
    dataset = suite.build_dataset("eval", size=2)
    model = build_tiny_model(tokenizer)
    with Evaluator(
        model, tokenizer, suite, dataset, num_samples=2, max_tokens=8, max_turns=2, concurrency=4
    ) as evaluator:
        metrics = evaluator.evaluate(seed=0)
    assert metrics["episodes"] == 4 and metrics["status"]["ok"] == 4 and metrics["mean_turns"] >= 1
    means = metrics["scored_reward_funcs"]
    assert set(means) == {f.__name__ for f in suite.reward_funcs}
    # The rubric's weights, not 1.0 each: the metrics (num_turns, ...) add nothing to the reward.
    assert metrics["scored_mean_reward"] == pytest.approx(means["correct_answer"] + 0.2 * means["short_reply"])

    from trl_agentic.scripts.eval import main

    output, episodes_path = tmp_path / "eval.json", tmp_path / "episodes.jsonl"
    code = main(
        [
            "--task",
            "verifiers:verifiers-env",
            "--model",
            "tiny:qwen2_5:64x2",
            "--size",
            "2",
            "--num-samples",
            "2",
            "--max-tokens",
            "8",
            "--max-turns",
            "2",
            "--output",
            str(output),
            "--episodes",
            str(episodes_path),
            "--no-progress",
        ]
    )
    assert code == 0
    written = json.loads(output.read_text())
    assert written["episodes"] == 4
    for line in episodes_path.read_text().splitlines():
        record = json.loads(line)
        if record["reward"] is not None:  # weighted with the rubric's weights (the metrics count 0)
            assert record["reward"] == pytest.approx(
                record["rewards"]["correct_answer"] + 0.2 * record["rewards"]["short_reply"]
            )


@pytest.mark.slow
def test_the_example_trains_two_steps_on_a_tiny_model(tmp_path, example_on_path):
    import verifiers_env

    trainer = verifiers_env.main(
        [
            "--model",
            "tiny:qwen2_5",
            "--steps",
            "2",
            "--num-generations",
            "2",
            "--max-tokens",
            "16",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert trainer.state.global_step == 2
    records = [json.loads(line) for line in (tmp_path / "episodes" / "episodes-rank0.jsonl").open()]
    assert len(records) == 4 and all(r["episode"]["status"] == "ok" and r["episode"]["turns"] for r in records)
    assert "rewards/correct_answer/mean" in trainer.state.log_history[0]


def test_trl_agentic_train_by_id_takes_the_rubrics_weights_and_the_rows_columns(tmp_path, example_on_path):
    from trl_agentic.recipes import make_parser
    from trl_agentic.scripts.train import run as train

    script_args, training_args, model_args = make_parser().parse_args_and_config(
        [
            "--task",
            "verifiers:verifiers-env",
            "--model_name_or_path",
            "tiny:qwen2_5",
            "--output_dir",
            str(tmp_path),
            "--max_steps",
            "1",
            "--num_generations",
            "2",
            "--per_device_train_batch_size",
            "2",  # 1 task x 2 episodes
            "--max_completion_length",
            "8",
            "--train_size",
            "2",
            "--use_cpu",
            "true",
            "--bf16",
            "false",
            "--report_to",
            "none",
            "--save_strategy",
            "no",
            "--log_episodes",
            "true",
            "--logging_steps",
            "1",
        ]
    )
    train(script_args, training_args, model_args)
    assert training_args.reward_weights == [1.0, 0.2, 0.0, 0.0, 0.0]
    assert training_args.agent_columns == ["prompt", "question", "answer", "example_id"]
    records = [json.loads(line) for line in (tmp_path / "episodes" / "episodes-rank0.jsonl").open()]
    assert len(records) == 2 and all(r["episode"]["status"] == "ok" for r in records)


def test_a_tool_that_blocks_times_out_its_own_episode_only(endpoint):
    # verifiers calls a sync tool on the episode's event loop: it blocked every episode of the rollout, past every
    # timeout (issue 40). Each episode now has a loop of its own; the blocked one times out alone.
    release = threading.Event()

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression.
        """
        if expression == "4 * 5":
            release.wait(60)  # a tool stuck on a network call
        return str(eval(expression))  # digits and operators only  # noqa: S307

    env = vf.ToolEnv(
        dataset=QUESTIONS.select(range(2)),
        system_prompt="Use the calculator.",
        tools=[calculator],
        max_turns=4,
        rubric=vf.Rubric(funcs=[correct_answer], weights=[1.0]),
    )
    suite = from_verifiers(env)
    tasks = [{column: row[column] for column in suite.agent_columns} for row in env.get_dataset().to_list()]
    out = {}
    thread = threading.Thread(
        target=lambda: out.update(
            episodes=run_rollout(run_episodes(endpoint, resolve_agent(suite.agent), tasks, timeout=5.0))
        ),
        daemon=True,
    )
    try:
        thread.start()
        thread.join(30)
        assert not thread.is_alive(), "a blocked tool held the rollout past its episode's timeout"
    finally:
        release.set()
    assert [e.status for e in out["episodes"]] == ["ok", "timeout"], [e.error for e in out["episodes"]]
    assert out["episodes"][0].result["stop_condition"] == "no_tools_called"
