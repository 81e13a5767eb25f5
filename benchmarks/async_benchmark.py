"""Steps per second of asynchronous rollouts (`AgenticGRPOConfig(async_rollouts=True, max_staleness=1)`) against
synchronous ones, side by side in one run, on a latency-bound and on a compute-bound task.

```bash
python benchmarks/async_benchmark.py                    # both workloads, 3 rounds of 8 steps per arm: ~4 min, 2 cores
python benchmarks/async_benchmark.py --workloads latency --tool-latency 1.0 --rounds 2
```

- **latency-bound**: the `latency` task (`trl_agentic.tasks.latency`): 2 to 4 tool runs per episode, each awaiting
  `--tool-latency` seconds (a test run, a build, a web call), a model call before each and one for the answer.
- **compute-bound**: the `calculator` task, whose tool returns at once: the rollout is the engine's decoding.

Both on the same tiny model (warm-started on each task's demonstrations so that episodes have the task's shape), the
same tasks, generations per step and sampling settings; only `async_rollouts` differs. Each round runs one block of
`--steps` consecutive optimizer steps per arm (one `train()` of a fresh trainer; the order of the arms flips every
round so that drifting machine load hits both alike); an arm's rate is its block's steps after the first (which fills
the pipeline) over their wall time.

What to expect with `max_staleness=1`: a batch may start when the step before the one that consumes it begins, so at
most two batches are in flight and a step takes max(train, (rollout + train) / 2) instead of rollout + train. The
ceiling is 2x when the rollout takes at least as long as the training step. Goals (issue 30): latency-bound >= 1.8x,
compute-bound >= 0.95x (the producer's decoding shares the CPU with training). The script also checks, from the
episode log (the version of every trained token), that no trained token is more than `max_staleness` versions older
than the step that trained it, and that no group was dropped.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from transformers import PrinterCallback

from trainer_benchmark import StepTimer
from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.tasks import get_task
from trl_agentic.tasks.latency import make_latency_suite
from trl_agentic.tiny_models import load_model_and_tokenizer
from trl_agentic.warm_start import warm_start


class RolloutTimer(StepTimer):
    """Step times, plus the seconds each step's trainer spent waiting for its batch's episodes: the whole rollout
    when synchronous (`_generate`), the wait on the producer when asynchronous (`async/trainer_wait_s`)."""

    def __init__(self, trainer):
        super().__init__()
        self.step_ends: list[float] = []
        self.rollout_seconds: list[float] = []
        generate = trainer._generate
        asynchronous = trainer.args.async_rollouts

        def timed_generate(prompts):
            started = time.perf_counter()
            try:
                return generate(prompts)
            finally:
                if not asynchronous:
                    self.rollout_seconds.append(time.perf_counter() - started)

        trainer._generate = timed_generate

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        self.step_ends.append(time.perf_counter())

    def on_log(self, args, state, control, logs=None, **kwargs):
        super().on_log(args, state, control, logs=logs, **kwargs)
        if logs and "async/trainer_wait_s" in logs:
            self.rollout_seconds.append(logs["async/trainer_wait_s"])


def trained_staleness(output_dir: Path) -> list[int]:
    """Per episode of the log: the step that trained it minus the version of its oldest trained token."""
    staleness = []
    for line in (output_dir / "episodes" / "episodes-rank0.jsonl").read_text().splitlines():
        record = json.loads(line)
        versions = [v for row in record["rows"] for v, m in zip(row["versions"], row["env_mask"], strict=True) if m]
        if versions:
            staleness.append(record["step"] - min(versions))
    return staleness


def run_block(model, tokenizer, suite, dataset, asynchronous: bool, args, output_dir: Path) -> dict:
    """One fresh trainer, `args.steps` optimizer steps in one `train()`: its rate and phase times."""
    trainer = AgenticGRPOTrainer(
        copy.deepcopy(model),
        agent=suite.agent,
        reward_funcs=suite.reward_funcs,
        args=AgenticGRPOConfig(
            output_dir=str(output_dir),
            async_rollouts=asynchronous,
            max_staleness=args.max_staleness,
            agent_columns=list(suite.agent_columns),
            num_generations=args.num_generations,
            per_device_train_batch_size=args.batch_size,
            max_completion_length=args.max_tokens,
            max_turns=8,
            temperature=1.0,
            beta=0.0,
            learning_rate=1e-6,  # the policy barely moves: every step does the same work
            max_steps=args.steps,
            use_cpu=True,
            bf16=False,
            report_to="none",
            logging_steps=1,
            save_strategy="no",
            seed=args.seed,
            disable_tqdm=True,
            generation_batch_wait_ms=0.0,
            log_episodes=True,  # the versions of every trained token: the bound checked from the log
        ),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    timer = RolloutTimer(trainer)
    trainer.add_callback(timer)
    trainer.remove_callback(PrinterCallback)
    try:
        trainer.train()
    finally:
        trainer.close()
    ends = timer.step_ends
    logs = [log for log in timer.logs if "loss" in log]
    return {
        "seconds_per_step": (ends[-1] - ends[0]) / (len(ends) - 1),  # after the first step: the pipeline is full
        "rollout_wait": statistics.mean(timer.rollout_seconds[1:]),
        "step_seconds": statistics.mean(timer.seconds[1:]),
        "staleness": trained_staleness(output_dir),
        "dropped_groups": sum(log.get("async/dropped_groups", 0) for log in logs),
        "in_flight": statistics.mean(log["async/in_flight_episodes"] for log in logs) if asynchronous else 0.0,
        "turns": statistics.mean(log.get("episodes/turns_mean", float("nan")) for log in logs),
    }


def benchmark(workload: str, args) -> float:
    if workload == "latency":
        suite = make_latency_suite(tool_latency=args.tool_latency)
        description = f"latency task: 2-4 tool runs of {args.tool_latency}s per episode"
    else:
        suite = get_task("calculator")
        description = "calculator task: instant tool"
    model, tokenizer = load_model_and_tokenizer(f"tiny:qwen2_5:{args.model_size}")
    started = time.perf_counter()
    warm_start(model, tokenizer, suite.demonstrations(512), steps=args.warm_start_steps, seed=args.seed)
    print(f"\n[{workload}] warm start: {args.warm_start_steps} SFT steps in {time.perf_counter() - started:.1f}s")
    dataset = suite.build_dataset(split="train", size=256, seed=args.seed)
    arms = {"sync": False, f"async (max_staleness={args.max_staleness})": True}
    results: dict[str, list[dict]] = {name: [] for name in arms}
    root = Path(tempfile.mkdtemp(prefix="async-benchmark-"))
    for round_index in range(args.rounds):
        names = list(arms) if round_index % 2 == 0 else list(arms)[::-1]
        for name in names:
            folder = root / f"{workload}-{'async' if arms[name] else 'sync'}-{round_index}"
            results[name].append(run_block(model, tokenizer, suite, dataset, arms[name], args, folder))
            print(f"  round {round_index} {name}: {results[name][-1]['seconds_per_step']:.3f} s/step")

    print(
        f"\n{workload}-bound: {description}; tiny:qwen2_5:{args.model_size}, {args.batch_size} episodes/step "
        f"({args.batch_size // args.num_generations} tasks x {args.num_generations}), max_tokens {args.max_tokens}, "
        f"{args.rounds} rounds x {args.steps} steps per arm, torch threads {args.threads}"
    )
    header = (
        f"{'arm':<28}{'s/step':>8}{'steps/s':>9}{'waits on rollout':>18}{'rest of step':>14}{'turns/ep':>10}"
        f"{'in flight':>11}{'staleness max':>15}{'dropped':>9}"
    )
    print(header)
    print("-" * len(header))
    rates = {}
    for name, blocks in results.items():
        seconds = statistics.mean(b["seconds_per_step"] for b in blocks)
        wait = statistics.mean(b["rollout_wait"] for b in blocks)
        staleness = [s for b in blocks for s in b["staleness"]]
        dropped = int(sum(b["dropped_groups"] for b in blocks))
        rates[name] = 1 / seconds
        print(
            f"{name:<28}{seconds:>8.3f}{1 / seconds:>9.3f}{wait:>18.3f}{seconds - wait:>14.3f}"
            f"{statistics.mean(b['turns'] for b in blocks):>10.2f}{statistics.mean(b['in_flight'] for b in blocks):>11.1f}"
            f"{max(staleness):>15}{dropped:>9}"
        )
        bound = args.max_staleness if blocks is not results["sync"] else 0
        assert max(staleness) <= bound, f"{name}: a trained token {max(staleness)} versions old (bound {bound})"
        assert dropped == 0, f"{name}: {dropped} groups dropped"
    print(
        "(s/step: wall time per optimizer step after the first; waits on rollout: the trainer waiting for its batch's "
        "episodes (sync: the whole rollout, async: the wait on the producer); staleness: per episode, the step that "
        "trained it minus its oldest trained token's version, from the episode log)"
    )
    sync_name, async_name = arms
    ratio = rates[async_name] / rates[sync_name]
    paired = statistics.median(
        s["seconds_per_step"] / a["seconds_per_step"] for s, a in zip(results[sync_name], results[async_name])
    )
    print(f"{workload}-bound: async / sync steps per second {ratio:.2f}x (median of the rounds' ratios {paired:.2f}x)")
    return ratio


GOALS = {"latency": 1.8, "compute": 0.95}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="latency,compute", help="Comma-separated: latency, compute.")
    parser.add_argument("--rounds", type=int, default=3, help="Blocks per arm (arm order flips every round).")
    parser.add_argument("--steps", type=int, default=8, help="Optimizer steps per block (the first fills the pipe).")
    parser.add_argument("--tool-latency", type=float, default=0.5, help="Seconds per tool run (latency task).")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--model-size", default="64x2", help="Tiny model <hidden>x<layers>.")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8, help="Episodes per step.")
    parser.add_argument("--max-tokens", type=int, default=48, help="max_completion_length (per model call).")
    parser.add_argument("--warm-start-steps", type=int, default=150)
    parser.add_argument("--threads", type=int, default=1, help="torch threads.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    ratios = {workload: benchmark(workload, args) for workload in args.workloads.split(",")}
    print()
    for workload, ratio in ratios.items():
        goal = GOALS[workload]
        print(
            f"{workload}-bound: async / sync steps/s {ratio:.2f}x (goal >= {goal}x: "
            f"{'met' if ratio >= goal else 'NOT met'})"
        )


if __name__ == "__main__":
    main()
