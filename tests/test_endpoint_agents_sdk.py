"""A real agent framework, unmodified: the OpenAI Agents SDK runs a tool-using task against the endpoint, and every
model call it makes is recorded as a turn continuing the previous one."""

import asyncio
import json

import pytest
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

from conftest import CALCULATOR_TOOL_AGENTS_SDK, TOOL_SYSTEM_PROMPT


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
            parent.prompt_ids + parent.completion_ids)
    # What the SDK sent: its own system message, its tool schema (strict), our tool call echoed back, the tool result.
    last = episode.turns[-1]
    assert last.request_messages[0] == {"role": "system", "content": TOOL_SYSTEM_PROMPT}
    assert last.request_tools[0]["function"]["strict"] is True
    echoed = [m for m in last.request_messages if m["role"] == "assistant"]
    returned = [t.response_message for t in episode.turns[:2]]
    assert [m["tool_calls"][0]["id"] for m in echoed] == [m["tool_calls"][0]["id"] for m in returned]
    assert [json.loads(m["tool_calls"][0]["function"]["arguments"]) for m in echoed] == [
        {"expression": "2 + 3"}, {"expression": "5 * 4"}]
    assert [m["content"] for m in last.request_messages if m["role"] == "tool"] == ["5", "20"]
