"""Asynchronous rollouts (issue 30): the producer's pacing, the staleness bound, version-consistent groups, partial
rollouts across weight updates, the off-policy objective computed by hand, and resume.

Real parts throughout: the trainer's endpoint (uvicorn on loopback), the embedded engine over a tiny Qwen2-shaped
model, agents using the official `openai` client.
"""

import asyncio
import json
import sys
import threading
import time

import pytest
import torch
from datasets import Dataset

from conftest import ScriptedEngine
from test_agentic_grpo_trainer import (
    StopAfter,
    config,
    dataset,
    length_reward,
    read_episode_log,
    tool_agent,
    train_and_read_log,
)
from trl_agentic import AgenticGRPOTrainer
from trl_agentic.generation.engine import SamplingParams
from trl_agentic.generation.transformers_engine import TransformersEngine
from trl_agentic.rollout.agents import resolve_agent
from trl_agentic.rollout.producer import RolloutProducer
from trl_agentic.rollout.rows import episode_to_rows
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer
from trl_agentic.trace import Turn
from trl_agentic.viewer import build_viewer_data, find_episode_files, load_records


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


def trained_versions(record):
    """The policy version of every trained (env_mask 1) token of an episode-log record's rows."""
    return [v for row in record["rows"] for v, m in zip(row["versions"], row["env_mask"]) if m]


# The producer on its own: pacing and admission


def test_the_producer_starts_a_batch_only_within_the_staleness_bound_and_a_group_all_at_once(start_server, tokenizer):
    server = start_server(ScriptedEngine(tokenizer, lambda prompt: "Fine."), tokenizer)
    started, running, most = [], [0], [0]

    async def agent(client, task):  # no model call: what is measured is when the producer starts it
        started.append(task["i"])
        running[0] += 1
        most[0] = max(most[0], running[0])
        await asyncio.sleep(0.05)
        running[0] -= 1

    producer = RolloutProducer(server, resolve_agent(agent), max_staleness=1, max_concurrent=2, timeout=10)
    try:
        for b in range(4):  # batch b is trained at version b; 2 groups of 2 episodes each
            tasks = [{"i": 4 * b + i} for i in range(4)]
            producer.submit(b, tasks, [0, 1, 0, 1], consume_version=b, unit_size=2)
        first, _ = producer.result(0, timeout=30)
        second, _ = producer.result(1, timeout=30)
        time.sleep(0.2)
        # Batches 0 and 1 start at version 0 (1 - 1 <= 0); batch 2 (trained at 2) waits for version 1.
        assert sorted(started) == list(range(8))
        assert most[0] == 2  # max_concurrent: one group of 2 at a time
        assert [ep.metadata["start_version"] for ep in first + second] == [0] * 8
        assert producer.take_idle_seconds() >= 0.15  # held back, and it says so
        producer.set_version(1)
        third, _ = producer.result(2, timeout=30)
        time.sleep(0.2)
        assert sorted(started) == list(range(12))  # batch 3 still waits for version 2
        assert [ep.metadata["start_version"] for ep in third] == [1] * 4
        assert [ep.task_index for ep in third] == [0, 1, 2, 3] and [ep.group_index for ep in third] == [0, 1, 0, 1]
        producer.set_version(2)
        fourth, _ = producer.result(3, timeout=30)
        assert [ep.metadata["start_version"] for ep in fourth] == [2] * 4
        assert all(ep.status == "ok" for ep in first + second + third + fourth)
        with pytest.raises(KeyError, match="not submitted"):
            producer.result(3)
    finally:
        producer.close()


def test_closing_the_producer_cancels_episodes_in_flight_and_fails_their_batch(start_server, tokenizer):
    server = start_server(ScriptedEngine(tokenizer, lambda prompt: "Fine."), tokenizer)

    async def slow_agent(client, task):
        await asyncio.sleep(30)

    producer = RolloutProducer(server, resolve_agent(slow_agent), max_staleness=1, timeout=60)
    producer.submit(0, [{"i": 0}, {"i": 1}], [0, 1], consume_version=0, unit_size=2)
    deadline = time.monotonic() + 30  # both started (polled: on a loaded machine 0.2 s was not always enough)
    while producer.running < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert producer.running == 2
    started = time.monotonic()
    producer.close()
    assert time.monotonic() - started < 20  # not the agents' 30 s: cancelled
    with pytest.raises(RuntimeError, match="closed"):
        producer.result(0, timeout=5)


