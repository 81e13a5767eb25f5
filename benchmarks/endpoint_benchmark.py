"""What the endpoint costs per call, and what batching concurrent agents buys, side by side in one run.

```bash
python benchmarks/endpoint_benchmark.py                      # ~1 min on 2 CPU cores
python benchmarks/endpoint_benchmark.py --model tiny:qwen2_5:128x4 --episodes 64
python benchmarks/endpoint_benchmark.py --sections c          # wire formats only
python benchmarks/endpoint_benchmark.py --sections f          # the endpoint against a trivial handler (~30 s)
```

(a) Per-call overhead: a zero-cost engine (fixed tokens, instantly) behind the real endpoint (uvicorn on loopback),
    N sequential calls of multi-turn episodes, each call continuing the previous one (token-in continuation: one
    render + tokenizing the new messages). Measured at the client, over a kept-alive HTTP connection (raw httpx) and
    through the official `openai` client. Early and late turns are shown apart: the cost must not grow with history.
(c) Per-call overhead of each wire format against Chat Completions, in the same run: the same zero-cost engine and
    the same tool episodes spoken as Chat Completions, Responses and Anthropic Messages, one call of each format in
    turn (so load on the machine hits all three alike), one client at a time (c1). Raw httpx shows the endpoint's own
    cost; the official clients (`openai` chat / responses, `anthropic`) add theirs. Goal: p50 <= 1.2x Chat Completions.
(b) Tiny-model throughput: the same multi-turn episodes with the embedded TransformersEngine, 32 concurrent agents
    (asyncio + AsyncOpenAI, one key each) vs one agent at a time; sampled tokens/s and episodes/s, and their ratio.
(d) Growth with the episode (issue #12): the zero-cost engine, one growing tool episode per lane; the call of turn 1
    (a new episode), turn 16 and turn 64 take turns, so that load on the machine hits them alike (turn k's request is
    sent again each round: a continuation from turn k - 1, the same work as the first time). Goals: turn 16 / turn 1
    <= 1.3, turn 64 / turn 1 <= 1.5. The same with `ChatRenderer(incremental=False)` (whole conversations rendered
    each call: what the endpoint did before) for reference.
(e) Time to first streamed token (issue #12): the embedded TransformersEngine with a real tiny model, 64-token
    completions (greedy), a streamed call (time to its first content chunk, at the client) and a non-streamed call
    (time to the whole answer) taking turns. Goal: first token / full response <= 0.3.
(f) The endpoint against a trivial handler (issue 29): what serving a call costs beyond what any FastAPI app on this
    server setup costs. The "trivial handler" (`trivial_app`) is a FastAPI app with one route,
    `POST /v1/chat/completions`, an `async def` taking the `Request`, that awaits `request.json()` (the whole body
    read and decoded with the standard `json` module) and returns a fixed dict: the endpoint's own answer to such a
    call, captured beforehand (a `chat.completion` with one tool call, ~450 bytes), serialised by FastAPI's default
    `JSONResponse`. No middleware, no auth, no validation (and a `GET /health` for the server's start). It runs under
    `EndpointServer` (the same uvicorn settings and socket options as the endpoint), and the same client calls both
    with the same headers and bodies: raw httpx (the server's cost shows most) and the official `openai` client (one
    per episode key, as an agent holds it). Eight lanes take turns every round, so load on the machine hits them
    alike: each client, the endpoint and the trivial handler, at turn 1 (a new episode whose question names the
    round; opening and closing it is not timed) and at turn 64 (the request of turn 64 of a grown tool episode with a
    tool result that names the round: a continuation from turn 63, new text every round, as in a real episode).
    Goal: endpoint p50 / trivial p50 <= 1.10 at turn 1 and at turn 64. Beside it, the median CPU time of this process
    per call (client and servers run in it) and its ratio: on a loaded machine a call that needs the CPU for longer
    waits more often for a core, which inflates the latency ratio, not this one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import anthropic
import httpx
import openai
import torch
from fastapi import FastAPI, Request

from trl_agentic.endpoint.app import EndpointSettings, SamplingOverrides, create_app
from trl_agentic.endpoint.chat import ChatRenderer
from trl_agentic.endpoint.server import EndpointServer
from trl_agentic.generation.engine import GenerationOutput, SamplingParams
from trl_agentic.generation.transformers_engine import TransformersEngine
from trl_agentic.tiny_models import build_tiny_tokenizer, load_model_and_tokenizer


TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


CALCULATOR_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'


class ZeroCostEngine:
    """Returns the same tool call (`text`), instantly: everything measured is the endpoint's own work."""

    def __init__(self, tokenizer, text: str = CALCULATOR_CALL):
        self.ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        self.max_context_length = 1 << 22
        self.policy_version = 0

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationOutput:
        return GenerationOutput(list(self.ids), [-0.1] * len(self.ids), "stop")


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def overhead(calls: int, turns: int, use_openai: bool) -> dict:
    tokenizer = build_tiny_tokenizer("qwen2_5")
    server = EndpointServer(create_app(ZeroCostEngine(tokenizer), ChatRenderer(tokenizer))).start()
    latencies: list[tuple[int, float]] = []  # (turn index, ms)
    forks = 0
    try:
        http = httpx.Client(timeout=30)
        while len(latencies) < calls:
            session = server.open_episode()
            client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, http_client=http)
            messages = [
                {"role": "system", "content": "Use the calculator."},
                {"role": "user", "content": "What is 2 + 3, then 3 more, many times?"},
            ]
            for turn in range(turns):
                body = {"model": "policy", "messages": messages, "tools": [TOOL], "max_tokens": 64}
                start = time.perf_counter()
                if use_openai:
                    message = client.chat.completions.create(**body).choices[0].message.model_dump(exclude_none=True)
                else:
                    response = http.post(
                        f"{server.base_url}/chat/completions",
                        json=body,
                        headers={"Authorization": f"Bearer {session.key}"},
                    )
                    message = response.json()["choices"][0]["message"]
                latencies.append((turn, (time.perf_counter() - start) * 1000))
                call_id = message["tool_calls"][0]["id"]
                messages += [message, {"role": "tool", "tool_call_id": call_id, "content": f"{5 + 3 * turn}"}]
                if len(latencies) >= calls:
                    break
            forks += server.close_episode(session.episode.id).num_forks
    finally:
        server.stop()
    all_ms = [ms for _, ms in latencies]
    early = [ms for t, ms in latencies if t < 5]
    late = [ms for t, ms in latencies if t >= turns - 5]
    return {
        "p50": statistics.median(all_ms),
        "p99": percentile(all_ms, 99),
        "early_p50": statistics.median(early),
        "late_p50": statistics.median(late),
        "forks": forks,
        "calls": len(all_ms),
    }


