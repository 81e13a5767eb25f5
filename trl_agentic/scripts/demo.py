"""`trl-agentic demo`: a black-box agent gets measurably better at its task from GRPO, on CPU, in minutes.

```bash
trl-agentic demo                      # the calculator, ~18 min on 2 CPU cores (~4 of them the warm start, cached)
                                      # outputs/demo/{summary.json,plots/*.png,model/}
trl-agentic demo --smoke              # the same pipeline at toy sizes (< 90 s), for CI
trl-agentic demo --task examples/custom_task/unit_converter.py:TASK   # your own task (docs/pipeline.md)
```

A thin command line over [`trl_agentic.pipeline.run_pipeline`]: warm start (SFT on the task's demonstrations, cached)
-> held-out evaluation -> GRPO -> held-out evaluation -> plots, saved model, summary. Without `--task` it runs the
calculator with [`CalculatorDemoConfig`] (the values the README's figures were measured with); with `--task`, the
task's agent, checkers and reference solver with [`PipelineConfig`]'s defaults. `--set NAME=VALUE` overrides any field.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from trl_agentic.imports import TASK_HELP
from trl_agentic.pipeline.calculator import CalculatorDemoConfig
from trl_agentic.pipeline.config import SMOKE_OVERRIDES, PipelineConfig, with_overrides


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="trl-agentic demo",
        description="CPU demo: warm-start a tiny model on a task's demonstrations, train its agent with GRPO through "
        "the endpoint, and compare held-out success before and after (default task: the calculator).",
    )
    parser.add_argument(
        "--task",
        default=None,
        help=f"{TASK_HELP} It must provide demonstrations (a reference solver). Default: the calculator demo.",
    )
    parser.add_argument("--output-dir", default="outputs/demo", help="Where summary.json, plots/ and model/ go.")
    parser.add_argument("--seed", type=int, default=None, help="Seed of the whole run (data, model, RL; default 0).")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"GRPO steps (default {CalculatorDemoConfig.steps}, or {PipelineConfig.steps} with --task).",
    )
    parser.add_argument("--smoke", action="store_true", help="The same pipeline at toy sizes, for CI (< 90 s).")
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="Folder for the warm-started model (default: $TRL_AGENTIC_CACHE/demo or ~/.cache/trl-agentic/demo).",
    )
    parser.add_argument("--no-cache", action="store_true", help="Neither read nor write the warm-start cache.")
    parser.add_argument("--eval-size", type=int, default=None, help="Held-out tasks per evaluation.")
    parser.add_argument("--eval-every", type=int, default=None, help="Held-out evaluation every N GRPO steps.")
    parser.add_argument("--learning-rate", type=float, default=None, help="GRPO learning rate.")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1; 0: torch's default, all cores). One thread leaves a core to "
        "the endpoint and the agents (faster on 2 cores), and the warm start's first phase is then "
        "the same whatever the machine's core count.",
    )
    parser.add_argument(
        "--async-rollouts",
        action="store_true",
        help="Generate the next step's episodes while this one trains (max_staleness 1; "
        "--set max_staleness=N for another bound; --set rollout_process=true to generate in a process of its own).",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="Override any field of the pipeline's config (trl_agentic.pipeline.PipelineConfig; the calculator's "
        "also digits and ops), e.g. --set num_generations=16 --set levels=1,2 (repeatable).",
    )
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> PipelineConfig:
    """The run's config: the calculator's or the generic defaults, then `--smoke`, the flags and `--set`."""
    config = CalculatorDemoConfig() if args.task is None else PipelineConfig()
    if args.smoke:
        config = dataclasses.replace(config, **SMOKE_OVERRIDES)
    for name, value in (
        ("seed", args.seed),
        ("steps", args.steps),
        ("eval_size", args.eval_size),
        ("eval_every", args.eval_every),
        ("learning_rate", args.learning_rate),
        ("async_rollouts", args.async_rollouts or None),
    ):
        if value is not None:
            config = dataclasses.replace(config, **{name: value})
    try:
        return with_overrides(config, args.set)
    except ValueError as error:
        raise SystemExit(f"trl-agentic demo: {error}") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.threads < 0:
        raise SystemExit(f"--threads {args.threads}: expected 0 (all cores) or a positive thread count")
    config = config_from_args(args)
    # imported once the arguments parsed: `--help` and a bad flag answer without loading torch and TRL (issue 40)
    from trl_agentic.pipeline.plan import make_plan
    from trl_agentic.pipeline.report import task_file_source as task_file_source_of
    from trl_agentic.pipeline.run import run_plan
    from trl_agentic.tasks import get_task

    try:  # a task that cannot run fails here, in seconds, with what to provide: resolving it builds no model
        if isinstance(config, CalculatorDemoConfig):
            suite, task_file_source = config.suite(), config.task_file_source()
        else:  # the user's task: the run's task.py loads it by name
            suite, task_file_source = get_task(args.task), task_file_source_of(args.task)
        plan = make_plan(
            suite,
            config,
            args.output_dir,
            cache_dir=args.cache_dir,
            use_cache=not args.no_cache,
            task_file_source=task_file_source,
            smoke=args.smoke,
        )
    except ValueError as error:
        print(f"trl-agentic demo: {error}", file=sys.stderr)
        return 2
    run_plan(plan, threads=args.threads, title="trl-agentic demo")
    return 0


if __name__ == "__main__":
    sys.exit(main())
