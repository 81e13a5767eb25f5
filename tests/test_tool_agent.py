"""`ToolAgent` (issue 33, item 4): tools as Python functions, schemas as TRL builds them, the tool loop, tool errors as
text; through the real endpoint with the official `openai` client."""

import asyncio
import json

import pytest
from transformers.utils import get_json_schema

from conftest import ScriptedEngine
from trl_agentic import ToolAgent
from trl_agentic.rollout.agents import resolve_agent
from trl_agentic.rollout.runner import run_episodes
from trl_agentic.tiny_models import build_tiny_tokenizer


RATIOS = {"km": 1000.0, "mi": 1609.344, "m": 1.0}


def convert(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a length between units.

    Args:
        value: The number to convert.
        from_unit: The unit it is in, e.g. "km".
        to_unit: The unit to convert to, e.g. "mi".
    """
    return f"{value * RATIOS[from_unit] / RATIOS[to_unit]:.3f}"


async def lookup(city: str) -> str:
    """Look up a city's distance from Paris in km.

    Args:
        city: The city's name.
    """
    await asyncio.sleep(0)
    return {"Lyon": "392"}[city]


def call(name, arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_tool_agent_runs_python_functions_as_tools_and_returns_errors_as_text(start_server):
    tokenizer = build_tiny_tokenizer("qwen2_5")
    script = iter(
        [
            call("lookup", {"city": "Lyon"}),
            call("lookup", {"city": "Nice"}),  # the async tool raises: KeyError
            call("convert", {"value": 392, "from_unit": "km", "to_unit": "mi"}) + "\n" + call("convert", {"value": 1}),
            "About 243.6 miles.",
        ]
    )
    server = start_server(ScriptedEngine(tokenizer, lambda ids: next(script)), tokenizer)
    agent = ToolAgent([convert, lookup], system_prompt="Use the tools.")
    assert agent.tool_schemas == [get_json_schema(convert), get_json_schema(lookup)]  # TRL's schemas
    task = {"prompt": "How far is Lyon from Paris in miles?"}
    [episode] = asyncio.run(run_episodes(server, resolve_agent(agent), [task], timeout=30))  # as the trainer does
    assert episode.status == "ok", episode.error
    assert episode.result == "About 243.6 miles."
    tools = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert tools == [
        "392",
        "Error: 'Nice'",
        "243.578",
        "Error: bad arguments for tool 'convert': missing a required argument: 'from_unit'. "
        "Expected arguments: (value, from_unit, to_unit).",
    ]
    assert episode.messages[0] == {"role": "system", "content": "Use the tools."}
    assert len(episode.turns) == 4 and episode.num_forks == 0
    assert [t["function"]["name"] for t in episode.turns[0].request_tools] == ["convert", "lookup"]


def test_tools_without_a_schema_fail_with_how_to_fix():
    def undocumented(x):
        return x

    with pytest.raises(ValueError, match="Google-style docstring"):
        ToolAgent([undocumented])
    with pytest.raises(ValueError, match="named function"):
        ToolAgent([lambda x: x])
    with pytest.raises(ValueError, match="at least one"):
        ToolAgent([])