RESPONSES_TOOL = {"type": "function", **TOOL["function"]}
ANTHROPIC_TOOL = {
    "name": "calculator",
    "description": TOOL["function"]["description"],
    "input_schema": TOOL["function"]["parameters"],
}
SYSTEM, QUESTION = "Use the calculator.", "What is 2 + 3, then 3 more, many times?"
WIRE_FORMATS = ("chat_completions", "responses", "anthropic_messages")


class FormatEpisode:
    """One tool episode spoken in one wire format, a call at a time: the request body of the next call, the call
    through raw httpx or the format's official client, and the history update an agent makes with the answer."""

    def __init__(self, server: EndpointServer, wire_format: str, http: httpx.Client):
        self.server, self.format, self.http = server, wire_format, http
        self.session = server.open_episode()
        self.turn = 0
        self.history: list = [{"role": "system", "content": SYSTEM}] if wire_format == "chat_completions" else []
        self.history.append({"role": "user", "content": QUESTION})
        if wire_format == "anthropic_messages":
            self.client = anthropic.Anthropic(
                base_url=server.url, api_key=self.session.key, max_retries=0, http_client=anthropic.DefaultHttpxClient()
            )
        else:
            self.client = openai.OpenAI(
                base_url=server.base_url,
                api_key=self.session.key,
                max_retries=0,
                http_client=openai.DefaultHttpxClient(),
            )

    def body(self) -> dict:
        if self.format == "chat_completions":
            return {"model": "policy", "messages": self.history, "tools": [TOOL], "max_tokens": 64}
        if self.format == "responses":
            return {
                "model": "policy",
                "instructions": SYSTEM,
                "input": self.history,
                "tools": [RESPONSES_TOOL],
                "max_output_tokens": 64,
            }
        return {
            "model": "policy",
            "system": SYSTEM,
            "messages": self.history,
            "tools": [ANTHROPIC_TOOL],
            "max_tokens": 64,
        }

    def call(self, use_sdk: bool) -> float:
        """One call; returns its latency in ms, measured at the client."""
        body = self.body()
        start = time.perf_counter()
        if use_sdk:
            if self.format == "chat_completions":
                answer = self.client.chat.completions.create(**body).model_dump(exclude_none=True)
            elif self.format == "responses":
                answer = self.client.responses.create(**body).model_dump(exclude_none=True)
            else:
                answer = self.client.messages.create(**body).model_dump(exclude_none=True)
        else:
            path = {
                "chat_completions": "/v1/chat/completions",
                "responses": "/v1/responses",
                "anthropic_messages": "/v1/messages",
            }[self.format]
            answer = self.http.post(
                f"{self.server.url}{path}", json=body, headers={"Authorization": f"Bearer {self.session.key}"}
            ).json()
        ms = (time.perf_counter() - start) * 1000
        result = f"{5 + 3 * self.turn}"
        if self.format == "chat_completions":
            message = answer["choices"][0]["message"]
            self.history += [
                message,
                {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": result},
            ]
        elif self.format == "responses":
            (call,) = [item for item in answer["output"] if item["type"] == "function_call"]
            self.history += answer["output"] + [
                {"type": "function_call_output", "call_id": call["call_id"], "output": result}
            ]
        else:
            (call,) = [block for block in answer["content"] if block["type"] == "tool_use"]
            self.history += [
                {"role": "assistant", "content": answer["content"]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": result}]},
            ]
        self.turn += 1
        return ms

    def close(self) -> int:
        self.client.close()
        episode = self.server.close_episode(self.session.episode.id)
        assert {turn.wire_format for turn in episode.turns} == {self.format}
        return episode.num_forks


def wire_format_overhead(calls: int, turns: int, use_sdk: bool) -> dict:
    """p50/p99 per format over `calls` calls each, and forks; the formats take turns call by call."""
    tokenizer = build_tiny_tokenizer("qwen2_5")
    server = EndpointServer(create_app(ZeroCostEngine(tokenizer), ChatRenderer(tokenizer))).start()
    latencies = {name: [] for name in WIRE_FORMATS}
    forks = 0
    try:
        with httpx.Client(timeout=30) as http:
            for name in WIRE_FORMATS:  # warm-up: first-call costs (template compilation, imports) out of the way
                episode = FormatEpisode(server, name, http)
                episode.call(use_sdk)
                episode.close()
            while len(latencies[WIRE_FORMATS[0]]) < calls:
                episodes = [FormatEpisode(server, name, http) for name in WIRE_FORMATS]
                for _ in range(min(turns, calls - len(latencies[WIRE_FORMATS[0]]))):
                    for episode in episodes:
                        latencies[episode.format].append(episode.call(use_sdk))
                forks += sum(episode.close() for episode in episodes)
    finally:
        server.stop()
    return {
        "forks": forks,
        **{
            name: {"p50": statistics.median(ms), "p99": percentile(ms, 99), "calls": len(ms)}
            for name, ms in latencies.items()
        },
    }


def throughput(model_spec: str, episodes: int, agent_turns: int, max_tokens: int) -> dict:
    model, tokenizer = load_model_and_tokenizer(model_spec)
    model.eval()
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, max_batch_size=episodes)
    # Every call samples exactly max_tokens (no early stop), so both modes sample the same number of tokens.
    settings = EndpointSettings(overrides=SamplingOverrides(max_tokens=max_tokens))
    server = EndpointServer(create_app(engine, ChatRenderer(tokenizer), settings)).start()

    async def agent(i: int) -> int:
        session = server.open_episode(task_index=i)
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=600)
        messages = [{"role": "user", "content": f"Task {i}: think aloud."}]
        for k in range(agent_turns):
            response = await client.chat.completions.create(model="policy", messages=messages, seed=i)
            messages += [
                response.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": f"Step {k} done, go on."},
            ]
        await client.close()
        episode = server.close_episode(session.episode.id)
        assert episode.num_forks == 0
        return episode.num_sampled_tokens

    async def concurrent() -> list[int]:
        return await asyncio.gather(*[agent(i) for i in range(episodes)])

    async def sequential() -> list[int]:
        return [await agent(i) for i in range(episodes)]

    results = {}
    try:
        asyncio.run(agent(0))  # warm-up
        for name, run in (("sequential", sequential), ("concurrent", concurrent)):
            engine.batch_sizes.clear()
            start = time.perf_counter()
            tokens = sum(asyncio.run(run()))
            seconds = time.perf_counter() - start
            results[name] = {
                "tokens_per_s": tokens / seconds,
                "episodes_per_s": episodes / seconds,
                "seconds": seconds,
                "tokens": tokens,
                "max_batch": max(engine.batch_sizes),
            }
    finally:
        server.stop()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="sequential calls measured for (a)")
    parser.add_argument("--turns", type=int, default=30, help="calls per episode in (a)")
    parser.add_argument("--model", default="tiny:qwen2_5", help="policy of (b)")
    parser.add_argument("--episodes", type=int, default=32, help="agents in (b)")
    parser.add_argument("--agent-turns", type=int, default=4, help="calls per episode in (b)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens sampled per call in (b)")
    parser.add_argument("--sections", default="a,b,c,d,e,f", help="which of (a)-(f) to run, comma-separated")
    parser.add_argument("--rounds", type=int, default=60, help="calls per lane in (d) and (e)")
    parser.add_argument("--trivial-rounds", type=int, default=400, help="calls per lane in (f)")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="intra-op threads; a tiny model gains nothing from more, and client, server and engine "
        "threads already share the cores (0 = torch's default)",
    )
    args = parser.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    sections = set(args.sections.split(","))
    if "a" in sections:
        print_overhead(args)
    if "c" in sections:
        print_wire_formats(args)
    if "b" in sections:
        print_throughput(args)
    if "d" in sections:
        print_growth(args)
    if "e" in sections:
        print_first_token(args)
    if "f" in sections:
        print_against_trivial(args)


