"""The demo's warm-start steps with length-chunked batches against one padded call, side by side in one run.

```bash
python benchmarks/warm_start_benchmark.py            # about 1 min on 2 CPU cores
```

A warm-start step (SFT, `trl_agentic.warm_start`) draws a batch of rows and back-propagates their mean token loss. The
demo's phase-1 rows hold 1-3 conversations each, so their lengths differ up to 3x and one padded call spends much of
its compute on padding; `length_chunks` sorts the batch by length and runs it in up to 4 calls of similar lengths,
with the token losses summed over the whole batch's label count (the same loss and gradient). Both ways run the
same batches, taking turns; printed: the median step time of each, their ratio, the padded tokens each runs through
the model, and the largest gradient difference between the two.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from trl_agentic.scripts.demo import DemoSettings, short_form_rows, warm_start_demonstrations
from trl_agentic.tasks.calculator import make_calculator_suite
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer
from trl_agentic.warm_start import assistant_masked_ids, batch_loss, length_chunks


def padded_tokens(chunks) -> int:
    return sum(len(chunk) * max(len(ids) for ids, _ in chunk) for chunk in chunks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="batches per phase, each run both ways")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    settings = DemoSettings()
    suite = make_calculator_suite(digits=settings.digits, ops=settings.ops)
    tokenizer = build_tiny_tokenizer("qwen2_5", vocab_size=settings.vocab_size)
    model = build_tiny_model(tokenizer, hidden_size=settings.hidden_size, num_layers=settings.num_layers,
                             num_heads=settings.num_heads, seed=0)
    demonstrations = warm_start_demonstrations(suite, settings)
    phases = [("phase 1 (1-3 conversations per row)", short_form_rows(demonstrations, 0), settings.short_batch_size),
              ("phase 2 (as the agent sends it)", demonstrations, settings.full_batch_size)]
    pad = tokenizer.pad_token_id
    print(f"demo model {settings.hidden_size}x{settings.num_layers}, {args.threads} threads, {args.steps} batches")
    for name, rows, batch_size in phases:
        examples = [assistant_masked_ids(tokenizer, row["messages"], row.get("tools")) for row in rows[:512]]
        rng = random.Random(0)
        batches = [[examples[rng.randrange(len(examples))] for _ in range(batch_size)] for _ in range(args.steps)]
        times: dict[str, list[float]] = {"one call": [], "chunked": []}
        tokens = {"one call": 0, "chunked": 0}
        max_diff = 0.0
        for batch in [batches[0]] + batches:  # the first batch twice: a warm-up, not timed
            grads = {}
            for way, chunks in (("one call", [batch]), ("chunked", length_chunks(batch))):
                model.zero_grad()
                started = time.perf_counter()
                batch_loss(model, chunks, pad)
                times[way].append(time.perf_counter() - started)
                tokens[way] += padded_tokens(chunks)
                grads[way] = [p.grad.clone() for p in model.parameters()]
            max_diff = max(max_diff, max((a - b).abs().max().item()
                                         for a, b in zip(grads["one call"], grads["chunked"], strict=True)))
        one, chunked = (statistics.median(times[w][1:]) for w in ("one call", "chunked"))
        print(f"\n{name}, batches of {batch_size}:")
        print(f"  one padded call  {one * 1000:7.0f} ms/step   {tokens['one call'] // (args.steps + 1):6d} tokens")
        print(f"  length-chunked   {chunked * 1000:7.0f} ms/step   {tokens['chunked'] // (args.steps + 1):6d} tokens")
        print(f"  ratio {chunked / one:.2f}x; max |gradient difference| {max_diff:.1e}")


if __name__ == "__main__":
    main()
