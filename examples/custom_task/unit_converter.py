"""A task defined outside trl-agentic: convert lengths with a `convert(value, from_unit, to_unit)` tool.

Copy this file (and `converter_tool.py`) to start your own task. It trains on CPU in ~15 minutes:

```bash
trl-agentic demo --task examples/custom_task/unit_converter.py:TASK            # docs/pipeline.md
trl-agentic demo --task examples/custom_task/unit_converter.py:TASK --smoke    # every stage at toy sizes
```

What the pipeline (`trl_agentic.pipeline`) needs from a task, all in the `TaskSuite` at the bottom:

1. `build_dataset(split, size, seed, **knobs)`: rows with a chat `prompt` (what the agent gets) and the checker's
   columns (`answer`, which the agent never sees). The "train" and "eval" splits share no question: `sample_split`
   puts each question in one split by a hash of its text.
2. `agent`: the agent being trained. Here trl-agentic's `ToolAgent` (the tool schema comes from `convert`'s signature
   and docstring); any `async def agent(client, task)` that talks to `client` (an `openai.AsyncOpenAI`) works.
3. `reward_funcs`: checkers with TRL's signature. The agent's return value (its final text) is `Episode.result`.
4. `demonstrations(n, seed, **knobs)`: a reference solver's successful conversations on training-split questions,
   for the warm start that teaches a tiny model the format before GRPO.
5. `difficulty_levels` (easier and harder than `target_difficulty`): GRPO learns from groups of episodes whose
   rewards differ, and the adaptive sampler sends groups to the level where they do. Held-out success is measured
   at the target level alone.
"""

from __future__ import annotations

import random
import re

import datasets
from converter_tool import METRES, convert

from trl_agentic import ToolAgent
from trl_agentic.tasks import TaskSuite
from trl_agentic.tasks.splits import sample_split


SYSTEM_PROMPT = "Use the convert tool, then reply with 'The answer is X.' where X is its result."
# Unit pairs whose ratio stays within 1000x either way: no answer needs more than 4 digits before the point or after it.
PAIRS = [(a, b) for a in METRES for b in METRES if a != b and 1e-3 <= METRES[a] / METRES[b] <= 1e3]
AGENT = ToolAgent([convert], max_rounds=4)


def make_question(rng: random.Random, digits: int) -> tuple[str, dict]:
    """One question: a `digits`-digit length and a unit pair. Returns its split key (the question) and its row."""
    value = rng.randint(10 ** (digits - 1), 10**digits - 1)
    from_unit, to_unit = rng.choice(PAIRS)
    question = f"Convert {value} {from_unit} to {to_unit}."
    row = {
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
        "value": value,
        "from_unit": from_unit,
        "to_unit": to_unit,
        "answer": value * METRES[from_unit] / METRES[to_unit],  # exact; the checker allows 1%
    }
    return question, row


def build_dataset(split: str = "train", size: int = 256, seed: int = 0, digits: int = 2) -> datasets.Dataset:
    return datasets.Dataset.from_list(sample_split(lambda rng: make_question(rng, digits), split, size, seed))


def within_one_percent(prompts, completions, answer, episodes, **kwargs) -> list[float]:
    """1.0 when the last number of the agent's final answer is within 1% of the exact conversion, else 0.0.

    Episodes that failed (crashed, timed out, hit a limit) are unscorable whatever this returns for them: the trainer
    and `trl-agentic eval` give them `None`.
    """
    rewards = []
    for episode, expected in zip(episodes, answer, strict=True):
        numbers = re.findall(r"-?\d+(?:\.\d+)?", episode.result if isinstance(episode.result, str) else "")
        close = bool(numbers) and abs(float(numbers[-1]) - expected) <= 0.01 * abs(expected)
        rewards.append(1.0 if close else 0.0)
    return rewards


def demonstrations(n: int, seed: int = 0, digits: int = 2) -> list[dict]:
    """The reference solver: question -> `convert` call -> its result -> "The answer is X.", on training questions."""
    result = []
    for row in build_dataset("train", n, seed, digits):
        arguments = {"value": row["value"], "from_unit": row["from_unit"], "to_unit": row["to_unit"]}
        call = {"id": "call_0", "type": "function", "function": {"name": "convert", "arguments": arguments}}
        converted = convert(**arguments)
        messages = row["prompt"] + [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "name": "convert", "content": converted},
            {"role": "assistant", "content": f"The answer is {converted}."},
        ]
        result.append({"messages": messages, "tools": AGENT.tool_schemas})
    return result


TASK = TaskSuite(
    name="unit_converter",
    tools=AGENT.tool_schemas,
    system_prompt=SYSTEM_PROMPT,
    build_dataset=build_dataset,
    agent=AGENT,
    reward_funcs=[within_one_percent],
    demonstrations=demonstrations,
    agent_columns=("prompt",),  # value, units and answer are the checker's
    difficulty_levels={1: {"digits": 1}, 2: {"digits": 2}, 3: {"digits": 3}},
    target_difficulty=2,
)
