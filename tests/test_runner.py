"""The rollout runner: an episode's timeout bounds the rollout, whatever the agent does (issue #9).

Every test runs real agents against a real endpoint (uvicorn on loopback, a scripted engine) through `run_rollout`,
the way the trainer runs them; the rollout runs in a thread joined with a deadline, so that a regression fails the test
instead of hanging it.
"""

import asyncio
import os
import random
import sys
import threading
import time

import pytest

from conftest import ScriptedEngine
from trl_agentic.generation.transformers_engine import TransformersEngine
from trl_agentic.rollout.agents import resolve_agent
from trl_agentic.rollout.producer import RolloutProducer
from trl_agentic.rollout.runner import CANCEL_GRACE_S, run_episodes, run_rollout
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


TIMEOUT = 1.0  # seconds per episode: short, the agents below misbehave on purpose


@pytest.fixture(scope="module")
def server(start_server):
    tokenizer = build_tiny_tokenizer("qwen2_5")
    return start_server(ScriptedEngine(tokenizer, lambda prompt: "Fine."), tokenizer)


def rollout(server, agent, num_episodes, deadline, **kwargs):
    """Run episodes in a thread of their own (as the trainer does); fail if they are not back within `deadline`."""
    out = {}

    def target():
        out["episodes"] = run_rollout(
            run_episodes(
                server,
                resolve_agent(agent),
                [{"prompt": "p"}] * num_episodes,
                timeout=kwargs.pop("timeout", TIMEOUT),
                **kwargs,
            )
        )

    started = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(deadline)
    assert not thread.is_alive(), f"the rollout was still running after {deadline}s"
    return out["episodes"], time.monotonic() - started


def call_model(client):
    return client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4)


def test_sync_agent_blocked_past_its_timeout_does_not_hold_the_rollout(server):
    release = threading.Event()

    def blocked_agent(client, task):
        call_model(client)
        release.wait(30)  # blocked in a call that does not come back in time (one that never returns holds nothing)
        return "too late"

    try:
        episodes, elapsed = rollout(server, blocked_agent, 2, deadline=15)
    finally:
        release.set()
    assert [e.status for e in episodes] == ["timeout", "timeout"]
    assert all(len(e.turns) == 1 for e in episodes)  # what it did before blocking is kept
    assert elapsed < TIMEOUT + CANCEL_GRACE_S + 2.0, elapsed


def test_sync_agents_run_at_once_and_their_clock_starts_when_they_start(server):
    # 16 agents of 1 s with a 2.5 s timeout and 16 slots: all fit (1.5 s of margin for the model call on a loaded
    # machine). Queued on the loop's default pool (6 threads on 2 cores) the last ones waited 2 s while their clock
    # ran, and timed out.
    def slow_agent(client, task):
        call_model(client)
        time.sleep(1.0)
        return "done"

    episodes, _ = rollout(server, slow_agent, 16, deadline=40, timeout=2.5, max_concurrent=16)
    assert [e.status for e in episodes] == ["ok"] * 16, [e.error for e in episodes]


def test_async_agent_that_swallows_cancellation_is_abandoned_as_timeout(server):
    async def sneaky_agent(client, task):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass  # ignores the timeout ...
        await asyncio.sleep(2)
        return "sneaked through"  # ... and returns as if nothing happened

    async def stubborn_agent(client, task):
        while True:  # never ends, whatever happens
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                pass

    for agent in (sneaky_agent, stubborn_agent):
        episodes, elapsed = rollout(server, agent, 2, deadline=15)
        assert [e.status for e in episodes] == ["timeout", "timeout"], agent.__name__
        assert all(e.result is None and e.metadata["abandoned"] for e in episodes)
        assert elapsed < TIMEOUT + 2 * CANCEL_GRACE_S + 2.0, (agent.__name__, elapsed)


def test_a_seeded_rollout_samples_the_same_tokens_whatever_order_its_calls_arrive_in(start_server):
    """Each episode's calls sample from seeds derived from the rollout's seed, the episode's position and the call's
    index, not from the order requests reach the engine (issue 29, L4): concurrent episodes interleave their calls
    differently from run to run, and the engine handed its own seeds out in arrival order."""
    tokenizer = build_tiny_tokenizer("qwen2_5")
    engine = TransformersEngine(
        build_tiny_model(tokenizer, hidden_size=32, num_layers=1), pad_token_id=tokenizer.pad_token_id, seed=0
    )
    server = start_server(engine, tokenizer)
    delays = random.Random()

    async def jittery_agent(client, task):
        messages = [{"role": "user", "content": task["prompt"]}]
        for call in range(3):
            await asyncio.sleep(delays.random() * 0.02)  # the calls reach the engine in a different order every run
            reply = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=4, n=2 if call == 0 else 1
            )  # n > 1: a seed per choice
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": f"Go on ({call})."},
            ]

    tasks = [{"prompt": f"Task {i}."} for i in range(3) for _ in range(2)]  # 3 groups of 2

    def sampled(order: int, seed: int | None) -> list[list[list[int]]]:
        delays.seed(order)
        engine.manual_seed(0)  # as the trainer reseeds the engine before each rollout
        episodes = run_rollout(
            run_episodes(
                server,
                resolve_agent(jittery_agent),
                tasks,
                group_indices=[i % 2 for i in range(6)],
                timeout=60,
                seed=seed,
            )
        )
        assert [e.status for e in episodes] == ["ok"] * 6, [e.error for e in episodes]
        # Per (task position, group index): each call's choices, in call order.
        return [[turn.completion_ids for turn in episode.turns] for episode in episodes]

    first = sampled(order=1, seed=7)
    assert all(len(turns) == 4 for turns in first)  # 2 choices, then 2 calls
    assert sampled(order=2, seed=7) == first
    assert sampled(order=1, seed=8) != first  # the rollout's seed decides what is sampled
    assert first[0] != first[1]  # the two episodes of a group sample differently
    assert first[0][0] != first[0][1]  # and so do the choices of one call


