"""Train an OpenAI Agents SDK agent (`pip install openai-agents`): the Responses API, the SDK's default.

The agent is written as for OpenAI's servers: an `Agent` with a `@function_tool`, run by `Runner.run`. The only
difference is the client it runs on, the one the trainer hands it, already pointed at its episode.

Answers cut at the token limit: the SDK raises `ModelBehaviorError` on the Responses API's `status: "incomplete"`, so
such an episode ends `agent_error`, which a checker cannot score. `cut_off_penalty` scores it -1 (docs/examples.md):
keep it in `reward_funcs`, or a policy that runs long gets no signal at all.

```bash
python examples/agents/agents_sdk_agent.py                                                     # tiny model, CPU
python examples/agents/agents_sdk_agent.py --model Qwen/Qwen3-4B-Instruct-2507 --use-vllm      # one GPU
```
"""

from __future__ import annotations

import argparse

import openai
import torch
from agents import Agent, OpenAIProvider, RunConfig, Runner, function_tool, set_tracing_disabled

import trl_agentic.tasks.calculator as calculator_task
from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.rewards import cut_off_penalty


set_tracing_disabled(True)  # the SDK would otherwise export every run's trace to OpenAI's servers


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with numbers, + - * / // % and parentheses."""
    return calculator_task.calculator(expression)  # the bundled task's safe evaluator


async def agent(client: openai.AsyncOpenAI, task: dict) -> str:
    """One episode: the SDK runs its tool loop over the Responses API; its final text is what the checker reads."""
    bot = Agent(name="calculator", instructions=calculator_task.SYSTEM_PROMPT, tools=[calculator], model="policy")
    # The SDK's default provider with our client (not OPENAI_BASE_URL): each training step runs on a fresh event loop.
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client))
    question = task["prompt"][-1]["content"]  # the task's user message; the system prompt is the agent's instructions
    result = await Runner.run(bot, question, max_turns=6, run_config=config)
    return result.final_output


def main(argv: list[str] | None = None) -> AgenticGRPOTrainer:
    parser = argparse.ArgumentParser(description="GRPO on an OpenAI Agents SDK agent (calculator task).")
    parser.add_argument("--model", default="tiny:qwen2_5", help="Hub id, path, or tiny:<family> (a local tiny model).")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--num-generations", type=int, default=4, help="Episodes per task (one task per step).")
    parser.add_argument("--max-tokens", type=int, default=256, help="Tokens per model call (max_completion_length).")
    parser.add_argument("--use-vllm", action="store_true", help="Generate with vLLM (colocate), on a GPU.")
    parser.add_argument("--output-dir", default="outputs/agents_sdk_agent")
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
        # 1 for the right answer, plus -1 when the last model call was cut at --max-tokens (the SDK then raised)
        reward_funcs=[calculator_task.calculator_correct, cut_off_penalty],
        args=config,
        train_dataset=calculator_task.build_calculator_dataset("train", size=256),
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


if __name__ == "__main__":
    main()
