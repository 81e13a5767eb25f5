"""The asynchronous producer in a process of its own (`AgenticGRPOConfig(rollout_process=True)`, issue 30).

In one process the trainer, the embedded engine, the endpoint and the agents share one interpreter lock: with small
models much of their time is Python, so generation and training overlap little. Here a spawned child process runs
the `RolloutProducer`, its endpoint and an embedded engine over an inference copy of the policy; the trainer's
process keeps the model that trains, the reward functions and the dataset (the agent never shares a process with the
checker's columns).

Weights: the trainer keeps a staging copy of the policy's tensors in shared memory. After an optimizer step it copies
its weights into the staging copy and sends the new version; the child's engine copies the staging tensors into its
inference copy between two decode steps and acknowledges. The trainer writes the staging copy only after the child
acknowledged the previous version, so the child never reads a half-written copy. Episodes in flight go on with the
new weights, and each sampled token records its version, as in one process.

The agent crosses to the child pickled with `dill` (closures and lambdas included, by value); the episodes come
back pickled, each result on its own. An episode whose result cannot be pickled in the child, or unpickled in the
trainer (an exception whose `__init__` takes two arguments), loses only its result (it ends `agent_error`, saying
why).

Neither process waits for the other for ever (issue 40): the child sends a heartbeat every `HEARTBEAT_S`, and a child
that sends nothing for `watchdog_s` (wedged: an agent holding the interpreter lock in native code) is killed, failing
the step that waits for it with the reason; the child dies with the trainer (Linux: the kernel kills it when the
trainer's thread that started it is gone; elsewhere it watches its parent's pid).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp

from ..generation.transformers_engine import EngineStats
from ..trace import Episode


HEARTBEAT_S = 1.0  # how often the child says it is alive
WATCHDOG_S = 120.0  # how long the trainer hears nothing from the child before it kills it as wedged


def ensure_picklable_agent(agent: Any) -> bytes:
    """The agent as `dill` bytes, or a `ValueError` that says how to make it cross to the rollout process."""
    import dill

    try:
        return dill.dumps(agent, recurse=True)
    except Exception as e:  # noqa: BLE001 - any pickling failure
        raise ValueError(
            f"rollout_process=True runs the agent in a process of its own, and it could not be pickled ({e!r}). "
            "Make what the agent holds picklable (build clients, locks, sockets and open files inside the agent "
            "function, not around it), or set rollout_process=False."
        ) from e


def _results_apart(episodes: list[Episode]) -> list[bytes]:
    """Each episode's result pickled on its own, taken out of the episode (`_results_back` puts it back): one that
    does not pickle here fails its episode, not the batch."""
    results = []
    for episode in episodes:
        try:
            data = pickle.dumps(episode.result)
        except Exception as e:  # noqa: BLE001 - any pickling failure
            episode.error = (
                f"The agent's result ({type(episode.result).__name__}) could not be sent from the rollout process: "
                f"{e!r}. Return plain data (str, numbers, lists, dicts) from the agent."
            )
            episode.status, data = "agent_error", pickle.dumps(None)
        episode.result = None
        results.append(data)
    return results


def _results_back(episodes: list[Episode], results: list[bytes]) -> None:
    """Put each episode's result back (the trainer's side): one that does not unpickle here (an exception class whose
    `__init__` takes two arguments, a class this process cannot import) fails its episode, not the batch."""
    for episode, data in zip(episodes, results, strict=True):
        try:
            episode.result = pickle.loads(data)
        except Exception as e:  # noqa: BLE001 - any unpickling failure
            episode.status, episode.result = "agent_error", None
            episode.error = (
                f"The agent's result could not be read in the trainer's process: {e!r}. Return plain data (str, "
                "numbers, lists, dicts) from the agent."
            )


def _send_episodes(send, message: tuple, episodes: list[Episode] | None) -> None:
    """Send a batch's episodes (their results apart, `_results_apart`); one whose metadata does not pickle loses its
    metadata, not the batch."""
    try:
        send(message)
        return
    except (pickle.PicklingError, TypeError, AttributeError, RecursionError):
        if episodes is None:
            raise
    for episode in episodes:
        try:
            pickle.dumps(episode)
        except Exception as e:  # noqa: BLE001 - any pickling failure
            episode.error = f"The episode's metadata could not be sent from the rollout process: {e!r}."
            episode.status, episode.metadata = "agent_error", {}
    send(message)


def _die_with_parent(parent: int) -> None:
    """End this process when the trainer's ends, even while something holds this one's interpreter lock: the kernel's
    parent-death signal on Linux, else a thread watching the parent's pid."""
    if sys.platform == "linux":
        import ctypes

        PR_SET_PDEATHSIG = 1  # noqa: N806 - <linux/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # it ended before the signal was asked for
            os._exit(1)
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(HEARTBEAT_S)
        os._exit(1)

    threading.Thread(target=watch, name="trl-agentic-parent-watch", daemon=True).start()


