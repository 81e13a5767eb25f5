"""Seeds x arms: does the black-box path learn like TRL's own loop? (issue 13)

For each seed, one warm-started model (the demo's warm start, cached) is trained twice with the same GRPO settings:

- `agentic`: `AgenticGRPOTrainer`, the bundled calculator agent talking to the policy through the endpoint;
- `trl_tools`: TRL's own `GRPOTrainer(tools=[calculator])` loop (`benchmarks/demo_control.py`).

Both arms are measured identically before and after: the black-box agent on the eval split (no question shared with
the training split), success counted over *all* episodes (an episode that crashed, timed out or hit a limit is a
failure). A run *collapses* when held-out success after training is below the success before it. The script prints
the per-seed table, each arm's mean +- std of the after/gain figures, the collapse counts and the cost.

```bash
python benchmarks/seeds_arms_study.py                                   # seeds 0-4, the demo's settings
python benchmarks/seeds_arms_study.py --seeds 0 1 2 3 4 --steps 100 --eval-size 100 --jobs 2
python benchmarks/seeds_arms_study.py --set learning_rate=4e-4 --set warmup_steps=0   # the old demo settings
```

Seeds run in `--jobs` worker processes (one torch thread each); a seed's two arms run one after the other in its
worker, so both arms of a seed see the same machine load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path


ARMS = ("agentic", "trl_tools")
LABELS = {"agentic": "AgenticGRPOTrainer (black-box agent)", "trl_tools": "GRPOTrainer(tools=[calculator])"}


def success_over_all_episodes(result: dict) -> float:
    """Held-out success over all episodes (failed and unscorable episodes are failures)."""
    if "scored_success" in result:  # trl_agentic.evaluation's summary: `success` already counts every episode
        return result["success"]
    return result["success"] * result["scored_episodes"] / max(result["episodes"], 1)


def run_seed(seed: int, demo_argv: list[str], output_dir: Path, cache_dir: str | None) -> dict:
    """Warm start (cached), held-out before, then each arm from the same warm start, held-out after."""
    import torch
    from transformers import set_seed

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from demo_control import train_trl_control
    from trl_agentic import pipeline
    from trl_agentic.pipeline.grpo import make_callbacks, train_grpo
    from trl_agentic.pipeline.printing import quiet_libraries
    from trl_agentic.scripts import demo
    from trl_agentic.tasks.calculator import make_calculator_suite

    settings = dataclasses.replace(demo.config_from_args(demo.parse_args([f"--seed={seed}", *demo_argv])), eval_every=0)
    quiet_libraries()
    suite = make_calculator_suite(digits=settings.digits, ops=settings.ops)
    eval_dataset = suite.build_dataset(split="eval", size=settings.eval_size, seed=settings.seed)
    record = {"seed": seed, "settings": dataclasses.asdict(settings)}
    started = time.monotonic()
    set_seed(seed)
    model, tokenizer, info = pipeline.build_warm_started(settings, suite, cache_dir)
    record["warm_start_seconds"] = info["seconds"] if not info.get("cached") else 0.0
    for arm in ARMS:
        set_seed(seed)
        model, tokenizer, _ = pipeline.build_warm_started(settings, suite, cache_dir)  # the same weights for each arm
        evaluator = pipeline.HeldOutEvaluator(
            model,
            tokenizer,
            suite,
            eval_dataset,
            settings.temperature,
            settings.max_completion_length,
            settings.max_turns,
        )
        try:
            if "before" not in record:
                record["before"] = success_over_all_episodes(evaluator.evaluate(model, seed=seed))
            arm_started = time.monotonic()
            callbacks = make_callbacks(settings)
            if arm == "agentic":
                trainer = train_grpo(model, tokenizer, suite, settings, output_dir / f"seed{seed}" / arm, callbacks)
            else:
                trainer = train_trl_control(model, tokenizer, suite, settings, output_dir / f"seed{seed}", callbacks[1])
            train_seconds = time.monotonic() - arm_started
            after = evaluator.evaluate(trainer.model, seed=seed)
        finally:
            evaluator.close()
        rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
        record[arm] = {
            "after": success_over_all_episodes(after),
            "malformed_tool_call_rate": after["malformed_tool_call_rate"],
            "seconds_per_step": train_seconds / max(settings.steps, 1),
            "train_reward_first_10": sum(rewards[:10]) / max(len(rewards[:10]), 1),
            "train_reward_last_10": sum(rewards[-10:]) / max(len(rewards[-10:]), 1),
        }
        print(f"  seed {seed} {arm}: {record['before']:.1%} -> {record[arm]['after']:.1%}", flush=True)
        del trainer
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    record["seconds"] = time.monotonic() - started
    return record


def mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, std


def format_report(records: list[dict], wall_seconds: float) -> str:
    lines = [f"  {'seed':>4} {'before':>8} " + " ".join(f"{arm + ' after':>16}" for arm in ARMS)]
    for r in records:
        cells = []
        for arm in ARMS:
            mark = " (collapse)" if r[arm]["after"] < r["before"] else ""
            cells.append(f"{r[arm]['after']:>6.1%}{mark:>10}")
        lines.append(f"  {r['seed']:>4} {r['before']:>8.1%} " + " ".join(cells))
    lines.append("")
    for arm in ARMS:
        after = mean_std([r[arm]["after"] * 100 for r in records])
        gain = mean_std([(r[arm]["after"] - r["before"]) * 100 for r in records])
        collapses = sum(r[arm]["after"] < r["before"] for r in records)
        sps = mean_std([r[arm]["seconds_per_step"] for r in records])
        lines.append(
            f"  {LABELS[arm]:<37} after {after[0]:5.1f} +- {after[1]:4.1f}   gain {gain[0]:+5.1f} +- "
            f"{gain[1]:4.1f} points   collapses {collapses}/{len(records)}   {sps[0]:.2f} s/step"
        )
    diffs = [(r["agentic"]["after"] - r["trl_tools"]["after"]) * 100 for r in records]
    diff = mean_std(diffs)
    stderr = diff[1] / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    lines.append(
        f"  paired difference (agentic - trl_tools), held-out after: {diff[0]:+.1f} +- {diff[1]:.1f} points "
        f"(standard error {stderr:.1f})"
    )
    lines.append(f"  cost: {wall_seconds / 60:.1f} min wall for {len(records)} seeds x {len(ARMS)} arms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=100, help="GRPO steps per arm.")
    parser.add_argument("--eval-size", type=int, default=100, help="Held-out tasks per evaluation.")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="Override a CalculatorDemoConfig field for both arms (repeatable).",
    )
    parser.add_argument("--jobs", type=int, default=2, help="Seeds run at once (one torch thread each).")
    parser.add_argument("--output-dir", default="outputs/seeds_arms_study")
    parser.add_argument("--cache-dir", default=None, help="Warm-start cache (default: the demo's).")
    parser.add_argument("--smoke", action="store_true", help="Toy sizes: checks the plumbing in seconds.")
    parser.add_argument(
        "--report-only", action="store_true", help="Print the table from the seed*.json files already in --output-dir."
    )
    parser.add_argument("--one-seed", type=int, default=None, help=argparse.SUPPRESS)  # worker mode
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    # Both arms on the target difficulty alone, in TRL's order: the study compares the loops, not the task sampler.
    demo_argv = (
        [f"--steps={args.steps}", f"--eval-size={args.eval_size}", "--set=task_sampling=uniform", "--set=levels=2"]
        + [f"--set={s}" for s in args.set]
        + (["--smoke"] if args.smoke else [])
    )

    if args.one_seed is not None:
        import torch

        torch.set_num_threads(1)
        record = run_seed(args.one_seed, demo_argv, output_dir, args.cache_dir)
        (output_dir / f"seed{args.one_seed}.json").write_text(json.dumps(record, indent=2))
        return 0

    if args.report_only:
        records = [json.loads((output_dir / f"seed{s}.json").read_text()) for s in args.seeds]
        wall = sum(r["seconds"] for r in records) / max(args.jobs, 1)
        print(format_report(records, wall).replace("min wall", "min of worker time / jobs"))
        return 0

    started = time.monotonic()
    forwarded = list(sys.argv[1:] if argv is None else argv)
    pending = list(args.seeds)
    running: list[tuple[int, subprocess.Popen]] = []
    failed = []
    while pending or running:
        while pending and len(running) < args.jobs:
            seed = pending.pop(0)
            command = [sys.executable, __file__, "--one-seed", str(seed), "--output-dir", str(output_dir), *forwarded]
            log = open(output_dir / f"seed{seed}.log", "w")
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
            running.append((seed, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)))
            print(f"seed {seed}: started (log {output_dir / f'seed{seed}.log'})", flush=True)
        time.sleep(2)
        for seed, process in list(running):
            if process.poll() is not None:
                running.remove((seed, process))
                print(f"seed {seed}: {'done' if process.returncode == 0 else 'FAILED'}", flush=True)
                if process.returncode != 0:
                    failed.append(seed)
    records = [json.loads((output_dir / f"seed{s}.json").read_text()) for s in args.seeds if s not in failed]
    if not records:
        print("every seed failed; see the logs")
        return 1
    report = format_report(records, time.monotonic() - started)
    print("\n" + report)
    (output_dir / "study.json").write_text(json.dumps({"records": records, "report": report}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
