"""Train a LangGraph agent (`pip install langgraph langchain-openai`): a graph of a model node and a tool node.

The graph is the one LangGraph's tutorials build (`StateGraph` + `ToolNode` + `tools_condition`); its chat model is
LangChain's `ChatOpenAI`, pointed at the episode the trainer opened.

```bash
python examples/agents/langgraph_agent.py                                                  # tiny model, CPU
python examples/agents/langgraph_agent.py --model Qwen/Qwen3-4B-Instruct-2507 --use-vllm   # one GPU
```
"""

from __future__ import annotations

import argparse

import httpx
import openai
import torch
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

import trl_agentic.tasks.calculator as calculator_task
from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.rewards import cut_off_penalty


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with numbers, + - * / // % and parentheses."""
    return calculator_task.calculator(expression)  # the bundled task's safe evaluator


def build_graph(model: ChatOpenAI):
    """model -> (tools -> model)* -> end: the model node answers or asks for tools, the tool node runs them."""
    model = model.bind_tools([calculator])

    async def call_model(state: MessagesState) -> dict:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([calculator]))  # a tool error goes back to the model as a message
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)  # tool calls -> "tools", otherwise the end
    graph.add_edge("tools", "model")
    return graph.compile()


async def agent(client: openai.AsyncOpenAI, task: dict) -> str:
    """One episode: the graph runs on the episode's address and key, and returns the model's last message."""
    # LangChain builds its own OpenAI client. An HTTP pool per episode: its default one is cached for the process,
    # bound to the first event loop, and each training step runs its episodes on a new loop.
    async with httpx.AsyncClient(trust_env=False) as http:
        model = ChatOpenAI(
            model="policy", base_url=str(client.base_url), api_key=client.api_key, http_async_client=http, max_retries=0
        )
        state = await build_graph(model).ainvoke({"messages": task["prompt"]}, {"recursion_limit": 12})
    return state["messages"][-1].text  # the answer: what the checker reads (`Episode.result`)


def main(argv: list[str] | None = None) -> AgenticGRPOTrainer:
    parser = argparse.ArgumentParser(description="GRPO on a LangGraph agent (calculator task).")
    parser.add_argument("--model", default="tiny:qwen2_5", help="Hub id, path, or tiny:<family> (a local tiny model).")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--num-generations", type=int, default=4, help="Episodes per task (one task per step).")
    parser.add_argument("--max-tokens", type=int, default=256, help="Tokens per model call (max_completion_length).")
    parser.add_argument("--use-vllm", action="store_true", help="Generate with vLLM (colocate), on a GPU.")
    parser.add_argument("--output-dir", default="outputs/langgraph_agent")
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
