"""The endpoint's boundary under load and under fire (issue #9): one run, numbers for the closing note.

```bash
python benchmarks/boundary_benchmark.py                 # ~2 min on 2 CPU cores
python benchmarks/boundary_benchmark.py --fuzz 6000 --episodes 2000
```

(a) Load: 256 concurrent 3-turn tool episodes (async `openai` agents, one shared connection pool, as the trainer runs
    them) against a zero-cost engine behind the real endpoint. Checked: every episode `ok`, every later turn a token-in
    continuation, and no cross-episode mix-up (each episode's prompts carry only its own task marker).
(b) Memory: process RSS after a warm-up round and after `--episodes` more episodes (opened, run, closed); the
    registry must be empty at the end.
(c) Fuzz: `--fuzz` hostile request bodies (the generator of tests/test_endpoint_fuzz.py, more seeds) on keep-alive
    connections; counted: 5xx answers, connection errors, and traces that could not be read back at close.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import time
from pathlib import Path

import httpx

# The same zero-cost engine and tool as the endpoint benchmark: what is measured is the endpoint, runner and agents.
from endpoint_benchmark import TOOL, ZeroCostEngine  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from trl_agentic.endpoint.app import create_app
from trl_agentic.endpoint.chat import ChatRenderer
from trl_agentic.endpoint.server import EndpointServer
from trl_agentic.rollout.agents import resolve_agent
from trl_agentic.rollout.runner import run_episodes, run_rollout
from trl_agentic.tiny_models import build_tiny_tokenizer


async def three_turn_agent(client, task):
    messages = [{"role": "user", "content": f"Task {task['marker']}: what is 2 + 3?"}]
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[TOOL], max_tokens=64)
        message = reply.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"5 ({task['marker']})"})
    return task["marker"]


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def load_round(server, tokenizer, num_episodes: int, concurrency: int, start: int) -> dict:
    tasks = [{"marker": f"m{start + i:07d}"} for i in range(num_episodes)]
    began = time.perf_counter()
    episodes = run_rollout(
        run_episodes(server, resolve_agent(three_turn_agent), tasks, max_concurrent=concurrency, timeout=120)
    )
    seconds = time.perf_counter() - began
    mixed = 0
    for task, episode in zip(tasks, episodes, strict=True):
        text = tokenizer.decode(episode.turns[-1].prompt_ids) if episode.turns else ""
        markers = {word.strip("():?,") for word in text.split() if word.strip("():?,").startswith("m0")}
        mixed += markers != {task["marker"]} or episode.result != task["marker"]
    return {
        "episodes": num_episodes,
        "seconds": seconds,
        "ok": sum(e.status == "ok" for e in episodes),
        "turns": sum(len(e.turns) for e in episodes),
        "continued": sum(t.prompt_source == "continued" for e in episodes for t in e.turns[1:]),
        "later_turns": sum(max(len(e.turns) - 1, 0) for e in episodes),
        "mixed_up": mixed,
    }


def fuzz(server, num_requests: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_endpoint_fuzz as generator  # the test's mutations, more seeds

    counts = {"requests": 0, "5xx": 0, "connection_errors": 0, "traces_unreadable": 0, "2xx": 0, "4xx": 0}
    admin = {"Authorization": f"Bearer {server.admin_token}"}
    seed, opened = 0, []
    while counts["requests"] < num_requests:
        rng = random.Random(seed)
        seed += 1
        session = server.open_episode()
        opened.clear()
        routes = [
            ("/v1/chat/completions", {"Authorization": f"Bearer {session.key}"}),
            (f"/episodes/{session.episode.id}/v1/chat/completions", {}),
            ("/admin/episodes", admin),
        ]
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for case in range(min(300, num_requests - counts["requests"])):
                path, headers = routes[0] if case % 10 < 7 else routes[1] if case % 10 < 9 else routes[2]
                content = generator.encode(rng, generator.mutate(rng, rng.choice(generator.base_bodies())))
                counts["requests"] += 1
                try:
                    response = client.post(
                        path, content=content, headers={**headers, "Content-Type": "application/json"}
                    )
                except httpx.HTTPError:
                    counts["connection_errors"] += 1
                    continue
                status = response.status_code
                counts["5xx" if status >= 500 else "4xx" if status >= 400 else "2xx"] += 1
                if path == "/admin/episodes" and status == 200:
                    opened.append(response.json()["id"])
            try:
                closed = client.post(f"/admin/episodes/{session.episode.id}/close", headers=admin, json={})
                json.loads(closed.content, parse_constant=float.fromhex)  # strict: NaN would raise
                counts["traces_unreadable"] += closed.status_code != 200
            except (httpx.HTTPError, ValueError):
                counts["traces_unreadable"] += 1
        for episode_id in opened:  # the fuzz opened these through the admin route
            server.close_episode(episode_id)
    counts["sessions"] = seed
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--episodes", type=int, default=2000, help="Episodes between the two RSS readings.")
    parser.add_argument("--fuzz", type=int, default=3000, help="Fuzzed request bodies.")
    args = parser.parse_args()

    tokenizer = build_tiny_tokenizer("qwen2_5")
    server = EndpointServer(create_app(ZeroCostEngine(tokenizer), ChatRenderer(tokenizer))).start()
    try:
        first = load_round(server, tokenizer, args.concurrency, args.concurrency, 0)
        print(
            f"(a) load: {first['episodes']} episodes x 3 turns, {args.concurrency} at once: {first['seconds']:.1f} s "
            f"({first['turns'] / first['seconds']:.0f} calls/s); ok {first['ok']}/{first['episodes']}, "
            f"continued {first['continued']}/{first['later_turns']} later turns, mixed up {first['mixed_up']}"
        )
        gc.collect()
        before, done, rounds = rss_mib(), 0, []
        while done < args.episodes:
            rounds.append(
                load_round(
                    server,
                    tokenizer,
                    min(args.concurrency, args.episodes - done),
                    args.concurrency,
                    args.concurrency + done,
                )
            )
            done += rounds[-1]["episodes"]
        gc.collect()
        after = rss_mib()
        print(
            f"(b) memory: RSS {before:.1f} MiB after the warm-up round -> {after:.1f} MiB after {done} more episodes "
            f"({after - before:+.1f} MiB, {100 * (after - before) / before:+.1f}%); ok "
            f"{sum(r['ok'] for r in rounds)}/{done}, mixed up {sum(r['mixed_up'] for r in rounds)}, "
            f"open episodes at the end {len(server.registry)}"
        )
        if args.fuzz:
            counts = fuzz(server, args.fuzz)
            print(
                f"(c) fuzz: {counts['requests']} requests ({counts['sessions']} episodes): {counts['5xx']} 5xx, "
                f"{counts['connection_errors']} connection errors, {counts['2xx']} 2xx, {counts['4xx']} 4xx; "
                f"traces unreadable at close: {counts['traces_unreadable']}"
            )
    finally:
        server.stop()


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
