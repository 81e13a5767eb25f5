"""Run B×G episodes concurrently against the endpoint, with limits; never lose an episode."""

from __future__ import annotations

import asyncio
import time
import traceback
from typing import Any, Protocol

import httpx

from ..trace import Episode
from .agents import AgentCrash, EpisodeAgent, EpisodeContext


class EpisodeServer(Protocol):
    """What the runner needs from an endpoint (`trl_agentic.endpoint.server.EndpointServer` is one): open an episode,
    say where agents reach it and which model name they send, and close it into the recorded `Episode`.

    A protocol rather than an import, so that `rollout/` does not depend on `endpoint/` (they meet in `trace.py`).
    """

    @property
    def base_url(self) -> str: ...

    @property
    def served_model_name(self) -> str: ...

    def open_episode(self, task_index: int = 0, group_index: int = 0) -> Any:
        """Returns a session with the episode's `key` and `episode.id`."""

    def close_episode(self, episode_id: str, status: str | None = None, result: Any = None,
                      error: str | None = None) -> Episode: ...


async def run_episode(
    server: EpisodeServer,
    agent: EpisodeAgent,
    task: dict[str, Any],
    task_index: int = 0,
    group_index: int = 0,
    timeout: float = 300.0,
    model: str | None = None,
    http_client: httpx.AsyncClient | None = None,
) -> Episode:
    """Open an episode, run the agent on `task` until it returns, fails or times out, and close the episode.

    The status is `ok`, `agent_error` (the agent raised or the command exited non-zero), `timeout`, or what the
    endpoint saw (`context_overflow`, `limit_exceeded`). The episode is always closed and returned. `model` is the
    name handed to the agent (default: the one the server answers to).
    """
    session = server.open_episode(task_index=task_index, group_index=group_index)
    context = EpisodeContext(server.base_url, session.key, model or server.served_model_name, timeout, http_client)
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
    server: EpisodeServer,
    agent: EpisodeAgent,
    tasks: list[dict[str, Any]],
    group_indices: list[int] | None = None,
    max_concurrent: int = 64,
    timeout: float = 300.0,
    model: str | None = None,
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
