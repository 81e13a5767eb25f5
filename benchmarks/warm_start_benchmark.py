"""The demo's warm-start steps: one padded call, length-chunked batches, and the chunks two at once, side by side.

```bash
python benchmarks/warm_start_benchmark.py            # about 1 min on 2 CPU cores
```

A warm-start step (SFT, `trl_agentic.warm_start`) draws a batch of rows and back-propagates their mean token loss. The
demo's phase-1 rows hold 1-3 conversations each, so their lengths differ up to 3x and one padded call spends much of
its compute on padding; `length_chunks` sorts the batch by length and runs it in up to 4 calls of similar lengths,
with the token losses summed over the whole batch's label count (the same loss and gradient). The demo runs those
chunks two at once (`warm_start_workers=2`: two threads of one torch thread each, gradients added in chunk order, the
same bits as one chunk after the other). The three ways run the same batches, taking turns, on the demo's one torch
thread; printed: the median step time of each, the ratios, the padded tokens each runs through the model, the
largest gradient difference between one call and the chunks, and whether two at once gave the chunks' gradients bit
for bit.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from trl_agentic.pipeline import CalculatorDemoConfig, short_form_rows, warm_start_demonstrations
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer
from trl_agentic.warm_start import assistant_masked_ids, batch_loss, chunk_pool, length_chunks


def padded_tokens(chunks) -> int:
    return sum(len(chunk) * max(len(ids) for ids, _ in chunk) for chunk in chunks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="batches per phase, each run all three ways")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the main thread (the demo's: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    settings = CalculatorDemoConfig()
    suite = settings.suite()
    tokenizer = build_tiny_tokenizer("qwen2_5", vocab_size=settings.vocab_size)
    model = build_tiny_model(
        tokenizer,
        hidden_size=settings.hidden_size,
        num_layers=settings.num_layers,
        num_heads=settings.num_heads,
        seed=0,
    )
    demonstrations = warm_start_demonstrations(suite, settings)
    phases = [
        ("phase 1 (1-3 conversations per row)", short_form_rows(demonstrations, 0), settings.short_batch_size),
        ("phase 2 (as the agent sends it)", demonstrations, settings.full_batch_size),
    ]
    pad = tokenizer.pad_token_id
    pool = chunk_pool(2)
    print(f"demo model {settings.hidden_size}x{settings.num_layers}, {args.threads} threads, {args.steps} batches")
    for name, rows, batch_size in phases:
        examples = [assistant_masked_ids(tokenizer, row["messages"], row.get("tools")) for row in rows[:512]]
        rng = random.Random(0)
        batches = [[examples[rng.randrange(len(examples))] for _ in range(batch_size)] for _ in range(args.steps)]
        ways = ("one call", "chunked", "2 at once")
        times: dict[str, list[float]] = {way: [] for way in ways}
        tokens = dict.fromkeys(ways, 0)
        max_diff, identical = 0.0, True
        for batch in [batches[0]] + batches:  # the first batch twice: a warm-up, not timed
            grads = {}
            chunked = length_chunks(batch)
            for way, chunks, way_pool in (
                ("one call", [batch], None),
                ("chunked", chunked, None),
                ("2 at once", chunked, pool),
            ):
                model.zero_grad()
                started = time.perf_counter()
                batch_loss(model, chunks, pad, pool=way_pool)
                times[way].append(time.perf_counter() - started)
                tokens[way] += padded_tokens(chunks)
                grads[way] = [p.grad.clone() for p in model.parameters()]
            max_diff = max(
                max_diff,
                max((a - b).abs().max().item() for a, b in zip(grads["one call"], grads["chunked"], strict=True)),
            )
            identical &= all(torch.equal(a, b) for a, b in zip(grads["chunked"], grads["2 at once"], strict=True))
        median = {way: statistics.median(times[way][1:]) for way in ways}
        print(f"\n{name}, batches of {batch_size}:")
        for way, label in zip(ways, ("one padded call ", "length-chunked  ", "chunks 2 at once")):
            print(f"  {label} {median[way] * 1000:7.0f} ms/step   {tokens[way] // (args.steps + 1):6d} tokens")
        print(
            f"  chunked / one call {median['chunked'] / median['one call']:.2f}x, max |gradient difference| "
            f"{max_diff:.1e}"
        )
        print(
            f"  2 at once / chunked {median['2 at once'] / median['chunked']:.2f}x, gradients bit for bit the "
            f"same: {'yes' if identical else 'NO'}"
        )
    pool.shutdown()


if __name__ == "__main__":
    main()