def growth(rounds: int, incremental: bool, lanes=(16, 64)) -> dict[int, float]:
    """p50 ms of the call of turn 1 and of each turn in `lanes`, taking turns (see (d))."""
    tokenizer = build_tiny_tokenizer("qwen2_5")
    renderer = ChatRenderer(tokenizer, incremental=incremental)
    server = EndpointServer(create_app(ZeroCostEngine(tokenizer), renderer)).start()
    http = httpx.Client(timeout=30)

    def call(session, messages) -> tuple[float, dict]:
        body = {"model": "policy", "messages": messages, "tools": [TOOL], "max_tokens": 64}
        start = time.perf_counter()
        response = http.post(
            f"{server.base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {session.key}"}
        )
        return (time.perf_counter() - start) * 1000, response.json()["choices"][0]["message"]

    def first_messages() -> list[dict]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]

    try:
        grown = {}
        for turns in lanes:  # an episode at its turn `turns`: turns - 1 calls made, answered with tool results
            session, messages = server.open_episode(), first_messages()
            for k in range(turns - 1):
                _, message = call(session, messages)
                messages += [
                    message,
                    {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": f"{5 + 3 * k}"},
                ]
            grown[turns] = (session, messages)
        for _ in range(3):  # warm-up
            session = server.open_episode()
            call(session, first_messages())
            server.close_episode(session.episode.id)
        latencies: dict[int, list[float]] = {1: [], **{turns: [] for turns in lanes}}
        for _ in range(rounds):
            session = server.open_episode()
            latencies[1].append(call(session, first_messages())[0])
            server.close_episode(session.episode.id)
            for turns, (session, messages) in grown.items():
                latencies[turns].append(call(session, messages)[0])
        for session, _ in grown.values():
            episode = server.close_episode(session.episode.id)
            assert episode.num_forks == 0 and episode.turns[-1].prompt_source == "continued"
    finally:
        http.close()
        server.stop()
    return {turns: statistics.median(ms) for turns, ms in latencies.items()}


def print_growth(args) -> None:
    incremental, whole = growth(args.rounds, incremental=True), growth(args.rounds // 2, incremental=False)
    print(
        f"(d) call latency as the episode grows, zero-cost engine, raw httpx, {args.rounds} rounds (turn 1, 16 and 64 "
        "taking turns; each turn adds an answer and a tool result)"
    )
    print(f"    {'prompt building':<26}{'turn 1 ms':>10}{'turn 16 ms':>11}{'turn 64 ms':>11}{'16 / 1':>8}{'64 / 1':>8}")
    for name, r in (("incremental (default)", incremental), ("whole conversation", whole)):
        print(f"    {name:<26}{r[1]:>10.2f}{r[16]:>11.2f}{r[64]:>11.2f}{r[16] / r[1]:>8.2f}{r[64] / r[1]:>8.2f}")
    print(
        f"    goals: turn 16 / turn 1 <= 1.3 ({incremental[16] / incremental[1]:.2f}), "
        f"turn 64 / turn 1 <= 1.5 ({incremental[64] / incremental[1]:.2f})"
    )


def first_token(model_spec: str, rounds: int, max_tokens: int = 64) -> dict:
    """Median time to the first streamed content chunk and to a whole non-streamed answer (see (e))."""
    model, tokenizer = load_model_and_tokenizer(model_spec)
    model.eval()
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id)
    settings = EndpointSettings(overrides=SamplingOverrides(max_tokens=max_tokens, temperature=0.0))
    server = EndpointServer(create_app(engine, ChatRenderer(tokenizer), settings)).start()
    first, full, tokens = [], [], []
    try:
        session = server.open_episode()
        client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=120)
        body = {"model": "policy", "messages": [{"role": "user", "content": "Tell me a long story."}]}
        for k in range(rounds + 2):  # the first two rounds warm up
            start = time.perf_counter()
            ttft = None
            for chunk in client.chat.completions.create(**body, stream=True):
                if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                    ttft = time.perf_counter() - start
            start = time.perf_counter()
            response = client.chat.completions.create(**body)
            seconds = time.perf_counter() - start
            if k >= 2:
                first.append(ttft)
                full.append(seconds)
                tokens.append(response.usage.completion_tokens)
        client.close()
        server.close_episode(session.episode.id)
    finally:
        server.stop()
    return {
        "first_ms": statistics.median(first) * 1000,
        "full_ms": statistics.median(full) * 1000,
        "tokens": statistics.median(tokens),
    }


