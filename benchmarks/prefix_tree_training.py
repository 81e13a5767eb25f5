"""Prefix-tree training against the flat rows, side by side in one run: forward tokens, training step time, gradients.

```bash
python benchmarks/prefix_tree_training.py          # a few minutes on 2 CPU cores
```

The demo's model shape (tiny Qwen2-shaped, vocab 1500, hidden 128, 2 layers) in `AgenticGRPOTrainer`, and TRL's own
loss (`_compute_loss`, DAPO, per-token advantages) forward and backward on one micro-batch, three ways taking turns:
`prefix_tree_training` (the rows packed into one prefix tree), TRL's flat rows (every row whole), and today's
`shared_prefix_scoring` (the prompt prefix the rows share computed once). Two batches:

The tree runs as trunk + tails (the trunk, the tokens two rows or more share, packed with a tree mask and its key/value
states kept, then each row's own tail on them: what runs on one process) and as one packed forward (what runs under
DDP, DeepSpeed, FSDP or gradient checkpointing).

(a) Tree: one task, 8-turn episodes (the calculator's system prompt and tool schemas, then per turn a ~30-token
    assistant call and a ~15-token tool result), branching in two at turns 2, 4 and 6: 8 leaves, 8 rows.
    Goals: forward tokens <= 1/3 of the flat rows', step time <= 0.5x flat, gradients equal within 1e-5.
(b) Today's groups: 8 episodes of one task that share only the prompt (two turns each, as the demo's).

Also the old-logprob pass (no gradient, the scoring before the loss). Every time is a median over repeats, in CPU
seconds of this process on one torch thread by default (the machine this was written on runs 8 engineers' jobs on 2
cores: wall-clock times there swing 2x between repeats; `--wall` on an idle machine).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from datasets import Dataset

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer, agentic_grpo_trainer, prefix_tree
from trl_agentic.tasks.calculator import CALCULATOR_TOOLS, SYSTEM_PROMPT
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


def prompt_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(
        messages, tools=CALCULATOR_TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def turn(generator) -> list[int]:
    """One turn's tokens: an assistant call (~30) and a tool result (~15), lengths varying."""
    length = int(torch.randint(38, 53, (1,), generator=generator))
    return torch.randint(20, 700, (length,), generator=generator).tolist()


def tree_completions(turns: int, branch_turns: tuple[int, ...], generator) -> list[list[int]]:
    """Leaves of a tree of episodes of `turns` turns, branching in two at each of `branch_turns` (the branches sample
    their own turn there and after; they share every turn before)."""
    paths: list[list[int]] = [[]]
    for t in range(turns):
        if t in branch_turns:
            paths = [list(path) for path in paths for _ in range(2)]
        for path in paths:
            path += turn(generator)
    return paths


def layout(prompts: list[list[int]], completions: list[list[int]], pad: int):
    prompt_width, width = max(map(len, prompts)), max(map(len, completions))
    ids = [[pad] * (prompt_width - len(p)) + p + c + [pad] * (width - len(c)) for p, c in zip(prompts, completions)]
    mask = [
        [0] * (prompt_width - len(p)) + [1] * (len(p) + len(c)) + [0] * (width - len(c))
        for p, c in zip(prompts, completions)
    ]
    input_ids, attention_mask = torch.tensor(ids), torch.tensor(mask)
    generator = torch.Generator().manual_seed(1)
    rows = len(prompts)
    return {
        "prompt_ids": input_ids[:, :prompt_width],
        "prompt_mask": attention_mask[:, :prompt_width],
        "completion_ids": input_ids[:, prompt_width:],
        "completion_mask": attention_mask[:, prompt_width:],
        "advantages": torch.randn(rows, width, generator=generator),
        "num_items_in_batch": attention_mask[:, prompt_width:].sum(),
    }


# CPU seconds of this process, on one torch thread (`--threads 1`, the default): the step's own compute, which the other
# processes of a shared machine do not change; `--wall` for wall-clock seconds (on an idle machine).
CLOCK = time.process_time

MODES = {
    "tree": (True, False),
    "tree, one forward": (True, False),
    "flat": (False, False),
    "shared prefix": (False, True),
}


def force_one_forward(on: bool) -> None:
    """`prefix_tree_training`'s one-forward mode (what runs under DDP or checkpointing) instead of trunk + tails."""
    mode = prefix_tree.prefix_tree_mode
    agentic_grpo_trainer.prefix_tree_mode = (lambda *a, **k: mode(*a, **k) and "packed") if on else mode


