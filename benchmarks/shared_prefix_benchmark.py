"""Shared prompt prefixes computed once, in the engine and in the trainer, side by side in one run (the demo's shapes).

```bash
python benchmarks/shared_prefix_benchmark.py          # about 1 min on 2 CPU cores
```

The calculator demo's episodes all start with the same ~270 tokens of system prompt and tool schemas, and a GRPO group
is G episodes of the same task. Every figure is a ratio of two things measured in the same run, taking turns:

(a) Engine: a group step's first turns (4 tasks x 8 identical prompts, admitted together) sampled by the embedded
    `TransformersEngine`, with the shared prefixes prefilled once (the default) and with every row prefilling its
    whole prompt (the engine before). Median engine time, and the prompt tokens run through the model.
(b) Trainer: scoring 32 demo-shaped rows (system prompt + question + two assistant turns with a tool result between)
    for the loss, forward and backward, with the shared prefix computed once (`shared_prefix_scoring`, the default)
    and TRL's own way (every row whole). Median time, and the max |difference| of the log-probabilities.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from datasets import Dataset

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.generation import model_steps
from trl_agentic.generation.engine import SamplingParams
from trl_agentic.generation.transformers_engine import TransformersEngine
from trl_agentic.tasks.calculator import CALCULATOR_TOOLS, SYSTEM_PROMPT
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


def first_prompts(tokenizer, tasks: int, group: int) -> list[list[int]]:
    prompts = []
    for task in range(tasks):
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"What is {task + 23} * {task + 58}?"},
        ]
        prompt = tokenizer.apply_chat_template(
            messages, tools=CALCULATOR_TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompts += [prompt] * group
    return prompts


def bench_engine(model, tokenizer, repeats: int) -> None:
    prompts = first_prompts(tokenizer, 4, 8)
    sampling = [SamplingParams(max_tokens=1, temperature=1.0, seed=i) for i in range(len(prompts))]
    times, tokens = {"shared": [], "each row": []}, {}
    default = model_steps.SHARED_PREFIX_MIN
    for _ in range(repeats):
        for name, minimum in (("shared", default), ("each row", 10**9)):
            model_steps.SHARED_PREFIX_MIN = minimum
            engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, max_batch_size=256)
            started = time.perf_counter()
            engine.generate_batch(prompts, sampling)
            times[name].append(time.perf_counter() - started)
            tokens[name] = engine.stats.prefilled_tokens
    model_steps.SHARED_PREFIX_MIN = default
    shared, each = statistics.median(times["shared"]), statistics.median(times["each row"])
    print(
        f"(a) engine, 32 first turns (4 tasks x 8): {shared * 1000:.0f} ms vs {each * 1000:.0f} ms every row whole: "
        f"**{shared / each:.2f}x**; prompt tokens run {tokens['shared']} vs {tokens['each row']}"
    )


def demo_rows(tokenizer, rows: int):
    """TRL's layout of `rows` calculator episodes: (input_ids, attention_mask, logits_to_keep)."""
    prompts, completions = [], []
    for i in range(rows):
        a, b = 10 + (i * 7) % 89, 10 + (i * 13) % 89
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"What is {a} * {b}?"}]
        prompt = tokenizer.apply_chat_template(
            messages, tools=CALCULATOR_TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        call = (
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + f"{a} * {b}" + '"}}\n'
            "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n" + f"{a * b}\n</tool_response><|im_end|>"
            f"\n<|im_start|>assistant\nThe answer is {a * b}.<|im_end|>"
        )
        prompts.append(prompt)
        completions.append(tokenizer.encode(call, add_special_tokens=False))
    prompt_width, width = max(map(len, prompts)), max(map(len, completions))
    pad = tokenizer.pad_token_id
    ids = [[pad] * (prompt_width - len(p)) + p + c + [pad] * (width - len(c)) for p, c in zip(prompts, completions)]
    mask = [
        [0] * (prompt_width - len(p)) + [1] * (len(p) + len(c)) + [0] * (width - len(c))
        for p, c in zip(prompts, completions)
    ]
    return torch.tensor(ids), torch.tensor(mask), width


def bench_trainer(model, tokenizer, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = AgenticGRPOTrainer(
            model,
            agent=lambda client, task: None,
            reward_funcs=lambda prompts, **kw: [0.0] * len(prompts),
            processing_class=tokenizer,
            train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}]}]),
            args=AgenticGRPOConfig(
                output_dir=output_dir,
                num_generations=2,
                per_device_train_batch_size=2,
                use_cpu=True,
                bf16=False,
                report_to="none",
                gradient_checkpointing=False,
            ),
        )
        try:
            trainer.model.train()
            input_ids, attention_mask, width = demo_rows(tokenizer, 32)
            times, logps = {True: [], False: []}, {}
            for _ in range(repeats):
                for shared in (True, False):
                    trainer.args.shared_prefix_scoring = shared
                    trainer.model.zero_grad()
                    started = time.perf_counter()
                    values, _, _ = trainer._get_per_token_logps_and_entropies(
                        trainer.model, input_ids, attention_mask, width, compute_entropy=True
                    )
                    values.sum().backward()
                    times[shared].append(time.perf_counter() - started)
                    logps[shared] = values.detach()
        finally:
            trainer.close()
    shared, whole = statistics.median(times[True]), statistics.median(times[False])
    difference = (logps[True] - logps[False]).abs().max().item()
    print(
        f"(b) trainer, scoring 32 demo rows of {input_ids.size(1)} columns, forward + backward: {shared * 1000:.0f} ms "
        f"vs {whole * 1000:.0f} ms TRL's way: **{shared / whole:.2f}x**; max |logp difference| {difference:.1e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer("qwen2_5", vocab_size=1500, seed=0)
    model = build_tiny_model(tokenizer, hidden_size=128, num_layers=2, num_heads=4, seed=0).eval()  # the demo's
    bench_engine(model, tokenizer, args.repeats)
    bench_trainer(model, tokenizer, args.repeats)


if __name__ == "__main__":
    main()