# The engine: a call decoding across a weight update


def test_a_call_decoding_across_a_weight_update_records_the_version_of_each_token(tokenizer):
    """Partial rollouts: the weights change while a call decodes; it goes on with the new weights, and each token
    carries the version that sampled it and the logprob those weights gave it."""
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1)
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, inference_copy=True, watch_weights=False)
    updated = threading.Event()

    async def main():
        loop = asyncio.get_running_loop()
        seen = []

        def on_token(ids, logprobs):
            seen.extend(ids)
            if len(seen) == 3 and not updated.is_set():
                updated.set()

                def update():
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(0.5)
                    engine.policy_version = 1
                    engine.sync_weights()  # waits for the decode step in progress

                loop.run_in_executor(None, update)

        sampling = SamplingParams(max_tokens=40, temperature=1.0, stop_token_ids=[], seed=0)
        return await engine.generate([1, 2, 3, 4], sampling, on_token=on_token)

    try:
        out = asyncio.run(main())
    finally:
        asyncio.run(engine.stop())
    assert len(out.versions) == len(out.token_ids) == 40
    switch = out.versions.index(1)
    assert switch >= 3 and out.versions == [0] * switch + [1] * (40 - switch)
    # The recorded logprob of a token after the switch is the new weights' (the copy holds them), not the old ones'.
    with torch.no_grad():
        ids = torch.tensor([[1, 2, 3, 4] + out.token_ids])
        logps = torch.log_softmax(model(ids).logits[0, 3:-1].float(), dim=-1)
        scored = logps.gather(1, torch.tensor(out.token_ids).unsqueeze(1)).squeeze(1).tolist()
    # (The states of the tokens before the switch were computed by the old weights: only the first token after it,
    # whose query attends to them, may differ; later ones too, through those states, so check the direction only.)
    assert scored[0] != pytest.approx(out.logprobs[0], abs=1e-4)  # token 0 was sampled by the old weights


def test_rows_carry_each_sampled_tokens_version_and_their_oldest():
    t0 = Turn(
        0, prompt_ids=[1, 2], completion_ids=[10, 11], logprobs=[-0.1, -0.2], finish_reason="stop", policy_version=3
    )
    t1 = Turn(
        1,
        prompt_ids=[1, 2, 10, 11, 5],
        completion_ids=[12, 13],
        logprobs=[-0.3, -0.4],
        finish_reason="stop",
        prompt_source="continued",
        parent_turn=0,
        policy_version=3,
        token_versions=[3, 4],
    )
    row = episode_to_rows([t0, t1]).rows[0]
    assert row.env_mask == [1, 1, 0, 1, 1]
    assert row.versions == [3, 3, -1, 3, 4]
    assert row.oldest_version == 3
    assert row.to_dict()["versions"] == [3, 3, -1, 3, 4]


# The trainer


@pytest.mark.slow
def test_async_training_trains_every_token_within_the_bound_from_groups_started_together(tmp_path, tokenizer):
    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=tool_agent,
        reward_funcs=length_reward,
        args=config(tmp_path, async_rollouts=True, max_staleness=1, max_steps=4, per_device_train_batch_size=4),
        train_dataset=dataset(8),
        processing_class=tokenizer,
    )
    records = train_and_read_log(trainer, tmp_path)
    # `step` is the optimizer step that trained the episode; 2 groups of 2 a step; 8 tasks, each drawn once.
    assert [r["step"] for r in records] == [s for s in range(4) for _ in range(4)]
    tasks = [r["episode"]["messages"][0]["content"] for r in records]
    assert sorted(tasks) == sorted(f"Add {i} and {i + 1}." for i in range(8) for _ in range(2))
    staleness = []
    for record in records:
        metadata = record["episode"]["metadata"]
        versions = trained_versions(record)
        assert versions and record["step"] - min(versions) <= 1  # the bound, from the logged tokens
        assert metadata["staleness"] == record["step"] - min(versions)
        assert min(versions) >= metadata["start_version"] and not metadata.get("dropped")
        staleness.append(metadata["staleness"])
    for first, second in zip(records[::2], records[1::2]):  # the two episodes of a group
        assert first["episode"]["messages"][0] == second["episode"]["messages"][0]
        assert first["episode"]["metadata"]["start_version"] == second["episode"]["metadata"]["start_version"]
    assert 1 in staleness  # it did run ahead: episodes of step s were sampled by version s - 1
    logs = [entry for entry in trainer.state.log_history if "async/staleness_max" in entry]
    assert len(logs) == 4
    assert all(entry["async/dropped_groups"] == 0 and entry["async/staleness_max"] <= 1 for entry in logs)
    assert all(
        k in logs[0]
        for k in (
            "async/staleness_mean",
            "async/trainer_wait_s",
            "async/producer_wait_s",
            "async/in_flight_episodes",
            "sampling/importance_sampling_ratio/mean",
        )
    )
    assert trainer._producer is None  # stopped with train()
    # `trl-agentic inspect` shows each episode's start version and staleness.
    summary, _ = build_viewer_data(load_records(find_episode_files(tmp_path)[0]))
    assert [(e["step"], e["staleness"]) for e in summary["episodes"]] == [
        (r["step"], r["episode"]["metadata"]["staleness"]) for r in records
    ]


@pytest.mark.slow
def test_max_staleness_0_never_runs_ahead_and_the_correction_is_then_the_identity(tmp_path, tokenizer):
    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=tool_agent,
        reward_funcs=length_reward,
        args=config(tmp_path, async_rollouts=True, max_staleness=0, max_steps=3, per_device_train_batch_size=4),
        train_dataset=dataset(8),
        processing_class=tokenizer,
    )
    records = train_and_read_log(trainer, tmp_path)
    assert all(set(trained_versions(r)) == {r["step"]} for r in records)
    for entry in [e for e in trainer.state.log_history if "async/staleness_max" in e]:
        assert entry["async/staleness_max"] == 0
        # Sampled by the weights that score them: the engine's logprobs are the trainer's, to float rounding.
        assert entry["sampling/importance_sampling_ratio/min"] == pytest.approx(1.0, abs=1e-3)
        assert entry["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-3)


# Partial rollouts in the trainer, and the objective by hand

TRAINER = {}


async def straddling_agent(client, task):
    """Two calls; between them, an episode of a batch trained after the first waits (up to 10 s) for the engine to
    take the next optimizer step's weights: the producer ran it ahead, and it samples its calls on two versions."""
    messages = list(task["prompt"])
    response = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    version = int(response.system_fingerprint.removeprefix("policy-v"))
    deadline = time.monotonic() + (0.0 if messages[0]["content"] in TRAINER["first_batch"] else 10.0)
    while TRAINER["trainer"].engine.policy_version <= version and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    messages += [response.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return "done"


def sampled_tokens_reward(prompts, completions, episodes, **kwargs):
    return [float(sum(t.completion_ids[0] for t in ep.turns) % 3) for ep in episodes]


def test_a_two_version_batch_trains_with_trls_correction_exactly_as_computed_by_hand(tmp_path, tokenizer):
    """Three policies meet in a step: the behaviour policy (the recorded logprobs, here of two versions within one
    episode), the old/proximal one (the trainer's weights when it consumes the batch: TRL's old logprobs) and the
    current one. The loss is TRL's: `-sum_t min(r_t A, clip(r_t, 1-eps, 1+eps) A) * w / N` with
    `r_t = exp(logp_t - old_t)` and `w`, TRL's importance-sampling weight of the row (default `sequence_mask`:
    `exp(sum_t(old_t - behaviour_t))`, zeroed beyond `vllm_importance_sampling_clip_max`). Its gradient, computed by
    hand from the batch and an independent forward, is the trainer's."""
    args = config(
        tmp_path,
        async_rollouts=True,
        max_staleness=1,
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        vllm_importance_sampling_clip_max=1e9,
    )  # no row masked: every term is checked
    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=straddling_agent,
        reward_funcs=sampled_tokens_reward,
        args=args,
        train_dataset=dataset(8),
        processing_class=tokenizer,
    )
    TRAINER["trainer"] = trainer
    first = next(trainer._task_batches())  # the tasks the producer draws first (the sampler is seeded)
    TRAINER["first_batch"] = {trainer.train_dataset[i]["prompt"][0]["content"] for i in first}
    records = train_and_read_log(trainer, tmp_path)
    step1 = [r for r in records if r["step"] == 1]
    # Step 1's batch was started at version 0; its episodes' second calls waited for version 1: two versions.
    assert {tuple(t["policy_version"] for t in r["episode"]["turns"]) for r in step1} == {(0, 1)}
    assert all(sorted(set(trained_versions(r))) == [0, 1] for r in step1)

    batch = trainer._buffered_inputs[0]  # step 1's batch, consumed at version 1; the model is now at version 2
    model = trainer.model
    model.train()
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    mask = batch["completion_mask"] * batch["tool_mask"]
    width = batch["completion_ids"].size(1)
    behaviour, old = batch["sampling_per_token_logps"], batch["old_per_token_logps"]
    # The behaviour logprobs are the recorded ones, row by row.
    recorded = sorted(lp for r in step1 for lp, m in zip(r["rows"][0]["logprobs"], r["rows"][0]["env_mask"]) if m)
    assert sorted(behaviour[mask.bool()].tolist()) == pytest.approx(recorded, abs=1e-6)
    weight = torch.exp(((old - behaviour) * mask).sum(-1, keepdim=True))  # sequence_mask, nothing beyond the bounds
    assert torch.allclose(batch["importance_sampling_ratio"], weight, rtol=1e-5)
    assert (weight - 1).abs().max() > 1e-3  # a real correction: version 0's tokens are off the consuming policy

    def hand_loss():
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attention, position_ids=position_ids).logits
        logits = logits[:, -width - 1 : -1].float() / args.temperature
        logp = torch.log_softmax(logits, dim=-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logp - old)
        advantages = batch["advantages"].unsqueeze(1)
        clipped = torch.clamp(ratio, 1 - trainer.epsilon_low, 1 + trainer.epsilon_high)  # TRL: epsilon_high = epsilon
        per_token = -torch.min(ratio * advantages, clipped * advantages) * weight
        return (per_token * mask).sum() / batch["num_items_in_batch"].clamp(min=1.0)

    def gradient(loss_fn):
        model.zero_grad()
        loss_fn().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    trainer.current_gradient_accumulation_steps = 1
    ours = gradient(lambda: trainer.compute_loss(model, batch))
    by_hand = gradient(hand_loss)
    assert ours.keys() == by_hand.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], by_hand[name], rtol=1e-4, atol=1e-7, msg=name)
    assert any(g.abs().sum() > 0 for g in ours.values())


# Resume


def resumable(output_dir, tokenizer, sampling, callbacks=None):
    extra = {}
    train = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"Add {i} and {i + 1}."}], "difficulty": 1 + i % 2} for i in range(6)]
    )
    if sampling == "adaptive":  # the sampler draws ahead of what it has observed; held-out evaluation beside it
        extra = dict(task_sampling="adaptive", target_difficulty=2, held_out_eval_steps=2, held_out_num_samples=2)
    args = config(
        output_dir,
        async_rollouts=True,
        max_staleness=1,
        max_steps=5,
        save_strategy="steps",
        save_steps=2,
        per_device_train_batch_size=4,
        disable_tqdm=True,
        **extra,
    )
    return AgenticGRPOTrainer(
        build_tiny_model(tokenizer, hidden_size=32, num_layers=1),
        agent=tool_agent,
        reward_funcs=length_reward,
        args=args,
        train_dataset=train,
        eval_dataset=train.select(range(2)),
        processing_class=tokenizer,
        callbacks=callbacks,
    )


