"""Step time of `AgenticGRPOTrainer` against TRL's own `GRPOTrainer(tools=[...])` loop, side by side, in one run.

Same tiny model (warm-started so that it calls the calculator once and then answers), same calculator tasks, same
generations per step, batch, temperature and max tokens, same reward function. After one warm-up step each, the two
trainers take turns, one step at a time (the order flips every round, so drifting machine load hits both alike).

```bash
python benchmarks/trainer_benchmark.py     # tiny:qwen2_5 64x2 then 256x2: ~10 min on 2 cores
python benchmarks/trainer_benchmark.py --steps 16 --model-size 128x2
```

Goal (issue #12, issue 29): `AgenticGRPOTrainer` s/step <= 1.10x `GRPOTrainer(tools=...)` on the 64x2 and on the
256x2 model; with asynchronous rollouts (`async_rollouts=True, max_staleness=1`, issue 30) <= 0.8x. The asynchronous
trainer runs ahead only within one `train()`, so it is timed in blocks: `--async-rounds` times, a fresh asynchronous
trainer trains `--async-steps` consecutive steps (its rate: the steps after the first, which fills the pipeline, over
their wall time), then `GRPOTrainer(tools=...)` takes `--async-steps` more steps, its mean step time the ratio's
denominator. Each model's summary prints that ratio (means of the timed steps) next to the goal, the median of the
rounds' ratios (both trainers run back to back in a round, so it cancels load that drifts between rounds) and the
ratio of CPU seconds per step (all threads): on a small shared machine other processes' load moves the wall-clock
ratio by +-0.15 from run to run, the CPU ratio much less. It also splits `AgenticGRPOTrainer`'s generation into the
engine's busy time and the rest, and its CPU by thread (engine, agents + openai client, endpoint, trainer).

What differs by design: TRL runs the tool loop inside the trainer (batched `generate`, tool results appended, then a
batched re-generation of the rows that called a tool); `AgenticGRPOTrainer` runs the task's agent against the
in-process OpenAI-compatible endpoint (HTTP per call, dynamic batching of concurrent calls, token-in continuation).
`max_completion_length` caps one model call for `AgenticGRPOTrainer` and the whole multi-turn completion (tool
results included) for TRL; it is set high enough that neither run is cut by it.

Where the asynchronous step's time goes (issue 30, measured on a 2-core machine saturated by other work, so in CPU
seconds per step: wall times there tracked how much of a core each run got, not the work). In one process the async
trainer keeps one core's worth busy ("cores busy" 1.00: trainer, engine, endpoint and agents share the GIL and
nothing overlaps), and does more work than the synchronous one. 64x2, 6 steps: 0.64 CPU s/step = trainer thread
0.30 (TRL's old-logps forward, ~0.075 s, runs because the behaviour-policy correction needs it; the synchronous
step skips it), engine 0.20 (decode batches of 4.7 rows instead of 6.5 and 63% of prompt tokens reused instead of
87%: the decoding competes with training for the GIL), agents + producer loop 0.09, endpoint 0.05; the trainer
waited 0.05 s/step for data. Side by side, CPU s/step over 3 runs: TRL's `tools=` loop 0.27-0.36, synchronous
1.16-1.35x that, asynchronous in-process 1.25-1.58x. `--rollout-process both` (the default) times the asynchronous
blocks twice, with the producer in the trainer's process and with `rollout_process=True` (producer, endpoint, agents
and engine in a spawned process, weights handed over in shared memory after each optimizer step); for the latter it
prints the rollout process's CPU seconds per step too, and for both the engine's batching and prefix reuse and each
block's slowest step. On 2 idle cores (2026-12-05, docs/async_rollouts.md), with the rollout process: 64x2 0.67x TRL
(trainer's process 0.145 CPU s/step, rollout process 0.146), 256x2 0.71x; in-process 1.01x and 0.85x (a second
run: 0.62x and 0.70x). Blocks must be long: a batch held back by one long episode (the slowest step, ~0.4 s at 64x2)
weighs 1/(steps - 1) of a block's rate, and 6-step blocks read 0.87x on 64x2 from the same code.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import tempfile
import threading
import time
import warnings
from collections import Counter

import torch
from transformers import PrinterCallback, TrainerCallback
from transformers.utils import get_json_schema
from trl import GRPOConfig, GRPOTrainer

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.tasks import get_task
from trl_agentic.tasks.calculator import calculator as calculator_tool
from trl_agentic.tasks.calculator import calculator_correct
from trl_agentic.tiny_models import load_model_and_tokenizer
from trl_agentic.warm_start import warm_start


def calculator(expression: str):  # no return annotation: TRL would add `"return"` to the schema in the prompt
    """
    Evaluate an arithmetic expression with numbers, + - * / // % and parentheses.

    Args:
        expression: The expression, e.g. '12 * (3 + 4)'.
    """
    # TRL builds the tool schema from the signature and this docstring: exactly the calculator agent's schema, so
    # both trainers render the same prompt (the tiny model is thrown off by any difference).
    return calculator_tool(expression)


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (generation + scoring + forward/backward + update), the CPU time of the
    process (all threads) in it, and the logged metrics."""

    def __init__(self):
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self.logs: list[dict] = []
        self._start = self._cpu_start = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start, self._cpu_start = time.perf_counter(), time.process_time()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._start)
        self.cpu_seconds.append(time.process_time() - self._cpu_start)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


