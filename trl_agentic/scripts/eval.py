# /// script
# requires-python = ">=3.10"
# dependencies = [
#     "trl-agentic",
# ]
# ///
"""Evaluate an agent against a model on a task split: success, pass@1 / pass@k, statuses, turns, tool calls.

```bash
trl-agentic eval --config recipes/calculator/tiny/config_cpu.yaml --num-samples 4 --output eval.json
trl-agentic eval --config recipes/calculator/Qwen2.5-1.5B-Instruct/config_lora.yaml \
    --model outputs/calculator-Qwen2.5-1.5B-Instruct-lora --size 200
trl-agentic eval --task calculator --model Qwen/Qwen2.5-0.5B-Instruct --temperature 0.7 --num-samples 8
```

A thin command line over `trl_agentic.evaluation` (`from trl_agentic.evaluation import evaluate` in Python). The
model is served exactly as during training: the agent talks to an in-process OpenAI-compatible endpoint built by
`trl_agentic.endpoint.launch`, as the trainer builds it, and the task's checkers score the episodes with TRL's
reward-function signature. A recipe supplies `task`, `model_name_or_path`, the agent overrides (`agent`,
`agent_command`, `reward_funcs`, `reward_weights`), `eval_size`, `dataset_seed`, `seed`, the sampling settings
(`temperature`, `top_p`, `top_k`, `max_completion_length`) and the episode limits (`max_turns`, `max_episode_tokens`,
`episode_timeout`), under the names `trl-agentic train` reads; flags override it.

An episode *succeeds* when its reward is `>= success_threshold`. `success` counts successes over *all* episodes: one
that crashed, timed out, overflowed the context, hit a limit or that no checker could score (reward `None`) is a
failure (see `trl_agentic.evaluation`). Figures over scorable episodes only are named `scored_*`
(`scored_success`, `scored_mean_reward`); episodes are also counted by status.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..imports import TASK_HELP


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-agentic eval",
        description="Evaluate an agent against a model on a task split: success, pass@1/pass@k, episode "
        "statuses, turns, tool calls. Flags override the recipe.",
    )

    def add(name: str, **kwargs):  # `--max-tokens` and `--max_tokens` alike, as `trl-agentic train` spells them
        parser.add_argument(*dict.fromkeys([name, "--" + name[2:].replace("-", "_")]), **kwargs)

    add("--config", help="Training recipe YAML: task, model, agent, eval size, seeds, sampling and episode limits.")
    add("--task", help=TASK_HELP)
    add("--model", help="Model: Hub id, local path or 'tiny:qwen2_5:64x2' (default: the recipe's model_name_or_path).")
    add("--agent", help="Import path 'pkg.module:attr' of an agent replacing the task's agent.")
    add("--agent-command", help="Shell command run per episode as the agent.")
    add("--reward-funcs", nargs="+", help="Reward functions replacing the task's (bundled names or 'pkg.module:func').")
    add(
        "--split",
        default="eval",
        choices=["eval", "train", "all"],
        help="Task split (default: eval; 'all': every task, for a suite that has it, e.g. a BFCL category).",
    )
    add("--size", type=int, help="Tasks to evaluate (default: the recipe's eval_size, else 64).")
    add("--dataset-seed", type=int, help="Seed of the task generator (default: the recipe's dataset_seed, else 0).")
    add("--num-samples", type=int, default=4, help="Episodes per task, the n of pass@k (default: 4).")
    add("--temperature", type=float, help="Sampling temperature (default: the recipe's, else 1.0; 0 = greedy).")
    add("--top-p", type=float, help="Nucleus sampling (default: the recipe's, else off).")
    add(
        "--max-tokens",
        type=int,
        help="Most tokens per model call (default: the recipe's max_completion_length, else 512).",
    )
    add("--max-turns", type=int, help="Most model calls per episode (default: the recipe's max_turns, else 16).")
    add("--episode-timeout", type=float, help="Seconds per episode (default: the recipe's episode_timeout, else 300).")
    add(
        "--concurrency",
        type=int,
        help="Most episodes at once (default: the recipe's max_concurrent_episodes, else 64).",
    )
    add(
        "--success-threshold",
        type=float,
        default=1.0,
        help="An episode succeeds when its reward is >= this (default: 1.0).",
    )
    add("--seed", type=int, help="Sampling seed (default: the recipe's seed, else 42).")
    add("--device", help="Device of the model (default: cuda if available, else cpu).")
    add("--output", help="Write the metrics (with per-task details) as JSON to this file.")
    add("--episodes", help="Write every episode with its rewards as JSONL to this file.")
    add("--no-progress", dest="progress", action="store_false", help="Hide the progress bar.")
    return parser


def _pick(flag, recipe: dict[str, Any], key: str, default=None):
    if flag is not None:
        return flag
    value = recipe.get(key)
    return default if value is None else value


def main(argv: list[str] | None = None) -> int:
    """`trl-agentic eval [--config recipe.yaml] [--task T --model M] [--num-samples K] [--output FILE.json] ...`."""
    args = make_parser().parse_args(argv)  # first: `--help` answers without loading TRL and torch (issue 40)
    from ..recipes import ScriptArguments, agent_from_recipe, load_recipe, resolve_reward_funcs
    from ..tasks import get_task

    recipe = load_recipe(args.config, prog="trl-agentic eval") if args.config else {}

    # Task, agent and reward functions: resolved before the model loads, so a bad name fails in seconds
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
    agent = agent_from_recipe(script_args, suite)
    reward_funcs = resolve_reward_funcs(script_args, suite)
    reward_weights = recipe.get("reward_weights") if args.reward_funcs is None else None
    if reward_weights is None and script_args.reward_funcs is None:
        reward_weights = suite.reward_weights  # the task's own checkers, with its weights (a verifiers rubric's)
    size = script_args.eval_size or 64  # a recipe without an eval split (eval_size: 0) is still evaluated

    # Model
    model_name = _pick(args.model, recipe, "model_name_or_path")
    if model_name is None:
        raise SystemExit(
            "trl-agentic eval: no model; pass --model (a Hub id, a local path or 'tiny:qwen2_5:64x2') or "
            "set model_name_or_path in the recipe."
        )
    import torch

    from ..console import interactive_console
    from ..endpoint.launch import DEFAULT_BATCH_WAIT_MS, DEFAULT_MAX_BATCH_SIZE
    from ..evaluation import evaluate
    from ..tiny_models import load_model_and_tokenizer

    dtype = recipe.get("dtype", "auto")
    model_init_kwargs = dict(dtype=dtype if dtype in ("auto", None) else getattr(torch, dtype))
    for key, name in (
        ("revision", "model_revision"),
        ("trust_remote_code", "trust_remote_code"),
        ("attn_implementation", "attn_implementation"),
    ):
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
        max_generation_batch_size=_pick(None, recipe, "max_generation_batch_size", DEFAULT_MAX_BATCH_SIZE),
        generation_batch_wait_ms=_pick(None, recipe, "generation_batch_wait_ms", DEFAULT_BATCH_WAIT_MS),
        chat_template_kwargs=recipe.get("chat_template_kwargs"),
        seed=_pick(args.seed, recipe, "seed", 42),
        progress=args.progress and interactive_console(),  # off a terminal a bar is one endless line
        episodes_path=args.episodes,
    )
    metrics = {"model": model_name, "split": args.split, "config": args.config, **metrics}
    if hasattr(suite, "leaderboard_metrics"):  # a benchmark's own figure beside ours (BFCL: its multi-turn accuracy)
        metrics.update(suite.leaderboard_metrics(metrics))

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
