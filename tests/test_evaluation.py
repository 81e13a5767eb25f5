"""`trl_agentic/evaluation.py`: one definition of success, the pass@k estimator, scoring, and evaluation runs."""

import dataclasses
import json
import math
import sys

import pytest
from datasets import Dataset

from trl_agentic.evaluation import (
    FINAL_STATUSES,
    Evaluator,
    evaluate,
    is_success,
    pass_at_k,
    pass_at_k_values,
    score_episodes,
    summarize,
)
from trl_agentic.tasks import TaskSuite
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer
from trl_agentic.trace import Episode, Turn


NUM_SAMPLES = 4


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


def turn(num_sampled: int = 2) -> Turn:
    return Turn(0, [1], [2] * num_sampled, [0.0] * num_sampled, "stop")


# ---------------------------------------------------------------------------------------------------------------------
# Success: failed and unscorable episodes are failures


def always_one(prompts, completions, **kwargs):
    """A checker that would pass every episode, failed or not."""
    return [1.0] * len(prompts)


def test_failed_episodes_count_as_failures_in_success():
    statuses = ["ok", "ok", "timeout", "agent_error", "limit_exceeded", "context_overflow"]
    episodes = [Episode(id=f"e{i}", status=s, turns=[turn()]) for i, s in enumerate(statuses)]
    tasks = [{"prompt": [{"role": "user", "content": "q"}]}] * len(episodes)

    rewards, _, _ = score_episodes([always_one], tasks, episodes)
    assert rewards == [1.0, 1.0, None, None, None, None]  # failed episodes are unscorable, whatever the checker says

    summary = summarize(episodes, rewards, num_tasks=6, num_samples=1)
    assert summary["success"] == 2 / 6  # over ALL episodes: the four failed ones are failures
    assert summary["scored_success"] == 1.0  # named as such: over the 2 scorable episodes only
    assert (summary["episodes"], summary["scored_episodes"], summary["unscorable_episodes"]) == (6, 2, 4)
    assert summary["pass@1"] == summary["success"]
    assert {s: n for s, n in summary["status"].items() if n} == {
        "ok": 2,
        "agent_error": 1,
        "timeout": 1,
        "context_overflow": 1,
        "limit_exceeded": 1,
    }
    assert tuple(summary["status"]) == FINAL_STATUSES  # every final status, in a fixed order, zeros included
    assert sum(summary["status"].values()) == summary["episodes"]


def test_unscorable_ok_episodes_and_misses_are_failures():
    episodes = [Episode(id=f"e{i}", status="ok", turns=[turn()]) for i in range(4)]
    rewards = [1.0, None, 0.0, 0.5]  # a checker could not score e1; e2 and e3 miss the threshold
    summary = summarize(episodes, rewards, num_tasks=4, num_samples=1)
    assert summary["success"] == 1 / 4 and summary["scored_success"] == 1 / 3
    assert summary["scored_mean_reward"] == pytest.approx(1.5 / 3)  # None is not averaged as 0
    assert [is_success(r) for r in rewards] == [True, False, False, False]
    assert summarize(episodes, rewards, 4, 1, success_threshold=0.5)["success"] == 2 / 4


def test_a_checker_that_scores_failures_counts_them():
    def timeout_is_fine(prompts, completions, **kwargs):
        return [1.0] * len(prompts)

    timeout_is_fine.scores_failed_episodes = True  # it scores failures itself: no masking
    episodes = [Episode(id="a", status="ok"), Episode(id="b", status="timeout")]
    tasks = [{"prompt": []}] * 2
    rewards, _, _ = score_episodes([timeout_is_fine], tasks, episodes)
    assert rewards == [1.0, 1.0]
    assert summarize(episodes, rewards, num_tasks=2, num_samples=1)["success"] == 1.0


