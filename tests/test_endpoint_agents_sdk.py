"""A real agent framework, unmodified: the OpenAI Agents SDK runs a tool-using task against the endpoint, and every
model call it makes is recorded as a turn continuing the previous one."""

import asyncio
import json

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIProvider,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.models import openai_provider
from openai import AsyncOpenAI

from conftest import CALCULATOR_TOOL_AGENTS_SDK, TOOL_SYSTEM_PROMPT, ScriptedEngine
from trl_agentic.rollout.agents import resolve_agent
from trl_agentic.rollout.rows import episode_to_rows
from trl_agentic.rollout.runner import run_episodes, run_rollout
from trl_agentic.tiny_models import build_tiny_tokenizer


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def server(start_server, tool_model):
    return start_server(tool_model.model, tool_model.tokenizer)


def test_agents_sdk_tool_task(server):
    set_tracing_disabled(True)  # no export to OpenAI's servers
    calls = []

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        calls.append(expression)
        return str(eval(expression, {"__builtins__": {}}))

    # The schema the SDK derives is the one the tool model was fine-tuned with.
    assert calculator.params_json_schema == CALCULATOR_TOOL_AGENTS_SDK["function"]["parameters"]

    session = server.open_episode()
    client = AsyncOpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=60)
    agent = Agent(
        name="calculator agent",
        instructions=TOOL_SYSTEM_PROMPT,
        tools=[calculator],
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
        model_settings=ModelSettings(temperature=0.0, max_tokens=48),
    )
    result = asyncio.run(Runner.run(agent, "What is (2 + 3) * 4?", max_turns=6))
    episode = server.close_episode(session.episode.id, result=result.final_output)

    assert result.final_output == "The answer is 20."
    assert calls == ["2 + 3", "5 * 4"]
    assert episode.status == "ok" and episode.result == "The answer is 20."
    assert len(episode.turns) == 3 and episode.num_tool_calls == 2 and episode.num_forks == 0
    for k, turn in enumerate(episode.turns):
        if k == 0:
            assert turn.prompt_source == "rendered"
            continue
        parent = episode.turns[k - 1]
        assert (turn.prompt_source, turn.parent_turn, turn.fork_reason) == ("continued", k - 1, None)
        assert turn.prompt_ids[: len(parent.prompt_ids) + len(parent.completion_ids)] == (
            parent.prompt_ids + parent.completion_ids
        )
    # What the SDK sent: its own system message, its tool schema (strict), our tool call echoed back, the tool result.
    last = episode.turns[-1]
    assert last.request_messages[0] == {"role": "system", "content": TOOL_SYSTEM_PROMPT}
    assert last.request_tools[0]["function"]["strict"] is True
    echoed = [m for m in last.request_messages if m["role"] == "assistant"]
    returned = [t.response_message for t in episode.turns[:2]]
    assert [m["tool_calls"][0]["id"] for m in echoed] == [m["tool_calls"][0]["id"] for m in returned]
    assert [json.loads(m["tool_calls"][0]["function"]["arguments"]) for m in echoed] == [
        {"expression": "2 + 3"},
        {"expression": "5 * 4"},
    ]
    assert [m["content"] for m in last.request_messages if m["role"] == "tool"] == ["5", "20"]


# The Agents SDK as most agents are written: `Agent(model="policy")` and the two environment variables. Its default
# model provider speaks the Responses API; every call must still continue the previous one token for token.


@pytest.fixture
def default_provider(monkeypatch, request):
    """Point the SDK's default provider at an episode of `server`, as `OPENAI_BASE_URL` / `OPENAI_API_KEY` would.

    The default provider keeps one HTTP pool per process (`openai_provider.shared_http_client`), bound to the event
    loop that first used it; every test here runs its own loop (`asyncio.run`), so each starts with a fresh pool. (A
    command agent is a process of its own; in-process agents pass the client they are handed, see docs/agents.md.)
    """
    monkeypatch.setattr(openai_provider, "_http_client", None)

    def point_at(server):
        session = server.open_episode()
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", session.key)
        return session

    return point_at


def calculator_tool(calls):
    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        calls.append(expression)
        return str(eval(expression, {"__builtins__": {}}))

    return calculator