# Who spends the CPU of `AgenticGRPOTrainer`'s generation: its threads by name prefix (Unix: per-thread CPU clocks)
THREAD_ROLES = {
    "trl-agentic-engine": "engine (prefill, decode, sampling)",
    "trl-agentic-rollout": "agents (agent code, openai client, httpx)",
    "trl-agentic-endpoint": "endpoint (HTTP server, validation, templating, parsing)",
    "MainThread": "trainer (weight sync, rows, rewards)",
}


def thread_cpu() -> Counter:
    """CPU seconds so far of each living thread, summed by role (`THREAD_ROLES`), and of the whole process."""
    cpu = Counter({"process": time.process_time()})
    if not hasattr(time, "pthread_getcpuclockid"):
        return cpu
    for thread in threading.enumerate():
        role = next((r for prefix, r in THREAD_ROLES.items() if thread.name.startswith(prefix)), "other threads")
        try:
            cpu[role] += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, TypeError):  # ended meanwhile
            pass
    return cpu


def count_tokens(trainer) -> list[dict]:
    """Record, per generation batch, the rows, the tokens trained (loss mask = sampled tokens), the tokens in the
    forward pass (prompt + completion, tool results included), the seconds spent generating (rollout + tools), the
    CPU seconds of each thread role meanwhile and, with an embedded engine, its busy seconds."""
    counts: list[dict] = []
    generate_and_score = trainer._generate_and_score_completions
    generate = trainer._generate
    generation_seconds: list[float] = []
    generation_cpu: list[Counter] = []
    engine_seconds: list[float] = []

    def timed_generate(prompts):
        started, cpu = time.perf_counter(), thread_cpu()
        try:
            return generate(prompts)
        finally:
            generation_seconds.append(time.perf_counter() - started)
            spent = thread_cpu()
            spent.subtract(cpu)
            # Threads that ended meanwhile (the engine's worker exits after an idle second) are counted by their
            # CPU before, not after: what the living threads do not explain is the process's rest.
            spent["other threads"] += spent["process"] - sum(v for k, v in spent.items() if k != "process")
            generation_cpu.append(spent)
            stats = getattr(getattr(trainer, "engine", None), "stats", None)
            if stats is not None:  # reset by the trainer at each rollout: this rollout's
                engine_seconds.append(stats.busy_s)

    def wrapped(inputs):
        output = generate_and_score(inputs)
        loss_mask = output["completion_mask"]
        if output.get("tool_mask") is not None:
            loss_mask = loss_mask * output["tool_mask"]
        counts.append(
            {
                "generation_seconds": generation_seconds.pop(),
                "generation_cpu": generation_cpu.pop(),
                "engine_seconds": engine_seconds.pop() if engine_seconds else float("nan"),
                "rows": output["completion_ids"].size(0),
                "trained": int(loss_mask.sum()),
                "forward": int(output["prompt_mask"].sum() + output["completion_mask"].sum()),
            }
        )
        return output

    trainer._generate = timed_generate
    trainer._generate_and_score_completions = wrapped
    return counts