def test_no_scorable_episode_at_all():
    episodes = [Episode(id="a", status="timeout"), Episode(id="b", status="agent_error")]
    summary = summarize(episodes, [None, None], num_tasks=1, num_samples=2)
    assert summary["success"] == 0.0 and summary["scored_success"] == 0.0 and summary["scored_mean_reward"] is None
    assert summary["pass@2"] == 0.0 and summary["mean_turns"] == 0.0 and summary["malformed_tool_call_rate"] == 0.0


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
    episodes = [
        Episode(id=f"e{i}", status=s, turns=[Turn(0, [1], [2, 3], [0.0, 0.0], "stop")] * t)
        for i, (s, t) in enumerate([("ok", 1), ("ok", 2), ("timeout", 1), ("ok", 2)])
    ]
    summary = summarize(episodes, rewards=[1.0, 0.5, None, 0.0], num_tasks=2, num_samples=2, success_threshold=0.5)
    assert summary["scored_mean_reward"] == pytest.approx(0.5)  # over the 3 scored episodes
    assert summary["scored_episodes"] == 3 and summary["unscorable_episodes"] == 1
    assert summary["success"] == 0.5 == summary["pass@1"]  # 1.0 and 0.5 reach the threshold: 2 of 4
    assert summary["scored_success"] == pytest.approx(2 / 3)
    assert [t["correct"] for t in summary["per_task"]] == [2, 0]  # the timeout counts as a failure
    assert summary["pass@2"] == 0.5 and summary["pass@k"] == {"1": 0.5, "2": 0.5}
    assert summary["status"]["ok"] == 3 and summary["status"]["timeout"] == 1
    assert summary["mean_turns"] == 1.5 and summary["mean_sampled_tokens"] == 3.0
    with pytest.raises(ValueError, match="2 tasks x 2 samples = 4 episodes"):
        summarize(episodes[:3], [1.0, 0.5, None], num_tasks=2, num_samples=2)


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
# Evaluation runs on real episodes of a tiny model


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
    agent_columns=("prompt", "crash"),  # `correct` is the checker's
)


def counts_dataset():
    # Tasks with 0, 2 and 4 correct samples out of 4, and one whose agent always crashes (its checker would say 4).
    rows = [(0, False), (2, False), (NUM_SAMPLES, False), (NUM_SAMPLES, True)]
    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": f"Task {i}."}], "correct": c, "crash": crash}
            for i, (c, crash) in enumerate(rows)
        ]
    )


def test_evaluate_counts_statuses_and_pass_at_k(tokenizer, tmp_path):
    model = build_tiny_model(tokenizer)
    metrics = evaluate(
        model,
        tokenizer,
        SUITE,
        counts_dataset(),
        num_samples=NUM_SAMPLES,
        temperature=1.0,
        max_tokens=3,
        concurrency=8,
        seed=0,
        episodes_path=tmp_path / "episodes.jsonl",
    )
    size = 4
    assert metrics["episodes"] == size * NUM_SAMPLES == sum(metrics["status"].values())
    assert metrics["status"]["ok"] == 12 and metrics["status"]["agent_error"] == 4
    # The crashed task is unscorable: a failure in success and pass@k, out of the scored_* figures.
    assert metrics["unscorable_episodes"] == 4 and metrics["scored_episodes"] == 12
    assert metrics["success"] == 6 / 16 and metrics["scored_success"] == 6 / 12
    assert metrics["scored_mean_reward"] == pytest.approx(6 / 12)
    assert [t["correct"] for t in metrics["per_task"]] == [0, 2, 4, 0]
    assert metrics["per_task"][0]["statuses"] == ["ok"] * 4
    assert metrics["per_task"][3]["statuses"] == ["agent_error"] * 4
    # pass@1 is the fraction correct; pass@k grows with k; all-correct -> 1, none -> 0.
    assert metrics["pass@1"] == pytest.approx(6 / 16) == pytest.approx(metrics["success"])
    assert metrics["pass@4"] == pytest.approx((0 + 1 + 1 + 0) / 4)
    assert metrics["pass@k"]["2"] == pytest.approx((0 + (1 - 1 / 6) + 1 + 0) / 4)
    assert metrics["pass@1"] <= metrics["pass@k"]["2"] <= metrics["pass@4"]
    assert [t["pass@k"]["4"] for t in metrics["per_task"]] == [0.0, 1.0, 1.0, 0.0]
    assert [t["pass@k"]["1"] for t in metrics["per_task"]] == [0.0, 0.5, 1.0, 0.0]
    for key in ("success", "scored_success", "pass@1", "pass@4", "malformed_tool_call_rate"):
        assert 0.0 <= metrics[key] <= 1.0, key
    # One model call per episode that ran; the crashed ones made none.
    assert metrics["mean_turns"] == pytest.approx(12 / 16)
    assert metrics["mean_tool_calls"] >= 0 and metrics["mean_sampled_tokens"] <= 3 * 12 / 16
    assert metrics["scored_reward_funcs"] == {"first_samples_correct": pytest.approx(0.5)}
    assert metrics["task"] == "counts" and "all episodes" in metrics["note"]
    assert (metrics["temperature"], metrics["max_tokens"], metrics["seed"]) == (1.0, 3, 0)
    json.dumps(metrics)  # JSON-serialisable as returned

    records = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert len(records) == 16
    crashed = [r for r in records if r["episode"]["status"] == "agent_error"]
    assert len(crashed) == 4 and all(r["reward"] is None and "agent bug" in r["episode"]["error"] for r in crashed)
    assert all(len(r["episode"]["turns"]) == 1 for r in records if r["episode"]["status"] == "ok")


