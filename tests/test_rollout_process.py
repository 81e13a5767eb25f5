"""The asynchronous producer in a process of its own (`rollout_process=True`, issue 30).

Real parts: a spawned child process with the embedded engine over an inference copy of a tiny Qwen2-shaped model,
the endpoint on loopback, agents using the official `openai` client, weights handed over in shared memory.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from test_agentic_grpo_trainer import config, dataset, length_reward, tool_agent, train_and_read_log
from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.rollout.agents import resolve_agent
from trl_agentic.rollout.process import ProcessRolloutProducer
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


class ToolFailure(Exception):
    """An exception whose `__init__` takes two arguments (a common pattern): it pickles, and unpickling it calls
    `ToolFailure(message)`, which raises `TypeError`."""

    def __init__(self, tool: str, reason: str):
        super().__init__(f"{tool}: {reason}")


def wedge() -> None:
    """Hold the interpreter lock for hours: a catastrophic backtracking match, in C, checking no signal."""
    re.match(r"(a+)+$", "a" * 64 + "!")


def scored_logprobs(model, turn) -> list[float]:
    """The logprobs `model` gives a turn's sampled ids after its prompt (temperature 1)."""
    with torch.no_grad():
        ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
        logits = model(ids).logits[0, len(turn.prompt_ids) - 1 : -1].float()
        logps = torch.log_softmax(logits, dim=-1)
        return logps.gather(1, torch.tensor(turn.completion_ids).unsqueeze(1)).squeeze(1).tolist()


def producer_for(model, tokenizer, agent, **overrides):
    kwargs = dict(
        engine_kwargs=dict(batch_wait_ms=0.0),
        endpoint_kwargs=dict(temperature=1.0, max_tokens=5),
        max_staleness=1,
        max_concurrent=8,
        timeout=60,
        model_name="policy",
        version=0,
    )
    return ProcessRolloutProducer(model, tokenizer, resolve_agent(agent), **{**kwargs, **overrides})


@pytest.mark.slow
def test_the_child_samples_with_the_weights_last_sent_and_records_their_version(tokenizer):
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1)
    suffix = " Be brief."  # a closure: crosses to the child by value (dill)

    async def agent(client, task):
        messages = [{"role": "user", "content": task["q"] + suffix}]
        response = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
        return {"text": response.choices[0].message.content}

    tasks = [{"q": "Add 1 and 2."}, {"q": "Add 1 and 2."}]
    producer = producer_for(model, tokenizer, agent)
    try:
        assert producer.pid != os.getpid()
        producer.submit(0, tasks, [0, 1], consume_version=0, unit_size=2, seed=7)
        before, _ = producer.result(0, timeout=120)
        assert producer.stats.requests == 2  # the child's engine's work, delivered with the batch
        first_cpu = producer.cpu_seconds  # the child's CPU (benchmarks/trainer_benchmark.py rates it per step)
        assert first_cpu > 0
        producer.stats.reset()  # as the trainer does when it has logged them
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        producer.sync_weights(model, 1)
        producer.submit(1, tasks, [0, 1], consume_version=2, unit_size=2, seed=8)
        after, waited = producer.result(1, timeout=120)
        assert waited >= 0 and producer.pending() == []
        assert producer.stats.requests == 2 and producer.stats.decode_steps > 0
        assert producer.cpu_seconds > first_cpu
    finally:
        producer.close()
    assert not producer._process.is_alive()
    for episodes, version in ((before, 0), (after, 1)):
        assert [e.status for e in episodes] == ["ok", "ok"] and [e.group_index for e in episodes] == [0, 1]
        for episode in episodes:
            (turn,) = episode.turns
            assert turn.policy_version == version and episode.metadata["start_version"] == version
            assert turn.request_messages == [{"role": "user", "content": "Add 1 and 2. Be brief."}]
            assert turn.prompt_ids == tokenizer.apply_chat_template(
                turn.request_messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            assert isinstance(episode.result["text"], str)
    # The tokens sampled after the sync carry the new weights' logprobs: the child took the trainer's weights.
    for episode in after:
        assert episode.turns[0].logprobs == pytest.approx(scored_logprobs(model, episode.turns[0]), abs=1e-4)


@pytest.mark.slow
def test_a_result_that_does_not_pickle_fails_its_episode_only(tokenizer):
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1)

    async def agent(client, task):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}])
        return threading.Lock() if task["bad"] else "fine"

    producer = producer_for(model, tokenizer, agent)
    try:
        producer.submit(0, [{"bad": True}, {"bad": False}], [0, 1], consume_version=0, unit_size=2)
        episodes, _ = producer.result(0, timeout=120)
    finally:
        producer.close()
    assert [e.status for e in episodes] == ["agent_error", "ok"] and episodes[1].result == "fine"
    assert "could not be sent from the rollout process" in episodes[0].error and len(episodes[0].turns) == 1


