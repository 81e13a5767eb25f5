"""Latency task: every step of the agent waits on a slow tool, as real agents wait on a shell command, a test run or a
web call. The task asynchronous rollouts are for (`AgenticGRPOConfig(async_rollouts=True)`): while one batch's
episodes wait on their tools, the trainer trains on the batch before.

Each row asks for the sum of `2` to `4` readings of a `probe` tool. The agent is a harness that runs the probe after
every model call (as a coding harness runs the tests after every edit), waiting `tool_latency` seconds each time;
the model sees each reading as the probe's answer to its call (or as a message from the harness when it made none)
and answers after the last one. The checker compares the last number of that answer with the readings' sum, which
only the tool outputs reveal.

Example:

```python
>>> from trl_agentic.tasks.latency import make_latency_suite
>>> suite = make_latency_suite(tool_latency=2.0)  # get_task("my_module:SLOW") for a module-level suite
>>> row = suite.build_dataset(split="train", size=1)[0]
>>> row["prompt"][-1]["content"], row["readings"], row["answer"]
('Run the probe 3 times and report the sum of its readings.', [3, 9, 4], '16')
```
"""

from __future__ import annotations

import asyncio
import functools
import random
from typing import Any

import datasets

from ..endpoint import SERVED_MODEL_NAME
from ..rollout.tool_loop import ToolLoop
from . import TaskSuite
from .calculator import calculator_correct
from .splits import sample_split


SYSTEM_PROMPT = (
    "You are an agent with a probe. Each time you call the probe tool it returns one reading. Run it as many times as "
    "the user asks, then reply with the sum of the readings."
)

LATENCY_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "probe",
            "description": "Run the probe once and return its reading, a number from 0 to 9.",
            "parameters": {"type": "object", "properties": {}, "required": []},
        },
    }
]

_MESSAGE = {"role": datasets.Value("string"), "content": datasets.Value("string")}
_FEATURES = datasets.Features(
    {"prompt": [_MESSAGE], "readings": datasets.Sequence(datasets.Value("int64")), "answer": datasets.Value("string")}
)


def build_latency_dataset(
    split: str = "train", size: int = 256, seed: int = 0, *, min_calls: int = 2, max_calls: int = 4
) -> datasets.Dataset:
    """Rows with a conversational `prompt`, the probe's `readings` (one per tool call, the agent's) and the `answer`
    (their sum, the checker's). Tasks are keyed by their readings: `"train"` and `"eval"` are disjoint.

    Example:

    ```python
    >>> build_latency_dataset("eval", size=2)["readings"]
    [[7, 2, 5], [2, 2]]
    ```
    """
    if not 1 <= min_calls <= max_calls:
        raise ValueError(f"Need 1 <= min_calls <= max_calls, got min_calls={min_calls}, max_calls={max_calls}.")

    def make_task(rng: random.Random) -> tuple[str, dict[str, Any]]:
        readings = [rng.randint(0, 9) for _ in range(rng.randint(min_calls, max_calls))]
        question = f"Run the probe {len(readings)} times and report the sum of its readings."
        prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        return " ".join(map(str, readings)), {"prompt": prompt, "readings": readings, "answer": str(sum(readings))}

    return datasets.Dataset.from_list(sample_split(make_task, split, size, seed), features=_FEATURES)


async def latency_agent(client: Any, task: dict[str, Any], *, tool_latency: float = 0.5) -> str:
    """The harness: one model call per reading, the probe run after each (`tool_latency` seconds), then the answer.

    A tool call of the model gets the reading as its tool message (further calls in the same turn get an error:
    the probe runs once per turn); a turn without a call gets it as a user message from the harness. So every
    episode makes `len(readings) + 1` model calls and waits `len(readings) * tool_latency` seconds on its tool.

    Example:

    ```python
    >>> await latency_agent(openai.AsyncOpenAI(base_url=..., api_key=...), dataset[0], tool_latency=1.0)
    'The sum is 13.'
    ```
    """
    hooks = _ProbeHarness(task.get("model") or SERVED_MODEL_NAME, list(task["readings"]), tool_latency)
    messages = list(task["prompt"])  # a new list: the dataset row must not grow
    return (await hooks.run(client, messages)).text  # the one tool loop (`rollout/tool_loop.py`)


