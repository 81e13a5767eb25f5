"""The asynchronous producer: episodes of the next generation batches run while the trainer trains (issue 30).

A generation batch is identified by its index `b` and the policy version that will train it, `consume_version`
(the trainer's global step when it consumes the batch). The producer starts the batch's episodes one *unit* at a
time (a group of G episodes of one task, or the whole batch when groups do not fit whole in it), in batch order, and
only when

- the current policy version is at least `consume_version - max_staleness` (pacing: a token sampled now is trained
  within the bound; nothing is generated only to be thrown away), and
- the unit fits in `max_concurrent` running episodes (or nothing runs).

All the episodes of a unit start together, on the same version (`Episode.metadata["start_version"]`). Episodes go on
across weight updates (the engine records the version of each sampled token), so the oldest token of an episode is
at least its start version: admission alone keeps every trained token within the bound.

The producer runs its own event loop in a thread; the trainer talks to it from its own thread (`submit`,
`set_version`, `result`). It never touches the weights: the trainer syncs the engine and then tells the version.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..trace import Episode
from .agents import EpisodeAgent
from .runner import CANCEL_GRACE_S, EpisodeServer, run_episodes
from .tree_groups import TreeSpec, run_tree_groups


@dataclass
class _Batch:
    index: int
    tasks: list[dict[str, Any]]
    group_indices: list[int]
    consume_version: int
    seed: int | None
    units: deque[tuple[int, int]]  # [start, end) of the units not started yet, in order
    episodes: list[Episode | None] = field(default_factory=list)
    running: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    group_size: int = 1  # episodes per group (`unit_size`, or the whole batch): the size of a tree (run_tree_groups)


class RolloutProducer:
    """Run the episodes of submitted generation batches ahead of the trainer, within a staleness bound.

    Args:
        server: the endpoint the agents call (`EndpointServer`).
        agent: the agent (`resolve_agent(...)`).
        max_staleness: most versions between a unit's start and the version that consumes its batch.
        max_concurrent: most episodes running at once (a unit larger than this runs alone).
        timeout: seconds an episode may run (`run_episode`).
        model: model name handed to agents.
        version: the current policy version.
        tree: sample each unit's groups as trees (`rollout_tree`, `rollout/tree_groups.py`): a unit is then whole
            groups (`unit_size` a multiple of the group size), its roots and then its branches, all started under the
            unit's version; `None`: flat groups.

    Example:

    ```python
    >>> producer = RolloutProducer(endpoint, agent, max_staleness=1)
    >>> producer.submit(0, tasks, group_indices, consume_version=0, unit_size=8)
    >>> producer.submit(1, next_tasks, group_indices, consume_version=1, unit_size=8)  # starts at once: 1 - 1 <= 0
    >>> episodes = producer.result(0)  # blocks until batch 0's episodes have ended
    >>> producer.set_version(1)  # after the optimizer step (and the engine's sync)
    ```
    """

    def __init__(
        self,
        server: EpisodeServer,
        agent: EpisodeAgent,
        *,
        max_staleness: int = 1,
        max_concurrent: int = 64,
        timeout: float = 300.0,
        model: str | None = None,
        version: int = 0,
        tree: TreeSpec | None = None,
    ):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}.")
        self.server, self.agent = server, agent
        self.max_staleness, self.max_concurrent = max_staleness, max_concurrent
        self.timeout, self.model = timeout, model
        self.tree = tree
        self._version = version
        self._queue: deque[_Batch] = deque()  # batches with units not started, in index order
        self._batches: dict[int, _Batch] = {}  # submitted and not taken by `result`
        self._running = 0
        self._tasks: set[asyncio.Task] = set()
        self._lock = threading.Lock()  # guards the wait statistics, read from the trainer's thread
        self._idle_since: float | None = None  # nothing running and nothing admissible, since then
        self._idle_s = 0.0
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="trl-agentic-producer", daemon=True)
        self._thread.start()

    # The trainer's side (any thread but the producer's)

    def submit(
        self,
        index: int,
        tasks: list[dict[str, Any]],
        group_indices: list[int],
        consume_version: int,
        unit_size: int,
        seed: int | None = None,
    ) -> None:
        """Queue generation batch `index` (after every batch submitted before it), to be trained at
        `consume_version`. `unit_size`: episodes started together (a group); must divide `len(tasks)`, else the
        batch is one unit. `seed`: the batch's seed (episode `i` samples from `derive_seed(seed, i)`)."""
        if self._closed:
            raise RuntimeError("The producer is closed.")
        n = len(tasks)
        size = unit_size if 0 < unit_size <= n and n % unit_size == 0 else n
        units = deque((start, start + size) for start in range(0, n, size))
        group_size = unit_size if unit_size > 0 else max(n, 1)
        batch = _Batch(
            index, list(tasks), list(group_indices), consume_version, seed, units, [None] * n, group_size=group_size
        )
        if n == 0:
            batch.done.set()
        with self._lock:
            self._batches[index] = batch
        self._loop.call_soon_threadsafe(self._enqueue, batch)

    def set_version(self, version: int) -> None:
        """The policy version is now `version` (the engine serves these weights): admit what it allows."""
        self._loop.call_soon_threadsafe(self._on_version, version)

    def result(self, index: int, timeout: float | None = None) -> tuple[list[Episode], float]:
        """Wait for batch `index`'s episodes to end; returns them (in task order) and the seconds waited."""
        with self._lock:
            batch = self._batches.get(index)
        if batch is None:
            raise KeyError(f"Generation batch {index} was not submitted (or was taken already).")
        started = time.monotonic()
        if not batch.done.wait(timeout):
            raise TimeoutError(f"Generation batch {index} did not end within {timeout} s.")
        waited = time.monotonic() - started
        with self._lock:
            self._batches.pop(index, None)
        if batch.error is not None:
            raise batch.error
        return list(batch.episodes), waited

    def pending(self) -> list[int]:
        """The indices of the batches submitted and not taken, in order."""
        with self._lock:
            return sorted(self._batches)

    @property
    def running(self) -> int:
        """Episodes running now."""
        return self._running

    def take_idle_seconds(self) -> float:
        """Seconds the producer ran no episode because the staleness bound held back what comes next (or nothing
        was submitted), since the last call."""
        with self._lock:
            now = time.monotonic()
            idle = self._idle_s + (now - self._idle_since if self._idle_since is not None else 0.0)
            self._idle_s = 0.0
            if self._idle_since is not None:
                self._idle_since = now
            return idle

    def close(self, grace_s: float = CANCEL_GRACE_S) -> None:
        """Cancel the episodes still running (their episodes are closed as the runner closes them) and stop."""
        if self._closed:
            return
        self._closed = True

        async def cancel_all() -> None:
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=grace_s)

        if self._thread.is_alive():
            future = asyncio.run_coroutine_threadsafe(cancel_all(), self._loop)
            try:
                future.result(timeout=grace_s + 5.0)
            except Exception:  # noqa: BLE001 - closing: an agent that ignores cancellation is abandoned
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5.0)
        for batch in list(self._batches.values()):
            if not batch.done.is_set():
                batch.error = RuntimeError("The producer was closed before this batch ended.")
                batch.done.set()

    # The producer's side (its event loop)

    def _enqueue(self, batch: _Batch) -> None:
        if batch.units:
            self._queue.append(batch)
        self._admit()

    def _on_version(self, version: int) -> None:
        self._version = version
        self._admit()

    def _admit(self) -> None:
        while self._queue and not self._closed:
            batch = self._queue[0]
            if self._version < batch.consume_version - self.max_staleness:
                break  # pacing: started now, its tokens would be trained too late
            start, end = batch.units[0]
            if self._running and self._running + (end - start) > self.max_concurrent:
                break
            batch.units.popleft()
            if not batch.units:
                self._queue.popleft()
            self._start(batch, start, end)
        self._mark_idle()

    def _start(self, batch: _Batch, start: int, end: int) -> None:
        version = self._version
        self._running += end - start
        batch.running += end - start
        task = self._loop.create_task(self._run_unit(batch, start, end, version))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_unit(self, batch: _Batch, start: int, end: int, version: int) -> None:
        try:
            if self.tree is not None:  # the unit's trees: roots, then branches once their parents closed
                episodes = await run_tree_groups(
                    self.server,
                    self.agent,
                    batch.tasks[start:end],
                    batch.group_size,
                    self.tree,
                    max_concurrent=end - start,
                    timeout=self.timeout,
                    model=self.model,
                    seed=batch.seed,
                    first_index=start,
                )
            else:
                episodes = await run_episodes(
                    self.server,
                    self.agent,
                    batch.tasks[start:end],
                    group_indices=batch.group_indices[start:end],
                    max_concurrent=end - start,
                    timeout=self.timeout,
                    model=self.model,
                    seed=batch.seed,
                    first_index=start,
                )
            for i, episode in enumerate(episodes):
                episode.metadata["start_version"] = version
                batch.episodes[start + i] = episode
        except asyncio.CancelledError:  # `close`
            batch.error = batch.error or RuntimeError("The producer was closed before this batch ended.")
            raise
        except Exception as error:  # noqa: BLE001 - a bug, not an agent's failure (those are episodes): `result` raises it
            batch.error = batch.error or error
        finally:
            self._running -= end - start
            batch.running -= end - start
            if batch.error is not None or (not batch.units and batch.running == 0):
                batch.done.set()
            self._admit()

    def _mark_idle(self) -> None:
        with self._lock:
            idle = self._running == 0 and not self._closed
            if idle and self._idle_since is None:
                self._idle_since = time.monotonic()
            elif not idle and self._idle_since is not None:
                self._idle_s += time.monotonic() - self._idle_since
                self._idle_since = None
