"""Branch episodes: run an agent again on a recorded episode's task, replaying its first `k` model calls, then
sampling fresh (`docs/tree_rollouts.md`).

The endpoint replays the calls (`trace.ReplaySpec`: each request must render to the recorded prompt, token for
token), so any agent can be branched, black box or not; for the project's own tool loop (`ToolAgent`, `MCPAgent`,
the `environment_factory` and OpenEnv agents) the recorded tool results are replayed too (`tool_loop.ToolReplay`), so
tools with side effects are not run again and their branches never diverge.

Example:

```python
>>> parent = run_rollout(run_episode(server, agent, task, seed=1))
>>> branch = branch_episode(server, agent, task, parent, 2, seed=2)
>>> branch.replay["replayed_calls"], branch.turns[1].completion_ids == parent.turns[1].completion_ids
(2, True)
```
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ..trace import Episode, ReplaySpec, Turn
from .agents import EpisodeAgent
from .runner import EpisodeServer, run_episode, run_rollout
from .tool_loop import ToolReplay


def tool_replay(episode: Episode, branch_point: int) -> ToolReplay:
    """The tool results of `episode`'s main line by call index, for a branch at endpoint call `branch_point`.

    The main line is the episode's task conversation (`Turn.role == "main"`, decided by lineage at close; every turn
    when roles are not set). The answer to reply `j` is what the next call of the main line added after it (tool
    results, an observation); `None` when that call did not continue the reply (a rewritten history) or there is none.
    `until` counts the main-line calls among the first `branch_point` calls of the episode.
    """
    calls = [turn for turn in episode.turns if turn.finish_reason != "cancelled"]
    replayed = {id(turn) for turn in calls[:branch_point]}
    main = [turn for turn in calls if turn.role in (None, "main")]
    replies = [turn.response_message for turn in main]
    answers: list[list[dict[str, Any]] | None] = [_answer(turn, after) for turn, after in zip(main, main[1:])]
    answers.append(None)
    until = sum(id(turn) in replayed for turn in main)
    return ToolReplay(replies, answers, until)


def _answer(turn: Turn, after: Turn) -> list[dict[str, Any]] | None:
    n = len(turn.request_messages)
    following = after.request_messages
    if len(following) <= n + 1 or following[n].get("role") != "assistant":
        return None
    return following[n + 1 :]


async def run_branch(
    server: EpisodeServer,
    agent: EpisodeAgent,
    task: dict[str, Any],
    parent: Episode,
    branch_point: int,
    *,
    timeout: float = 300.0,
    seed: int | None = None,
    group_index: int | None = None,
    model: str | None = None,
) -> Episode:
    """Run one branch of `parent` from its call `branch_point` (`branch_episode`, on the caller's event loop)."""
    replay = ReplaySpec.from_episode(parent, branch_point)
    return await run_episode(
        server,
        agent,
        task,
        parent.task_index,
        parent.group_index if group_index is None else group_index,
        timeout,
        model,
        seed=seed,
        replay=replay,
        tool_replay=tool_replay(parent, branch_point),
    )


@dataclass
class Branch:
    """One branch to run (`run_branches`): `parent` (a recorded episode of `task`) from its call `branch_point`, with
    the branch's own `seed` and `group_index` (default: the parent's)."""

    task: dict[str, Any]
    parent: Episode
    branch_point: int
    seed: int | None = None
    group_index: int | None = None


async def run_branches(
    server: EpisodeServer,
    agent: EpisodeAgent,
    branches: list[Branch],
    *,
    max_concurrent: int = 64,
    timeout: float = 300.0,
    model: str | None = None,
) -> list[Episode]:
    """Run `branches` concurrently, at most `max_concurrent` at once (each agent on a loop and thread of its own, as
    `run_episodes`); returns their episodes in the order of `branches`."""
    semaphore = asyncio.Semaphore(max_concurrent)

    async def one(branch: Branch) -> Episode:
        async with semaphore:
            return await run_branch(
                server,
                agent,
                branch.task,
                branch.parent,
                branch.branch_point,
                timeout=timeout,
                seed=branch.seed,
                group_index=branch.group_index,
                model=model,
            )

    return list(await asyncio.gather(*[one(branch) for branch in branches]))


def branch_episode(
    server: EpisodeServer,
    agent: EpisodeAgent,
    task: dict[str, Any],
    parent: Episode,
    branch_point: int,
    *,
    timeout: float = 300.0,
    seed: int | None = None,
    group_index: int | None = None,
    model: str | None = None,
) -> Episode:
    """Run `agent` on `task` again as a branch of the recorded `parent`: its model calls `0 .. branch_point - 1` are
    answered with the parent's recorded completions (checked token for token, `trace.ReplaySpec`), its tool loop
    (when it is the project's) gets the parent's tool results for them, and from call `branch_point` on it samples.

    Synchronous (a fresh event loop, `run_rollout`). Returns the branch `Episode`; `episode.replay` says how many calls
    were replayed and whether (and why) replay diverged; `Turn.replayed` marks the replayed turns.

    Args:
        server: the endpoint (an `EndpointServer`) the parent was recorded on, or one serving the same tokenizer.
        agent: the agent that ran the parent.
        task: the parent's task.
        parent: the recorded episode.
        branch_point: the first call sampled fresh, in `[0, len(parent.turns)]` (cancelled calls not counted).
        timeout: the branch's timeout (seconds).
        seed: the branch's seed (its sampled calls' seeds derive from it); give each branch its own.
        group_index: the branch's group index (default: the parent's).
        model: the model name handed to the agent (default: the one the server answers to).
    """
    return run_rollout(
        run_branch(
            server, agent, task, parent, branch_point, timeout=timeout, seed=seed, group_index=group_index, model=model
        )
    )


__all__ = ["Branch", "branch_episode", "run_branch", "run_branches", "tool_replay"]