def test_evaluator_serves_the_model_it_is_given_and_keeps_the_callers_rng(tokenizer):
    import torch

    first, second = build_tiny_model(tokenizer, seed=0), build_tiny_model(tokenizer, seed=1)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "Hi."}], "correct": 1, "crash": False}])
    with Evaluator(first, tokenizer, SUITE, dataset, num_samples=2, max_tokens=3) as evaluator:
        assert evaluator.server.served_model_name == "policy"
        torch.manual_seed(123)
        expected_next = torch.rand(1)
        torch.manual_seed(123)
        result = evaluator.evaluate(seed=7)
        assert torch.rand(1) == expected_next  # evaluation draws from a forked RNG
        assert result["episodes"] == 2 and result["success"] == 0.5  # the first of 2 samples is "correct"
        evaluator.evaluate(second, seed=7)
        assert evaluator.engine.model is second  # a later evaluation serves the model it is given


def test_a_reused_evaluator_samples_from_the_live_weights_after_a_fused_optimizer_step(tokenizer):
    """The demo's held-out evaluator serves the model being trained and is reused every `eval_every` steps.
    `AdamW(fused=True)` (TRL's default optimizer) bumps no parameter version counter: the engine kept the previous
    evaluation's key/value states of the shared prompt and sampled from them (held-out success 41% measured, 55-59% on
    a fresh evaluator)."""
    import torch

    model = build_tiny_model(tokenizer, seed=0)
    dataset = Dataset.from_list(
        [
            {
                "prompt": [
                    {"role": "system", "content": "You are a careful assistant. " * 8},
                    {"role": "user", "content": f"Task {i}."},
                ],
                "correct": 1,
                "crash": False,
            }
            for i in range(2)
        ]
    )

    def sampled(episodes):
        return [(turn.completion_ids, turn.logprobs) for episode in episodes for turn in episode.turns]

    with Evaluator(model, tokenizer, SUITE, dataset, num_samples=1, max_tokens=4, concurrency=1) as evaluator:
        evaluator.run(model, seed=3)
        assert len(evaluator.engine.prefix_cache) > 0  # the prompts' states are cached
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        after_step = sampled(evaluator.run(model, seed=3))
    with Evaluator(model, tokenizer, SUITE, dataset, num_samples=1, max_tokens=4, concurrency=1) as fresh:
        expected = sampled(fresh.run(model, seed=3))
    assert after_step == expected


def test_an_evaluation_samples_what_its_seed_says_whatever_order_the_calls_arrive_in(tokenizer):
    """Episode i samples from seeds derived from (seed, i) and each call's index (issue 29): concurrent episodes'
    calls reach the engine in any order, and the engine handed its own seeds out in that order."""
    import asyncio
    import dataclasses
    import random

    delays = random.Random()

    async def jittery_agent(client, task):
        messages = list(task["prompt"])
        for _ in range(2):
            await asyncio.sleep(delays.random() * 0.02)  # another order of calls each run
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "Again."},
            ]

    suite = dataclasses.replace(SUITE, agent=jittery_agent)
    with Evaluator(
        build_tiny_model(tokenizer, hidden_size=32, num_layers=1),
        tokenizer,
        suite,
        counts_dataset(),
        num_samples=2,
        max_tokens=3,
        concurrency=6,
    ) as evaluator:

        def sampled(order, seed):
            delays.seed(order)
            return [[turn.completion_ids for turn in episode.turns] for episode in evaluator.run(seed=seed)]

        first = sampled(order=1, seed=5)
        assert all(len(turns) == 2 for turns in first)
        assert sampled(order=2, seed=5) == first
        assert sampled(order=1, seed=6) != first


def test_evaluator_rejects_bad_arguments(tokenizer):
    model = build_tiny_model(tokenizer)
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        Evaluator(model, tokenizer, SUITE, counts_dataset(), num_samples=0)
    with pytest.raises(ValueError, match="dataset is empty"):
        Evaluator(model, tokenizer, SUITE, Dataset.from_list([]))


async def cli_agent(client, task):
    if task["crash"]:
        sys.exit("usage: agent [-h] TASK")  # a CLI's main() reached from the agent: its own episode, not the eval
    response = await client.chat.completions.create(model="policy", messages=task["prompt"], max_tokens=3)
    return response.choices[0].message.content


def test_an_agent_that_calls_sys_exit_costs_only_its_episodes_in_an_evaluation(tokenizer):
    metrics = evaluate(
        build_tiny_model(tokenizer),
        tokenizer,
        dataclasses.replace(SUITE, agent=cli_agent),
        counts_dataset(),
        num_samples=2,
        max_tokens=3,
        concurrency=8,
        seed=0,
    )
    assert (metrics["status"]["ok"], metrics["status"]["agent_error"]) == (6, 2)
    assert [t["statuses"] for t in metrics["per_task"]] == [["ok", "ok"]] * 3 + [["agent_error", "agent_error"]]
