"""The task the harness examples train on, and the training loop they share.

Task: "Create a file answer.txt containing N." The checker reads the file the harness left in its workspace (the
episode's `result["files"]`, see `trl_agentic.rollout.harnesses`); the model never sees the checker.

Each `examples/harnesses/<harness>.py` calls `train(Harness(...))`:

```bash
python examples/harnesses/claude_code.py --model Qwen/Qwen3-4B-Instruct-2507 --use-vllm     # one GPU
python examples/harnesses/mini_swe_agent.py --model tiny:qwen2_5 --steps 1 --max-tokens 64   # CPU smoke run
```
"""

from __future__ import annotations

import argparse
import random

import datasets
import torch

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
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
    parser.add_argument("--use-vllm", action="store_true", help="Generate with vLLM (colocate), on a GPU.")
    parser.add_argument("--output-dir", default=f"outputs/{harness.name}")
    args = parser.parse_args(argv)
    model, tokenizer = load_model_and_tokenizer(args.model)
    gpu = torch.cuda.is_available()
    config = AgenticGRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.num_generations,
        max_completion_length=args.max_tokens,
        max_turns=args.max_turns,
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
        reward_funcs=[answer_file_correct],
        args=config,
        train_dataset=answer_file_dataset(),
        processing_class=tokenizer,
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer
