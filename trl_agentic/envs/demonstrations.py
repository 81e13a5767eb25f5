"""Demonstrations from a scripted solver: the suite's own agent plays against the real environment, with the solver
answering in place of the model, and the successful conversations become the warm start's demonstrations.

Any [`TaskSuite`] whose agent talks through `client.chat.completions.create` (an [`EnvironmentAgent`] from
`environment_suite` or `gym_text_suite`, the verifiers, OpenEnv and MCP agents, a `ToolAgent`) gets a reference solver
this way, so `trl-agentic demo --task` can warm-start it: `with_solver(suite, solver)`.

A solver is `solver(messages, tools) -> reply`: `messages` the conversation so far (as the agent sends it), `tools` the
tool schemas it sends (`[]` for none); `reply` the next assistant message, as one of

- a string: a text answer (no tool call);
- a dict `{"name": ..., "arguments": {...}}`: one tool call;
- a list of such dicts: several tool calls in one message.

Example:

```python
>>> def solver(messages, tools):
...     return {"name": "add", "arguments": {"a": 2, "b": 3}} if messages[-1]["role"] == "user" else "5"
>>> suite = with_solver(environment_suite(AddEnv, eval_rows, train_dataset=train_rows), solver)
>>> suite.demonstrations(2)[0]["messages"][1]["tool_calls"][0]["function"]
{'name': 'add', 'arguments': {'a': 2, 'b': 3}}
```
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import uuid
from collections.abc import Callable
from typing import Any

from ..endpoint import SERVED_MODEL_NAME
from ..trace import Episode


# `solver(messages, tools) -> str | {"name", "arguments"} | [{"name", "arguments"}, ...]`
Solver = Callable[[list[dict[str, Any]], list[dict[str, Any]]], Any]

# How many rows are tried per demonstration wanted before giving up (a solver that wins a third of the time still
# fills its quota).
ATTEMPTS_PER_DEMONSTRATION = 4


class ScriptedClient:
    """An `openai.AsyncOpenAI` stand-in whose replies come from a scripted solver, not a model: what the suite's agent
    plays against when [`record_demonstrations`] records the solver's play. It answers `chat.completions.create` with
    real `openai` `ChatCompletion` objects and keeps the last call's messages and tools (the conversation)."""

    def __init__(self, solver: Solver):
        self.solver = solver
        self.messages: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] = []
        self.calls = 0
        self.chat = self  # `client.chat.completions.create`
        self.completions = self

    async def create(self, *, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **kwargs):
        from openai.types.chat import ChatCompletion

        messages = [dict(m) for m in messages]
        reply = self.solver(messages, list(tools or []))
        if inspect.isawaitable(reply):
            reply = await reply
        message = _assistant_message(reply, self.calls)
        self.calls += 1
        self.messages, self.tools = [*map(_dict_arguments, messages), message], list(tools or [])
        wire = dict(message)
        if wire.get("tool_calls"):
            wire["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": json.dumps(call["function"]["arguments"])}}
                for call in wire["tool_calls"]
            ]
        return ChatCompletion.model_validate(
            {
                "id": f"scripted-{self.calls}",
                "object": "chat.completion",
                "created": 0,
                "model": kwargs.get("model") or SERVED_MODEL_NAME,
                "choices": [
                    {"index": 0, "finish_reason": "tool_calls" if wire.get("tool_calls") else "stop", "message": wire}
                ],
            }
        )


def _dict_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with its tool calls' arguments as dicts (the agent sends them back as the JSON text it received)."""
    calls = message.get("tool_calls") if message.get("role") == "assistant" else None
    if not calls:
        return message
    decoded = []
    for call in calls:
        call = dict(call)
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            function["arguments"] = json.loads(function["arguments"] or "{}")
        call["function"] = function
        decoded.append(call)
    return {**message, "tool_calls": decoded}


def _assistant_message(reply: Any, turn: int) -> dict[str, Any]:
    """The solver's reply as an assistant message, tool-call arguments as dicts (what chat templates expect)."""
    if isinstance(reply, str):
        return {"role": "assistant", "content": reply}
    calls = [reply] if isinstance(reply, dict) else reply
    if not isinstance(calls, list) or not calls or not all(isinstance(c, dict) and "name" in c for c in calls):
        raise ValueError(
            f"The solver returned {reply!r}: expected a text answer (a str), a tool call {{'name': ..., "
            "'arguments': {...}}, or a list of tool calls."
        )
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": f"call_{turn}_{index}",
                "type": "function",
                "function": {"name": call["name"], "arguments": dict(call.get("arguments") or {})},
            }
            for index, call in enumerate(calls)
        ],
    }


async def _play(suite: Any, solver: Solver, row: dict[str, Any]) -> tuple[dict[str, Any], Episode, ScriptedClient]:
    task = {column: row[column] for column in suite.agent_columns if column in row}
    client = ScriptedClient(solver)
    episode = Episode(id=f"demo-{uuid.uuid4().hex[:8]}", status="ok", metadata={"task": task})
    try:
        episode.result = await suite.agent(client, task)
    except Exception as error:  # noqa: BLE001 - the solver's play failed: not a demonstration
        episode.status, episode.error = "agent_error", str(error)
    episode.messages = client.messages
    return task, episode, client


def record_demonstrations(
    suite: Any,
    solver: Solver,
    n: int,
    seed: int = 0,
    *,
    success_threshold: float = 1.0,
    concurrency: int = 16,
    **knobs: Any,
) -> list[dict[str, Any]]:
    """Play `solver` through `suite.agent` against the real environment on training-split tasks
    (`suite.build_dataset(split="train", ...)`) and return `n` successful conversations as demonstrations
    (`{"messages": [...], "tools": [...]}`, tool-call arguments as dicts), what `TaskSuite.demonstrations` returns.

    An episode counts when the suite's checkers give it at least `success_threshold` (as [`Evaluator`] counts success);
    failed plays are left out. Episodes run `concurrency` at a time, as training runs them. Raises a `ValueError` when
    the solver does not succeed at all, or on too few tasks (`n` wanted, `4 * n` tried).

    Args:
        suite: a [`TaskSuite`] whose agent calls `client.chat.completions.create`.
        solver: `solver(messages, tools) -> reply` (the module's docstring).
        n, seed: demonstrations wanted; the seed of the training-split tasks drawn.
        knobs: the suite's difficulty knobs, passed to `build_dataset`.
    """
    if n <= 0:
        return []
    rows = list(suite.build_dataset(split="train", size=n * ATTEMPTS_PER_DEMONSTRATION, seed=seed, **knobs))

    async def play_all():
        demonstrations: list[dict[str, Any]] = []
        tried = 0
        for start in range(0, len(rows), concurrency):
            chunk = rows[start : start + concurrency]
            played = await asyncio.gather(*(_play(suite, solver, row) for row in chunk))
            tried += len(chunk)
            for task, episode, client in played:
                if episode.status != "ok" or not client.messages:
                    continue
                prompt = task.get("prompt") or []
                reward = await _areward(suite, task, episode, client.messages[len(prompt) :])
                if reward is not None and reward >= success_threshold:
                    demonstrations.append({"messages": client.messages, "tools": client.tools})
            if len(demonstrations) >= n:
                break
        return demonstrations, tried

    demonstrations, tried = asyncio.run(play_all())
    if len(demonstrations) < n:
        raise ValueError(
            f"The solver succeeded on {len(demonstrations)} of {tried} training-split tasks of {suite.name!r}; "
            f"{n} demonstrations were asked for. Check the solver against the environment (a success is a reward of "
            f"at least {success_threshold} from the suite's checkers), or ask for fewer (--set num_demonstrations=)."
        )
    return demonstrations[:n]


async def _areward(suite: Any, task: dict[str, Any], episode: Episode, completion: list[dict[str, Any]]):
    weights = suite.reward_weights or [1.0] * len(suite.reward_funcs)
    columns = {k: [v] for k, v in task.items() if k not in ("prompt", "completion", "completion_ids")}
    total, scored = 0.0, False
    for func, weight in zip(suite.reward_funcs, weights, strict=True):
        value = func(
            prompts=[task.get("prompt")],
            completions=[completion],
            completion_ids=[[]],
            episodes=[episode],
            trainer_state=None,
            log_extra=lambda *a, **k: None,
            log_metric=lambda *a, **k: None,
            **columns,
        )
        if inspect.isawaitable(value):
            value = await value
        if value[0] is not None:
            total, scored = total + weight * float(value[0]), True
    return total if scored else None


def with_solver(suite: Any, solver: Solver, *, success_threshold: float = 1.0) -> Any:
    """`suite` with `demonstrations` recorded from `solver`'s play ([`record_demonstrations`]): a reference solver
    for any suite (an environment adapter's included), so `trl-agentic demo --task` can warm-start it.

    Example:

    ```python
    >>> TASK = with_solver(environment_suite(MyEnv, eval_rows, train_dataset=train_rows), my_solver)
    ```
    """

    def demonstrations(n: int, seed: int = 0, **knobs: Any) -> list[dict[str, Any]]:
        return record_demonstrations(suite, solver, n, seed, success_threshold=success_threshold, **knobs)

    return dataclasses.replace(suite, demonstrations=demonstrations)


__all__ = ["ScriptedClient", "Solver", "record_demonstrations", "with_solver"]
