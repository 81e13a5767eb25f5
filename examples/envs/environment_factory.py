"""Train an environment written for TRL's `environment_factory`, unchanged, with AgenticGRPOTrainer.

`GuessEnv` follows TRL 1.16's contract: its public methods are the tools, `reset(**row)` starts an episode from the
dataset row (and may return text appended to the prompt), `get_reward()` scores it. The same class and arguments train
under `trl.GRPOTrainer` (`--trainer trl`) and under `AgenticGRPOTrainer`, where a built-in agent plays TRL's tool loop
through the endpoint (so the episode log, the viewer, alarms and asynchronous rollouts apply).

```bash
python examples/envs/environment_factory.py --model tiny:qwen2_5 --steps 2 --max-tokens 32          # CPU smoke run
python examples/envs/environment_factory.py --model Qwen/Qwen3-4B-Instruct-2507 --use-vllm          # one GPU
python examples/envs/environment_factory.py --model tiny:qwen2_5 --steps 2 --trainer trl            # TRL's own loop
trl-agentic eval --task examples/envs/environment_factory.py:SUITE --model tiny:qwen2_5 --size 4 --max-tokens 32
```

Docs: docs/envs_environment_factory.md.
"""

from __future__ import annotations

import argparse
import random

import datasets
import torch
from trl import GRPOConfig, GRPOTrainer

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.envs.environment_factory import environment_suite
from trl_agentic.tiny_models import load_model_and_tokenizer


class GuessEnv:
    """Find a hidden number with at most a few guesses. Written for `trl.GRPOTrainer(environment_factory=GuessEnv)`."""

    max_guesses = 5

    def reset(self, target: int, **row) -> str:
        self.target, self.guesses, self.solved = target, 0, False
        return f" You have {self.max_guesses} guesses."  # appended to the last user message

    def guess(self, number: int) -> str:
        """Guess the hidden number.

        Args:
            number: Your guess, an integer from 1 to 20.

        Returns:
            Whether the hidden number is higher, lower, or found.
        """
        if self.guesses >= self.max_guesses:
            raise ValueError("no guesses left")  # the model reads "{'error': 'no guesses left'}", as under TRL
        self.guesses += 1
        if number == self.target:
            self.solved = True
            return "Found it!"
        return "Higher." if number < self.target else "Lower."

    def get_reward(self) -> float:
        return 1.0 if self.solved else 0.0


def few_guesses(prompts, completions, environments, **kwargs) -> list[float]:
    """A TRL reward function reading the live environments: a bonus for solving it in few guesses."""
    return [(env.max_guesses - env.guesses) / env.max_guesses if env.solved else 0.0 for env in environments]


def guess_dataset(size: int = 256, seed: int = 0) -> datasets.Dataset:
    rng = random.Random(seed)
    targets = [rng.randint(1, 20) for _ in range(size)]
    prompt = [{"role": "user", "content": "Find the hidden number between 1 and 20 with the guess tool."}]
    return datasets.Dataset.from_dict({"prompt": [prompt] * size, "target": targets})


# For `trl-agentic eval --task examples/envs/environment_factory.py:SUITE --model ...`: the same agent and rewards.
SUITE = environment_suite(GuessEnv, guess_dataset(64, seed=1), reward_funcs=[few_guesses], name="guess")


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description="GRPO on a TRL environment_factory environment.")
    parser.add_argument("--model", default="Qwen/Qwen3-4B-Instruct-2507", help="Hub id, path, or tiny:<family>.")
    parser.add_argument("--trainer", choices=["agentic", "trl"], default="agentic")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--num-generations", type=int, default=8, help="Episodes per task (one task per step).")
    parser.add_argument("--max-tokens", type=int, default=512, help="Completion budget (TRL's max_completion_length).")
    parser.add_argument("--max-tool-calling-iterations", type=int, default=6)
    parser.add_argument("--use-vllm", action="store_true", help="Generate with vLLM (colocate), on a GPU.")
    parser.add_argument("--output-dir", default="outputs/environment_factory")
    args = parser.parse_args(argv)
    model, tokenizer = load_model_and_tokenizer(args.model)
    gpu = torch.cuda.is_available()
    settings = dict(
        output_dir=args.output_dir,
        max_steps=args.steps,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.num_generations,
        max_completion_length=args.max_tokens,
        max_tool_calling_iterations=args.max_tool_calling_iterations,
        learning_rate=1e-6,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=gpu,
        use_cpu=not gpu,
        use_vllm=args.use_vllm,
        vllm_mode="colocate",
    )
    # The same three arguments for both trainers: dataset, environment_factory, reward_funcs.
    common = dict(
        train_dataset=guess_dataset(),
        environment_factory=GuessEnv,
        reward_funcs=[few_guesses],
        processing_class=tokenizer,
    )
    if args.trainer == "trl":
        trainer = GRPOTrainer(model, args=GRPOConfig(**settings), **common)
        trainer.train()
        return trainer
    trainer = AgenticGRPOTrainer(model, args=AgenticGRPOConfig(**settings, log_episodes=True), **common)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


if __name__ == "__main__":
    main()
