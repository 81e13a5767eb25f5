# /// script
# requires-python = ">=3.10"
# dependencies = [
#     "trl-agentic",
# ]
# ///
"""Evaluate an agent against a model on a task split: mean reward, pass@1 / pass@k, statuses, turns, tool calls.

```bash
trl-agentic eval --config recipes/calculator/tiny/config_cpu.yaml --num-samples 4 --output eval.json
trl-agentic eval --config recipes/calculator/Qwen2.5-1.5B-Instruct/config_lora.yaml \
    --model outputs/calculator-Qwen2.5-1.5B-Instruct-lora --size 200
trl-agentic eval --task calculator --model Qwen/Qwen2.5-0.5B-Instruct --temperature 0.7 --num-samples 8
```

The model is served exactly as during training: the agent talks to an in-process OpenAI-compatible endpoint (the
same `create_app` the trainer starts) and the task's checkers score the episodes with TRL's reward-function
signature. A recipe supplies `task`, `model_name_or_path`, the agent overrides (`agent`, `agent_command`,
`reward_funcs`, `reward_weights`), `eval_size`, `dataset_seed`, `seed`, the sampling settings (`temperature`, `top_p`,
`top_k`, `max_completion_length`) and the episode limits (`max_turns`, `max_episode_tokens`, `episode_timeout`),
under the names `trl-agentic train` reads; flags override it.

An episode is *successful* when its reward is `>= success_threshold`. An episode nobody can score (reward `None`:
it crashed, timed out, overflowed the context or hit a limit, or every checker returned `None`) is counted by status,
left out of `mean_reward`, and counted as a failure for pass@k.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
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

import yaml


UNSCORABLE_NOTE = (
    "Unscorable episodes (reward None: status other than ok, or no checker could score them) are counted in "
    "status_counts, excluded from mean_reward, and count as failures for success_rate and pass@k."
)


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
    episodes: list,
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
    """
    from ..agentic_grpo_trainer import unscorable_unless_ok

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
        wrapped = unscorable_unless_ok(func)
        output = wrapped(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
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


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(
    episodes: list,
    rewards: list[float | None],
    num_tasks: int,
    num_samples: int,
    success_threshold: float = 1.0,
    rewards_per_func: dict[str, list[float | None]] | None = None,
) -> dict[str, Any]:
    """Aggregate scored episodes (task-major: the `num_samples` episodes of task 0, then of task 1, ...) into metrics.

    Example:

    ```python
    >>> summarize(episodes, rewards=[1.0, 0.0, None, 1.0], num_tasks=2, num_samples=2)["pass@2"]
    1.0
    ```
    """
    from ..trace import EPISODE_STATUSES

    if len(episodes) != num_tasks * num_samples or len(rewards) != len(episodes):
        raise ValueError(
            f"Expected {num_tasks} tasks x {num_samples} samples = {num_tasks * num_samples} episodes and rewards, "
            f"got {len(episodes)} episodes and {len(rewards)} rewards."
        )
    successes = [r is not None and r >= success_threshold for r in rewards]
    ks = pass_at_k_values(num_samples)
    per_task = []
    for t in range(num_tasks):
        block = slice(t * num_samples, (t + 1) * num_samples)
        correct = sum(successes[block])
        per_task.append({
            "index": t,
            "correct": correct,
            "samples": num_samples,
            "pass@k": {str(k): pass_at_k(num_samples, correct, k) for k in ks},
            "rewards": rewards[block],
            "statuses": [episode.status for episode in episodes[block]],
        })
    pass_at = {str(k): _mean([task["pass@k"][str(k)] for task in per_task]) or 0.0 for k in ks}

    statuses = Counter(episode.status for episode in episodes)
    num_turns = sum(len(episode.turns) for episode in episodes)
    malformed = sum(episode.num_malformed_tool_calls for episode in episodes)
    scored = [r for r in rewards if r is not None]
    num_episodes = len(episodes)
    summary: dict[str, Any] = {
        "num_tasks": num_tasks,
        "num_samples": num_samples,
        "num_episodes": num_episodes,
        "success_threshold": success_threshold,
        "mean_reward": _mean(scored),
        "scored_episodes": len(scored),
        "unscorable_episodes": num_episodes - len(scored),
        "reward_funcs": {name: _mean([v for v in values if v is not None]) for name, values in
                         (rewards_per_func or {}).items()},
        "success_rate": sum(successes) / num_episodes if num_episodes else 0.0,
        "pass@1": pass_at["1"],
        f"pass@{num_samples}": pass_at[str(num_samples)],
        "pass@k": pass_at,
        "status_counts": {status: statuses.get(status, 0) for status in EPISODE_STATUSES if status != "running"},
        "mean_turns": num_turns / num_episodes if num_episodes else 0.0,
        "mean_tool_calls": _mean([episode.num_tool_calls for episode in episodes]) or 0.0,
        "malformed_tool_calls": malformed,
        # Per model call: calls whose output looked like a tool call but did not parse, over all model calls.
        "malformed_tool_call_rate": malformed / num_turns if num_turns else 0.0,
        "mean_sampled_tokens": _mean([episode.num_sampled_tokens for episode in episodes]) or 0.0,
        "note": UNSCORABLE_NOTE,
        "per_task": per_task,
    }
    return summary


# ---------------------------------------------------------------------------------------------------------------------
# Episodes


async def _run_with_progress(server, agent, tasks, num_samples, concurrency, timeout, bar) -> list:
    from ..rollout.runner import run_episode

    semaphore = asyncio.Semaphore(concurrency)
    statuses: Counter[str] = Counter()

    async def one(i: int):
        async with semaphore:
            episode = await run_episode(server, agent, tasks[i], i // num_samples, i % num_samples, timeout, "policy")
        statuses[episode.status] += 1
        bar.update(1)
        bar.set_postfix({s: statuses[s] for s in sorted(statuses)}, refresh=False)
        return episode

    return list(await asyncio.gather(*[one(i) for i in range(len(tasks))]))


def evaluate(
    model,
    tokenizer,
    suite,
    dataset,
    num_samples: int = 4,
    temperature: float = 1.0,
    *,
    max_tokens: int = 512,
    top_p: float | None = None,
    top_k: int | None = None,
    agent: Any = None,
    reward_funcs: Sequence[Callable] | None = None,
    reward_weights: Sequence[float] | None = None,
    success_threshold: float = 1.0,
    concurrency: int = 64,
    max_turns: int | None = 16,
    max_episode_tokens: int | None = None,
    episode_timeout: float = 300.0,
    max_generation_batch_size: int = 64,
    chat_template_kwargs: dict[str, Any] | None = None,
    seed: int | None = None,
    progress: bool = True,
    episodes_path: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Run `num_samples` episodes of the agent on every row of `dataset` against `model`, and score them.

    The model is served by the same OpenAI-compatible endpoint the trainer uses (embedded `TransformersEngine`,
    sampling set by the server, not by the agent), so an evaluation sees the policy exactly as training did.

    Args:
        model: a causal LM (its current weights are used; it is not modified).
        tokenizer: its tokenizer, with a chat template (and tool-call parsing: `tiny_models.load_model_and_tokenizer`).
        suite: a [`TaskSuite`] or a task name (`"calculator"`, `"pkg.module:attr"`).
        dataset: rows with a conversational `prompt` and the checker's columns (`suite.build_dataset("eval", ...)`).
        num_samples: episodes per task (the `n` of the pass@k estimator); pass@k is reported for k = 1, powers of
            two, and `num_samples`.
        temperature: sampling temperature of every model call (`0` = greedy).
        max_tokens: most tokens of one model call.
        top_p, top_k: nucleus / top-k sampling; `None` = what the agent asks (default 1.0 / off).
        agent: replaces the suite's agent (a function `(client, task)` or a `CommandAgent`).
        reward_funcs: replace the suite's checkers (TRL signature).
        reward_weights: one weight per reward function (default 1.0 each).
        success_threshold: an episode is successful when its reward is `>=` this.
        concurrency: most episodes running at once.
        max_turns, max_episode_tokens: per-episode limits, as in [`AgenticGRPOConfig`].
        episode_timeout: wall-clock seconds per episode.
        max_generation_batch_size: most requests the engine samples together.
        chat_template_kwargs: extra variables for the chat template.
        seed: seeds torch before sampling (episodes run concurrently, so batches, hence draws, may still differ).
        progress: show a tqdm bar over episodes (on stderr).
        episodes_path: write every episode with its rewards as JSONL there.

    Returns:
        The metrics (see `summarize`), plus `task`, the sampling settings and `seconds`.

    Example:

    ```python
    >>> from trl_agentic.tasks import get_task
    >>> from trl_agentic.tiny_models import load_model_and_tokenizer
    >>> model, tokenizer = load_model_and_tokenizer("tiny:qwen2_5:64x2")
    >>> suite = get_task("calculator")
    >>> metrics = evaluate(model, tokenizer, suite, suite.build_dataset("eval", size=8), num_samples=4)
    >>> metrics["pass@1"], metrics["pass@4"], metrics["status_counts"]["ok"]
    (0.0, 0.0, 32)
    ```
    """
    import torch
    from tqdm.auto import tqdm

    from ..endpoint.app import EndpointSettings, SamplingOverrides, create_app
    from ..endpoint.chat import ChatRenderer
    from ..endpoint.server import EndpointServer
    from ..endpoint.sessions import EpisodeLimits
    from ..generation.transformers_engine import TransformersEngine
    from ..rollout.agents import resolve_agent
    from ..tasks import TaskSuite, get_task

    # Task, agent and checkers
    if not isinstance(suite, TaskSuite):
        suite = get_task(suite)
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1 (episodes per task), got {num_samples}.")
    if len(dataset) == 0:
        raise ValueError("The evaluation dataset is empty; build it with a size >= 1.")
    episode_agent = resolve_agent(agent if agent is not None else suite.agent)
    reward_funcs = list(reward_funcs if reward_funcs is not None else suite.reward_funcs)
    if not reward_funcs:
        raise ValueError("No reward functions: the suite has none and none were given.")

    # Tasks, task-major: the num_samples episodes of a task are consecutive (one group)
    rows = [dict(row) for row in dataset]
    tasks = [dict(row) for row in rows for _ in range(num_samples)]

    # Endpoint serving the model
    if seed is not None:
        torch.manual_seed(seed)
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, max_batch_size=max_generation_batch_size)
    settings = EndpointSettings(
        served_model_names=["policy"],
        default_max_tokens=max_tokens,
        overrides=SamplingOverrides(temperature=temperature, top_p=top_p, top_k=top_k or None, max_tokens=max_tokens),
        default_limits=EpisodeLimits(max_turns=max_turns, max_episode_tokens=max_episode_tokens),
    )
    server = EndpointServer(create_app(engine, ChatRenderer(tokenizer, chat_template_kwargs), settings)).start()
    started = time.monotonic()
    bar = tqdm(total=len(tasks), desc=f"eval {suite.name}", unit="episode", disable=not progress, file=sys.stderr)
    try:
        episodes = asyncio.run(
            _run_with_progress(server, episode_agent, tasks, num_samples, concurrency, episode_timeout, bar)
        )
    finally:
        bar.close()
        try:
            server.call(engine.stop(), timeout=10)
        finally:
            server.stop()
    seconds = time.monotonic() - started

    # Scores and metrics
    rewards, per_func, logged = score_episodes(reward_funcs, tasks, episodes, reward_weights)
    summary = summarize(episodes, rewards, len(rows), num_samples, success_threshold, per_func)
    if logged:
        summary["logged_metrics"] = {name: _mean(values) for name, values in logged.items()}
    if episodes_path is not None:
        path = Path(episodes_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        names = list(per_func)
        with path.open("w") as f:
            for i, episode in enumerate(episodes):
                record = {
                    "task_index": i // num_samples,
                    "sample": i % num_samples,
                    "reward": rewards[i],
                    "rewards": {name: per_func[name][i] for name in names},
                    "episode": episode.to_dict(),
                }
                f.write(json.dumps(record, default=str) + "\n")
    header = {
        "task": suite.name,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "max_tokens": max_tokens,
        "max_turns": max_turns,
        "seed": seed,
        "seconds": round(seconds, 3),
    }
    return {**header, **summary}


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def load_recipe(path: str) -> dict[str, Any]:
    """Read a training recipe as `trl-agentic train` does: same keys, unknown keys rejected, `env:` block applied.

    Returns every recipe key (the fields of `ScriptArguments`, `AgenticGRPOConfig` and `ModelConfig`) with the
    recipe's value or the field's default. No `TrainingArguments` is built, so a GPU recipe can be read on a CPU.
    """
    from .train import RECIPE_DATACLASSES, make_parser

    with open(path) as f:
        config = yaml.safe_load(f)
    if not isinstance(config, dict):
        raise ValueError(f"Recipe {path} must contain a YAML mapping.")
    env = config.pop("env", {}) or {}
    if not isinstance(env, dict):
        raise ValueError(f"The `env` block of {path} must be a mapping of variable names to values.")
    parser = make_parser(prog="trl-agentic eval")
    parser._config_path = path  # named in the unknown-key error
    parser.set_defaults_with_config(**config)  # raises on a key no dataclass declares, with a did-you-mean hint
    for key, value in env.items():
        os.environ[key] = str(value)
    values: dict[str, Any] = {}
    for dtype in RECIPE_DATACLASSES:
        for f in dataclasses.fields(dtype):
            if not f.init or f.name in values:
                continue
            if f.name in config:
                values[f.name] = config[f.name]
            elif f.default is not dataclasses.MISSING:
                values[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                values[f.name] = f.default_factory()
    return values


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-agentic eval",
        description="Evaluate an agent against a model on a task split: mean reward, pass@1/pass@k, episode "
        "statuses, turns, tool calls. Flags override the recipe.",
    )
    add = parser.add_argument
    add("--config", help="Training recipe YAML: task, model, agent, eval size, seeds, sampling and episode limits.")
    add("--task", help="Task: a bundled name ('calculator', 'files') or an import path 'pkg.module:attr'.")
    add("--model", help="Model to evaluate: Hub id, local path or 'tiny:qwen2_5:64x2' (default: the recipe's "
                        "model_name_or_path).")
    add("--agent", help="Import path 'pkg.module:attr' of an agent replacing the task's agent.")
    add("--agent-command", "--agent_command", dest="agent_command",
        help="Shell command run per episode as the agent.")
    add("--reward-funcs", "--reward_funcs", dest="reward_funcs", nargs="+",
        help="Reward functions replacing the task's (bundled names or 'pkg.module:func').")
    add("--split", default="eval", choices=["eval", "train"], help="Task split (default: eval).")
    add("--size", type=int, help="Tasks to evaluate (default: the recipe's eval_size, else 64).")
    add("--dataset-seed", "--dataset_seed", dest="dataset_seed", type=int,
        help="Seed of the task generator (default: the recipe's dataset_seed, else 0).")
    add("--num-samples", "--num_samples", dest="num_samples", type=int, default=4,
        help="Episodes per task, the n of pass@k (default: 4).")
    add("--temperature", type=float, help="Sampling temperature (default: the recipe's, else 1.0; 0 = greedy).")
    add("--top-p", "--top_p", dest="top_p", type=float, help="Nucleus sampling (default: the recipe's, else off).")
    add("--max-tokens", "--max_tokens", dest="max_tokens", type=int,
        help="Most tokens per model call (default: the recipe's max_completion_length, else 512).")
    add("--max-turns", "--max_turns", dest="max_turns", type=int,
        help="Most model calls per episode (default: the recipe's max_turns, else 16).")
    add("--episode-timeout", "--episode_timeout", dest="episode_timeout", type=float,
        help="Seconds per episode (default: the recipe's episode_timeout, else 300).")
    add("--concurrency", type=int, help="Most episodes at once (default: the recipe's max_concurrent_episodes, "
                                        "else 64).")
    add("--success-threshold", "--success_threshold", dest="success_threshold", type=float, default=1.0,
        help="An episode succeeds when its reward is >= this (default: 1.0).")
    add("--seed", type=int, help="Sampling seed (default: the recipe's seed, else 42).")
    add("--device", help="Device of the model (default: cuda if available, else cpu).")
    add("--output", help="Write the metrics (with per-task details) as JSON to this file.")
    add("--episodes", help="Write every episode with its rewards as JSONL to this file.")
    add("--no-progress", "--no_progress", dest="progress", action="store_false", help="Hide the progress bar.")
    return parser


def _pick(flag, recipe: dict[str, Any], key: str, default=None):
    if flag is not None:
        return flag
    value = recipe.get(key)
    return default if value is None else value


def main(argv: list[str] | None = None) -> int:
    """`trl-agentic eval [--config recipe.yaml] [--task T --model M] [--num-samples K] [--output FILE.json] ...`."""
    args = make_parser().parse_args(argv)
    recipe = load_recipe(args.config) if args.config else {}

    # Task, agent and reward functions: resolved before the model loads, so a bad name fails in seconds
    from ..tasks import get_task
    from .train import ScriptArguments, resolve_agent, resolve_reward_funcs

    if args.size is not None and args.size < 1:
        raise SystemExit(f"trl-agentic eval: --size must be >= 1 task, got {args.size}.")
    if args.num_samples < 1:
        raise SystemExit(f"trl-agentic eval: --num-samples must be >= 1 episode per task, got {args.num_samples}.")
    task_name = _pick(args.task, recipe, "task")
    if task_name is None:
        raise SystemExit("trl-agentic eval: no task; pass --task calculator (or a 'pkg.module:attr') or --config.")
    script_args = ScriptArguments(
        task=task_name,
        agent=_pick(args.agent, recipe, "agent") if args.agent_command is None else None,
        agent_command=_pick(args.agent_command, recipe, "agent_command") if args.agent is None else None,
        reward_funcs=_pick(args.reward_funcs, recipe, "reward_funcs"),
        eval_size=_pick(args.size, recipe, "eval_size", 0),
        dataset_seed=_pick(args.dataset_seed, recipe, "dataset_seed", 0),
    )
    suite = get_task(script_args.task)
    agent = resolve_agent(script_args, suite)
    reward_funcs = resolve_reward_funcs(script_args, suite)
    reward_weights = recipe.get("reward_weights") if args.reward_funcs is None else None
    size = script_args.eval_size or 64  # a recipe without an eval split (eval_size: 0) is still evaluated

    # Model
    model_name = _pick(args.model, recipe, "model_name_or_path")
    if model_name is None:
        raise SystemExit("trl-agentic eval: no model; pass --model (a Hub id, a local path or 'tiny:qwen2_5:64x2') or "
                         "set model_name_or_path in the recipe.")
    import torch

    from ..tiny_models import load_model_and_tokenizer

    dtype = recipe.get("dtype", "auto")
    model_init_kwargs = dict(dtype=dtype if dtype in ("auto", None) else getattr(torch, dtype))
    for key, name in (("revision", "model_revision"), ("trust_remote_code", "trust_remote_code"),
                      ("attn_implementation", "attn_implementation")):
        if recipe.get(name) is not None:
            model_init_kwargs[key] = recipe[name]
    model_init_kwargs.update(recipe.get("model_init_kwargs") or {})
    model, tokenizer = load_model_and_tokenizer(model_name, **model_init_kwargs)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()

    # Dataset and evaluation
    dataset = suite.build_dataset(split=args.split, size=size, seed=script_args.dataset_seed)
    metrics = evaluate(
        model,
        tokenizer,
        suite,
        dataset,
        num_samples=args.num_samples,
        temperature=_pick(args.temperature, recipe, "temperature", 1.0),
        max_tokens=_pick(args.max_tokens, recipe, "max_completion_length", 512),
        top_p=_pick(args.top_p, recipe, "top_p"),
        top_k=recipe.get("top_k") or None,
        agent=agent,
        reward_funcs=reward_funcs,
        reward_weights=reward_weights,
        success_threshold=args.success_threshold,
        concurrency=_pick(args.concurrency, recipe, "max_concurrent_episodes", 64),
        max_turns=_pick(args.max_turns, recipe, "max_turns", 16),
        max_episode_tokens=recipe.get("max_episode_tokens"),
        episode_timeout=_pick(args.episode_timeout, recipe, "episode_timeout", 300.0),
        max_generation_batch_size=recipe.get("max_generation_batch_size") or 64,
        chat_template_kwargs=recipe.get("chat_template_kwargs"),
        seed=_pick(args.seed, recipe, "seed", 42),
        progress=args.progress,
        episodes_path=args.episodes,
    )
    metrics = {"model": model_name, "split": args.split, "config": args.config, **metrics}

    summary = {key: value for key, value in metrics.items() if key != "per_task"}
    print(json.dumps(summary, indent=2))
    if args.output:
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(metrics, indent=2) + "\n")
        print(f"Wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