# One agent's fault costs one episode (issue 40, item 4): what an `async def` agent does on its own loop.

# More calls than the loop's default thread pool has threads (min(32, cpus + 4)): enough hung ones to fill it.
DEFAULT_POOL_THREADS = min(32, (os.cpu_count() or 1) + 4)


def test_an_async_agent_that_calls_sys_exit_fails_only_its_episode(server):
    async def cli_agent(client, task):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        if task["prompt"] == "exit":
            sys.exit(2)  # a CLI's main() (argparse, click) reached from inside the agent
        return "done"

    out = {}
    thread = threading.Thread(
        target=lambda: out.update(
            episodes=run_rollout(
                run_episodes(server, resolve_agent(cli_agent), [{"prompt": "exit"}, {"prompt": "p"}], timeout=10)
            )
        ),
        daemon=True,
    )
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    assert [e.status for e in out["episodes"]] == ["agent_error", "ok"]
    assert out["episodes"][0].error == "the agent raised SystemExit: 2"
    assert [len(e.turns) for e in out["episodes"]] == [1, 1] and out["episodes"][1].result == "done"


def test_an_async_agent_blocked_in_a_sync_call_times_out_alone(server):
    release = threading.Event()

    async def blocking_agent(client, task):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        if task["prompt"] == "block":
            release.wait(30)  # time.sleep / requests.get / subprocess.run inside an async def: blocks its loop
            return "too late"
        await asyncio.sleep(0.5)  # still running when the blocked one starts blocking
        return "done"

    tasks = [{"prompt": "block"}] + [{"prompt": "p"}] * 3
    try:
        out = {}
        thread = threading.Thread(
            target=lambda: out.update(
                episodes=run_rollout(run_episodes(server, resolve_agent(blocking_agent), tasks, timeout=3.0))
            ),
            daemon=True,
        )
        thread.start()
        thread.join(20)
        assert not thread.is_alive(), "a blocked async agent held the rollout past its episode's timeout"
    finally:
        release.set()
    episodes = out["episodes"]
    assert [e.status for e in episodes] == ["timeout", "ok", "ok", "ok"], [e.error for e in episodes]
    assert episodes[0].error == "episode exceeded 3.0s" and episodes[0].metadata["abandoned"] is True
    assert [e.result for e in episodes[1:]] == ["done"] * 3


def test_hung_thread_calls_of_agents_never_starve_the_episodes_after_them(server):
    # Under asynchronous rollouts the producer's loop lives for the whole run: hung `asyncio.to_thread` calls (an
    # environment's sync `reset` or tool) used to hold its default pool for good, and every later episode timed out.
    release = threading.Event()

    async def agent(client, task):
        if task["prompt"] == "hang":
            await asyncio.to_thread(release.wait, 60)
        answer = await asyncio.to_thread(lambda: "tool result")
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": answer}])
        return answer

    producer = RolloutProducer(server, resolve_agent(agent), max_staleness=1, max_concurrent=64, timeout=1.0)
    try:
        producer.submit(0, [{"prompt": "hang"}] * DEFAULT_POOL_THREADS, [0] * DEFAULT_POOL_THREADS, 0, 1)
        hung, _ = producer.result(0, timeout=30)
        producer.submit(1, [{"prompt": "p"}] * 4, [0] * 4, 0, 1)
        after, _ = producer.result(1, timeout=30)
    finally:
        release.set()
        producer.close()
    assert {e.status for e in hung} == {"timeout"}
    assert [e.status for e in after] == ["ok"] * 4, [e.error for e in after]
    assert [e.result for e in after] == ["tool result"] * 4


def test_an_async_agent_that_calls_sys_exit_under_the_producer_fails_only_its_episode(server):
    async def cli_agent(client, task):
        if task["prompt"] == "exit":
            raise SystemExit("usage: agent [-h]")
        return "done"

    producer = RolloutProducer(server, resolve_agent(cli_agent), max_staleness=1, timeout=10)
    try:
        producer.submit(0, [{"prompt": "exit"}, {"prompt": "p"}], [0, 0], 0, 1)
        episodes, _ = producer.result(0, timeout=30)
        producer.submit(1, [{"prompt": "p"}], [0], 0, 1)  # the producer goes on
        (later,), _ = producer.result(1, timeout=30)
    finally:
        producer.close()
    assert [e.status for e in episodes] == ["agent_error", "ok"]
    assert episodes[0].error == "the agent raised SystemExit: usage: agent [-h]"
    assert later.status == "ok" and later.result == "done"
