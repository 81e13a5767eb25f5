"""Train an agent written in another language: a Node.js script (node_agent.mjs), run as a command per episode.

Any program that speaks the OpenAI (or Anthropic) API over HTTP can be trained: `CommandAgent` runs it once per
episode with `OPENAI_BASE_URL`, `OPENAI_API_KEY` and `OPENAI_MODEL` pointing at the episode, the task as JSON in
`TRL_AGENTIC_TASK` (and on stdin), in a minimal environment (no trainer secrets). What it prints last as a JSON line
is the episode's result; a non-zero exit is a failed episode.

```bash
python examples/agents/node_agent.py                                                       # tiny model, CPU
python examples/agents/node_agent.py --model Qwen/Qwen3-4B-Instruct-2507 --use-vllm        # one GPU
```
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import torch

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer, CommandAgent
from trl_agentic.rewards import cut_off_penalty
from trl_agentic.tasks.calculator import build_calculator_dataset, calculator_correct


SCRIPT = Path(__file__).resolve().with_name("node_agent.mjs")


def main(argv: list[str] | None = None) -> AgenticGRPOTrainer:
    parser = argparse.ArgumentParser(description="GRPO on a Node.js agent run as a command (calculator task).")
    parser.add_argument("--model", default="tiny:qwen2_5", help="Hub id, path, or tiny:<family> (a local tiny model).")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--num-generations", type=int, default=4, help="Episodes per task (one task per step).")
    parser.add_argument("--max-tokens", type=int, default=256, help="Tokens per model call (max_completion_length).")
    parser.add_argument("--node", default="node", help="The Node.js executable.")
    parser.add_argument("--use-vllm", action="store_true", help="Generate with vLLM (colocate), on a GPU.")
    parser.add_argument("--output-dir", default="outputs/node_agent")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    config = AgenticGRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.num_generations,
        max_completion_length=args.max_tokens,
        learning_rate=1e-6,
        log_episodes=True,  # output_dir/episodes/*.jsonl: every episode, its rewards and the rows trained
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=gpu,
        use_cpu=not gpu,
        use_vllm=args.use_vllm,
        vllm_mode="colocate",
    )
    trainer = AgenticGRPOTrainer(
        args.model,
        agent=CommandAgent(f"{shlex.quote(args.node)} {shlex.quote(str(SCRIPT))}"),
        # 1 for the right answer, plus -1 when the last model call was cut at --max-tokens. The checker reads the
        # episode's last assistant message (the command's result is a dict: {"result": {"answer": ...}, ...}).
        reward_funcs=[calculator_correct, cut_off_penalty],
        args=config,
        train_dataset=build_calculator_dataset("train", size=256),  # columns: prompt, expression, answer
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


if __name__ == "__main__":
    main()
