"""Train on a verifiers environment (`pip install 'trl-agentic[verifiers]'`).

The environment is written here the way one is published on the Environments Hub: a module with
`load_environment(**args) -> vf.Environment`. It is a `vf.ToolEnv`: arithmetic questions, a Python `calculator` tool,
and a rubric of two weighted functions (the answer is right: 1.0; the reply is short: 0.2). `from_verifiers` turns it
into a task suite: its dataset, its own rollout loop as the agent (driving the policy through the endpoint), and its
rubric's functions as reward functions with their weights, each logged as `rewards/<name>/mean`.

```bash
python examples/envs/verifiers_env.py --model Qwen/Qwen3-4B-Instruct-2507 --use-vllm    # one GPU
python examples/envs/verifiers_env.py --model tiny:qwen2_5 --steps 1 --max-tokens 32      # CPU smoke run
trl-agentic eval --task examples/envs/verifiers_env.py:SUITE --model tiny:qwen2_5 --size 4 --num-samples 2
PYTHONPATH=examples/envs trl-agentic eval --task verifiers:verifiers-env --model tiny:qwen2_5 --size 4  # by id
```

An environment installed from the Hub (`prime env install <owner>/<name>`, or `pip install` its package) is loaded
the same way, by id: `get_task("verifiers:<env-id>")`, or `task: verifiers:<env-id>` in a recipe. Supported
environment types and the trust model: docs/envs_verifiers.md.
"""

from __future__ import annotations

import argparse
import random

import verifiers as vf
from datasets import Dataset

from trl_agentic.envs import from_verifiers


SYSTEM_PROMPT = "Use the calculator tool, then reply with 'The answer is N.'"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with integers, + - * and parentheses.

    Args:
        expression: The expression, e.g. '12 * (3 + 4)'.
    """
    if not set(expression) <= set("0123456789+-*() "):
        raise ValueError(f"only integers, + - * and parentheses are allowed, got {expression!r}")
    return str(eval(expression))  # digits and operators only  # noqa: S307


def questions(size: int, seed: int, first: range) -> Dataset:
    """`size` questions "What is a op b?" with `a` drawn from `first` (the splits draw from disjoint ranges)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b, op = rng.choice(first), rng.randint(10, 99), rng.choice("+-*")
        rows.append({"question": f"What is {a} {op} {b}?", "answer": str(eval(f"{a} {op} {b}"))})  # noqa: S307
    return Dataset.from_list(rows)


def correct_answer(parser, completion, answer) -> float:
    """1.0 when the last number of the final reply is the answer."""
    words = (parser.parse_answer(completion) or "").replace(".", " ").split()
    numbers = [w for w in words if w.lstrip("-").isdigit()]
    return 1.0 if numbers and numbers[-1] == answer else 0.0


def short_reply(parser, completion) -> float:
    """1.0 for a final reply of at most 8 words, 0.0 otherwise."""
    return 1.0 if len((parser.parse_answer(completion) or "").split()) <= 8 else 0.0


def load_environment(num_train_examples: int = 256, num_eval_examples: int = 32, max_turns: int = 4):
    """The environment, as a Hub module defines it (`vf.load_environment("verifiers-env")` finds it by module name)."""
    return vf.ToolEnv(
        dataset=questions(num_train_examples, seed=0, first=range(10, 100)),
        eval_dataset=questions(num_eval_examples, seed=1, first=range(100, 200)),
        system_prompt=SYSTEM_PROMPT,
        tools=[calculator],
        max_turns=max_turns,
        rubric=vf.Rubric(funcs=[correct_answer, short_reply], weights=[1.0, 0.2]),
    )


SUITE = from_verifiers(load_environment(), name="verifiers-env")


def main(argv: list[str] | None = None):
    import torch

    from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
    from trl_agentic.tiny_models import load_model_and_tokenizer

    parser = argparse.ArgumentParser(description="GRPO on a verifiers ToolEnv (arithmetic with a calculator tool).")
    parser.add_argument("--model", default="Qwen/Qwen3-4B-Instruct-2507", help="Hub id, path, or tiny:<family>.")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--num-generations", type=int, default=8, help="Episodes per task (one task per step).")
    parser.add_argument("--max-tokens", type=int, default=512, help="Tokens per model call.")
    parser.add_argument("--use-vllm", action="store_true", help="Generate with vLLM (colocate), on a GPU.")
    parser.add_argument("--output-dir", default="outputs/verifiers_env")
    args = parser.parse_args(argv)
    model, tokenizer = load_model_and_tokenizer(args.model)
    gpu = torch.cuda.is_available()
    config = AgenticGRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.num_generations,
        max_completion_length=args.max_tokens,
        reward_weights=SUITE.reward_weights,  # the rubric's weights, one per reward function
        agent_columns=list(SUITE.agent_columns),  # the environment's rollout reads the row as verifiers gives it
        episode_timeout=300,
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
        agent=SUITE.agent,
        reward_funcs=SUITE.reward_funcs,
        args=config,
        train_dataset=SUITE.build_dataset("train"),
        processing_class=tokenizer,
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


if __name__ == "__main__":
    main()