def one_step(trainer) -> None:
    trainer.args.max_steps = 1
    trainer.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="Timed steps per trainer, after one warm-up step each.")
    parser.add_argument(
        "--model-size",
        default="64x2,256x2",
        help="Tiny models <hidden>x<layers>, comma-separated (default: 64x2,256x2).",
    )
    parser.add_argument("--num-generations", type=int, default=4, help="Episodes (completions) per task.")
    parser.add_argument("--batch-size", type=int, default=8, help="Episodes per step (per_device_train_batch_size).")
    parser.add_argument("--max-tokens", type=int, default=96, help="max_completion_length of both trainers.")
    parser.add_argument("--temperature", type=float, default=0.7, help="Sampling temperature of both trainers.")
    parser.add_argument("--warm-start-steps", type=int, default=200, help="SFT steps on calculator demonstrations.")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1 is fastest on a small, shared CPU: no thread oversubscription).",
    )
    parser.add_argument(
        "--async-rounds",
        type=int,
        default=2,
        help="Blocks of the asynchronous trainer, each followed by as many steps of TRL's (0: none).",
    )
    parser.add_argument(
        "--async-steps",
        type=int,
        default=16,
        help="Optimizer steps per asynchronous block (the first fills the pipeline; a block's rate is the others').",
    )
    parser.add_argument(
        "--rollout-process",
        choices=("off", "on", "both"),
        default="both",
        help="Asynchronous blocks with the producer in the trainer's process (off), in a process of its own "
        "(`rollout_process=True`, on), or both, one after the other in each round (default).",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    ratios = {size: benchmark(size, args) for size in args.model_size.split(",")}
    print()
    for size, (ratio, async_ratios) in ratios.items():
        print(
            f"tiny:qwen2_5:{size}: AgenticGRPOTrainer / GRPOTrainer(tools=...) s/step {ratio:.2f}x "
            f"(goal <= 1.10x: {'met' if ratio <= 1.10 else 'NOT met'})"
        )
        for arm, async_ratio in async_ratios.items():
            print(
                f"tiny:qwen2_5:{size}: AgenticGRPOTrainer(async_rollouts=True, {arm}) / GRPOTrainer(tools=...) "
                f"s/step {async_ratio:.2f}x (goal <= 0.80x: {'met' if async_ratio <= 0.80 else 'NOT met'})"
            )


class StepEnds(TrainerCallback):
    """When each optimizer step ended, the process's CPU seconds then (an asynchronous block's rate: steps over the
    time between their ends) and the rollout process's, if the trainer has one (its CPU when it delivered its last
    batch); the engine's logged work per step."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.ends: list[float] = []
        self.cpu: list[float] = []
        self.rollout_cpu: list[float] = []
        self.engine: list[dict] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())
        self.cpu.append(time.process_time())
        if self.trainer.args.rollout_process:
            self.rollout_cpu.append(self.trainer._producer.cpu_seconds)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "engine/mean_decode_batch" in logs:
            self.engine.append(logs)


def benchmark(model_size: str, args) -> tuple[float, dict[str, float]]:
    """The trainers on the `model_size` tiny model; prints the table, returns the ratios of seconds per step
    (synchronous; asynchronous by arm) to TRL's."""
    # Model: warm-started so that it calls the calculator, reads the result and answers (two model calls)
    task = get_task("calculator")
    assert get_json_schema(calculator) == task.tools[0], "the two trainers would render different prompts"
    model, tokenizer = load_model_and_tokenizer(f"tiny:qwen2_5:{model_size}")
    started = time.perf_counter()
    warm_start(model, tokenizer, task.demonstrations(512), steps=args.warm_start_steps, seed=args.seed)
    print(f"warm start: {args.warm_start_steps} SFT steps in {time.perf_counter() - started:.1f}s")
    tasks_per_step = args.batch_size // args.num_generations
    # Each one-step `train()` call starts a new epoch with the same seeded shuffle: both trainers get the same tasks.
    dataset = task.build_dataset(split="train", size=64, seed=args.seed)

    # The same GRPO settings for both; only the rollout differs
    common = dict(
        num_generations=args.num_generations,
        per_device_train_batch_size=args.batch_size,  # episodes per step
        max_completion_length=args.max_tokens,
        temperature=args.temperature,
        beta=0.0,  # no reference model in either
        learning_rate=1e-6,  # the policy barely moves, so both keep doing the same work step after step
        max_steps=1,
        use_cpu=True,
        bf16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=args.seed,
        disable_tqdm=True,
    )
    output_dir = tempfile.mkdtemp(prefix="trainer-benchmark-")

    def agentic(folder: str, **overrides) -> AgenticGRPOTrainer:
        return AgenticGRPOTrainer(
            copy.deepcopy(model),
            agent=task.agent,  # calculator agent: at most 6 model calls
            reward_funcs=task.reward_funcs,
            # No wait for company: the engine batches continuously, calls join the running batch (issue #12)
            args=AgenticGRPOConfig(
                output_dir=f"{output_dir}/{folder}",
                max_turns=6,
                generation_batch_wait_ms=0.0,
                **{**common, **overrides},
            ),
            train_dataset=dataset,
            processing_class=tokenizer,
        )

    ours = agentic("agentic")
    trl = GRPOTrainer(
        copy.deepcopy(model),
        reward_funcs=calculator_correct,
        args=GRPOConfig(output_dir=f"{output_dir}/trl", max_tool_calling_iterations=5, **common),  # 6 model calls
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[calculator],
    )
    trl_name = "GRPOTrainer(tools=...)"
    trainers = {"AgenticGRPOTrainer": ours, trl_name: trl}
    timers = {name: StepTimer() for name in trainers}
    counts = {name: count_tokens(trainer) for name, trainer in trainers.items()}
    for name, trainer in trainers.items():
        trainer.add_callback(timers[name])
        trainer.remove_callback(PrinterCallback)  # disable_tqdm=True would print every log dict

    arms = {"in-process": False, "rollout process": True}
    if args.rollout_process != "both":
        arms = {k: v for k, v in arms.items() if v == (args.rollout_process == "on")}
    async_seconds, trl_block_seconds, async_cpu, trl_block_cpu, rollout_cpu, async_engine, slowest = (
        {arm: [] for arm in arms} for _ in range(7)
    )
    try:
        # One warm-up step each (lazy initialisation, first endpoint calls), then alternate, flipping the order
        for trainer in trainers.values():
            one_step(trainer)
        names = list(trainers)
        for step in range(args.steps):
            for name in names if step % 2 == 0 else names[::-1]:
                one_step(trainers[name])
        # Asynchronous blocks, each followed by as many of TRL's steps (its timer keeps counting them separately)
        for round_index in range(args.async_rounds):
            for arm, in_process in arms.items():
                ahead = agentic(
                    f"async-{round_index}-{in_process}",
                    async_rollouts=True,
                    max_staleness=1,
                    rollout_process=in_process,
                    max_steps=args.async_steps,
                )
                ends = StepEnds(ahead)
                ahead.add_callback(ends)
                ahead.remove_callback(PrinterCallback)
                try:
                    ahead.train()
                finally:
                    ahead.close()
                async_seconds[arm].append((ends.ends[-1] - ends.ends[0]) / (len(ends.ends) - 1))
                slowest[arm].append(max(b - a for a, b in itertools.pairwise(ends.ends)))
                # The rollout process's CPU is not in this process's: the ratio of CPU is of the trainer's only
                async_cpu[arm].append((ends.cpu[-1] - ends.cpu[0]) / (len(ends.cpu) - 1))
                # Deliveries are not step ends, but over a block the difference is one batch's at most
                if ends.rollout_cpu:
                    rollout_cpu[arm].append((ends.rollout_cpu[-1] - ends.rollout_cpu[0]) / (len(ends.rollout_cpu) - 1))
                logs = ends.engine[1:]  # after the first step, which fills the pipeline
                async_engine[arm].append(
                    (
                        statistics.mean(log["engine/mean_decode_batch"] for log in logs),
                        statistics.mean(log["engine/reused_prompt_tokens"] for log in logs),
                    )
                )
                timer = timers[trl_name]
                kept = len(timer.seconds), len(timer.logs), len(counts[trl_name])
                for _ in range(args.async_steps):
                    one_step(trl)
                trl_block_seconds[arm].append(statistics.mean(timer.seconds[kept[0] :]))
                trl_block_cpu[arm].append(statistics.mean(timer.cpu_seconds[kept[0] :]))
                # The table below is of the alternating steps only
                del (
                    timer.seconds[kept[0] :],
                    timer.cpu_seconds[kept[0] :],
                    timer.logs[kept[1] :],
                    counts[trl_name][kept[2] :],
                )
    finally:
        ours.close()

    # Report
    print(
        f"\ntiny:qwen2_5:{model_size}, calculator task, {args.batch_size} episodes/step "
        f"({tasks_per_step} tasks x {args.num_generations}), max_tokens {args.max_tokens}, "
        f"temperature {args.temperature}, {args.steps} timed steps each after 1 warm-up, torch threads {args.threads}"
    )
    header = (
        f"{'trainer':<24}{'s/step':>8}{'± sd':>7}{'median':>8}{'cpu s':>7}{'generation':>12}{'gen cpu':>9}"
        f"{'trained tok':>13}{'fwd tok':>9}{'rows':>6}{'tool calls/ep':>15}{'reward':>8}"
    )
    print(header)
    print("-" * len(header))
    means, cpus = {}, {}
    for name in trainers:
        seconds = timers[name].seconds[1:]  # drop the warm-up step
        batches = counts[name][1:]
        logs = [log for log in timers[name].logs if "loss" in log][1:]
        tool_key = "episodes/tool_calls_mean" if name == "AgenticGRPOTrainer" else "tools/call_frequency"
        means[name] = statistics.mean(seconds)
        cpus[name] = statistics.mean(timers[name].cpu_seconds[1:])
        print(
            f"{name:<24}{means[name]:>8.3f}{statistics.pstdev(seconds):>7.3f}{statistics.median(seconds):>8.3f}"
            f"{cpus[name]:>7.3f}"
            f"{statistics.mean(b['generation_seconds'] for b in batches):>12.3f}"
            f"{statistics.mean(b['generation_cpu']['process'] for b in batches):>9.3f}"
            f"{statistics.mean(b['trained'] for b in batches):>13.1f}"
            f"{statistics.mean(b['forward'] for b in batches):>9.1f}"
            f"{statistics.mean(b['rows'] for b in batches):>6.1f}"
            f"{statistics.mean(log.get(tool_key, float('nan')) for log in logs):>15.2f}"
            f"{statistics.mean(log.get('reward', float('nan')) for log in logs):>8.3f}"
        )
    print(
        "(per step: seconds, CPU seconds of the process (all threads), of which generation = rollout incl. tools and "
        "HTTP, wall and CPU; trained tok = sampled tokens in the loss; fwd tok = prompt + completion tokens in the "
        "forward pass; rows = training sequences)"
    )
    batches = counts["AgenticGRPOTrainer"][1:]
    generation = statistics.mean(b["generation_seconds"] for b in batches)
    sampling = statistics.mean(b["engine_seconds"] for b in batches)
    print(
        f"AgenticGRPOTrainer generation per step: {generation:.3f}s, of which {sampling:.3f}s with the engine busy "
        f"(prefill, decode, sampling); the rest ({generation - sampling:.3f}s) the engine waits for calls: the "
        f"agent, the openai client, HTTP, templating, parsing"
    )
    roles = [*THREAD_ROLES.values(), "other threads"]
    print(
        "AgenticGRPOTrainer generation CPU per step by thread: "
        + ", ".join(f"{role} {statistics.mean(b['generation_cpu'][role] for b in batches):.3f}s" for role in roles)
    )
    stats = ours.engine.stats  # the last rollout's
    print(
        f"AgenticGRPOTrainer engine (last step): {stats.mean_decode_batch:.2f} sequences decoded per step, "
        f"{stats.decode_occupancy:.2f} of the requests waiting on it; prefix hits {stats.prefix_hits}/"
        f"{stats.requests}, {stats.reused_tokens} prompt tokens reused, {stats.prefilled_tokens} prefilled"
    )
    ratio = means["AgenticGRPOTrainer"] / means[trl_name]
    # Each round runs both trainers back to back: its ratio cancels the machine's load drift between rounds
    ours_seconds, trl_seconds = (timers[name].seconds[1:] for name in trainers)
    paired = statistics.median(a / b for a, b in zip(ours_seconds, trl_seconds, strict=True))
    cpu_ratio = cpus["AgenticGRPOTrainer"] / cpus[trl_name]
    print(
        f"ratio AgenticGRPOTrainer / GRPOTrainer(tools=...) seconds per step: {ratio:.2f}x (goal <= 1.10x); median "
        f"of the rounds' ratios {paired:.2f}x; CPU seconds per step {cpu_ratio:.2f}x (less sensitive to the load of "
        f"other processes)"
    )
    if not args.async_rounds:
        return ratio, {}
    async_ratios = {}
    for arm in arms:
        seconds, trl_seconds, cpu, trl_cpu = (
            values[arm] for values in (async_seconds, trl_block_seconds, async_cpu, trl_block_cpu)
        )
        async_ratios[arm] = statistics.mean(seconds) / statistics.mean(trl_seconds)
        print(
            f"AgenticGRPOTrainer(async_rollouts=True, max_staleness=1), {arm}, {args.async_rounds} blocks of "
            f"{args.async_steps} steps: " + ", ".join(f"{a:.3f}" for a in seconds) + " s/step; GRPOTrainer(tools="
            "...) right after each: " + ", ".join(f"{t:.3f}" for t in trl_seconds) + f" s/step; ratio "
            f"{async_ratios[arm]:.2f}x (goal <= 0.80x); median of the blocks' ratios "
            f"{statistics.median(a / t for a, t in zip(seconds, trl_seconds, strict=True)):.2f}x; CPU seconds per step "
            f"of the trainer's process {statistics.mean(cpu):.3f} / {statistics.mean(trl_cpu):.3f} = "
            f"{statistics.mean(cpu) / statistics.mean(trl_cpu):.2f}x; its cores busy "
            f"{statistics.mean(cpu) / statistics.mean(seconds):.2f} (CPU / wall)"
        )
        print(
            "  slowest step of each block: " + ", ".join(f"{t:.3f}" for t in slowest[arm]) + " s (a batch waiting on "
            "its longest episode: one such batch weighs 1/(steps - 1) of a block's rate)"
        )
        if rollout_cpu[arm]:
            print(f"  the rollout process's CPU seconds per step: {statistics.mean(rollout_cpu[arm]):.3f}")
        decode_batch, reused = (statistics.mean(values) for values in zip(*async_engine[arm], strict=True))
        print(
            f"  engine: {decode_batch:.2f} sequences decoded per step, {reused:.0%} of prompt tokens reused "
            f"(synchronous, last step: {stats.mean_decode_batch:.2f}, "
            f"{stats.reused_tokens / max(stats.reused_tokens + stats.prefilled_tokens, 1):.0%})"
        )
    return ratio, async_ratios


if __name__ == "__main__":
    main()
