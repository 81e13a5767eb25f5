"""The embedded engine under agent load: KV prefix reuse, continuous batching, batching gain, side by side in one run.

```bash
python benchmarks/engine_benchmark.py                 # about 1-2 min on 2 CPU cores
python benchmarks/engine_benchmark.py --sections a --model tiny:qwen2_5:256x4
```

Every figure is a ratio of two things measured in the same run, printed with its goal (issue #12):

(a) One 8-turn episode with growing tool outputs (each prompt = the previous prompt + its completion + a longer tool
    result), sampled by the embedded `TransformersEngine` with and without KV prefix reuse, the two engines taking
    turns episode by episode. Engine time of turn 8 / turn 1 (median over the episodes). Goal with reuse: <= 1.3.
(b) 32 concurrent calculator-like episodes of 2-4 calls each (a short random tool latency between calls): the mean
    number of sequences the engine decodes per step over the number of requests waiting on the model at that step
    (decoding or queued). Goal: >= 0.9 (a call arriving mid-batch joins at the next step, it does not wait).
(c) 32 single-call agents on a 256-hidden model: their speed-up over one call at a time (concurrent `generate` calls)
    against the speed-up of transformers' own batched `generate` over one call at a time. Goal: >= 0.9 of it (issue
    29: 0.74-0.80 measured after continuous batching). Also printed: the concurrent agents' time over batched
    `generate`'s, which no per-call cost of the engine can flatter.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import torch

from trl_agentic.generation.engine import SamplingParams
from trl_agentic.generation.transformers_engine import TransformersEngine
from trl_agentic.tiny_models import load_model_and_tokenizer


def chat(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def tool_result_ids(tokenizer, text: str) -> list[int]:
    """What the chat template appends after an assistant turn: the tool result, then the next generation prompt."""
    return tokenizer.encode(
        f"\n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )


# (a) growing episode


async def timed_episode(engine, tokenizer, seed: int, turns: int, max_tokens: int, growth: int) -> list[float]:
    """Seconds of each `generate` call of one episode whose tool results grow by `growth` words per turn."""
    rng = random.Random(seed)
    prompt = chat(
        tokenizer,
        [
            {"role": "system", "content": "Use the tools."},
            {"role": "user", "content": f"Task {seed}: list the files and summarize them."},
        ],
    )
    seconds = []
    for turn in range(turns):
        sampling = SamplingParams(max_tokens=max_tokens, seed=seed * 100 + turn, stop_token_ids=[])
        started = time.perf_counter()
        out = await engine.generate(prompt, sampling)
        seconds.append(time.perf_counter() - started)
        listing = " ".join(f"file{rng.randrange(1000)}.txt" for _ in range(growth * (turn + 1)))
        prompt = prompt + out.token_ids + tool_result_ids(tokenizer, listing)
    return seconds


def growing_episode(model, tokenizer, episodes: int, turns: int, max_tokens: int, growth: int) -> dict:
    engines = {
        "with reuse": TransformersEngine(model, pad_token_id=tokenizer.pad_token_id),
        "without reuse": TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, prefix_cache_bytes=0),
    }
    per_turn = {name: [[] for _ in range(turns)] for name in engines}

    async def run():
        for episode in range(-1, episodes):  # episode -1 warms up
            names = list(engines) if episode % 2 else list(engines)[::-1]
            for name in names:
                seconds = await timed_episode(engines[name], tokenizer, episode + 1, turns, max_tokens, growth)
                if episode >= 0:
                    for turn, s in enumerate(seconds):
                        per_turn[name][turn].append(s)
        for engine in engines.values():
            await engine.stop()

    asyncio.run(run())
    return {
        name: {"turn_ms": [statistics.median(s) * 1000 for s in turns_seconds], "stats": engines[name].stats}
        for name, turns_seconds in per_turn.items()
    }


# (b) concurrent multi-turn episodes


def concurrent_episodes(model, tokenizer, episodes: int, max_tokens: int, seed: int) -> dict:
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, max_batch_size=episodes)
    rng = random.Random(seed)
    plans = [(rng.randint(2, 4), [rng.uniform(0.0, 0.01) for _ in range(4)]) for _ in range(episodes)]

    async def episode(i: int) -> int:
        calls, tool_seconds = plans[i]
        prompt = chat(
            tokenizer,
            [
                {"role": "system", "content": "Use the calculator."},
                {"role": "user", "content": f"What is {i} * ({i + 3} + 4)?"},
            ],
        )
        for call in range(calls):
            sampling = SamplingParams(
                max_tokens=rng.randint(max_tokens // 2, max_tokens), seed=i * 10 + call, stop_token_ids=[]
            )
            out = await engine.generate(prompt, sampling)
            await asyncio.sleep(tool_seconds[call])  # the tool runs
            prompt = prompt + out.token_ids + tool_result_ids(tokenizer, str(i * (i + 7)))
        return calls

    async def run():
        await episode(0)  # warm-up
        engine.stats.reset()
        started = time.perf_counter()
        calls = sum(await asyncio.gather(*[episode(i) for i in range(episodes)]))
        seconds = time.perf_counter() - started
        await engine.stop()
        return calls, seconds

    calls, seconds = asyncio.run(run())
    return {"calls": calls, "seconds": seconds, "stats": engine.stats}


# (c) batching gain against transformers' own batched generate


def batching_gain(model, tokenizer, agents: int, max_tokens: int, rounds: int) -> dict:
    prompts = [
        chat(tokenizer, [{"role": "user", "content": f"Question {i}: " + "why? " * (i % 7)}]) for i in range(agents)
    ]
    engine = TransformersEngine(
        model, pad_token_id=tokenizer.pad_token_id, max_batch_size=agents, prefix_cache_bytes=0
    )  # one call per agent: nothing to reuse
    samplings = [SamplingParams(max_tokens=max_tokens, seed=i, stop_token_ids=[]) for i in range(agents)]

    def hf_generate(batch: list[list[int]]) -> None:
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in batch])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            model.generate(
                input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                eos_token_id=None,
                pad_token_id=tokenizer.pad_token_id,
                output_scores=True,
                return_dict_in_generate=True,
            )  # scores: we report logprobs too

    async def engine_one_at_a_time():
        for prompt, sampling in zip(prompts, samplings):
            await engine.generate(prompt, sampling)

    async def engine_concurrent():
        await asyncio.gather(*[engine.generate(p, s) for p, s in zip(prompts, samplings)])

    modes = {
        "transformers generate, one at a time": lambda: [hf_generate([p]) for p in prompts],
        "transformers generate, batched": lambda: hf_generate(prompts),
        "engine, one agent at a time": lambda: asyncio.run(engine_one_at_a_time()),
        "engine, concurrent agents": lambda: asyncio.run(engine_concurrent()),
    }
    seconds = {name: [] for name in modes}
    for name, run in modes.items():  # warm-up
        run()
    for r in range(rounds):
        for name in list(modes) if r % 2 == 0 else list(modes)[::-1]:
            started = time.perf_counter()
            modes[name]()
            seconds[name].append(time.perf_counter() - started)
    return {name: statistics.median(s) for name, s in seconds.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default="a,b,c", help="which of (a), (b), (c) to run, comma-separated")
    parser.add_argument("--model", default="tiny:qwen2_5:64x2", help="policy of (a) and (b)")
    parser.add_argument("--gain-model", default="tiny:qwen2_5:256x2", help="policy of (c): a 256-hidden model")
    parser.add_argument("--episodes", type=int, default=6, help="(a): episodes per engine")
    parser.add_argument("--turns", type=int, default=8, help="(a): calls per episode")
    parser.add_argument("--growth", type=int, default=6, help="(a): tool result words added per turn")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens sampled per call")
    parser.add_argument("--agents", type=int, default=32, help="(b) episodes and (c) agents")
    parser.add_argument("--rounds", type=int, default=5, help="(c): timed rounds per mode")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: no oversubscription)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    sections = set(args.sections.split(","))

    if sections & {"a", "b"}:
        model, tokenizer = load_model_and_tokenizer(args.model)
        model.eval()
    if "a" in sections:
        result = growing_episode(model, tokenizer, args.episodes, args.turns, args.max_tokens, args.growth)
        print(
            f"(a) {args.model}: one episode of {args.turns} calls x {args.max_tokens} tokens, tool results "
            f"growing by {args.growth} file names per turn, {args.episodes} episodes per engine (median ms per call)"
        )
        print(
            f"    {'engine':<15}"
            + "".join(f"{f'turn {t + 1}':>9}" for t in range(args.turns))
            + f"{'last / first':>14}{'reused tok':>12}{'prefilled tok':>15}"
        )
        for name, r in result.items():
            ms = r["turn_ms"]
            print(
                f"    {name:<15}" + "".join(f"{m:>9.1f}" for m in ms) + f"{ms[-1] / ms[0]:>13.2f}x"
                f"{r['stats'].reused_tokens:>12}{r['stats'].prefilled_tokens:>15}"
            )
        ratio = result["with reuse"]["turn_ms"][-1] / result["with reuse"]["turn_ms"][0]
        print(
            f"    engine time of turn {args.turns} / turn 1 with KV reuse: {ratio:.2f}x (goal <= 1.3x: "
            f"{'met' if ratio <= 1.3 else 'NOT met'})\n"
        )
    if "b" in sections:
        result = concurrent_episodes(model, tokenizer, args.agents, args.max_tokens, args.seed)
        stats = result["stats"]
        print(
            f"(b) {args.model}: {args.agents} concurrent calculator-like episodes, {result['calls']} calls of "
            f"{args.max_tokens // 2}-{args.max_tokens} tokens, 0-10 ms tool latency, {result['seconds']:.2f}s"
        )
        print(
            f"    decode steps {stats.decode_steps}, mean sequences decoded per step {stats.mean_decode_batch:.2f}, "
            f"mean requests waiting on the model per step {stats.waiting_rows / max(stats.decode_steps, 1):.2f}, "
            f"prefix hits {stats.prefix_hits}/{stats.requests}"
        )
        print(
            f"    decoded / waiting: {stats.decode_occupancy:.3f} (goal >= 0.9: "
            f"{'met' if stats.decode_occupancy >= 0.9 else 'NOT met'})\n"
        )
    if "c" in sections:
        model, tokenizer = load_model_and_tokenizer(args.gain_model)
        model.eval()
        seconds = batching_gain(model, tokenizer, args.agents, args.max_tokens, args.rounds)
        print(
            f"(c) {args.gain_model}: {args.agents} single-call agents x {args.max_tokens} tokens "
            f"(median of {args.rounds} rounds, modes taking turns)"
        )
        for name, s in seconds.items():
            print(f"    {name:<40}{s:>8.3f}s")
        raw = seconds["transformers generate, one at a time"] / seconds["transformers generate, batched"]
        ours = seconds["engine, one agent at a time"] / seconds["engine, concurrent agents"]
        print(
            f"    batching gain: transformers {raw:.2f}x, engine {ours:.2f}x; kept {ours / raw:.2f} of it "
            f"(goal >= 0.9: {'met' if ours / raw >= 0.9 else 'NOT met'})"
        )
        direct = seconds["engine, concurrent agents"] / seconds["transformers generate, batched"]
        print(f"    engine, concurrent agents / transformers generate, batched: {direct:.2f}x the time")


if __name__ == "__main__":
    main()
