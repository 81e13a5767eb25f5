"""Run B×G episodes concurrently against the endpoint, with limits; never lose an episode."""

from __future__ import annotations

import asyncio
import time
import traceback
from typing import Any

import httpx

from ..endpoint.server import EndpointServer
from .agents import AgentCrash, EpisodeAgent, EpisodeContext
from ..trace import Episode


async def run_episode(
    server: EndpointServer,
    agent: EpisodeAgent,
    task: dict[str, Any],
    task_index: int = 0,
    group_index: int = 0,
    timeout: float = 300.0,
    model: str = "policy",
    http_client: httpx.AsyncClient | None = None,
) -> Episode:
    """Open an episode, run the agent on `task` until it returns, fails or times out, and close the episode.

    The status is `ok`, `agent_error` (the agent raised or the command exited non-zero), `timeout`, or what the
    endpoint saw (`context_overflow`, `limit_exceeded`). The episode is always closed and returned.
    """
    session = server.open_episode(task_index=task_index, group_index=group_index)
    context = EpisodeContext(server.base_url, session.key, model, timeout, http_client)
    status, result, error, metadata = "ok", None, None, {}
    started = time.monotonic()
    try:
        result = await asyncio.wait_for(agent.run(context, task), timeout=timeout)
    except asyncio.TimeoutError:
        status, error = "timeout", f"episode exceeded {timeout:.1f}s"
    except AgentCrash as crash:
        status, error, metadata = "agent_error", str(crash), crash.metadata
    except Exception as crash:  # noqa: BLE001 - an agent's crash is data, not a trainer failure
        status = "agent_error"
        error = "".join(traceback.format_exception_only(type(crash), crash)).strip()
        metadata = {"traceback": traceback.format_exc()[-4000:]}
    finally:
        episode = server.close_episode(session.episode.id, status=status, result=result, error=error)
    episode.metadata.update(metadata)
    episode.metadata.setdefault("agent_seconds", time.monotonic() - started)
    return episode


async def run_episodes(
    server: EndpointServer,
    agent: EpisodeAgent,
    tasks: list[dict[str, Any]],
    group_indices: list[int] | None = None,
    max_concurrent: int = 64,
    timeout: float = 300.0,
    model: str = "policy",
) -> list[Episode]:
    """Run one episode per entry of `tasks` (a task repeated G times makes a group), at most `max_concurrent` at once.

    Returns the episodes in the order of `tasks`.
    """
    semaphore = asyncio.Semaphore(max_concurrent)
    group_indices = group_indices or [0] * len(tasks)
    limits = httpx.Limits(max_connections=max_concurrent, max_keepalive_connections=max_concurrent)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http_client:

        async def one(i: int) -> Episode:
            async with semaphore:
                return await run_episode(server, agent, tasks[i], i, group_indices[i], timeout, model, http_client)

        return list(await asyncio.gather(*[one(i) for i in range(len(tasks))]))