def print_first_token(args) -> None:
    r = first_token(args.model, max(4, args.rounds // 4))
    print(
        f"(e) time to first streamed token, {args.model}, embedded engine, {r['tokens']:.0f}-token completions, "
        f"{torch.get_num_threads()} torch thread(s)"
    )
    print(
        f"    first streamed token {r['first_ms']:.1f} ms, whole answer {r['full_ms']:.1f} ms: "
        f"{r['first_ms'] / r['full_ms']:.2f} (goal <= 0.3)"
    )


def print_wire_formats(args) -> None:
    results = {
        "httpx": wire_format_overhead(args.calls, args.turns, use_sdk=False),
        "official client": wire_format_overhead(args.calls, args.turns, use_sdk=True),
    }
    forks = sum(r["forks"] for r in results.values())
    print(
        f"(c) overhead per call by wire format, zero-cost engine, c1, {args.calls} calls per format, episodes of "
        f"{args.turns} continued turns, formats taking turns (forks: {forks})"
    )
    print(f"    {'client':<17}{'format':<20}{'p50 ms':>9}{'p99 ms':>9}{'p50 / chat':>12}")
    for client, result in results.items():
        chat = result["chat_completions"]["p50"]
        for name in WIRE_FORMATS:
            r = result[name]
            print(f"    {client:<17}{name:<20}{r['p50']:>9.2f}{r['p99']:>9.2f}{r['p50'] / chat:>11.2f}x")


def print_overhead(args) -> None:
    raw = overhead(args.calls, args.turns, use_openai=False)
    sdk = overhead(args.calls, args.turns, use_openai=True)
    print(
        f"(a) endpoint overhead per call, zero-cost engine, {raw['calls']} sequential calls, episodes of "
        f"{args.turns} continued turns (forks: {raw['forks'] + sdk['forks']})"
    )
    print(f"    {'client':<14}{'p50 ms':>9}{'p99 ms':>9}{'turns 0-4 p50':>16}{'last 5 p50':>13}")
    for name, r in (("httpx", raw), ("openai", sdk)):
        print(f"    {name:<14}{r['p50']:>9.2f}{r['p99']:>9.2f}{r['early_p50']:>16.2f}{r['late_p50']:>13.2f}")


def trivial_app(answer: dict) -> FastAPI:
    """The trivial handler of (f): read and decode the JSON body, return the fixed `answer` (and a `/health` route,
    which `EndpointServer.start` waits for)."""
    app = FastAPI()
    app.get("/health")(lambda: {"status": "ok"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        await request.json()
        return answer

    return app


def against_trivial(rounds: int, turns: int = 64) -> dict[tuple[str, str, int], list[tuple[float, float]]]:
    """`(latency, CPU time)` in ms of each call of the lanes of (f), taking turns: `(client, server, turn)` for the raw
    httpx and `openai` clients, the endpoint and the trivial handler, at turn 1 and at turn `turns`. The CPU time is
    this process's (client and server threads both run in it) during the call: what the call costs without the time
    spent waiting for a core, which other processes' load adds to the latency."""
    tokenizer = build_tiny_tokenizer("qwen2_5")
    server = EndpointServer(create_app(ZeroCostEngine(tokenizer), ChatRenderer(tokenizer))).start()
    http = httpx.Client(timeout=30)
    trivial = None

    def call(client, base_url: str, key: str, messages: list[dict]) -> tuple[tuple[float, float], dict]:
        body = {"model": "policy", "messages": messages, "tools": [TOOL], "max_tokens": 64}
        start, cpu = time.perf_counter(), time.process_time()
        if client is not None:
            answer = client.chat.completions.create(**body)
            ms = ((time.perf_counter() - start) * 1000, (time.process_time() - cpu) * 1000)
            return ms, answer.model_dump(exclude_none=True)
        response = http.post(f"{base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        ms = ((time.perf_counter() - start) * 1000, (time.process_time() - cpu) * 1000)
        response.raise_for_status()
        return ms, response.json()

    def first(k: int) -> list[dict]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{QUESTION} (round {k})"}]

    try:
        grown, history = server.open_episode(), first(-1)
        for k in range(turns - 1):
            answer = call(None, server.base_url, grown.key, history)[1]
            message = answer["choices"][0]["message"]
            history += [
                message,
                {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": f"{5 + 3 * k}"},
            ]
        trivial = EndpointServer(trivial_app(answer)).start()
        sdks = {
            (url, grown.key): openai.OpenAI(base_url=url, api_key=grown.key, max_retries=0, http_client=http)
            for url in (server.base_url, trivial.base_url)
        }
        lanes = {
            (client, name, turn): []
            for client in ("httpx", "openai")
            for turn in (1, turns)
            for name in ("endpoint", "trivial")
        }
        for k in range(rounds + 20):  # the first 20 rounds warm up
            session = server.open_episode()
            for url in (server.base_url, trivial.base_url):
                sdks[url, session.key] = openai.OpenAI(
                    base_url=url, api_key=session.key, max_retries=0, http_client=http
                )
            messages = {
                1: first(k),
                turns: history[:-1] + [{**history[-1], "content": f"{history[-1]['content']} (round {k})"}],
            }
            for client, name, turn in lanes:
                key = session.key if turn == 1 else grown.key
                url = server.base_url if name == "endpoint" else trivial.base_url
                sdk = sdks[url, key] if client == "openai" else None
                timing, answer = call(sdk, url, key, messages[turn])
                assert answer["choices"][0]["message"]["tool_calls"]
                if k >= 20:
                    lanes[client, name, turn].append(timing)
            server.close_episode(session.episode.id)
            del sdks[server.base_url, session.key], sdks[trivial.base_url, session.key]
        episode = server.close_episode(grown.episode.id)
        assert episode.num_forks == 0 and episode.turns[-1].prompt_source == "continued"
    finally:
        http.close()
        server.stop()
        if trivial is not None:
            trivial.stop()
    return lanes


def print_against_trivial(args) -> None:
    lanes = against_trivial(args.trivial_rounds)
    p50 = {lane: statistics.median(ms for ms, _ in calls) for lane, calls in lanes.items()}
    cpu = {lane: statistics.median(cpu for _, cpu in calls) for lane, calls in lanes.items()}
    print(
        f"(f) the endpoint against a trivial FastAPI handler (same server setup, same client, same bodies), "
        f"zero-cost engine, c1, {args.trivial_rounds} rounds, the lanes taking turns (load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: a loaded machine inflates the ratios)"
    )
    print(
        f"    {'client':<9}{'call':<10}{'endpoint p50':>14}{'trivial p50':>13}{'endpoint p99':>14}{'ratio':>8}"
        f"{'CPU ms per call':>22}{'CPU ratio':>11}"
    )
    for client, _, turn in [lane for lane in lanes if lane[1] == "endpoint"]:
        endpoint, trivial = p50[client, "endpoint", turn], p50[client, "trivial", turn]
        p99 = percentile([ms for ms, _ in lanes[client, "endpoint", turn]], 99)
        cpus = cpu[client, "endpoint", turn], cpu[client, "trivial", turn]
        print(
            f"    {client:<9}{f'turn {turn}':<10}{endpoint:>12.2f}ms{trivial:>11.2f}ms{p99:>12.2f}ms"
            f"{endpoint / trivial:>7.2f}x{cpus[0]:>11.2f} vs {cpus[1]:.2f}{cpus[0] / cpus[1]:>10.2f}x"
            "  (goal <= 1.10)"
        )


def print_throughput(args) -> None:
    tput = throughput(args.model, args.episodes, args.agent_turns, args.max_tokens)
    print(
        f"(b) {args.model}: {args.episodes} episodes x {args.agent_turns} calls x {args.max_tokens} tokens, "
        f"{torch.get_num_threads()} torch thread(s)"
    )
    print(f"    {'mode':<14}{'tokens/s':>10}{'episodes/s':>12}{'seconds':>9}{'max batch':>11}")
    for name in ("sequential", "concurrent"):
        r = tput[name]
        print(
            f"    {name:<14}{r['tokens_per_s']:>10.0f}{r['episodes_per_s']:>12.2f}{r['seconds']:>9.2f}"
            f"{r['max_batch']:>11}"
        )
    ratio = tput["concurrent"]["tokens_per_s"] / tput["sequential"]["tokens_per_s"]
    print(
        f"    concurrent / sequential: {ratio:.1f}x tokens/s, "
        f"{tput['concurrent']['episodes_per_s'] / tput['sequential']['episodes_per_s']:.1f}x episodes/s"
    )


if __name__ == "__main__":
    main()