def bench(trainer, inputs: dict, repeats: int, label: str, goals: bool) -> None:
    model = trainer.model
    tokens: dict[str, int] = {}
    calls: list[int] = []
    handle = model.model.register_forward_hook(
        lambda m, args, kwargs, out: calls.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    times = {mode: [] for mode in MODES}
    no_grad_times = {mode: [] for mode in MODES}
    grads = {}
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    width = inputs["completion_ids"].size(1)
    try:
        for _ in range(repeats):
            for mode, (tree, shared) in MODES.items():
                trainer.args.prefix_tree_training, trainer.args.shared_prefix_scoring = tree, shared
                force_one_forward(mode == "tree, one forward")
                model.zero_grad()
                calls[:] = []
                started = CLOCK()
                trainer._compute_loss(model, inputs).backward()
                times[mode].append(CLOCK() - started)
                tokens[mode] = sum(calls)
                grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                started = CLOCK()
                with torch.no_grad():
                    trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, width)
                no_grad_times[mode].append(CLOCK() - started)
    finally:
        handle.remove()
    real = int(attention_mask.sum())
    step = {mode: statistics.median(values) for mode, values in times.items()}
    score = {mode: statistics.median(values) for mode, values in no_grad_times.items()}
    difference = max((grads["tree"][n] - grads["flat"][n]).abs().max().item() for n in grads["flat"])
    token_goal = " (goal <= 0.33)" if goals else ""
    time_goal = " (goal <= 0.5)" if goals else ""
    print(f"{label}: {input_ids.size(0)} rows, {input_ids.size(1)} columns, {real} real tokens")
    print(
        f"  forward tokens: tree {tokens['tree']}, flat {tokens['flat']}, shared prefix {tokens['shared prefix']}: "
        f"tree / flat **{tokens['tree'] / tokens['flat']:.2f}**{token_goal} (tree / flat real tokens "
        f"{tokens['tree'] / real:.2f})"
    )
    print(
        f"  training step (TRL's loss, forward + backward): tree {step['tree'] * 1000:.0f} ms, flat "
        f"{step['flat'] * 1000:.0f} ms, shared prefix {step['shared prefix'] * 1000:.0f} ms: tree / flat "
        f"**{step['tree'] / step['flat']:.2f}x**{time_goal}, tree / shared prefix "
        f"{step['tree'] / step['shared prefix']:.2f}x; one forward (tokens {tokens['tree, one forward']}) / flat "
        f"{step['tree, one forward'] / step['flat']:.2f}x"
    )
    print(
        f"  old-logprob pass (no gradient): tree {score['tree'] * 1000:.0f} ms, flat {score['flat'] * 1000:.0f} ms: "
        f"**{score['tree'] / score['flat']:.2f}x**; one forward / flat {score['tree, one forward'] / score['flat']:.2f}x"
    )
    difference = max((grads["tree, one forward"][n] - grads["flat"][n]).abs().max().item() for n in grads["flat"])
    print(f"  max |gradient difference| one forward vs flat: {difference:.1e}")
    print(f"  max |gradient difference| tree vs flat: {difference:.1e} (goal <= 1e-5)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wall", action="store_true", help="time wall-clock seconds instead of this process's CPU")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.wall:
        global CLOCK
        CLOCK = time.perf_counter
    print(
        f"times: {'wall-clock' if args.wall else 'CPU'} seconds, {args.threads} torch thread(s), median of {args.repeats}"
    )
    tokenizer = build_tiny_tokenizer("qwen2_5", vocab_size=1500, seed=0)
    model = build_tiny_model(tokenizer, hidden_size=128, num_layers=2, num_heads=4, seed=0)  # the demo's
    generator = torch.Generator().manual_seed(0)
    pad = tokenizer.pad_token_id
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
                loss_type="dapo",
            ),
        )
        try:
            trainer.model.train()
            trainer.current_gradient_accumulation_steps = 1  # (set by `train()`)
            prompt = prompt_ids(tokenizer, "What is 23 * 58, then minus 17?")
            leaves = tree_completions(8, (2, 4, 6), generator)
            bench(trainer, layout([prompt] * len(leaves), leaves, pad), args.repeats, "(a) tree, 8 leaves", True)
            group = [turn(generator) + turn(generator) for _ in range(8)]
            bench(trainer, layout([prompt] * 8, group, pad), args.repeats, "(b) group of 8, shared prompt", False)
        finally:
            trainer.close()


if __name__ == "__main__":
    main()
