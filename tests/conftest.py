"""Shared fixtures of the endpoint tests: a tool-calling tiny model, scripted engines, real servers.

Everything here is built locally (no Hub access) and sized for 2 CPU cores.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import pytest
import torch

from trl_agentic.endpoint.app import EndpointSettings, create_app
from trl_agentic.endpoint.chat import ChatRenderer
from trl_agentic.endpoint.server import EndpointServer
from trl_agentic.generation.engine import GenerationOutput, SamplingParams
from trl_agentic.generation.transformers_engine import TransformersEngine
from trl_agentic.sandbox import bwrap_unavailable
from trl_agentic.sandbox.factory import SANDBOX_ENV
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


# Agents' commands run in the default sandbox (bubblewrap) where it works; on a machine without it the suite opts into
# unsandboxed runs explicitly (tests/test_sandbox.py's bubblewrap tests are skipped there, with the reason).
if bwrap_unavailable() is not None:
    os.environ.setdefault(SANDBOX_ENV, "none")


# The calculator tool as a hand-written agent sends it, and as the OpenAI Agents SDK derives it from
# `@function_tool def calculator(expression: str) -> str: """Evaluate an arithmetic expression."""`.
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "The expression."}},
            "required": ["expression"],
        },
    },
}
CALCULATOR_TOOL_AGENTS_SDK = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "properties": {"expression": {"title": "Expression", "type": "string"}},
            "required": ["expression"],
            "title": "calculator_args",
            "type": "object",
            "additionalProperties": False,
        },
        "strict": True,
    },
}
# The transcripts the tool model learns: (question, [(expression, result), ...], final answer).
TOOL_TASKS = [
    ("What is 2 + 3?", [("2 + 3", "5")], "The answer is 5."),
    ("What is (2 + 3) * 4?", [("2 + 3", "5"), ("5 * 4", "20")], "The answer is 20."),
]
TOOL_SYSTEM_PROMPT = "Use the calculator."


def tool_transcript(question: str, steps: list[tuple[str, str]], answer: str, system: str | None = None) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": question})
    for k, (expression, result) in enumerate(steps):
        call = {
            "id": f"call_{k}",
            "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": expression}},
        }
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": result})
    messages.append({"role": "assistant", "content": answer})
    return messages


def pytest_configure(config):
    """Under pytest-xdist (README's test command: `-n 2`) each worker gets its share of the cores, for its own torch and
    for the processes it starts (`OMP_NUM_THREADS`, inherited): two workers of 2 intra-op threads each on 2 cores
    spin-wait against each other (see `torch_threads`). A user's own `OMP_NUM_THREADS` is left as set."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // int(workers))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


@contextlib.contextmanager
def torch_threads(n: int):
    """Run with `n` intra-op threads. Tiny models gain nothing from more, and in these tests the client, the uvicorn
    thread and the engine thread already share 2 cores: a second OpenMP thread spin-waits against them (measured up
    to 20x slower decoding on a busy 2-core machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def single_torch_thread():
    with torch_threads(1):
        yield


@dataclass
class ToolModel:
    model: torch.nn.Module
    tokenizer: object


def _train_tool_model() -> ToolModel:
    """A tiny qwen2_5 model fine-tuned (plain next-token loss on the assistant tokens) on `TOOL_TASKS`, so that
    greedy decoding reliably calls the calculator, then answers: a random tiny model almost never emits a valid call.

    Measured: 80 AdamW steps at lr 5e-3 on the 4 transcripts (2 tasks x 2 tool schemas) reproduce every assistant
    turn greedily, and 40/40 at temperature 1; 8-18 s on 2 busy CPU cores.
    """
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer("qwen2_5")
    model = build_tiny_model(tokenizer)  # hidden 64, 2 layers: fast enough for the CPU
    renderer = ChatRenderer(tokenizer)
    sequences = []
    for question, steps, answer in TOOL_TASKS:
        for tools in ([CALCULATOR_TOOL], [CALCULATOR_TOOL_AGENTS_SDK]):
            messages = tool_transcript(question, steps, answer, TOOL_SYSTEM_PROMPT)
            ids = renderer.render(messages, tools, add_generation_prompt=False)
            labels = [-100] * len(ids)
            for k, message in enumerate(messages):  # learn the assistant turns only
                if message["role"] == "assistant":
                    start = len(renderer.render(messages[:k], tools, add_generation_prompt=True))
                    end = len(renderer.render(messages[: k + 1], tools, add_generation_prompt=False))
                    labels[start:end] = ids[start:end]
            sequences.append((ids, labels))
    length = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), length), tokenizer.pad_token_id)  # (B, T), right padding
    labels = torch.full((len(sequences), length), -100)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, (ids, row_labels) in enumerate(sequences):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.tensor(row_labels)
        attention_mask[i, : len(ids)] = 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    model.train()
    for _ in range(80):
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return ToolModel(model, tokenizer)


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory) -> ToolModel:
    """The trained tool model, once per test run: under pytest-xdist (`-n 2`) the first worker that needs it trains it
    and saves its weights beside the workers' temporary folders, the others load them (the tokenizer is deterministic)."""
    with torch_threads(1):
        if "PYTEST_XDIST_WORKER" not in os.environ:
            return _train_tool_model()
        from filelock import FileLock

        shared = tmp_path_factory.getbasetemp().parent / "tool_model.pt"  # the run's folder, common to its workers
        with FileLock(f"{shared}.lock"):
            if not shared.is_file():
                tool = _train_tool_model()
                torch.save(tool.model.state_dict(), shared)
                return tool
            tokenizer = build_tiny_tokenizer("qwen2_5")
            model = build_tiny_model(tokenizer)
            model.load_state_dict(torch.load(shared))
            return ToolModel(model.eval(), tokenizer)


class ScriptedEngine:
    """A `GenerationEngine` that answers instantly with text chosen by `respond(prompt_ids) -> str`.

    The text is tokenized and followed by the end-of-turn token, like a model that stops; `max_tokens` truncates it
    (finish "length"). Logprobs are a fixed -0.5. Lets tests drive exact tool calls and reasoning on any template.
    """

    def __init__(self, tokenizer, respond, max_context_length: int = 4096):
        self.tokenizer = tokenizer
        self.respond = respond
        self.max_context_length = max_context_length
        self.policy_version = 0
        self.prompts: list[list[int]] = []

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationOutput:
        self.prompts.append(list(prompt_ids))
        ids = self.tokenizer.encode(self.respond(prompt_ids), add_special_tokens=False) + [self.tokenizer.eos_token_id]
        finish = "stop"
        if len(ids) > sampling.max_tokens:
            ids, finish = ids[: sampling.max_tokens], "length"
        return GenerationOutput(ids, [-0.5] * len(ids), finish)


@pytest.fixture(scope="module")
def start_server():
    """Start real uvicorn endpoints on free loopback ports; all are stopped when the module ends.

    `start_server(engine_or_model, tokenizer, **settings) -> EndpointServer`; a model is wrapped in a
    `TransformersEngine`.
    """
    servers = []

    def start(engine, tokenizer, chat_template_kwargs=None, **settings) -> EndpointServer:
        if isinstance(engine, torch.nn.Module):
            engine = TransformersEngine(engine, pad_token_id=tokenizer.pad_token_id)
        app = create_app(engine, ChatRenderer(tokenizer, chat_template_kwargs), EndpointSettings(**settings))
        server = EndpointServer(app).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        with contextlib.suppress(Exception):
            server.stop()