def _serve(conn, weights: dict[str, torch.Tensor], payload: bytes, num_threads: int, parent: int) -> None:
    """The child: build the engine, the endpoint and the producer, then serve the trainer's messages."""
    import dill

    _die_with_parent(parent)

    from ..endpoint.launch import build_engine, launch_endpoint
    from .producer import RolloutProducer

    torch.set_num_threads(num_threads)
    send_lock = threading.Lock()

    def send(message) -> None:
        with send_lock:
            conn.send(message)

    try:
        model_class, config, tokenizer, agent, engine_kwargs, endpoint_kwargs, producer_kwargs = pickle.loads(payload)
        agent = dill.loads(agent)
        model = model_class(config)
        model.load_state_dict(weights, assign=True)  # its tensors are the shared staging tensors
        model.eval().requires_grad_(False)
        engine = build_engine(model, tokenizer, inference_copy=True, watch_weights=False, **engine_kwargs)
        engine.sync_weights(policy_version=producer_kwargs["version"])
        endpoint = launch_endpoint(engine, tokenizer, port=0, **endpoint_kwargs)
        producer = RolloutProducer(endpoint, agent, **producer_kwargs)
    except BaseException:  # noqa: BLE001 - reported to the trainer, which raises it
        send(("error", traceback.format_exc()))
        return
    send(("ready",))

    def heartbeat() -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            try:
                send(("heartbeat",))
            except (BrokenPipeError, OSError):
                return

    threading.Thread(target=heartbeat, name="trl-agentic-heartbeat", daemon=True).start()

    def deliver(index: int) -> None:
        try:
            episodes, _ = producer.result(index)
            error = None
        except BaseException as e:  # noqa: BLE001 - the trainer raises it when it takes the batch
            episodes, error = None, repr(e)
        with send_lock:  # the engine's work since the last delivery, added up on the trainer's side
            stats = engine.take_stats()
            idle, cpu = producer.take_idle_seconds(), time.process_time()
            results = _results_apart(episodes) if episodes is not None else None
            message = ("result", index, episodes, results, error, idle, producer.running, stats, cpu)
            _send_episodes(conn.send, message, episodes)

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            break
        if message[0] == "submit":
            producer.submit(*message[1:])
            threading.Thread(target=deliver, args=(message[1],), name="trl-agentic-deliver", daemon=True).start()
        elif message[0] == "sync":
            engine.sync_weights(policy_version=message[1])  # between two decode steps, under the engine's lock
            producer.set_version(message[1])
            send(("ack", message[1]))
        elif message[0] == "close":
            break
    producer.close()
    endpoint.call(engine.stop())
    endpoint.stop()
    try:
        send(("closed",))
    except (BrokenPipeError, OSError):
        pass


