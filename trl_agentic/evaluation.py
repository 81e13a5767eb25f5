"""Evaluation: run an agent against a model, score its episodes, summarize them with one definition of success.

**Success.** An episode *succeeds* when its reward is not `None` and is `>= success_threshold`. `success` is the
number of successful episodes over *all* episodes: an episode that crashed (`agent_error`), timed out, overflowed the
context or hit a limit, or that no checker could score (reward `None`), is a failure. Figures computed over the
scorable episodes only are reported beside it and named as such: `scored_success`, `scored_mean_reward`,
`scored_reward_funcs`. pass@k (unbiased estimator) counts the same successes.

`trl-agentic eval`, the demo's held-out evaluation and the benchmarks all report through this module. The model is
served exactly as in training: the agent talks to the endpoint built by `trl_agentic.endpoint.launch` (sampling set
by the server, not the agent) and the checkers are called with TRL's reward-function signature, with failed episodes
unscorable unless a checker scores them (`trl_agentic.rewards.unscorable_unless_ok`).

Example:

```python
>>> from trl_agentic.evaluation import Evaluator
>>> from trl_agentic.tasks import get_task
>>> from trl_agentic.tiny_models import load_model_and_tokenizer
>>> model, tokenizer = load_model_and_tokenizer("tiny:qwen2_5:64x2")
>>> suite = get_task("calculator")
>>> with Evaluator(model, tokenizer, suite, suite.build_dataset("eval", size=8), num_samples=4) as evaluator:
...     metrics = evaluator.evaluate(seed=0)
>>> metrics["success"], metrics["pass@4"], metrics["status"]["ok"]
(0.0, 0.0, 32)
```
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .endpoint.launch import DEFAULT_BATCH_WAIT_MS, DEFAULT_MAX_BATCH_SIZE, build_engine, launch_endpoint
from .generation.engine import derive_seed
from .rewards.utils import unscorable_unless_ok
from .rollout.agents import resolve_agent
from .rollout.harnesses import release_episodes
from .rollout.runner import run_episode, run_rollout
from .tasks import TaskSuite, get_task
from .trace import EPISODE_STATUSES, Episode


SUCCESS_NOTE = (
    "success = successful episodes / all episodes: an episode that crashed, timed out, overflowed the context, hit a "
    "limit or could not be scored (reward None) is a failure. scored_* figures are over scorable episodes only."
)
FINAL_STATUSES = tuple(status for status in EPISODE_STATUSES if status != "running")


# ---------------------------------------------------------------------------------------------------------------------
# pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task from `n` samples of which `c` are correct: `1 - C(n - c, k) / C(n, k)`.

    The estimator of the Codex paper (Chen et al., 2021, "Evaluating Large Language Models Trained on Code", eq. 1),
    computed as a product so that large `n` does not overflow.

    Args:
        n: samples drawn for the task.
        c: correct samples among them.
        k: the `k` of pass@k, `1 <= k <= n`.

    Example:

    ```python
    >>> pass_at_k(n=4, c=1, k=1), pass_at_k(n=4, c=1, k=2), pass_at_k(n=4, c=0, k=4)
    (0.25, 0.5, 0.0)
    ```
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}.")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples per task, got k={k}, n={n}; draw more samples.")
    if n - c < k:  # every draw of k samples contains a correct one
        return 1.0
    failure = 1.0
    for i in range(n - c + 1, n + 1):
        failure *= 1.0 - k / i
    return 1.0 - failure


def pass_at_k_values(num_samples: int) -> list[int]:
    """The `k`s reported for `num_samples` samples per task: 1, powers of two, and `num_samples` itself."""
    ks = {1, num_samples}
    k = 2
    while k < num_samples:
        ks.add(k)
        k *= 2
    return sorted(ks)


# ---------------------------------------------------------------------------------------------------------------------
# Scoring


def _func_name(func: Callable) -> str:
    return getattr(func, "__name__", type(func).__name__)


def score_episodes(
    reward_funcs: Sequence[Callable],
    tasks: list[dict[str, Any]],
    episodes: list[Episode],
    reward_weights: Sequence[float] | None = None,
) -> tuple[list[float | None], dict[str, list[float | None]], dict[str, list[float]]]:
    """Score episodes with TRL-signature reward functions, as the trainer does.

    Each function is called once with `prompts`, `completions` (each episode's messages after the prompt),
    `completion_ids` (every token the episode sampled, all turns), `episodes`, the dataset columns (but `prompt`),
    and TRL's `trainer_state=None`, `log_extra`, `log_metric`. Failed episodes are unscorable (`None`) unless the
    function sets `scores_failed_episodes = True`. An episode's reward is the weighted sum of the functions that
    scored it (TRL's `nansum`), or `None` when none did.

    Returns:
        `(rewards, rewards_per_func, logged_metrics)`.

    Example:

    ```python
    >>> rewards, per_func, _ = score_episodes([calculator_correct], tasks, episodes)
    >>> rewards
    [1.0, 0.0, None]
    ```
    """
    if reward_weights is None:
        reward_weights = [1.0] * len(reward_funcs)
    if len(reward_weights) != len(reward_funcs):
        raise ValueError(
            f"Got {len(reward_weights)} reward_weights for {len(reward_funcs)} reward functions; give one weight per "
            "function."
        )
    prompts = [task["prompt"] for task in tasks]
    completions = [
        episode.messages[len(prompt) :] if episode.messages else []
        for episode, prompt in zip(episodes, prompts, strict=True)
    ]
    completion_ids = [[token for turn in episode.turns for token in turn.completion_ids] for episode in episodes]
    columns = [key for key in tasks[0] if key not in ("prompt", "completion", "completion_ids")] if tasks else []
    logged: dict[str, list[float]] = {}

    def log_metric(name: str, value: float) -> None:
        logged.setdefault(name, []).append(float(value))

    kwargs = {key: [task[key] for task in tasks] for key in columns}
    kwargs.update(episodes=episodes, trainer_state=None, log_extra=lambda *args, **kw: None, log_metric=log_metric)

    per_func: dict[str, list[float | None]] = {}
    for func in reward_funcs:
        if not callable(func) or isinstance(func, type):
            raise ValueError(f"Reward function {func!r} is not a function; evaluation supports callables only.")
        output = unscorable_unless_ok(func)(
            prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs
        )
        if inspect.isawaitable(output):
            output = asyncio.run(output)
        output = list(output)
        if len(output) != len(episodes):
            raise ValueError(
                f"The reward function {_func_name(func)!r} returned {len(output)} rewards for {len(episodes)} "
                "episodes; it must return one per completion."
            )
        values = [None if r is None or math.isnan(float(r)) else float(r) for r in output]  # NaN = None, as in TRL
        name, suffix = _func_name(func), 1
        while name in per_func:  # the same function twice (e.g. with two weights)
            suffix += 1
            name = f"{_func_name(func)}_{suffix}"
        per_func[name] = values

    rewards: list[float | None] = []
    for i in range(len(episodes)):
        scored = [(w, values[i]) for w, values in zip(reward_weights, per_func.values()) if values[i] is not None]
        rewards.append(sum(w * r for w, r in scored) if scored else None)
    return rewards, per_func, logged


# ---------------------------------------------------------------------------------------------------------------------
# Summaries


def is_success(reward: float | None, success_threshold: float = 1.0) -> bool:
    """Whether an episode with this reward succeeded: it was scored, and reached the threshold.

    Example:

    ```python
    >>> is_success(1.0), is_success(0.0), is_success(None)
    (True, False, False)
    ```
    """
    return reward is not None and reward >= success_threshold


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(
    episodes: list[Episode],
    rewards: list[float | None],
    num_tasks: int,
    num_samples: int,
    success_threshold: float = 1.0,
    rewards_per_func: dict[str, list[float | None]] | None = None,
) -> dict[str, Any]:
    """Aggregate scored episodes (task-major: the `num_samples` episodes of task 0, then of task 1, ...) into metrics.

    Returns:
        `success` (successful episodes / all episodes), `scored_success` (over scorable episodes only), `episodes`,
        `scored_episodes`, `unscorable_episodes`, `scored_mean_reward`, `scored_reward_funcs` (mean of each
        function over the episodes it scored), `pass@1`, `pass@{num_samples}`, `pass@k` (every reported k), `status`
        (episodes by final status), `mean_turns`, `mean_tool_calls`, `malformed_tool_calls`,
        `malformed_tool_call_rate` (per model call), `mean_sampled_tokens`, and `per_task`.

    Example:

    ```python
    >>> summary = summarize(episodes, rewards=[1.0, 0.0, None, 1.0], num_tasks=2, num_samples=2)
    >>> summary["success"], summary["scored_success"], summary["pass@2"]
    (0.5, 0.6666666666666666, 1.0)
    ```
    """
    if num_tasks < 1 or num_samples < 1:
        raise ValueError(f"Need at least one task and one sample per task, got {num_tasks} and {num_samples}.")
    if len(episodes) != num_tasks * num_samples or len(rewards) != len(episodes):
        raise ValueError(
            f"Expected {num_tasks} tasks x {num_samples} samples = {num_tasks * num_samples} episodes and rewards, "
            f"got {len(episodes)} episodes and {len(rewards)} rewards."
        )
    successes = [is_success(r, success_threshold) for r in rewards]
    ks = pass_at_k_values(num_samples)
    per_task = []
    for t in range(num_tasks):
        block = slice(t * num_samples, (t + 1) * num_samples)
        correct = sum(successes[block])
        per_task.append(
            {
                "index": t,
                "correct": correct,
                "samples": num_samples,
                "pass@k": {str(k): pass_at_k(num_samples, correct, k) for k in ks},
                "rewards": rewards[block],
                "statuses": [episode.status for episode in episodes[block]],
            }
        )
    pass_at = {str(k): sum(task["pass@k"][str(k)] for task in per_task) / num_tasks for k in ks}

    num_episodes = len(episodes)
    scored = [r for r in rewards if r is not None]
    statuses = Counter(episode.status for episode in episodes)
    num_turns = sum(len(episode.turns) for episode in episodes)
    malformed = sum(episode.num_malformed_tool_calls for episode in episodes)
    return {
        "success": sum(successes) / num_episodes,
        "scored_success": sum(successes) / len(scored) if scored else 0.0,
        "success_threshold": success_threshold,
        "episodes": num_episodes,
        "scored_episodes": len(scored),
        "unscorable_episodes": num_episodes - len(scored),
        "num_tasks": num_tasks,
        "num_samples": num_samples,
        "pass@1": pass_at["1"],
        f"pass@{num_samples}": pass_at[str(num_samples)],
        "pass@k": pass_at,
        "scored_mean_reward": _mean(scored),
        "scored_reward_funcs": {
            name: _mean([v for v in values if v is not None]) for name, values in (rewards_per_func or {}).items()
        },
        "status": {status: statuses.get(status, 0) for status in FINAL_STATUSES},
        "mean_turns": num_turns / num_episodes,
        "mean_tool_calls": sum(episode.num_tool_calls for episode in episodes) / num_episodes,
        "malformed_tool_calls": malformed,
        # Per model call: calls whose output looked like a tool call but did not parse, over all model calls.
        "malformed_tool_call_rate": malformed / num_turns if num_turns else 0.0,
        "mean_sampled_tokens": sum(episode.num_sampled_tokens for episode in episodes) / num_episodes,
        "note": SUCCESS_NOTE,
        "per_task": per_task,
    }


def write_episodes(
    path: str | os.PathLike,
    episodes: list[Episode],
    rewards: list[float | None],
    rewards_per_func: dict[str, list[float | None]],
    num_samples: int,
) -> Path:
    """Write every episode with its rewards as JSONL: `task_index`, `sample`, `reward`, `rewards` (per function),
    `episode` (the Episode JSON)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, episode in enumerate(episodes):
            record = {
                "task_index": i // num_samples,
                "sample": i % num_samples,
                "reward": rewards[i],
                "rewards": {name: values[i] for name, values in rewards_per_func.items()},
                "episode": episode.to_dict(),
            }
            f.write(json.dumps(record, default=str) + "\n")
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Running episodes against a model


class Evaluator:
    """An agent, its tasks and checkers, and an endpoint serving a model: evaluate the model as often as needed.

    The endpoint stays up between evaluations; `evaluate(model)` swaps the weights it serves (e.g. the live model of
    a training run, as the demo does every few steps). Every task is run `num_samples` times (the `n` of pass@k).

    Args:
        model: a causal LM (its current weights are used; it is not modified).
        tokenizer: its tokenizer, with a chat template (and tool-call parsing: `tiny_models.load_model_and_tokenizer`).
        suite: a [`TaskSuite`] or a task name (`"calculator"`, `"pkg.module:attr"`).
        dataset: rows with a conversational `prompt` and the checker's columns (`suite.build_dataset("eval", ...)`).
        num_samples: episodes per task; pass@k is reported for k = 1, powers of two, and `num_samples`.
        temperature: sampling temperature of every model call (`0` = greedy).
        max_tokens: most tokens of one model call.
        top_p, top_k: nucleus / top-k sampling; `None` = what the agent asks (default 1.0 / off).
        min_p, repetition_penalty: TRL's min-p sampling and repetition penalty on every call; `None` = off.
        agent: replaces the suite's agent (a function `(client, task)` or a `CommandAgent`).
        reward_funcs: replace the suite's checkers (TRL signature).
        reward_weights: one weight per reward function (default: the suite's `reward_weights` for its own checkers,
            else 1.0 each).
        success_threshold: an episode succeeds when its reward is `>=` this.
        concurrency: most episodes running at once.
        max_turns, max_episode_tokens: per-episode limits, as in [`AgenticGRPOConfig`].
        episode_timeout: wall-clock seconds per episode.
        max_generation_batch_size, generation_batch_wait_ms: the engine's batching, as in [`AgenticGRPOConfig`].
        chat_template_kwargs: extra variables for the chat template.
        progress: show a tqdm bar over episodes (on stderr).

    Example:

    ```python
    >>> evaluator = Evaluator(model, tokenizer, "calculator", dataset, num_samples=4, temperature=0.7)
    >>> before = evaluator.evaluate(seed=0)
    >>> trainer.train()
    >>> after = evaluator.evaluate(trainer.model, seed=0)
    >>> evaluator.close()
    ```
    """

    def __init__(
        self,
        model,
        tokenizer,
        suite,
        dataset,
        *,
        num_samples: int = 1,
        temperature: float = 1.0,
        max_tokens: int = 512,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        agent: Any = None,
        reward_funcs: Sequence[Callable] | None = None,
        reward_weights: Sequence[float] | None = None,
        success_threshold: float = 1.0,
        concurrency: int = 64,
        max_turns: int | None = 16,
        max_episode_tokens: int | None = None,
        episode_timeout: float = 300.0,
        max_generation_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        generation_batch_wait_ms: float = DEFAULT_BATCH_WAIT_MS,
        chat_template_kwargs: dict[str, Any] | None = None,
        progress: bool = False,
    ):

        # Task, agent and checkers
        self.suite = suite if isinstance(suite, TaskSuite) else get_task(suite)
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1 (episodes per task), got {num_samples}.")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 (episodes at once), got {concurrency}.")
        if len(dataset) == 0:
            raise ValueError("The evaluation dataset is empty; build it with a size >= 1.")
        self.agent = resolve_agent(agent if agent is not None else self.suite.agent)
        self.reward_funcs = list(reward_funcs if reward_funcs is not None else self.suite.reward_funcs)
        if not self.reward_funcs:
            raise ValueError("No reward functions: the suite has none and none were given.")
        # The suite's own checkers come with its weights (a verifiers rubric's); checkers given here, with those given.
        self.reward_weights = (
            reward_weights if reward_weights is not None or reward_funcs is not None else self.suite.reward_weights
        )
        self.success_threshold = success_threshold

        # Tasks, task-major: the num_samples episodes of a task are consecutive (one group)
        self.num_tasks, self.num_samples = len(dataset), num_samples
        self.tasks = [dict(row) for row in dataset for _ in range(num_samples)]
        # The agent sees its suite's `agent_columns` only, as in training; the checkers get every column (issue #9).
        missing = [c for c in self.suite.agent_columns if c not in self.tasks[0]]
        if missing:
            raise ValueError(
                f"The suite's agent_columns {missing} are not columns of the dataset {sorted(self.tasks[0])}."
            )
        self.agent_tasks = [{c: task[c] for c in self.suite.agent_columns} for task in self.tasks]
        self.concurrency, self.episode_timeout, self.progress = concurrency, episode_timeout, progress
        self.sampling = {
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "max_tokens": max_tokens,
            "max_turns": max_turns,
            # set only (the summary of a run that uses neither stays as it was)
            **{k: v for k, v in (("min_p", min_p), ("repetition_penalty", repetition_penalty)) if v is not None},
        }

        # Endpoint serving the model, built as the trainer builds it
        self.engine = build_engine(
            model, tokenizer, max_batch_size=max_generation_batch_size, batch_wait_ms=generation_batch_wait_ms
        )
        self.server = launch_endpoint(
            self.engine,
            tokenizer,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            max_tokens=max_tokens,
            max_turns=max_turns,
            max_episode_tokens=max_episode_tokens,
            chat_template_kwargs=chat_template_kwargs,
        )

    def run(self, model=None, seed: int | None = None) -> list[Episode]:
        """Run every task's episodes against `model` (default: the model served last) and return them, task-major.

        With a `seed`, episode `i` samples from seeds derived from `(seed, i)` and each call's index in the episode
        (`run_episodes`): the same seed samples the same tokens however the concurrent episodes' calls interleave
        (issue 29). Neither draws from, or moves, torch's global RNG. The model's weights are taken afresh, even if
        they were edited in place since the last run.
        """
        if model is not None:
            self.engine.model = model
        self.engine.sync_weights()  # an EMA callback or a loader writing through `.data` bumps nothing the engine sees
        if seed is not None:
            self.engine.manual_seed(seed)
        return run_rollout(self._run_episodes(seed))  # a hung agent cannot hold the evaluation (issue 9)

    async def _run_episodes(self, seed: int | None = None) -> list[Episode]:
        from tqdm.auto import tqdm

        semaphore = asyncio.Semaphore(self.concurrency)
        statuses: Counter[str] = Counter()
        bar = tqdm(
            total=len(self.tasks),
            desc=f"eval {self.suite.name}",
            unit="episode",
            disable=not self.progress,
            file=sys.stderr,
        )

        async def one(i: int) -> Episode:
            async with semaphore:
                # No connection pool shared with the others: each agent runs on an event loop (and a thread) of its
                # own with a pool of its own, so one that blocks or exits holds only its episode (issue 40).
                episode = await run_episode(
                    self.server,
                    self.agent,
                    self.agent_tasks[i],
                    i // self.num_samples,
                    i % self.num_samples,
                    self.episode_timeout,
                    seed=None if seed is None else derive_seed(seed, i),
                )
            statuses[episode.status] += 1
            bar.update(1)
            bar.set_postfix({s: statuses[s] for s in sorted(statuses)}, refresh=False)
            return episode

        try:
            return list(await asyncio.gather(*[one(i) for i in range(len(self.tasks))]))
        finally:
            bar.close()

    def score(self, episodes: list[Episode]):
        """`score_episodes` with this evaluator's checkers and weights: `(rewards, rewards_per_func, logged)`."""
        return score_episodes(self.reward_funcs, self.tasks, episodes, self.reward_weights)

    def summarize(
        self,
        episodes: list[Episode],
        rewards: list[float | None],
        rewards_per_func: dict[str, list[float | None]] | None = None,
    ) -> dict[str, Any]:
        """`summarize` for this evaluator's tasks, samples and threshold."""
        return summarize(episodes, rewards, self.num_tasks, self.num_samples, self.success_threshold, rewards_per_func)

    def evaluate(
        self, model=None, seed: int | None = None, episodes_path: str | os.PathLike | None = None
    ) -> dict[str, Any]:
        """Run, score and summarize: the metrics of `summarize`, plus `task`, the sampling settings, `seed` and
        `seconds` (and `logged_metrics` when a checker logged any). `episodes_path`: also write every episode as JSONL.
        """
        started = time.monotonic()
        episodes = self.run(model, seed)
        try:
            rewards, per_func, logged = self.score(episodes)
        finally:
            release_episodes(self.agent, episodes)  # scored: a harness's workspaces can go
        summary = self.summarize(episodes, rewards, per_func)
        if logged:
            summary["logged_metrics"] = {name: _mean(values) for name, values in logged.items()}
        if episodes_path is not None:
            write_episodes(episodes_path, episodes, rewards, per_func, self.num_samples)
        header = {
            "task": self.suite.name,
            **self.sampling,
            "seed": seed,
            "seconds": round(time.monotonic() - started, 3),
        }
        return {**header, **summary}

    def close(self) -> None:
        """Stop the engine's batching worker and the endpoint."""
        try:
            self.server.call(self.engine.stop(), timeout=10)
        finally:
            self.server.stop()

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def evaluate(
    model,
    tokenizer,
    suite,
    dataset,
    num_samples: int = 4,
    temperature: float = 1.0,
    *,
    seed: int | None = None,
    episodes_path: str | os.PathLike | None = None,
    **evaluator_kwargs,
) -> dict[str, Any]:
    """Evaluate once: run `num_samples` episodes of the agent on every row of `dataset` against `model`, and score
    them (what `trl-agentic eval` does). The other keyword arguments are those of [`Evaluator`].

    Example:

    ```python
    >>> metrics = evaluate(model, tokenizer, "calculator", suite.build_dataset("eval", size=8), num_samples=4)
    >>> metrics["success"], metrics["pass@4"]
    (0.0, 0.0)
    ```
    """
    with Evaluator(
        model, tokenizer, suite, dataset, num_samples=num_samples, temperature=temperature, **evaluator_kwargs
    ) as evaluator:
        return evaluator.evaluate(seed=seed, episodes_path=episodes_path)


__all__ = [
    "Evaluator",
    "evaluate",
    "is_success",
    "pass_at_k",
    "pass_at_k_values",
    "score_episodes",
    "summarize",
    "write_episodes",
]