async def run_default_provider(agent, question, streamed):
    if not streamed:
        return await Runner.run(agent, question, max_turns=6)
    result = Runner.run_streamed(agent, question, max_turns=6)
    kinds = [event.type async for event in result.stream_events()]
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    return result


def assert_episode_continues(episode):
    assert episode.num_forks == 0 and {t.wire_format for t in episode.turns} == {"responses"}
    for k, turn in enumerate(episode.turns[1:], start=1):
        parent = episode.turns[k - 1]
        assert (turn.prompt_source, turn.parent_turn, turn.fork_reason) == ("continued", k - 1, None)
        exact = parent.prompt_ids + parent.completion_ids
        assert turn.prompt_ids[: len(exact)] == exact
    (row,) = episode_to_rows(episode.turns).rows
    assert [t for t, mask in zip(row.completion_ids, row.env_mask) if mask] == [
        t for turn in episode.turns for t in turn.completion_ids
    ]


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_agents_sdk_default_provider_speaks_responses(server, default_provider, streamed):
    """The tool model (Qwen2.5 template) solves the task through `/v1/responses` exactly as through Chat Completions."""
    set_tracing_disabled(True)
    session = default_provider(server)
    calls = []
    agent = Agent(
        name="calculator agent",
        instructions=TOOL_SYSTEM_PROMPT,
        tools=[calculator_tool(calls)],
        model="policy",
        model_settings=ModelSettings(temperature=0.0, max_tokens=48),
    )
    result = asyncio.run(run_default_provider(agent, "What is (2 + 3) * 4?", streamed))
    episode = server.close_episode(session.episode.id, result=result.final_output)

    assert result.final_output == "The answer is 20." and calls == ["2 + 3", "5 * 4"]
    assert len(episode.turns) == 3 and episode.num_tool_calls == 2
    assert_episode_continues(episode)
    last = episode.turns[-1]
    assert last.request_messages[0] == {"role": "system", "content": TOOL_SYSTEM_PROMPT}
    assert last.request_tools == [CALCULATOR_TOOL_AGENTS_SDK]  # the chat shape the tool model was trained on
    assert [m["content"] for m in last.request_messages if m["role"] == "tool"] == ["5", "20"]


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_agents_sdk_default_provider_round_trips_reasoning(start_server, default_provider, streamed):
    """A thinking model (Qwen3 template, scripted): the SDK sends our reasoning items back, and the history still
    continues token for token."""
    set_tracing_disabled(True)
    tokenizer = build_tiny_tokenizer("qwen3")
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
    script = iter([f"<think>\nAdd them.\n</think>\n\n{call}", "<think>\nDone.\n</think>\n\nThe answer is 5."])
    server = start_server(ScriptedEngine(tokenizer, lambda prompt: next(script)), tokenizer)
    session = default_provider(server)
    calls = []
    agent = Agent(
        name="calculator agent", instructions=TOOL_SYSTEM_PROMPT, tools=[calculator_tool(calls)], model="policy"
    )
    result = asyncio.run(run_default_provider(agent, "What is 2 + 3?", streamed))
    episode = server.close_episode(session.episode.id)
    assert result.final_output == "The answer is 5." and calls == ["2 + 3"]
    assert len(episode.turns) == 2
    assert_episode_continues(episode)
    echoed = episode.turns[1].request_messages[2]
    assert echoed["role"] == "assistant" and echoed["reasoning_content"] == "Add them."


def test_agents_sdk_in_process_agent_over_two_rollouts(server):
    """The README's in-process pattern: the agent hands the SDK's default provider the client it is given. Two
    rollouts (two training steps, each on a fresh event loop) both work, and speak the Responses API."""
    set_tracing_disabled(True)

    async def agent(client, task):
        bot = Agent(
            name="calculator agent",
            instructions=TOOL_SYSTEM_PROMPT,
            tools=[calculator_tool([])],
            model="policy",
            model_settings=ModelSettings(temperature=0.0, max_tokens=48),
        )
        run_config = RunConfig(model_provider=OpenAIProvider(openai_client=client))
        return (await Runner.run(bot, task["question"], max_turns=6, run_config=run_config)).final_output

    for _ in range(2):
        (episode,) = run_rollout(run_episodes(server, resolve_agent(agent), [{"question": "What is 2 + 3?"}]))
        assert episode.status == "ok" and episode.result == "The answer is 5."
        assert len(episode.turns) == 2
        assert_episode_continues(episode)