class ProcessRolloutProducer:
    """`RolloutProducer`'s interface (`submit`, `result`, ...), its producer, endpoint and engine in a spawned process.

    Args:
        model: the policy (a transformers causal LM on the CPU, not wrapped by PEFT): its class, config and weights
            build the child's copy.
        tokenizer: its tokenizer (with its chat template).
        agent: the resolved agent (`resolve_agent(...)`); pickled with `dill`.
        engine_kwargs: `build_engine` arguments (batch size, batch wait, context length).
        endpoint_kwargs: `launch_endpoint` arguments (sampling defaults, limits, host); the child listens on a free
            port.
        max_staleness, max_concurrent, timeout, model_name, version: as for `RolloutProducer`.
        num_threads: torch threads of the child (default: half of this process's, at least 1: the two processes share
            the cores).
        start_timeout: seconds the child may take to start (import, build the engine, listen).
        watchdog_s: seconds the child may send nothing, not even its heartbeat (every `HEARTBEAT_S`), before it is
            killed as wedged; the step waiting for it then fails with the reason.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        agent,
        *,
        engine_kwargs: dict[str, Any],
        endpoint_kwargs: dict[str, Any],
        max_staleness: int,
        max_concurrent: int,
        timeout: float | None,
        model_name: str,
        version: int,
        num_threads: int | None = None,
        start_timeout: float = 300.0,
        watchdog_s: float = WATCHDOG_S,
    ):
        if watchdog_s <= HEARTBEAT_S:
            raise ValueError(f"watchdog_s={watchdog_s} must exceed the child's heartbeat interval ({HEARTBEAT_S}s).")
        self._watchdog_s = watchdog_s
        payload = pickle.dumps(
            (
                type(model),
                model.config,
                tokenizer,
                ensure_picklable_agent(agent),
                engine_kwargs,
                endpoint_kwargs,
                dict(
                    max_staleness=max_staleness,
                    max_concurrent=max_concurrent,
                    timeout=timeout,
                    model=model_name,
                    version=version,
                ),
            )
        )
        # The staging copy, in shared memory: the child's model is built on these very tensors.
        self._weights = {name: t.detach().clone().share_memory_() for name, t in model.state_dict().items()}
        context = mp.get_context("spawn")  # never fork a process that runs threads (the endpoint, the engine)
        self._conn, child = context.Pipe()
        threads = num_threads if num_threads is not None else max(1, torch.get_num_threads() // 2)
        self._process = context.Process(
            target=_serve,
            args=(child, self._weights, payload, threads, os.getpid()),
            name="trl-agentic-rollout",
            daemon=True,
        )
        self._process.start()
        child.close()
        self._lock = threading.Condition()
        self._results: dict[int, tuple[list[Episode] | None, str | None]] = {}
        self._pending: set[int] = set()
        self._sent = self._acked = version
        self._idle = 0.0
        self._running = 0
        # The child's engine's work delivered since the owner last reset it (as `engine.stats` in one process)
        self.stats = EngineStats()
        self.cpu_seconds = 0.0  # the child's CPU seconds (all its threads) when it delivered its last batch
        self._dead: str | None = None
        self._closed = False
        if not self._conn.poll(start_timeout):
            self._process.kill()
            raise TimeoutError(f"The rollout process did not start within {start_timeout:.0f}s.")
        try:
            first = self._conn.recv()
        except EOFError:
            first = ("error", f"it exited with code {self._process.join(5) or self._process.exitcode}")
        if first[0] != "ready":
            self._process.join(timeout=5)
            raise RuntimeError(f"The rollout process failed to start:\n{first[1]}")
        self._listener = threading.Thread(target=self._listen, name="trl-agentic-rollout-listener", daemon=True)
        self._listener.start()

    def take_stats(self) -> EngineStats:
        """The child's engine's work delivered since the last `take_stats`, counting afresh from now on (one step under
        the lock the listener adds deliveries under: none is lost between the copy and the reset)."""
        with self._lock:
            stats = dataclasses.replace(self.stats)
            self.stats.reset()
        return stats

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _listen(self) -> None:
        failure = None  # why the child is being killed, when this side decides it
        while True:
            try:
                if not self._conn.poll(self._watchdog_s):
                    failure = (
                        f"The rollout process sent nothing, not even its heartbeat, for {self._watchdog_s:.0f}s: it is "
                        "wedged (an agent holding the interpreter lock in native code, a deadlock) and was killed; its "
                        "episodes in flight are lost."
                    )
                    break
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception as e:  # noqa: BLE001 - a message that does not unpickle here: fail, never hang
                failure = f"A message from the rollout process could not be read ({e!r}); it was stopped."
                break
            with self._lock:
                if message[0] == "result":
                    _, index, episodes, results, error, idle, running, stats, self.cpu_seconds = message
                    if episodes is not None:
                        _results_back(episodes, results)
                    self._results[index] = (episodes, error)
                    for name, value in dataclasses.asdict(stats).items():
                        setattr(self.stats, name, getattr(self.stats, name) + value)
                    self._idle += idle
                    self._running = running
                elif message[0] == "ack":
                    self._acked = message[1]
                elif message[0] == "closed":
                    self._lock.notify_all()
                    break
                self._lock.notify_all()
        with self._lock:
            if not self._closed:
                if failure is not None:
                    self._process.kill()
                self._process.join(timeout=5.0)
                self._dead = failure or (
                    f"The rollout process exited unexpectedly (exit code {self._process.exitcode}): its episodes in "
                    "flight are lost. Out of memory, or a crash in native code, are the usual causes."
                )
            self._lock.notify_all()

    def _wait(self, predicate, timeout: float | None = None) -> None:
        with self._lock:
            if not self._lock.wait_for(lambda: predicate() or self._dead is not None, timeout):
                raise TimeoutError("Timed out waiting for the rollout process.")
            if self._dead is not None and not predicate():
                raise RuntimeError(self._dead)

    def submit(self, index, tasks, group_indices, consume_version, unit_size, seed=None) -> None:
        if self._dead is not None:
            raise RuntimeError(self._dead)
        if index in self._pending:
            raise ValueError(f"Generation batch {index} was submitted already.")
        self._pending.add(index)
        self._conn.send(("submit", index, tasks, group_indices, consume_version, unit_size, seed))

    def sync_weights(self, model: torch.nn.Module, version: int) -> None:
        """Copy `model`'s weights into the staging copy and send the version (the child takes them between decode
        steps; this does not wait for it, only for the previous version's acknowledgement)."""
        self._wait(lambda: self._acked == self._sent)  # the child no longer reads the staging copy
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                self._weights[name].copy_(tensor)
        self._sent = version
        self._conn.send(("sync", version))

    def set_version(self, version: int) -> None:
        """The version travels with the weights (`sync_weights`)."""

    def result(self, index: int, timeout: float | None = None) -> tuple[list[Episode], float]:
        """Wait for batch `index`'s episodes; returns them and the seconds waited."""
        if index not in self._pending:
            raise KeyError(f"Generation batch {index} was not submitted (or was taken already).")
        started = time.monotonic()
        self._wait(lambda: index in self._results, timeout)
        episodes, error = self._results.pop(index)
        self._pending.discard(index)
        if error is not None:
            raise RuntimeError(f"Generation batch {index} failed in the rollout process: {error}")
        return episodes, time.monotonic() - started

    def pending(self) -> list[int]:
        return sorted(self._pending)

    @property
    def running(self) -> int:
        return self._running

    def take_idle_seconds(self) -> float:
        with self._lock:
            idle, self._idle = self._idle, 0.0
            return idle

    def close(self) -> None:
        """Stop the child: its episodes in flight are cancelled, as `RolloutProducer.close` does."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
        try:
            self._conn.send(("close",))
        except (BrokenPipeError, OSError):
            pass
        self._process.join(timeout=60.0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()
