"""The rollout runner: an episode's timeout bounds the rollout, whatever the agent does (issue #9).

Every test runs real agents against a real endpoint (uvicorn on loopback, a scripted engine) through `run_rollout`,
the way the trainer runs them; the rollout runs in a thread joined with a deadline, so that a regression fails the test
instead of hanging it.
"""

import asyncio
import threading
import time

import pytest

from trl_agentic.rollout.agents import resolve_agent
from trl_agentic.rollout.runner import CANCEL_GRACE_S, run_episodes, run_rollout
from trl_agentic.tiny_models import build_tiny_tokenizer

from conftest import ScriptedEngine


TIMEOUT = 1.0  # seconds per episode: short, the agents below misbehave on purpose


@pytest.fixture(scope="module")
def server(start_server):
    tokenizer = build_tiny_tokenizer("qwen2_5")
    return start_server(ScriptedEngine(tokenizer, lambda prompt: "Fine."), tokenizer)


def rollout(server, agent, num_episodes, deadline, **kwargs):
    """Run episodes in a thread of their own (as the trainer does); fail if they are not back within `deadline`."""
    out = {}

    def target():
        out["episodes"] = run_rollout(run_episodes(server, resolve_agent(agent), [{"prompt": "p"}] * num_episodes,
                                                   timeout=kwargs.pop("timeout", TIMEOUT), **kwargs))

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
