"""The task the harness examples train on, and the training loop they share.

Task: "Create a file answer.txt containing N." The checker reads the file the harness left in its workspace (the
episode's `result["files"]`, see `trl_agentic.rollout.harnesses`); the model never sees the checker.

Each `examples/harnesses/<harness>.py` calls `train(Harness(...))`:

```bash
python examples/harnesses/claude_code.py --model Qwen/Qwen3-4B-Instruct-2507 --use-vllm --max-context-length 65536
python examples/harnesses/codex.py --model tiny:qwen2_5 --steps 1 --num-generations 2 --max-tokens 16 \
    --max-context-length 65536   # CPU smoke run
```

A harness's own system prompt and tool list come first: its opening prompt is 2k (mini-swe-agent) to 46k (Claude
Code) tokens with the tiny tokenizer. `--max-context-length` must hold that plus the episode's calls, or the endpoint
answers `context_length_exceeded` and the episode cannot be scored; a tiny model's default is 4096. Each episode is
one row of that length, so a step trains its G rows one per micro-batch.

Episodes that end with the harness exiting non-zero right after a call cut at `--max-tokens` are scored -1 by
`cut_off_penalty` (a random tiny model cuts every call); the checker scores those that end `ok`.
"""

from __future__ import annotations

import argparse
import random

import datasets
import torch

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.rewards import cut_off_penalty
from trl_agentic.rewards.utils import episode_for, is_scorable
from trl_agentic.rollout.harnesses import Harness
from trl_agentic.tiny_models import load_model_and_tokenizer


def answer_file_dataset(size: int = 256, seed: int = 0) -> datasets.Dataset:
    """Rows with a conversational `prompt` (the harness's task) and the checker's `answer`."""
    rng = random.Random(seed)
    answers = [str(rng.randint(0, 999)) for _ in range(size)]
    prompts = [[{"role": "user", "content": f"Create a file answer.txt containing {n}."}] for n in answers]
    return datasets.Dataset.from_dict({"prompt": prompts, "answer": answers})


def answer_file_correct(prompts, completions, answer, **kwargs) -> list[float | None]:
    """1.0 when the workspace's answer.txt holds the answer, 0.0 otherwise, None for a failed episode."""
    rewards = []
    for index, expected in enumerate(answer):
        episode = episode_for(kwargs, index)
        if not is_scorable(episode):
            rewards.append(None)
            continue
        text = episode.result["files"].get("answer.txt")
        rewards.append(1.0 if isinstance(text, str) and text.strip() == expected else 0.0)
    return rewards


def train(harness: Harness, argv: list[str] | None = None) -> AgenticGRPOTrainer:
    parser = argparse.ArgumentParser(description=f"GRPO on answer-file tasks through {harness.name}, unmodified.")
    parser.add_argument("--model", default="Qwen/Qwen3-4B-Instruct-2507", help="Hub id, path, or tiny:<family>.")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--num-generations", type=int, default=8, help="Episodes per task (one task per step).")
    parser.add_argument("--max-tokens", type=int, default=1024, help="Tokens per model call.")
    parser.add_argument("--max-turns", type=int, default=32, help="Model calls per episode.")
    parser.add_argument(
        "--max-context-length",
        type=int,
        help="Prompt + completion tokens the policy accepts (default: the model's). Harnesses open with 15k-60k "
        "token prompts: a tiny model (4096 positions) needs e.g. 65536, or every call overflows its context.",
    )
    parser.add_argument("--use-vllm", action="store_true", help="Generate with vLLM (colocate), on a GPU.")
    parser.add_argument("--output-dir", default=f"outputs/{harness.name}")
    args = parser.parse_args(argv)
    model, tokenizer = load_model_and_tokenizer(args.model)
    gpu = torch.cuda.is_available()
    config = AgenticGRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        num_generations=args.num_generations,
        per_device_train_batch_size=1,  # a harness's rows are 15k-60k tokens: one per micro-batch, none padded
        gradient_accumulation_steps=args.num_generations,  # one task's episodes per optimizer step
        max_completion_length=args.max_tokens,
        max_turns=args.max_turns,
        vllm_max_model_length=args.max_context_length,  # also the context of the transformers engine
        episode_timeout=900,
        learning_rate=1e-6,
        log_episodes=True,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=gpu,
        use_cpu=not gpu,
        use_vllm=args.use_vllm,
        vllm_mode="colocate",
    )
    trainer = AgenticGRPOTrainer(
        model,
        agent=harness,
        reward_funcs=[answer_file_correct, cut_off_penalty],
        args=config,
        train_dataset=answer_file_dataset(),
        processing_class=tokenizer,
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer
