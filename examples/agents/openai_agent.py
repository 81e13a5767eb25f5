"""Train an agent written with the `openai` client: Chat Completions, one tool, the usual tool-call loop.

This is the loop most agents run: call the model, run the tool calls it makes, send the results back, repeat until it
answers. `trl_agentic.ToolAgent([calculator])` is the same loop in one line; write your own when your agent does more.

```bash
python examples/agents/openai_agent.py                                                     # tiny model, CPU
python examples/agents/openai_agent.py --model Qwen/Qwen3-4B-Instruct-2507 --use-vllm      # one GPU
```
"""

from __future__ import annotations

import argparse
import json

import openai
import torch

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.rewards import cut_off_penalty
from trl_agentic.tasks.calculator import build_calculator_dataset, calculator, calculator_correct


# The tool as the OpenAI API describes it; `calculator` (the bundled task's safe evaluator) runs it.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with numbers, + - * / // % and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. '12 * (3 + 4)'"}},
                "required": ["expression"],
            },
        },
    }
]


async def agent(client: openai.AsyncOpenAI, task: dict) -> str:
    """One episode. `client` already points at this episode's endpoint; the model is called "policy"."""
    messages = list(task["prompt"])  # the dataset row's system + user messages (a copy: the row must not grow)
    for _ in range(6):  # at most 6 model calls
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_unset=True))  # sent back as returned: the next call continues it
        if not message.tool_calls:
            return message.content or ""  # the answer: what the checker reads (`Episode.result`)
        for call in message.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except Exception as error:  # a bad call is the model's to fix: it reads the error and tries again
                result = f"Error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return message.content or ""


def main(argv: list[str] | None = None) -> AgenticGRPOTrainer:
    parser = argparse.ArgumentParser(description="GRPO on an openai-client agent (calculator task).")
    parser.add_argument("--model", default="tiny:qwen2_5", help="Hub id, path, or tiny:<family> (a local tiny model).")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--num-generations", type=int, default=4, help="Episodes per task (one task per step).")
    parser.add_argument("--max-tokens", type=int, default=256, help="Tokens per model call (max_completion_length).")
    parser.add_argument("--use-vllm", action="store_true", help="Generate with vLLM (colocate), on a GPU.")
    parser.add_argument("--output-dir", default="outputs/openai_agent")
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
