"""`trl-agentic eval` (`trl_agentic/scripts/eval.py`): the pass@k estimator, metrics on real episodes, the CLI."""

import json
import math

import pytest
from datasets import Dataset

from trl_agentic.trace import Episode, Turn
from trl_agentic.scripts.eval import evaluate, main, pass_at_k, pass_at_k_values, score_episodes, summarize
from trl_agentic.tasks import TaskSuite
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


NUM_SAMPLES = 4


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


# ---------------------------------------------------------------------------------------------------------------------
# pass@k on hand-made counts


def codex_pass_at_k(n, c, k):
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # math.comb(m, k) == 0 when m < k


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 0, 1, 0.0), (4, 0, 4, 0.0),  # never correct
        (4, 4, 1, 1.0), (4, 4, 4, 1.0),  # always correct
        (4, 1, 1, 0.25),                 # pass@1 = c / n
        (4, 1, 2, 0.5),                  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 3, 0.9),                  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (4, 2, 3, 1.0),                  # n - c < k: every 3 of 4 samples include a correct one
        (10, 3, 5, 1 - 21 / 252),        # 1 - C(7,5)/C(10,5)
    ],
)  # fmt: skip
def test_pass_at_k_hand_made_counts(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_matches_the_combinatorial_formula_and_is_monotone():
    for n in range(1, 13):
        for c in range(n + 1):
            values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
            assert values == pytest.approx([codex_pass_at_k(n, c, k) for k in range(1, n + 1)])
            assert values[0] == pytest.approx(c / n)
            assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))  # more tries never hurt
    assert pass_at_k(200, 3, 100) == pytest.approx(codex_pass_at_k(200, 3, 100))  # large n: no overflow


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="draw more samples"):
        pass_at_k(n=2, c=1, k=4)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(n=2, c=3, k=1)
    assert pass_at_k_values(4) == [1, 2, 4] and pass_at_k_values(6) == [1, 2, 4, 6] and pass_at_k_values(1) == [1]


def test_summarize_on_hand_made_episodes():
    episodes = [Episode(id=f"e{i}", status=s, turns=[Turn(0, [1], [2, 3], [0.0, 0.0], "stop")] * t)
                for i, (s, t) in enumerate([("ok", 1), ("ok", 2), ("timeout", 1), ("ok", 2)])]
    summary = summarize(episodes, rewards=[1.0, 0.5, None, 0.0], num_tasks=2, num_samples=2, success_threshold=0.5)
    assert summary["mean_reward"] == pytest.approx(0.5)  # the timed-out episode is left out
    assert summary["scored_episodes"] == 3 and summary["unscorable_episodes"] == 1
    assert summary["success_rate"] == 0.5 == summary["pass@1"]  # 1.0 and 0.5 reach the threshold
    assert [t["correct"] for t in summary["per_task"]] == [2, 0]  # the timeout counts as a failure
    assert summary["pass@2"] == 0.5 and summary["pass@k"] == {"1": 0.5, "2": 0.5}
    assert summary["status_counts"]["ok"] == 3 and summary["status_counts"]["timeout"] == 1
    assert summary["mean_turns"] == 1.5 and summary["mean_sampled_tokens"] == 3.0


def test_score_episodes_weights_and_unscorable():
    tasks = [{"prompt": [{"role": "user", "content": "q"}], "answer": "1"}] * 3
    episodes = [Episode(id="a", status="ok"), Episode(id="b", status="ok"), Episode(id="c", status="agent_error")]

    def first(prompts, completions, answer, episodes, **kwargs):
        assert answer == ["1", "1", "1"] and kwargs["trainer_state"] is None
        kwargs["log_metric"]("seen", len(prompts))
        return [1.0, None, 1.0]

    async def second(prompts, completions, **kwargs):  # async checkers are awaited, as in TRL
        return [0.5, 0.5, 0.5]

    rewards, per_func, logged = score_episodes([first, second], tasks, episodes, reward_weights=[1.0, 2.0])
    assert rewards == [2.0, 1.0, None]  # weighted sum of what scored; the crashed episode is unscorable
    assert per_func == {"first": [1.0, None, None], "second": [0.5, 0.5, None]}
    assert logged == {"seen": [3.0]}


# ---------------------------------------------------------------------------------------------------------------------
# evaluate() on real episodes of a tiny model


async def one_call_agent(client, task):
    if task["crash"]:
        raise RuntimeError("agent bug")
    response = await client.chat.completions.create(model="policy", messages=task["prompt"], max_tokens=3)
    return response.choices[0].message.content


def first_samples_correct(prompts, completions, correct, episodes, **kwargs):
    """1.0 for the first `correct` samples of a task (known counts, whatever the model says), 0.0 for the rest."""
    return [float(episode.group_index < c) for episode, c in zip(episodes, correct)]


SUITE = TaskSuite(
    name="counts",
    tools=[],
    system_prompt="",
    build_dataset=None,
    agent=one_call_agent,
    reward_funcs=[first_samples_correct],
    demonstrations=None,
)