@pytest.mark.slow
def test_a_result_that_does_not_unpickle_in_the_trainer_fails_its_episode_only(tokenizer):
    # It pickles in the child and fails only on the trainer's side: the listener thread died of it, and the trainer
    # waited for the batch for ever (issue 40).
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1)

    async def agent(client, task):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}])
        return {"failure": ToolFailure("grep", "no match")} if task["bad"] else "fine"

    producer = producer_for(model, tokenizer, agent)
    try:
        producer.submit(0, [{"bad": True}, {"bad": False}], [0, 1], consume_version=0, unit_size=2)
        episodes, _ = producer.result(0, timeout=120)
        producer.submit(1, [{"bad": False}], [0], consume_version=0, unit_size=1)  # the producer goes on
        (later,), _ = producer.result(1, timeout=120)
    finally:
        producer.close()
    assert [e.status for e in episodes] == ["agent_error", "ok"] and episodes[1].result == "fine"
    assert episodes[0].result is None and len(episodes[0].turns) == 1
    assert "could not be read in the trainer's process" in episodes[0].error and "TypeError" in episodes[0].error
    assert later.status == "ok" and later.result == "fine"


@pytest.mark.slow
def test_an_agent_that_calls_sys_exit_in_the_child_fails_its_episode_only(tokenizer):
    # `SystemExit` stopped the child's producer loop, and the trainer waited for the batch for ever (issue 40).
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1)

    async def agent(client, task):
        if task["exit"]:
            sys.exit(2)
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}])
        return "fine"

    producer = producer_for(model, tokenizer, agent)
    try:
        producer.submit(0, [{"exit": True}, {"exit": False}], [0, 1], consume_version=0, unit_size=2)
        episodes, _ = producer.result(0, timeout=120)
    finally:
        producer.close()
    assert [e.status for e in episodes] == ["agent_error", "ok"] and episodes[1].result == "fine"
    assert episodes[0].error == "the agent raised SystemExit: 2"


@pytest.mark.slow
def test_a_wedged_child_is_killed_by_the_watchdog_and_fails_the_waiting_step(tokenizer):
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1)

    async def agent(client, task):
        wedge()  # every thread of the child stops: its episode timeout cannot run either

    producer = producer_for(model, tokenizer, agent, watchdog_s=5.0)
    try:
        producer.submit(0, [{"q": 1}], [0], consume_version=0, unit_size=1)
        with pytest.raises(RuntimeError, match="sent nothing, not even its heartbeat, for 5s"):
            producer.result(0, timeout=120)
        producer._process.join(10)
        assert not producer._process.is_alive()
    finally:
        producer.close()


TRAINER_THAT_DIES = """
import sys, time
sys.path[:0] = {path!r}
from test_rollout_process import producer_for, wedge
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer

async def agent(client, task):
    wedge()

if __name__ == "__main__":
    tokenizer = build_tiny_tokenizer("qwen2_5")
    producer = producer_for(build_tiny_model(tokenizer, hidden_size=32, num_layers=1), tokenizer, agent)
    producer.submit(0, [{{"q": 1}}], [0], consume_version=0, unit_size=1)
    print(producer.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
def test_the_rollout_process_does_not_outlive_a_killed_trainer(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER_THAT_DIES.format(path=[os.path.dirname(__file__), *sys.path]))
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(trainer.stdout.readline())
        time.sleep(1.0)  # the child's agent is wedged by now
        trainer.kill()
        trainer.wait(30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and alive(child):
            time.sleep(0.2)
        assert not alive(child), "the rollout process outlived the trainer"
    finally:
        trainer.kill()
        if alive(child):
            os.kill(child, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_a_child_that_dies_fails_the_waiting_step_with_a_reason_not_a_hang(tokenizer):
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1)

    def agent(client, task):
        time.sleep(600)  # the episode runs until the child dies

    producer = producer_for(model, tokenizer, agent)
    try:
        producer.submit(0, [{"q": 1}], [0], consume_version=0, unit_size=1)
        os.kill(producer.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="rollout process exited unexpectedly"):
            producer.result(0, timeout=60)
        with pytest.raises(RuntimeError, match="rollout process exited unexpectedly"):
            producer.submit(1, [{"q": 1}], [0], consume_version=1, unit_size=1)
    finally:
        producer.close()


@pytest.mark.slow
def test_training_in_a_rollout_process_keeps_every_trained_token_within_the_bound(tmp_path, tokenizer):
    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=tool_agent,
        reward_funcs=length_reward,
        args=config(tmp_path, async_rollouts=True, rollout_process=True, max_steps=3, per_device_train_batch_size=4),
        train_dataset=dataset(8),
        processing_class=tokenizer,
    )
    records = train_and_read_log(trainer, tmp_path)
    assert [r["step"] for r in records] == [s for s in range(3) for _ in range(4)]
    staleness = []
    for record in records:
        versions = [v for row in record["rows"] for v, m in zip(row["versions"], row["env_mask"]) if m]
        assert versions and record["step"] - min(versions) <= 1
        assert record["episode"]["metadata"]["staleness"] == record["step"] - min(versions)
        staleness.append(record["episode"]["metadata"]["staleness"])
        # Rows are built in the trainer from the child's exact ids: each trained token is one the child sampled.
        turns = record["episode"]["turns"]
        sampled = [t for turn in turns for t in turn["completion_ids"]]
        trained = [t for row in record["rows"] for t, m in zip(row["completion_ids"], row["env_mask"]) if m]
        assert trained == sampled
    assert 1 in staleness  # it ran ahead
    logs = [entry for entry in trainer.state.log_history if "async/staleness_max" in entry]
    assert len(logs) == 3 and all(e["async/dropped_groups"] == 0 for e in logs)
    # The child's engine statistics reach the logs (a step whose batch was all decoded before the last step consumed
    # its own logs none, as in one process)
    assert any(e["engine/mean_decode_batch"] > 0 for e in logs)
    assert trainer._producer is None  # the child stopped with train()


def test_what_a_rollout_process_cannot_run_is_refused_at_construction(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="set async_rollouts=True"):
        AgenticGRPOConfig(output_dir=str(tmp_path), rollout_process=True, use_cpu=True, report_to="none")
    numbers = (i for i in range(3))  # a generator does not pickle

    async def holds_a_generator(client, task):
        return next(numbers)

    with pytest.raises(ValueError, match="could not be pickled.*build clients, locks"):
        AgenticGRPOTrainer(
            build_tiny_model(tokenizer, hidden_size=32, num_layers=1),
            agent=holds_a_generator,
            reward_funcs=length_reward,
            args=config(tmp_path, async_rollouts=True, rollout_process=True),
            train_dataset=dataset(2),
            processing_class=tokenizer,
        )
