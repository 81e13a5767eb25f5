"""Train an agent written with the `anthropic` SDK (`pip install anthropic`): the Messages API, one tool.

The trainer hands an agent an `anthropic` client when its first parameter is annotated as one; the endpoint serves
`/v1/messages` over the same policy, so the agent is written exactly as for Anthropic's API (model name "policy").

```bash
python examples/agents/anthropic_agent.py                                                  # tiny model, CPU
python examples/agents/anthropic_agent.py --model Qwen/Qwen3-4B-Instruct-2507 --use-vllm   # one GPU
```
"""

from __future__ import annotations

import argparse

import anthropic
import torch

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.rewards import cut_off_penalty
from trl_agentic.tasks.calculator import SYSTEM_PROMPT, build_calculator_dataset, calculator, calculator_correct


# The tool as the Messages API describes it; `calculator` (the bundled task's safe evaluator) runs it.
TOOLS = [
    {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with numbers, + - * / // % and parentheses.",
        "input_schema": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. '12 * (3 + 4)'"}},
            "required": ["expression"],
        },
    }
]


async def agent(client: anthropic.AsyncAnthropic, task: dict) -> str:
    """One episode. The annotation `anthropic.AsyncAnthropic` is what makes the trainer pass an anthropic client."""
    # Messages takes the system prompt apart: keep the task's user message, give the system prompt as `system`.
    messages = [m for m in task["prompt"] if m["role"] != "system"]
    for _ in range(6):  # at most 6 model calls
        # max_tokens is required by the API; the trainer's --max-tokens caps it whatever is asked here
        reply = await client.messages.create(
            model="policy", max_tokens=1024, system=SYSTEM_PROMPT, tools=TOOLS, messages=messages
        )
        messages.append({"role": "assistant", "content": reply.content})  # sent back as returned
        if reply.stop_reason != "tool_use":  # "end_turn", or "max_tokens" for an answer cut at the limit
            return "".join(block.text for block in reply.content if block.type == "text")
        results = []
        for block in reply.content:
            if block.type == "tool_use":
                try:
                    output, failed = calculator(**block.input), False
                except Exception as error:  # a bad call is the model's to fix: it reads the error and tries again
                    output, failed = f"Error: {error}", True
                results.append({"type": "tool_result", "tool_use_id": block.id, "content": output, "is_error": failed})
        messages.append({"role": "user", "content": results})
    return ""  # no answer within 6 calls


def main(argv: list[str] | None = None) -> AgenticGRPOTrainer:
    parser = argparse.ArgumentParser(description="GRPO on an anthropic-SDK agent (calculator task).")
    parser.add_argument("--model", default="tiny:qwen2_5", help="Hub id, path, or tiny:<family> (a local tiny model).")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--num-generations", type=int, default=4, help="Episodes per task (one task per step).")
    parser.add_argument("--max-tokens", type=int, default=256, help="Tokens per model call (max_completion_length).")
    parser.add_argument("--use-vllm", action="store_true", help="Generate with vLLM (colocate), on a GPU.")
    parser.add_argument("--output-dir", default="outputs/anthropic_agent")
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
        agent=agent,
        # 1 for the right answer, plus -1 when the last model call was cut at --max-tokens
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