def counts_dataset():
    # Tasks with 0, 2 and 4 correct samples out of 4, and one whose agent always crashes (its checker would say 4).
    rows = [(0, False), (2, False), (NUM_SAMPLES, False), (NUM_SAMPLES, True)]
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"Task {i}."}], "correct": c, "crash": crash}
                              for i, (c, crash) in enumerate(rows)])


def test_evaluate_counts_statuses_and_pass_at_k(tokenizer, tmp_path):
    model = build_tiny_model(tokenizer)
    metrics = evaluate(model, tokenizer, SUITE, counts_dataset(), num_samples=NUM_SAMPLES, temperature=1.0,
                       max_tokens=3, concurrency=8, seed=0, progress=False, episodes_path=tmp_path / "episodes.jsonl")
    size = 4
    assert metrics["num_episodes"] == size * NUM_SAMPLES == sum(metrics["status_counts"].values())
    assert metrics["status_counts"]["ok"] == 12 and metrics["status_counts"]["agent_error"] == 4
    # The crashed task is unscorable: out of the mean reward, a failure for pass@k.
    assert metrics["unscorable_episodes"] == 4 and metrics["scored_episodes"] == 12
    assert metrics["mean_reward"] == pytest.approx(6 / 12)
    assert [t["correct"] for t in metrics["per_task"]] == [0, 2, 4, 0]
    assert metrics["per_task"][0]["statuses"] == ["ok"] * 4
    assert metrics["per_task"][3]["statuses"] == ["agent_error"] * 4
    # pass@1 is the fraction correct; pass@k grows with k; all-correct -> 1, none -> 0.
    assert metrics["pass@1"] == pytest.approx(6 / 16) == pytest.approx(metrics["success_rate"])
    assert metrics["pass@4"] == pytest.approx((0 + 1 + 1 + 0) / 4)
    assert metrics["pass@k"]["2"] == pytest.approx((0 + (1 - 1 / 6) + 1 + 0) / 4)
    assert metrics["pass@1"] <= metrics["pass@k"]["2"] <= metrics["pass@4"]
    assert [t["pass@k"]["4"] for t in metrics["per_task"]] == [0.0, 1.0, 1.0, 0.0]
    assert [t["pass@k"]["1"] for t in metrics["per_task"]] == [0.0, 0.5, 1.0, 0.0]
    for key in ("mean_reward", "success_rate", "pass@1", "pass@4", "malformed_tool_call_rate"):
        assert 0.0 <= metrics[key] <= 1.0, key
    # One model call per episode that ran; the crashed ones made none.
    assert metrics["mean_turns"] == pytest.approx(12 / 16)
    assert metrics["mean_tool_calls"] >= 0 and metrics["mean_sampled_tokens"] <= 3 * 12 / 16
    assert metrics["reward_funcs"] == {"first_samples_correct": pytest.approx(0.5)}
    assert metrics["task"] == "counts" and "excluded from mean_reward" in metrics["note"]
    json.dumps(metrics)  # JSON-serialisable as returned

    records = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert len(records) == 16
    crashed = [r for r in records if r["episode"]["status"] == "agent_error"]
    assert len(crashed) == 4 and all(r["reward"] is None and "agent bug" in r["episode"]["error"] for r in crashed)
    assert all(len(r["episode"]["turns"]) == 1 for r in records if r["episode"]["status"] == "ok")


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def test_cli_reads_the_recipe_and_writes_json(tmp_path, capsys):
    output = tmp_path / "out" / "eval.json"
    code = main([
        "--config", "recipes/calculator/tiny/config_cpu.yaml",  # tiny:qwen2_5:64x2, calculator, max_turns 2
        "--size", "2", "--num-samples", "2",  # 2 tasks x 2 samples
        "--max-tokens", "4",  # short calls keep the test fast
        "--output", str(output), "--no-progress",
    ])
    assert code == 0
    written = json.loads(output.read_text())
    printed = json.loads(capsys.readouterr().out)
    assert printed == {k: v for k, v in written.items() if k != "per_task"}
    assert written["task"] == "calculator" and written["model"] == "tiny:qwen2_5:64x2" and written["split"] == "eval"
    assert written["num_tasks"] == 2 and written["num_episodes"] == 4 == sum(written["status_counts"].values())
    assert written["max_tokens"] == 4 and written["max_turns"] == 2 and written["seed"] == 42  # recipe's seed
    assert written["temperature"] == 1.0 and len(written["per_task"]) == 2
    assert 0.0 <= written["pass@1"] <= written["pass@2"] <= 1.0
    assert set(written["reward_funcs"]) == {"calculator_correct"}


def test_cli_errors_say_how_to_fix(tmp_path):
    with pytest.raises(SystemExit, match="no task"):
        main(["--model", "tiny:qwen2_5:64x2"])
    with pytest.raises(SystemExit, match="no model"):
        main(["--task", "calculator"])
    with pytest.raises(SystemExit, match="--size must be >= 1"):
        main(["--task", "calculator", "--model", "tiny:qwen2_5:64x2", "--size", "0"])
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("task: calculator\nmodel_name_or_path: tiny:qwen2_5:64x2\ntemprature: 0.7\n")
    with pytest.raises(ValueError, match="did you mean 'temperature'"):
        main(["--config", str(recipe)])
