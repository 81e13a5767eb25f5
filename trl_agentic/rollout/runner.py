"""Run B×G episodes concurrently against the endpoint, with limits; never lose an episode.

An episode's timeout bounds the rollout whatever the agent does (issue #9): the clock starts when the episode starts
(not while it waits for a concurrency slot); at the deadline the agent is cancelled and given `CANCEL_GRACE_S` to
end, after which it is abandoned (status `timeout`, `metadata["abandoned"] = True`) rather than awaited: a sync agent's
thread is left blocked, an async agent that swallows `CancelledError` is never run again once `run_rollout` returns.

Each agent runs on an event loop of its own, in a daemon thread of its own (issue 40): an `async def` agent is still
code we do not trust, and one blocking call in it (`time.sleep`, `requests.get`, `subprocess.run`) blocked the loop of
every episode of the rollout, past every timeout; its `sys.exit()` (a CLI's `main()`) stopped that loop, which raised
`SystemExit` out of a synchronous rollout and silently stopped the asynchronous producer. On a loop of its own, what
blocks it blocks only its episode, whose deadline the runner keeps from outside; `SystemExit` ends that episode as an
`agent_error`. The agent's `asyncio.to_thread` calls (an environment's sync `reset` and tools) get a daemon thread each
instead of the loop's small default pool, which hung calls filled for good under asynchronous rollouts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import ssl
import threading
import time
import traceback
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

import httpx

from ..generation.engine import derive_seed
from ..trace import Episode, ReplaySpec
from .agents import AgentCrash, EpisodeAgent, EpisodeContext
from .tool_loop import TOOL_REPLAY, ToolReplay


# Seconds a timed-out agent gets to end after it is cancelled (a command agent's process group is killed at once);
# then it is abandoned, never awaited.
CANCEL_GRACE_S = 1.0

_abandoned_lock = threading.Lock()
_abandoned_threads: list[threading.Thread] = []  # agents' threads left behind on a timeout (`abandoned_agent_threads`)

T = TypeVar("T")


class EpisodeServer(Protocol):
    """What the runner needs from an endpoint (`trl_agentic.endpoint.server.EndpointServer` is one): open an episode,
    say where agents reach it and which model name they send, and close it into the recorded `Episode`.

    A protocol rather than an import, so that `rollout/` does not depend on `endpoint/` (they meet in `trace.py`).
    """

    @property
    def base_url(self) -> str: ...

    @property
    def served_model_name(self) -> str: ...

    def open_episode(
        self, task_index: int = 0, group_index: int = 0, metadata: dict[str, Any] | None = None, seed: int | None = None
    ) -> Any:
        """Returns a session with the episode's `key` and `episode.id`; its calls that bring no seed sample from seeds
        derived from `seed` and their index in the episode (`None`: the engine draws them). `metadata` starts the
        episode's metadata (`task_prompt`: what lineage uses to tell the task's conversation from the others).
        Branch episodes (`rollout/replay.py`) pass `replay=ReplaySpec(...)` too: a server that replays takes it."""

    def close_episode(
        self, episode_id: str, status: str | None = None, result: Any = None, error: str | None = None
    ) -> Episode: ...


async def run_episode(
    server: EpisodeServer,
    agent: EpisodeAgent,
    task: dict[str, Any],
    task_index: int = 0,
    group_index: int = 0,
    timeout: float = 300.0,
    model: str | None = None,
    http_client: httpx.AsyncClient | None = None,
    seed: int | None = None,
    replay: ReplaySpec | None = None,
    tool_replay: ToolReplay | None = None,
) -> Episode:
    """Open an episode, run the agent on `task` until it returns, fails or times out, and close the episode.

    The status is `ok`, `agent_error` (the agent raised or the command exited non-zero), `timeout`, or what the
    endpoint saw (`context_overflow`, `limit_exceeded`). The episode is always closed and returned. `model` is the
    name handed to the agent (default: the one the server answers to). `seed`: the episode's seed (its calls' seeds
    derive from it, `EpisodeServer.open_episode`). `replay` / `tool_replay`: a branch episode (`rollout/replay.py`:
    the endpoint replays the parent's first calls, the agent's tool loop their tool results).
    """
    # The task's prompt, when it has one: the conversation that holds it is the episode's main line (lineage), whatever
    # a harness sends first (a title request, a sub-agent). Kept trainer-side: the agent never sees the metadata.
    metadata = {"task_prompt": task["prompt"]} if task.get("prompt") else None
    opened = {"replay": replay} if replay is not None else {}
    session = server.open_episode(
        task_index=task_index, group_index=group_index, metadata=metadata, seed=seed, **opened
    )
    context = EpisodeContext(
        server.base_url, session.key, model or server.served_model_name, timeout, http_client, session.episode.id
    )
    status, result, error, metadata = "ok", None, None, {}
    started = time.monotonic()
    # A future of its own rather than `asyncio.wait_for`, which waits for the cancelled agent to end, forever if it
    # swallows the cancellation (and then takes whatever it returns for a result). On a loop and a thread of its own,
    # unless it was handed a connection pool shared with the others (bound to this loop).
    if http_client is None:
        agent_thread = _AgentThread(agent, context, task, tool_replay)
        run, cancel = agent_thread.future, agent_thread.cancel
    else:
        agent_thread = None
        run = asyncio.ensure_future(_guarded(_with_tool_replay(agent.run(context, task), tool_replay)))
        cancel = run.cancel
    try:
        await asyncio.wait({run}, timeout=timeout)
        if run.done():
            if run.cancelled():
                raise RuntimeError("the agent cancelled itself")
            result = run.result()
        else:
            status, error = "timeout", f"episode exceeded {timeout:.1f}s"
            cancel()
            await asyncio.wait({run}, timeout=CANCEL_GRACE_S)
            if run.done():
                _retrieve(run)
            else:
                metadata["abandoned"] = True  # it ignored the cancellation, or blocks its thread: left behind
                if agent_thread is not None:
                    agent_thread.abandon()
    except AgentCrash as crash:
        status, error, metadata = "agent_error", str(crash), crash.metadata
    except Exception as crash:  # noqa: BLE001 - an agent's crash is data, not a trainer failure
        status = "agent_error"
        error = "".join(traceback.format_exception_only(type(crash), crash)).strip()
        metadata = {"traceback": traceback.format_exc()[-4000:]}
    finally:
        if not run.done():  # the rollout itself is being cancelled
            cancel()
            run.cancel()
        episode = server.close_episode(session.episode.id, status=status, result=result, error=error)
    episode.metadata.update(metadata)
    episode.metadata.setdefault("agent_seconds", time.monotonic() - started)
    return episode


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """httpx's default context, built once: a client builds one per instance and loads the CA bundle to do it (~30 ms
    of CPU)."""
    return httpx.create_ssl_context()


async def run_episodes(
    server: EpisodeServer,
    agent: EpisodeAgent,
    tasks: list[dict[str, Any]],
    group_indices: list[int] | None = None,
    max_concurrent: int = 64,
    timeout: float = 300.0,
    model: str | None = None,
    http_client: httpx.AsyncClient | None = None,
    seed: int | None = None,
    first_index: int = 0,
) -> list[Episode]:
    """Run one episode per entry of `tasks` (a task repeated G times makes a group), at most `max_concurrent` at once.

    Each episode's agent runs on an event loop and a thread of its own with an HTTP client (a connection pool) of its
    own, unless `http_client` is given for all: the agents then share this loop, and a blocking call in one blocks
    them all (`benchmarks/rollout_benchmark.py` compares the two). Returns the episodes in the order of `tasks`.

    With a `seed`, episode `i` is opened with the seed `derive_seed(seed, i)`, and each of its model calls that brings
    no seed samples from one derived from that and the call's index in the episode: the same tasks and seed sample the
    same tokens however the episodes' calls interleave (issue 29; the engine's own seeds go in arrival order).
    `first_index`: the index (task index, seed) of `tasks[0]` in a batch run a part at a time (the asynchronous
    producer starts a batch one group at a time).
    """
    semaphore = asyncio.Semaphore(max_concurrent)
    group_indices = group_indices or [0] * len(tasks)

    async def one(i: int) -> Episode:
        index = first_index + i
        episode_seed = None if seed is None else derive_seed(seed, index)
        async with semaphore:
            # A connection pool per episode, not one for all: httpcore walks every pooled connection (two system calls
            # each) at each request and response, 9% of a CPU demo step's profile with 32 episodes sharing one pool
            # (benchmarks/rollout_benchmark.py: 0.95x the shared pool's time on a zero-cost engine).
            # Without a shared pool, each agent builds its own on its own loop (`_AgentThread`).
            return await run_episode(
                server, agent, tasks[i], index, group_indices[i], timeout, model, http_client, episode_seed
            )

    return list(await asyncio.gather(*[one(i) for i in range(len(tasks))]))


def run_rollout(coroutine: Coroutine[Any, Any, T], cancel_grace_s: float = CANCEL_GRACE_S) -> T:
    """Run `coroutine` (e.g. `run_episodes(...)`) on a fresh event loop in this thread and return its result.

    `asyncio.run` without its unbounded waits at exit: it cancels the tasks still running and waits for *all* of them
    (an agent that swallows `CancelledError` held it forever), and joins the default thread pool (a blocked sync agent
    held it as long as it blocked, issue #9). Here leftover tasks are cancelled, given `cancel_grace_s`, then left
    behind with the loop, which never runs again.

    Example:

    ```python
    >>> episodes = run_rollout(run_episodes(server, agent, tasks, timeout=60))
    ```
    """
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    loop.set_default_executor(_DAEMON_EXECUTOR)
    try:
        return loop.run_until_complete(coroutine)
    finally:
        _close_loop(loop, cancel_grace_s)


def abandoned_agent_threads() -> int:
    """How many agents left behind on a timeout (blocked in a call, or ignoring their cancellation) still hold a
    thread of this process: each keeps its thread until what blocks it returns, and never runs again after that."""
    with _abandoned_lock:
        _abandoned_threads[:] = [thread for thread in _abandoned_threads if thread.is_alive()]
        return len(_abandoned_threads)


class _DaemonThreadExecutor(concurrent.futures.ThreadPoolExecutor):
    """The default executor of an agent's loop (`asyncio.to_thread`, `run_in_executor(None, ...)`): a daemon thread per
    call. The loop's own pool has min(32, cpus + 4) threads, which hung calls (an environment's `reset` that never
    returns) filled for good, and its threads are joined at the interpreter's exit, which hung calls then held."""

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def target() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as error:  # noqa: BLE001 - handed to the awaiting coroutine
                future.set_exception(error)

        threading.Thread(target=target, name="trl-agentic-agent-call", daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass  # nothing pooled; a call still running is abandoned with its episode


_DAEMON_EXECUTOR = _DaemonThreadExecutor(max_workers=1)  # stateless: shared by the agents' loops


async def _guarded(coroutine: Coroutine[Any, Any, T]) -> T:
    """`coroutine`, with `SystemExit` and `KeyboardInterrupt` raised in it turned into an `AgentCrash`: a task that
    raises them re-raises them out of its loop, which then stops."""
    try:
        return await coroutine
    except (SystemExit, KeyboardInterrupt) as exit_:
        raise _as_crash(exit_) from None


async def _with_tool_replay(coroutine: Coroutine[Any, Any, T], tool_replay: ToolReplay | None) -> T:
    """`coroutine` run with the episode's tool replay visible to its tool loop (`TOOL_REPLAY`, in its task's
    context: what it starts, threads included, sees it too)."""
    if tool_replay is not None:
        TOOL_REPLAY.set(tool_replay)
    return await coroutine


def _as_crash(exception: BaseException) -> AgentCrash:
    return AgentCrash(f"the agent raised {type(exception).__name__}: {exception}")


class _AgentThread:
    """One episode's agent, run on an event loop of its own in a daemon thread of its own; `future` (on the caller's
    loop) gets its result or its exception. `cancel()` cancels it on its loop (it may ignore that, or be blocked)."""

    def __init__(
        self, agent: EpisodeAgent, context: EpisodeContext, task: dict[str, Any], tool_replay: ToolReplay | None = None
    ):
        self._tool_replay = tool_replay
        self._caller = asyncio.get_running_loop()
        self.future: asyncio.Future = self._caller.create_future()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._cancelled = False
        self._thread = threading.Thread(
            target=self._run, args=(agent, context, task), name="trl-agentic-agent", daemon=True
        )
        self._thread.start()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._task is not None:
                with contextlib.suppress(RuntimeError):  # its loop is closed: it has ended already
                    self._loop.call_soon_threadsafe(self._task.cancel)

    def abandon(self) -> None:
        with _abandoned_lock:
            _abandoned_threads.append(self._thread)

    def _run(self, agent: EpisodeAgent, context: EpisodeContext, task: dict[str, Any]) -> None:
        async def main() -> Any:
            # trust_env=False: the endpoint is ours, on loopback; an HTTP(S)_PROXY / ALL_PROXY set for the agents' own
            # traffic (a cluster's proxy) sent every model call to the proxy, and every episode failed.
            async with httpx.AsyncClient(timeout=context.timeout, verify=_ssl_context(), trust_env=False) as client:
                run = agent.run(dataclasses.replace(context, http_client=client), task)
                return await _with_tool_replay(run, self._tool_replay)

        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.set_default_executor(_DAEMON_EXECUTOR)
        result, error, cancelled = None, None, False
        try:
            with self._lock:
                self._loop, self._task = loop, loop.create_task(_guarded(main()))
                if self._cancelled:
                    self._task.cancel()
            result = loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            cancelled = True
        except Exception as exception:  # noqa: BLE001 - handed to the episode
            error = exception
        except BaseException as exception:  # noqa: BLE001 - `SystemExit` from a task the agent started
            error = _as_crash(exception)
        finally:
            _close_loop(loop, CANCEL_GRACE_S)
        with contextlib.suppress(RuntimeError):  # the rollout's loop is gone: nobody is waiting any more
            self._caller.call_soon_threadsafe(self._settle, result, error, cancelled)

    def _settle(self, result: Any, error: BaseException | None, cancelled: bool) -> None:
        if self.future.done():
            return
        if cancelled:
            self.future.cancel()
        elif error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)


def _close_loop(loop: asyncio.AbstractEventLoop, cancel_grace_s: float) -> None:
    """Close `loop` without `asyncio.run`'s unbounded waits: the tasks still running are cancelled and given
    `cancel_grace_s`, then left behind with the loop, which never runs again; its executor is not joined."""
    try:
        leftover = asyncio.all_tasks(loop)
        for task in leftover:
            task.cancel()
        with contextlib.suppress(Exception, SystemExit):  # an agent's leftovers may raise anything as they end
            if leftover:
                loop.run_until_complete(asyncio.wait(leftover, timeout=cancel_grace_s))
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_asyncgens(), cancel_grace_s))
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def _retrieve(task: asyncio.Future) -> None:
    # Mark the outcome of a cancelled agent as seen (no "exception was never retrieved" at garbage collection).
    if not task.cancelled():
        task.exception()