class _ProbeHarness(ToolLoop):
    """The tool loop's hooks for the latency harness: the probe answers every reply (after `tool_latency` seconds),
    whether it called the tool or not; the reply after the last reading ends the episode."""

    def __init__(self, model: str, readings: list[int], tool_latency: float):
        self.model, self.readings, self.tool_latency = model, readings, tool_latency
        self.given = 0  # readings shown to the model so far

    def request(self) -> dict[str, Any]:
        return {"model": self.model, "tools": LATENCY_TOOLS}

    def is_final(self, message: Any) -> bool:
        return self.given == len(self.readings)

    async def env_response(self, message: Any, response: Any) -> list[dict[str, Any]]:
        reading = self.readings[self.given]
        self.given += 1
        await asyncio.sleep(self.tool_latency)  # the tool runs: a test suite, a build, a web call
        if message.tool_calls:
            return [
                {
                    "role": "tool",
                    "tool_call_id": tool_call.id,
                    "content": str(reading) if position == 0 else "Error: the probe runs once per turn.",
                }
                for position, tool_call in enumerate(message.tool_calls)
            ]
        return [{"role": "user", "content": f"The probe ran: reading {reading}."}]


def latency_demonstrations(n: int, seed: int = 0, *, min_calls: int = 2, max_calls: int = 4) -> list[dict[str, Any]]:
    """Successful conversations (train split): a probe call and its reading per turn, then "The sum is N."."""
    demonstrations = []
    for row in build_latency_dataset("train", n, seed, min_calls=min_calls, max_calls=max_calls):
        messages = list(row["prompt"])
        for index, reading in enumerate(row["readings"]):
            call = {"id": f"call_{index}", "type": "function", "function": {"name": "probe", "arguments": {}}}
            messages += [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"call_{index}", "name": "probe", "content": str(reading)},
            ]
        messages.append({"role": "assistant", "content": f"The sum is {row['answer']}."})
        demonstrations.append({"messages": messages, "tools": LATENCY_TOOLS})
    return demonstrations


def make_latency_suite(tool_latency: float = 0.5, min_calls: int = 2, max_calls: int = 4) -> TaskSuite:
    """The latency [`TaskSuite`]: `min_calls` to `max_calls` probe runs per episode, `tool_latency` seconds each.

    Args:
        tool_latency: seconds each probe run takes (awaited: other episodes go on meanwhile).
        min_calls, max_calls: readings (tool runs) per task, drawn uniformly.
    """
    if tool_latency < 0:
        raise ValueError(f"tool_latency must be >= 0 seconds, got {tool_latency}.")
    knobs = {"min_calls": min_calls, "max_calls": max_calls}
    if not 1 <= min_calls <= max_calls:  # checked now, not at the first build
        raise ValueError(f"Need 1 <= min_calls <= max_calls, got min_calls={min_calls}, max_calls={max_calls}.")

    async def agent(client: Any, task: dict[str, Any]) -> str:
        return await latency_agent(client, task, tool_latency=tool_latency)

    agent.__name__ = agent.__qualname__ = "latency_agent"
    return TaskSuite(
        name="latency",
        tools=LATENCY_TOOLS,
        system_prompt=SYSTEM_PROMPT,
        build_dataset=functools.partial(build_latency_dataset, **knobs),
        agent=agent,
        reward_funcs=[calculator_correct],  # the last number of the answer against `answer`
        demonstrations=functools.partial(latency_demonstrations, **knobs),
        agent_columns=("prompt", "readings"),  # the probe's readings are the environment's; `answer` the checker's
    )


LATENCY = make_latency_suite()
