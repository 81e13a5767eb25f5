"""verifiers 0.4 environments (`verifiers.v1`) as task suites: the half of `trl_agentic.envs.verifiers` that runs when
verifiers 0.4.x is installed (`pip install 'trl-agentic[verifiers]'`).

verifiers 0.4 has no rollout loop in Python: a `vf.Env` pairs a *taskset* (typed tasks that score their own traces
with `@vf.reward`/`@vf.metric` methods) with a *harness*, a program (`null`: a plain chat loop, `bash`, `codex`,
...) that a runtime (`subprocess`, `docker`, a Prime sandbox) runs on each task, and that reaches the model through
verifiers' interception proxy, which records the trace and forwards each call to the model client. [`from_verifiers`]
maps it onto ours:

1. the taskset's tasks become `suite.build_dataset(split, size, seed)`: a `prompt` column (the task's messages), the
   task's data as JSON (`verifiers_task`, what the agent rebuilds the task from) and `example_id` (its index);
2. the agent ([`VerifiersAgent`]) runs `env.run_episode(task, vf.ModelContext(...))` per episode, inside
   `env.serving()` (the proxy and the taskset's shared tool servers, started once, on a thread of their own, and held
   for as long as the agent lives), with the model client pointed at **the episode's own URL**
   (`/episodes/<episode id>/v1`): verifiers reads the client's key from one environment variable per process
   (`api_key_var`), so concurrent episodes could not each bring their own key; the path names the episode instead,
   and every call the proxy forwards is recorded token by token;
3. the task's rewards (its `@vf.reward` methods and config-plugged rewards and judges, with their weights) become one
   TRL-signature reward function each, named like it, reading the episode's scored trace (`trace.rewards`); its
   `@vf.metric` methods are weight-0 functions (logged only). The episode's reward is their weighted sum, as verifiers
   computes `trace.reward`.

An episode verifiers reports as failed (`episode.ok` false: the harness crashed or timed out, the endpoint refused a
call, scoring raised) ends as `agent_error` with verifiers' errors, unscorable: never a silent 0. Verified against
verifiers 0.4.0 with the `null` harness in the `subprocess` runtime (which needs `uv` on `PATH`: the harness is a
PEP 723 script that `uv` prepares, fetching its requirements the first time). docs/envs_verifiers.md.

Example:

```python
>>> import verifiers.v1 as vf
>>> from trl_agentic.envs import from_verifiers
>>> env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset={"id": "my-taskset"},
...                                                 agent={"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}))
>>> suite = from_verifiers(env)  # or get_task("verifiers:my-taskset")
>>> config = AgenticGRPOConfig(..., reward_weights=suite.reward_weights, agent_columns=list(suite.agent_columns))
>>> trainer = AgenticGRPOTrainer(model, agent=suite.agent, reward_funcs=suite.reward_funcs, args=config,
...                              train_dataset=suite.build_dataset("train", size=256))
```
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets

from ..tasks import TaskSuite


try:
    import verifiers.v1 as vf
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError(
        "trl_agentic.envs.verifiers needs verifiers 0.4: pip install 'trl-agentic[verifiers]'."
    ) from error
from verifiers.v1.configs.agent import agent_config_fields
from verifiers.v1.runtimes import SubprocessConfig
from verifiers.v1.utils.loaders import resolve_env_config


# verifiers reads the model client's key from an environment variable (`api_key_var`); this one is never set, so it
# sends the placeholder "EMPTY", which the endpoint ignores: the episode's path URL admits the call.
NO_KEY_VAR = "TRL_AGENTIC_VERIFIERS_UNSET_KEY"
# The dataset column holding a task's data (JSON), from which the agent rebuilds the task.
TASK_COLUMN = "verifiers_task"
# How long starting `env.serving()` (the interception proxy, the taskset's shared tool servers) may take.
SERVING_START_TIMEOUT = 120.0


class VerifiersResult(dict):
    """What a [`VerifiersAgent`] episode returns (`episode.result`): a summary for the episode log (`reply`,
    `num_turns`, `stop_condition`, `is_truncated`, `rewards` as `{name: score}`, `reward`), with verifiers' scored
    `Trace` as the attribute `trace` and its `Episode` as `episode` (never written to the log)."""

    trace: Any = None
    episode: Any = None


def verifiers_trace(episode: Any) -> Any:
    """The scored verifiers `Trace` of an episode a [`VerifiersAgent`] ran, or `None` (the episode failed before the
    agent returned, or another agent ran it)."""
    result = getattr(episode, "result", None)
    return result.trace if isinstance(result, VerifiersResult) else None


# The name the 0.3 adapter gives it (there, the rollout's `State`).
verifiers_state = verifiers_trace


class _ServingLoop:
    """An event loop on a thread of its own that holds `env.serving()` (verifiers' interception proxy and the
    taskset's shared tool servers) from the first episode until `close()` (or the process's exit): each episode runs
    on a loop of its own (the runner's), so it submits its `env.run_episode` here, where the proxy lives."""

    def __init__(self, env: Any):
        self.env = env
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    def submit(self, coroutine: Any) -> concurrent.futures.Future:
        try:
            loop = self._started()
        except BaseException:
            coroutine.close()
            raise
        return asyncio.run_coroutine_threadsafe(coroutine, loop)

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is not None and self._thread is not None and self._thread.is_alive():
                return self._loop
            ready: concurrent.futures.Future = concurrent.futures.Future()

            async def serve() -> None:
                self._stop = asyncio.Event()
                try:
                    async with self.env.serving():
                        ready.set_result(asyncio.get_running_loop())
                        await self._stop.wait()
                except BaseException as error:
                    if not ready.done():
                        ready.set_exception(error)
                        return
                    raise

            def run() -> None:
                loop = asyncio.new_event_loop()
                try:
                    loop.run_until_complete(serve())
                finally:
                    loop.close()

            self._thread = threading.Thread(target=run, name="trl-agentic-verifiers-serving", daemon=True)
            self._thread.start()
            try:
                self._loop = ready.result(timeout=SERVING_START_TIMEOUT)
            except concurrent.futures.TimeoutError:
                raise RuntimeError(
                    f"verifiers' env.serving() did not start within {SERVING_START_TIMEOUT:g}s."
                ) from None
            atexit.register(self.close)
            return self._loop

    def close(self) -> None:
        """Leave `env.serving()` (stops the proxy and the shared tool servers); a later episode starts them again."""
        with self._lock:
            loop, stop, thread = self._loop, self._stop, self._thread
            self._loop = self._stop = self._thread = None
        if loop is not None and stop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(stop.set)
        if thread is not None:
            thread.join(timeout=30)


@dataclass
class VerifiersAgent:
    """An agent that plays one verifiers 0.4 episode per task: `env.run_episode(task, ModelContext(...))`, the model
    client pointed at the episode's own URL.

    Args:
        env: a single-agent `vf.Env` (e.g. `vf.SingleAgentEnv`), built on the main thread.
        model: the model name the harness sends (default: the one the endpoint answers to, `"policy"`).

    The episode's task row must hold the `verifiers_task` column ([`from_verifiers`]'s datasets do): an episode
    without it fails saying how to fix it. `close()` stops verifiers' proxy (also done at exit).

    Example:

    ```python
    >>> agent = VerifiersAgent(env)
    >>> episodes = run_rollout(run_episodes(server, agent, list(suite.build_dataset("train", size=4))))
    >>> episodes[0].result["rewards"], episodes[0].result.trace.last_reply
    ({'correct': 1.0}, 'The answer is 5.')
    ```
    """

    env: Any
    model: str | None = None

    def __post_init__(self):
        _check_env(self.env, "VerifiersAgent")
        self.__name__ = f"verifiers:{self.env.config.env_id}"  # named in logs like a function
        self._serving = _ServingLoop(self.env)

    def __getstate__(self) -> dict[str, Any]:  # the serving thread stays in its process; a copy starts its own
        return {key: value for key, value in self.__dict__.items() if key != "_serving"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._serving = _ServingLoop(self.env)

    def close(self) -> None:
        self._serving.close()

    async def run(self, context: Any, task: dict[str, Any]) -> VerifiersResult:
        if TASK_COLUMN not in task:
            raise ValueError(
                f"The verifiers environment rebuilds each task from the dataset's {TASK_COLUMN!r} column, which this "
                "episode's task lacks: give the agent every column, "
                "AgenticGRPOConfig(agent_columns=list(suite.agent_columns))."
            )
        vf_task = task_from_row(self.env, task)
        client = vf.EvalClientConfig(base_url=context.path_base_url, api_key_var=NO_KEY_VAR)
        model_context = vf.ModelContext(model=self.model or context.model, client=client)
        future = self._serving.submit(self.env.run_episode(vf_task, model_context))
        try:
            episode = await asyncio.wrap_future(future)
        finally:
            future.cancel()  # a no-op once done; on a timeout, verifiers aborts the rollout (kills the program)
        if not episode.ok:  # possibly before its agent ran (no trace)
            errors = [*episode.errors, *(error for trace in episode.traces for error in trace.errors)]
            summary = "; ".join(f"{error.type}: {error.message}" for error in errors) or "no error recorded"
            stop = episode.traces[-1].stop_condition if episode.traces else None
            raise RuntimeError(f"The verifiers episode failed (stop condition {stop!r}): {summary}"[:4000])
        (trace,) = episode.traces  # a single-agent env (checked): one trace per episode
        result = VerifiersResult(
            reply=trace.last_reply,
            num_turns=trace.num_turns,
            stop_condition=trace.stop_condition,
            is_truncated=trace.is_truncated,
            rewards={name: None if reward is None else reward.score for name, reward in trace.rewards.items()},
            reward=trace.reward,
        )
        result.trace, result.episode = trace, episode
        return result


def _check_env(env: Any, who: str) -> None:
    if not isinstance(env, vf.Env):
        legacy = hasattr(env, "rollout") and hasattr(env, "rubric")
        raise ValueError(
            f"{who} needs a verifiers 0.4 `vf.Env` (e.g. vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset=..., "
            f"agent=...))), got a {type(env).__name__}."
            + (
                " It looks like a verifiers 0.3 Environment: install verifiers 0.3 for it, "
                "pip install 'trl-agentic[verifiers-legacy]'."
                if legacy
                else ""
            )
        )
    roles = agent_config_fields(env.config)
    if len(roles) != 1:
        raise ValueError(
            f"{who} runs single-agent verifiers environments (one trace per episode, as vf.SingleAgentEnv); "
            f"{type(env).__name__} declares {len(roles)} agents ({sorted(roles)}), which it does not train yet."
        )
    (role,) = roles.values()
    if isinstance(role.runtime, SubprocessConfig) and shutil.which("uv") is None:
        raise ValueError(
            "The verifiers harness runs in the `subprocess` runtime, where verifiers prepares its program (a PEP 723 "
            "script) with `uv`, and `uv` is not on PATH: pip install uv (the [verifiers] extra installs it into "
            "the environment: activate it, or put its bin/ on PATH)."
        )


# ---------------------------------------------------------------------------------------------------------------------
# Tasks <-> dataset rows


def task_row(task: Any) -> dict[str, Any]:
    """A verifiers task as a dataset row: `prompt` (its messages: the system prompt, then its prompt), `verifiers_task`
    (its data as JSON, from which [`task_from_row`] rebuilds it) and `example_id` (its index in the taskset)."""
    data = task.data
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        messages += [json.loads(message.model_dump_json(exclude_none=True)) for message in data.prompt]
    return {"prompt": messages, TASK_COLUMN: data.model_dump_json(), "example_id": data.idx}


def task_from_row(env: Any, row: dict[str, Any]) -> Any:
    """The verifiers task a [`task_row`] row holds, as the environment's taskset builds it (its task class, with the
    taskset's task config), as verifiers' own env server rebuilds a task from its wire data."""
    task_type = type(env.taskset).task_type()
    data = task_type.data_type().model_validate_json(row[TASK_COLUMN])
    return task_type(data, env.config.taskset.task)


# ---------------------------------------------------------------------------------------------------------------------
# Rewards -> reward functions


def task_reward_funcs(env: Any) -> tuple[list[Callable], list[float]]:
    """One TRL-signature reward function per reward of the environment's tasks, and their weights.

    The rewards are what `Task.score` records in `trace.rewards`: the task class's `@vf.reward` methods and the
    config's plugged rewards (each with its weight), then its judges (`judge.config.weight`); each function returns
    the reward's unweighted score for every episode. The task's `@vf.metric` methods follow with weight 0 (logged as
    `rewards/<name>/mean`, not trained on; a metric named like a reward is suffixed `_metric`). Read from the
    taskset's first task. Episodes without a trace (failed, or run by another agent) get `None`.

    Returns:
        `(reward_funcs, reward_weights)`.
    """
    first = next(iter(env.taskset.take(1)), None)
    if first is None:
        raise ValueError(f"The verifiers taskset {env.config.taskset.id!r} yields no task.")
    rewards = [(fn.__name__, float(getattr(fn, "_vf_weight", 1.0))) for fn in first.hooks("reward")]
    rewards += [(judge.reward_name, float(judge.config.weight)) for judge in first.plugged_judges()]
    known = {name for name, _ in rewards}
    funcs = [_reward_func(name, name, "rewards", known) for name, _ in rewards]
    for fn in first.hooks("metric"):
        label = fn.__name__ if fn.__name__ not in known else f"{fn.__name__}_metric"
        funcs.append(_reward_func(label, fn.__name__, "metrics", known))
    return funcs, [weight for _, weight in rewards] + [0.0] * (len(funcs) - len(rewards))


def _reward_func(label: str, key: str, kind: str, known: set[str]) -> Callable:
    def reward(prompts: list, completions: list, episodes: list | None = None, **kwargs: Any) -> list[float | None]:
        if episodes is None:
            raise ValueError(
                f"The reward function {label!r} reads verifiers traces and needs `episodes=` (AgenticGRPOTrainer and "
                "Evaluator pass them); it cannot score plain TRL completions."
            )
        scores: list[float | None] = []
        for episode in episodes:
            trace = verifiers_trace(episode)
            if trace is None:
                if episode.status == "ok":
                    raise ValueError(
                        f"The reward function {label!r} of a verifiers taskset got an episode that no VerifiersAgent "
                        f"ran (its result is a {type(episode.result).__name__}); use the suite's agent (suite.agent) "
                        "with its reward functions."
                    )
                scores.append(None)
                continue
            unknown = sorted(set(trace.rewards) - known)
            if unknown:
                # A reward returning a mapping records its keys instead of its name: they have no function here.
                raise ValueError(
                    f"The verifiers trace holds rewards {unknown} that no reward function maps (a @vf.reward returning "
                    f"a mapping of scores); the suite's functions are {sorted(known)}. Return one float per @vf.reward."
                )
            value = getattr(trace, kind).get(key)
            if value is not None and kind == "rewards":
                value = value.score
            scores.append(None if value is None else float(value))
        return scores

    reward.__name__ = reward.__qualname__ = label
    reward.__doc__ = f"The verifiers task's {kind[:-1]} {key!r}, read from the episode's scored trace."
    return reward


# ---------------------------------------------------------------------------------------------------------------------
# Suite


@dataclass
class VerifiersSuite(TaskSuite):
    """A [`TaskSuite`] made from a verifiers 0.4 environment by [`from_verifiers`], with the environment as `env`.

    Its `reward_weights` are the task's reward weights (metrics 0): `trl-agentic train`/`eval` use them, and a trainer
    built in code takes them as `AgenticGRPOConfig(reward_weights=suite.reward_weights)`.
    """

    env: Any = None


def _no_demonstrations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    raise ValueError(
        "A verifiers taskset brings no demonstrations for an SFT warm start; warm-start from your own "
        "conversations or train without one."
    )


def from_verifiers(env: Any, *, name: str | None = None, eval_taskset: Any = None) -> VerifiersSuite:
    """Dataset, agent and reward functions of a verifiers 0.4 environment, as a [`TaskSuite`].

    Args:
        env: a single-agent `vf.Env`, e.g. `vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset={"id": ...},
            agent={"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}))` (verifiers' default runtime is a
            Prime sandbox: an account and network access).
        name: the suite's name (default: the environment's `env_id`).
        eval_taskset: the held-out tasks, a `vf.Taskset` (e.g. the same taskset class over another split) of the
            same task type. verifiers 0.4 tasksets have no splits of their own: without one, `build_dataset("eval")`
            is refused rather than evaluating on the training tasks.

    Returns:
        A [`VerifiersSuite`]: `build_dataset(split="train" | "eval" | "all", size, seed)` returns up to `size` tasks
        of the taskset, of `eval_taskset`, or of both in order (train and eval shuffled with `seed` when finite) as
        rows ([`task_row`]); `agent` is a [`VerifiersAgent`];
        `reward_funcs`/`reward_weights` come from the tasks' rewards ([`task_reward_funcs`]); `agent_columns` are
        `prompt`, `verifiers_task` and `example_id`.

    Example:

    ```python
    >>> suite = from_verifiers(env)
    >>> [f.__name__ for f in suite.reward_funcs], suite.reward_weights
    (['correct', 'short', 'length'], [1.0, 0.5, 0.0])
    ```
    """
    _check_env(env, "from_verifiers")
    label = name or env.config.env_id
    if eval_taskset is not None and type(eval_taskset).task_type() is not type(env.taskset).task_type():
        raise ValueError(
            f"eval_taskset yields {type(eval_taskset).task_type().__name__} tasks, the environment's taskset "
            f"{type(env.taskset).task_type().__name__}: the agent rebuilds every task with the environment's task type."
        )
    reward_funcs, reward_weights = task_reward_funcs(env)
    if not any(reward_weights):
        raise ValueError(
            f"The tasks of the verifiers environment {label!r} have no reward with a non-zero weight (functions: "
            f"{[f.__name__ for f in reward_funcs]}), so every reward would be 0. Give the task a @vf.reward method."
        )

    def build_dataset(split: str = "train", size: int = 256, seed: int = 0) -> datasets.Dataset:
        if split == "all":  # every task: the taskset's, then the held-out ones
            tasksets = [env.taskset] if eval_taskset is None else [env.taskset, eval_taskset]
            rows = [task_row(task) for taskset in tasksets for task in taskset.take(size)]
            return datasets.Dataset.from_list(rows[:size])
        if split == "train":
            taskset = env.taskset
        elif split == "eval":
            if eval_taskset is None:
                raise ValueError(
                    f"The verifiers environment {label!r} has no held-out tasks: verifiers 0.4 tasksets have no "
                    "splits, so pass them, from_verifiers(env, eval_taskset=<a vf.Taskset of other tasks>) (or "
                    "evaluate on the training tasks knowingly: trl-agentic eval --split train)."
                )
            taskset = eval_taskset
        else:
            raise ValueError(f"split must be 'train', 'eval' or 'all', got {split!r}.")
        view = taskset.shuffle(seed).take(size) if taskset.bounded else taskset.take(size)
        return datasets.Dataset.from_list([task_row(task) for task in view])

    first = next(iter(env.taskset.take(1)))
    return VerifiersSuite(
        name=label,
        tools=[],
        system_prompt=first.data.system_prompt or "",
        build_dataset=build_dataset,
        agent=VerifiersAgent(env),
        reward_funcs=reward_funcs,
        demonstrations=_no_demonstrations,
        agent_columns=("prompt", TASK_COLUMN, "example_id"),
        env=env,
        reward_weights=reward_weights,
    )


def load_verifiers_suite(
    taskset_id: str, harness: str | None = None, runtime: str = "subprocess", **env_args: Any
) -> VerifiersSuite:
    """`from_verifiers` of the environment verifiers builds for an installed taskset (what
    `get_task("verifiers:<taskset-id>")` returns): `vf.load_environment` of its config, its agent's harness the
    taskset's default (or `harness`), in the `runtime` given (default `subprocess`, on this machine; verifiers' own
    default is a Prime sandbox). `env_args` are more of the environment config's fields.

    Example:

    ```python
    >>> load_verifiers_suite("my-taskset", harness="null").name
    'my-taskset'
    ```
    """
    if not taskset_id:
        raise ValueError("No taskset id: write the task as 'verifiers:<taskset-id>', e.g. 'verifiers:gsm8k'.")
    from verifiers.v1.utils.loaders import load_environment

    agent = {"runtime": {"type": runtime}, **({"harness": {"id": harness}} if harness else {})}
    config = resolve_env_config({"taskset": {"id": taskset_id}, "agent": agent, **env_args})
    return from_verifiers(load_environment(config), name=taskset_id)


__all__ = [
    "NO_KEY_VAR",
    "TASK_COLUMN",
    "VerifiersAgent",
    "VerifiersResult",
    "VerifiersSuite",
    "from_verifiers",
    "load_verifiers_suite",
    "task_from_row",
    "task_reward_funcs",
    "task_row",
    "verifiers_state",
    "verifiers_trace",
]
