"""What the rollout's HTTP clients cost: one connection pool shared by every episode against one per episode, side by
side in one run.

```bash
python benchmarks/rollout_benchmark.py              # ~1 min on 2 CPU cores
python benchmarks/rollout_benchmark.py --episodes 64 --rounds 20
```

A zero-cost engine (the same tool call, instantly) behind the real endpoint (uvicorn on loopback), and `--episodes`
concurrent calculator-style agents (the official `openai.AsyncOpenAI`, `--turns` calls each) run by
`trl_agentic.rollout.runner.run_episodes`, as the trainer runs a GRPO step's rollout: with one `httpx.AsyncClient`
for all episodes, every agent on the rollout's event loop (what the runner did), and with an event loop, a thread and
a client per episode (what it does), the two taking turns so that load on the machine hits both alike. httpcore walks
every pooled connection at each request and response, so a shared pool's cost per call grows with the number of
concurrent episodes; a loop and a thread per episode (issue 40: what blocks one agent blocks only its episode) cost
a few milliseconds per episode (32 episodes x 2 calls on 2 loaded cores, medians of 6: 355 and 419 ms per rollout
with a client per episode on one loop, 480 to 581 ms with a loop and a thread each; noisy, the cores were shared).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx
import torch

from endpoint_benchmark import TOOL, ZeroCostEngine
from trl_agentic.endpoint.app import create_app
from trl_agentic.endpoint.chat import ChatRenderer
from trl_agentic.endpoint.server import EndpointServer
from trl_agentic.rollout.agents import CallableAgent
from trl_agentic.rollout.runner import _ssl_context, run_episodes
from trl_agentic.tiny_models import build_tiny_tokenizer


def make_agent(turns: int) -> CallableAgent:
    async def agent(client, task):
        messages = list(task["prompt"])
        for _ in range(turns):
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=[TOOL], max_tokens=48
            )
            message = response.choices[0].message.model_dump(exclude_none=True)
            messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "5"}]
        return "The answer is 5."

    return CallableAgent(agent)


async def rollout(server, agent, tasks, shared: bool) -> float:
    start = time.perf_counter()
    if shared:
        limits = httpx.Limits(max_connections=len(tasks), max_keepalive_connections=len(tasks))
        async with httpx.AsyncClient(limits=limits, timeout=60, verify=_ssl_context()) as client:
            episodes = await run_episodes(server, agent, tasks, timeout=60, http_client=client)
    else:
        episodes = await run_episodes(server, agent, tasks, timeout=60)
    seconds = time.perf_counter() - start
    assert all(e.status == "ok" for e in episodes), [e.error for e in episodes if e.status != "ok"]
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=32, help="concurrent episodes per rollout (the demo's 4 x 8)")
    parser.add_argument("--turns", type=int, default=2, help="model calls per episode")
    parser.add_argument("--rounds", type=int, default=15, help="rollouts of each kind")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    tokenizer = build_tiny_tokenizer("qwen2_5")
    server = EndpointServer(create_app(ZeroCostEngine(tokenizer), ChatRenderer(tokenizer))).start()
    agent = make_agent(args.turns)
    tasks = [{"prompt": [{"role": "user", "content": f"What is {i} + 3?"}]} for i in range(args.episodes)]
    times = {True: [], False: []}
    try:
        for shared in (True, False):  # warm-up
            asyncio.run(rollout(server, agent, tasks, shared))
        for _ in range(args.rounds):
            for shared in (True, False):
                times[shared].append(asyncio.run(rollout(server, agent, tasks, shared)))
    finally:
        server.stop()
    calls = args.episodes * args.turns
    shared, own = statistics.median(times[True]), statistics.median(times[False])
    print(
        f"{args.episodes} concurrent episodes x {args.turns} calls, zero-cost engine, median of {args.rounds} rollouts"
    )
    print(f"  one pool for all episodes: {shared * 1000:7.1f} ms per rollout ({shared / calls * 1000:.2f} ms per call)")
    print(f"  a loop and pool per episode: {own * 1000:5.1f} ms per rollout ({own / calls * 1000:.2f} ms per call)")
    print(f"  ratio (per episode / shared): {own / shared:.2f}x")


if __name__ == "__main__":
    main()
