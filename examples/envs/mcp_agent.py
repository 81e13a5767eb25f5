"""Train an agent whose tools come from an MCP server (`pip install 'trl-agentic[mcp]'`).

The server is in this file (`python examples/envs/mcp_agent.py serve` runs it alone, on stdio): a counter with
`increment` and `read`. The task: "Increment the counter by A, then by B, and say its value." A fresh server per
episode is what makes the checker's answer right: with a shared counter, every episode would start where the last
one stopped. [`MCPAgent`] starts one per episode, offers its tools to the model, runs the calls it makes, and returns
the final text and the tool call log, which the checker reads (`episode.result`).

```bash
python examples/envs/mcp_agent.py --model Qwen/Qwen3-4B-Instruct-2507 --use-vllm    # one GPU
python examples/envs/mcp_agent.py --model tiny:qwen2_5 --steps 1 --max-tokens 32      # CPU smoke run
trl-agentic eval --task examples/envs/mcp_agent.py:SUITE --model tiny:qwen2_5 --size 4 --num-samples 2
```

Trust model and settings: docs/envs_mcp.md.
"""

from __future__ import annotations

import sys


def serve() -> None:
    """The MCP server: one counter per process, so one per episode."""
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("counter", instructions="A counter that starts at 0.")
    state = {"value": 0}

    @server.tool()
    def increment(by: int = 1) -> int:
        """Add `by` to the counter and return its new value."""
        state["value"] += by
        return state["value"]

    @server.tool()
    def read() -> int:
        """Return the counter's value."""
        return state["value"]

    server.run("stdio")


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    # Before the imports below: the server is started once per episode and needs nothing of torch.
    serve()
    sys.exit(0)

import argparse  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402

from trl_agentic.envs import MCPAgent  # noqa: E402
from trl_agentic.rewards.utils import episode_for, is_scorable  # noqa: E402
from trl_agentic.tasks import TaskSuite  # noqa: E402
from trl_agentic.tasks.splits import sample_split  # noqa: E402


SYSTEM_PROMPT = "You have a counter. Use its tools, then answer with its final value."

# The agent: this file's server over stdio, one per episode (the default); the trainer's environment is not passed.
AGENT = MCPAgent(servers={"counter": [sys.executable, __file__, "serve"]}, max_turns=6)


def build_dataset(split: str = "train", size: int = 256, seed: int = 0):
    """Rows with a conversational `prompt` and the checker's `answer`; train and eval never share a question."""
    import datasets

    def make_task(rng: random.Random):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        return f"{a},{b}", {
            "prompt": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"Increment the counter by {a}, then by {b}, and tell me its value."},
            ],
            "answer": a + b,
        }

    return datasets.Dataset.from_list(sample_split(make_task, split, size, seed))


def counter_correct(prompts, completions, answer, **kwargs) -> list[float | None]:
    """1.0 when the counter reached the answer and the final text says it; None for a failed episode."""
    rewards = []
    for index, expected in enumerate(answer):
        episode = episode_for(kwargs, index)
        if not is_scorable(episode):
            rewards.append(None)
            continue
        reached = any(call["content"] == str(expected) for call in episode.result["tool_calls"])
        said = str(expected) in re.findall(r"-?\d+", episode.result["text"])
        rewards.append(1.0 if reached and said else 0.0)
    return rewards


SUITE = TaskSuite(
    name="mcp_counter",
    tools=[],  # the MCP server's, listed by the agent each episode
    system_prompt=SYSTEM_PROMPT,
    build_dataset=build_dataset,
    agent=AGENT,
    reward_funcs=[counter_correct],
    demonstrations=lambda n, seed=0: [],  # none: no SFT warm start for this example
)


def main(argv: list[str] | None = None):
    import torch

    from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
    from trl_agentic.tiny_models import load_model_and_tokenizer

    parser = argparse.ArgumentParser(description="GRPO on a counter task whose tools are an MCP server's.")
    parser.add_argument("--model", default="Qwen/Qwen3-4B-Instruct-2507", help="Hub id, path, or tiny:<family>.")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--num-generations", type=int, default=8, help="Episodes per task (one task per step).")
    parser.add_argument("--max-tokens", type=int, default=512, help="Tokens per model call.")
    parser.add_argument("--use-vllm", action="store_true", help="Generate with vLLM (colocate), on a GPU.")
    parser.add_argument("--output-dir", default="outputs/mcp_counter")
    args = parser.parse_args(argv)
    model, tokenizer = load_model_and_tokenizer(args.model)
    gpu = torch.cuda.is_available()
    config = AgenticGRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.num_generations,
        max_completion_length=args.max_tokens,
        max_turns=AGENT.max_turns,
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
        agent=AGENT,
        reward_funcs=SUITE.reward_funcs,
        args=config,
        train_dataset=build_dataset("train"),
        processing_class=tokenizer,
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


if __name__ == "__main__":
    main()