@pytest.mark.slow
@pytest.mark.parametrize("sampling", ["uniform", "adaptive"])
def test_a_resumed_async_run_trains_each_batch_once_with_the_tasks_of_the_run_never_stopped(
    tmp_path, tokenizer, sampling
):
    """A checkpoint keeps the producer's batches drawn but not trained (their tasks, not their episodes): the resumed
    run generates them again and trains them at the steps the stopped run would have, nothing twice, nothing lost."""
    whole = resumable(tmp_path / "whole", tokenizer, sampling)
    train_and_read_log(whole, tmp_path / "whole")
    stopped = resumable(tmp_path / "resumed", tokenizer, sampling, callbacks=[StopAfter(3).callback])
    train_and_read_log(stopped, tmp_path / "resumed")
    state = json.loads((tmp_path / "resumed" / "checkpoint-2" / "trl_agentic_state_0.json").read_text())
    assert state["async"]["consumed"] == 2 and sorted(state["async"]["pending"]) == ["2"]  # batch 2 ran ahead
    resumed = resumable(tmp_path / "resumed", tokenizer, sampling)
    try:
        resumed.train(resume_from_checkpoint=True)
    finally:
        resumed.close()

    def tasks_by_step(path):
        return [(r["step"], r["episode"]["messages"][0]["content"]) for r in read_episode_log(path)]

    resumed_tasks, whole_tasks = tasks_by_step(tmp_path / "resumed"), tasks_by_step(tmp_path / "whole")
    if sampling == "uniform":
        assert resumed_tasks == whole_tasks
    else:
        # Batch 2 ran ahead on version 1 when the checkpoint (version 2) was saved: the resumed run samples it again
        # on version 2, so its rewards, and what the sampler draws after observing them (batch 4), may differ.
        assert resumed_tasks[:16] == whole_tasks[:16]
    assert [s for s, _ in tasks_by_step(tmp_path / "whole")] == [s for s in range(5) for _ in range(4)]
    for record in read_episode_log(tmp_path / "resumed"):
        assert record["step"] - min(trained_versions(record)) <= 1
    if sampling == "adaptive":
        held_out = [s for s, _ in whole.alarms_callback.history["held_out/success"]]
        assert held_out == [0, 2, 4, 5]
        assert [s for s, _ in resumed.alarms_callback.history["held_out/success"]] == held_out


@pytest.mark.slow
@pytest.mark.timeout(300)  # a regression hangs the run: fail it instead
def test_async_training_goes_on_past_an_agent_that_exits_and_one_that_blocks(tmp_path, tokenizer):
    # Both used to stop the run (issue 40): `sys.exit()` stopped the producer's loop and `train()` waited for ever; a
    # blocking call held every episode of the loop past its timeout.
    release = threading.Event()

    async def unruly_agent(client, task):
        first = task["prompt"][0]["content"].split()[1]  # "Add <first> and <second>."
        if first == "0":
            sys.exit(1)  # a CLI's main()
        if first == "1":
            release.wait(60)  # requests.get without a timeout, inside an async def
        return await tool_agent(client, task)

    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=unruly_agent,
        reward_funcs=length_reward,
        args=config(
            tmp_path,
            async_rollouts=True,
            max_staleness=1,
            max_steps=2,
            per_device_train_batch_size=4,
            episode_timeout=5,
        ),
        train_dataset=dataset(4),
        processing_class=tokenizer,
    )
    try:
        records = train_and_read_log(trainer, tmp_path)
    finally:
        release.set()
    episodes = [record["episode"] for record in records]
    assert sorted(e["status"] for e in episodes) == ["agent_error"] * 2 + ["ok"] * 4 + ["timeout"] * 2
    assert {e["error"] for e in episodes if e["status"] == "agent_error"} == {"the agent raised SystemExit: 1"}
    assert {e["error"] for e in episodes if e["status"] == "timeout"} == {"episode exceeded 5.0s"}
    assert {e["messages"][0]["content"] for e in episodes if e["status"] == "ok"} == {"Add 2 and 3.", "Add 3 and 4."}
    # The blocked agents were left behind (their threads still blocked), and the log says how many.
    abandoned = [entry["episodes/abandoned"] for entry in trainer.state.log_history if "episodes/abandoned" in entry]
    assert abandoned == [0.5, 0.0]
    assert trainer.state.global_step == 2
