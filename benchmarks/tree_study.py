"""Tree rollouts vs flat GRPO at equal sampled tokens (issue 42, "Learning").

On `trl_agentic.tasks.precedence` (the first of three model calls, which operation to evaluate first, decides the
outcome: a wrong one leaves no call to undo it), for each seed one warm-started model (the pipeline's warm start,
cached per seed, on demonstrations whose first operation is wrong `--decision-noise` of the time, 0.5: the model
learns the mechanics and is left at chance on the decision) is trained twice with the same GRPO settings:

- `flat`: `AgenticGRPOTrainer` as today (`rollout_tree=False`);
- `tree`: the same with `rollout_tree=True` (its knobs: `--tree-set NAME=VALUE`).

Both arms are measured identically: held-out success (the eval split, one episode per task, success over all
episodes) before training and every `eval_every` steps, and before and after training what the episodes got right
(`decision_breakdown`: the first operation, and success given it). Cost is counted in **sampled tokens**: the completion tokens
the engine sampled during training, read back from the episode log; a branch's replayed turns (`Turn.replayed`) are
the parent's tokens and are not counted. Per seed the script prints the flat arm's final success, the sampled tokens
the tree arm needed to reach it (ratio to the flat arm's total, goal <= 0.6) and both arms' success at equal sampled
tokens (the flat curve interpolated at the tree arm's last point, or the tree curve at the flat arm's total). "Beats
it at equal tokens" counts only for a tree run that spent (within 5%) the flat arm's tokens: before that, a lead is
over a flat run still mid-way.

```bash
python benchmarks/tree_study.py --warm-start-only --seeds 0         # the warm start, its held-out first-op accuracy
python benchmarks/tree_study.py --warm-start-seed 0 --tree-set tree_branches=4 --tree-set tree_branch_points=first
python benchmarks/tree_study.py --report-only                      # the table from the runs in --output-dir
python benchmarks/tree_study.py --report-only --flat-from DIR      # ... its tree runs against DIR's flat runs
python benchmarks/tree_study.py --smoke                            # toy sizes: checks the plumbing
```

Runs are one at a time (a seed's arms one after the other; `--jobs 2`: two at a time, in that order), each in its own
process with one torch thread; a run's record is `<output-dir>/<arm>-seed<N>.json` (`--skip-done` leaves the runs
that have one).

`--suite precedence_lookup` (`trl_agentic.tasks.precedence_lookup`): the same decision after three `read(name)`
look-ups, so it is call 3 of six, after a deterministic prefix; the tree arm branches AT it
(`--tree-set tree_branch_points=call:3`): a branch replays the look-ups (not sampled tokens) and samples the decision
afresh, so siblings differ exactly there. Its settings and outcome (the tiny model's warm start does not yet copy
through six calls): docs/tree_rollouts.md, "Second study".

```bash
python benchmarks/tree_study.py --suite precedence_lookup --warm-start-seed 0 --jobs 2 --set steps=80 \
    --tree-set tree_branches=7 --tree-set tree_branch_points=call:3
```

GRPO's training questions (`--grpo-questions`): `unseen` (default), the train split without the questions the warm
start was trained on (with `--warm-start-seed`, that seed's; ~90 questions at operands 3-9, each drawn ~4 times in a
run: both arms learn them by heart), or `all`, the whole train split (~850; the seventh study's verdict).

`--suite precedence_plan` (`trl_agentic.tasks.precedence_plan`): the same decision after one `plan(steps)` call whose
steps are the same for every question (about half of a successful episode's sampled tokens), so it is call 1 of four
and the numbers stay in the question; the tree arm branches AT it (`--tree-set tree_branch_points=call:1`). Its
settings and outcome: docs/tree_rollouts.md, "Third study".
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path


ARMS = ("flat", "tree")
RATIO_GOAL = 0.6
BUDGET_TOLERANCE = 0.05  # a tree run within 5% of the flat arm's sampled tokens spent "equal tokens"

# The study's GRPO settings (PipelineConfig fields); `--set` overrides them.
STUDY_SETTINGS = dict(
    task_sampling="uniform",
    levels=(1,),  # the target level alone (operands up to 9)
    steps=100,  # at 50 the flat arm's held-out gain was beyond noise on seed 0 only (+17.5, +4.0, +3.5 points)
    learning_rate=2e-4,  # 5e-4 with 16 episodes a step collapsed the flat arm of seed 0 (95% malformed calls by step 15)
    warmup_steps=5,
    decay_steps=10,
    num_generations=8,
    tasks_per_step=4,
    eval_size=200,
    eval_every=10,
    max_completion_length=48,
    max_turns=4,
    train_size=3000,
    # The warm start at the demo's length (600 phase-1 steps of 32, up to 200 phase-2 steps of 16), on demonstrations
    # whose first operation is wrong half the time (`--decision-noise`): it stops once the model solves 35% of 48
    # training-split tasks (at most ~50% with the decision at chance: copying right ~70% of the time).
    short_steps=600,
    short_batch_size=32,
    full_steps=200,
    warm_start_target=0.35,
    validation_size=48,
    warm_start_check_every=4,
)
# Per suite, over STUDY_SETTINGS: the episode limit above the agent's six model calls
SUITE_SETTINGS = {
    "precedence": {},
    "precedence_lookup": dict(max_turns=7),
    # The plan call alone is ~90 sampled tokens (the tiny tokenizer spends about one a character on English). Those
    # tokens are the same in every demonstration and learned first, so they dilute the warm start's loss: at the
    # others' phase-1 target (0.05) the numbers were not copied yet (3.0% held-out, 5.7% when the first operation was
    # right), at 0.02 hardly (9.0%, 20.7%); 0.01, with up to 1000 + 300 steps. Sampled at 1.2, 17% of the plans went
    # astray and 7% of the episodes succeeded over the first 10 steps (at 1.0 on held-out tasks: 9.0%): GRPO samples
    # at the warm start's 1.0.
    "precedence_plan": dict(
        max_turns=5,
        max_completion_length=128,
        short_loss_target=0.01,
        short_steps=1000,
        full_steps=300,
        grpo_temperature=1.0,
    ),
}
DECISION_NOISE = 0.5  # the warm start's demonstrations take the wrong first operation this often


SUITES = tuple(SUITE_SETTINGS)  # `--suite`: the decision at call 0, at call 3 after three look-ups, at 1 after a plan


def study_suite(decision_noise: float = DECISION_NOISE, name: str = "precedence"):
    """The suite `name` (`SUITES`) whose demonstrations take the wrong first operation `decision_noise` of the time
    (`precedence_demonstrations(decision_noise=...)`): the warm start learns the mechanics, not the decision."""
    import functools

    if name == "precedence":
        from trl_agentic.tasks.precedence import PRECEDENCE as suite
        from trl_agentic.tasks.precedence import precedence_demonstrations as demonstrations
    elif name == "precedence_lookup":
        from trl_agentic.tasks.precedence_lookup import PRECEDENCE_LOOKUP as suite
        from trl_agentic.tasks.precedence_lookup import precedence_lookup_demonstrations as demonstrations
    elif name == "precedence_plan":
        from trl_agentic.tasks.precedence_plan import PRECEDENCE_PLAN as suite
        from trl_agentic.tasks.precedence_plan import precedence_plan_demonstrations as demonstrations
    else:
        raise ValueError(f"--suite must be one of {SUITES}, got {name!r}")
    demonstrations = functools.partial(demonstrations, decision_noise=decision_noise)
    return dataclasses.replace(suite, demonstrations=demonstrations)


GRPO_QUESTIONS = ("unseen", "all")


def study_tasks(suite, settings, warm_seed: int, questions: str = "unseen"):
    """GRPO's training tasks for one run: `grpo_tasks` of the run's seed, without the questions the *warm start* was
    trained on (`questions="unseen"`: the demonstrations of `warm_seed`, the seed the model was warm-started with,
    not the run's), or the whole train split (`"all"`: the warm start's questions included).

    Until the seventh study the exclusion took the run's seed's demonstrations: with `--warm-start-seed 0`, seed 0
    trained on 91 questions the warm start had never seen, seeds 1 and 2 on 87 and 71 of which 81 and 65 it had
    been trained on. With operands 3-9 the train split has ~860 questions and the warm start's 2000 demonstrations
    cover ~785: "unseen" leaves ~90 (each drawn ~4 times in 100 steps of 4), "all" ~860.
    """
    from trl_agentic.pipeline.data import grpo_tasks, warm_start_demonstrations

    if questions not in GRPO_QUESTIONS:
        raise ValueError(f"--grpo-questions must be one of {GRPO_QUESTIONS}, got {questions!r}")
    if questions == "all":
        return grpo_tasks(suite, settings, [])
    warm = dataclasses.replace(settings, seed=warm_seed)
    return grpo_tasks(suite, settings, warm_start_demonstrations(suite, warm))


def decision_breakdown(tasks: list[dict], episodes: list, rewards: list) -> dict[str, float]:
    """What the episodes got right: `first_op_right` (the first operation, the first tool call other than a look-up
    (`read`), names the reference's first tool: the decision), `success`, and `success_given_right` (success among
    those: how well the rest, copying operands and results, goes)."""
    from trl_agentic.tasks.precedence import reference_calls

    right, wins, wins_right = 0, 0, 0
    for task, episode, reward in zip(tasks, episodes, rewards, strict=True):
        calls = [c for t in episode.turns for c in t.response_message.get("tool_calls") or []]
        calls = [c for c in calls if c["function"].get("name") not in ("read", "plan")]
        first = calls[0]["function"].get("name") if calls else None
        is_right = first == reference_calls(task["expression"])[0][0]
        won = reward is not None and reward >= 1.0
        right, wins, wins_right = right + is_right, wins + won, wins_right + (won and is_right)
    n = max(len(episodes), 1)
    return {"first_op_right": right / n, "success": wins / n, "success_given_right": wins_right / max(right, 1)}


def measure(evaluator, model, seed: int) -> dict[str, float]:
    """Held-out success (as `HeldOutEvaluator.evaluate`) with its `decision_breakdown`."""
    episodes = evaluator.run(model, seed)
    rewards, _, _ = evaluator.score(episodes)
    return decision_breakdown(evaluator.tasks, episodes, rewards)


def sampled_tokens_by_step(episode_log: Path) -> dict[int, int]:
    """Completion tokens the engine sampled per training step (`mode == "train"` records), replayed turns left out."""
    opener = gzip.open if episode_log.suffix == ".gz" else open
    counts: dict[int, int] = {}
    with opener(episode_log, "rt") as f:
        for line in f:
            record = json.loads(line)
            if record.get("mode") != "train":
                continue
            turns = record["episode"]["turns"]
            sampled = sum(len(t["completion_ids"]) for t in turns if not t.get("replayed"))
            counts[record["step"]] = counts.get(record["step"], 0) + sampled
    return counts


def curve(held_out: dict[int, float], tokens_by_step: dict[int, int]) -> list[tuple[int, int, float]]:
    """`[(step, sampled tokens, success), ...]`: held-out success measured after `step` training steps, against the
    tokens sampled for those steps (the episode log numbers steps from 0: step `s`'s episodes trained update `s + 1`)."""
    points = []
    for step in sorted(held_out):
        tokens = sum(n for s, n in tokens_by_step.items() if s < step)
        points.append((step, tokens, held_out[step]))
    return points


def interpolate(points: list[tuple[int, int, float]], tokens: float) -> float | None:
    """Success at `tokens` on a curve, linear between its points; `None` beyond its last point."""
    for (_, t0, s0), (_, t1, s1) in zip(points, points[1:], strict=False):
        if t0 <= tokens <= t1:
            return s0 if t1 == t0 else s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)
    if points and tokens == points[-1][1]:
        return points[-1][2]
    return None


def tokens_to_reach(points: list[tuple[int, int, float]], success: float) -> int | None:
    """The sampled tokens at the first evaluation whose success is at least `success` (`None`: never)."""
    for _, tokens, value in points:
        if value >= success:
            return tokens
    return None


def run_one(seed: int, arm: str, args: argparse.Namespace) -> dict:
    """Warm start (cached per seed), held-out before, GRPO with evaluations every `eval_every` steps."""
    import torch
    from transformers import set_seed

    from trl_agentic import pipeline
    from trl_agentic.pipeline.config import with_overrides
    from trl_agentic.pipeline.grpo import grpo_config, make_callbacks, train_grpo
    from trl_agentic.pipeline.printing import quiet_libraries

    suite = study_suite(args.decision_noise, args.suite)
    torch.set_num_threads(1)
    quiet_libraries()
    settings = pipeline.PipelineConfig(seed=seed, **{**STUDY_SETTINGS, **SUITE_SETTINGS[args.suite]})
    if args.smoke:
        settings = dataclasses.replace(settings, **pipeline.SMOKE_OVERRIDES)
    settings = with_overrides(settings, args.set)
    output_dir = Path(args.output_dir) / f"{arm}-seed{seed}"
    started = time.monotonic()
    # The warm start: the run's seed's, or `--warm-start-seed`'s (one model shared by the seeds: GRPO's seed differs).
    warm_seed = seed if args.warm_start_seed is None else args.warm_start_seed
    set_seed(warm_seed)
    model, tokenizer, info = pipeline.build_warm_started(
        dataclasses.replace(settings, seed=warm_seed), suite, args.cache_dir, smoke=args.smoke
    )
    eval_dataset = suite.build_dataset(split="eval", size=settings.eval_size, seed=seed)
    evaluator = pipeline.HeldOutEvaluator(
        model, tokenizer, suite, eval_dataset, settings.temperature, settings.max_completion_length, settings.max_turns
    )
    held_out: dict[int, float] = {}
    try:
        breakdown = {"before": measure(evaluator, model, seed)}
        before = breakdown["before"]["success"]
        print(f"held-out before: {breakdown['before']}", flush=True)
        if args.warm_start_only:
            return {"seed": seed, "warm_start": info, "breakdown": breakdown}
        tree_settings = {"rollout_tree": True, **dict(_parse(item) for item in args.tree_set)} if arm == "tree" else {}
        # PipelineConfig's tree fields (rollout_tree, tree_branches, ...) through it, the others as config overrides
        fields = {f.name for f in dataclasses.fields(settings)}
        settings = dataclasses.replace(settings, **{k: v for k, v in tree_settings.items() if k in fields})
        overrides = {k: v for k, v in tree_settings.items() if k not in fields}
        config = grpo_config(settings, suite, output_dir, **overrides)
        callbacks = make_callbacks(settings, evaluator, held_out=held_out)
        set_seed(seed)
        train_started = time.monotonic()
        trainer = train_grpo(
            model,
            tokenizer,
            suite,
            settings,
            output_dir,
            callbacks,
            args=config,
            train_dataset=study_tasks(suite, settings, warm_seed, args.grpo_questions),
        )
        train_seconds = time.monotonic() - train_started
        # The held-out tasks again, sampled with the seed of the "before" measurement (the evaluations during training
        # use seed + step): a second draw beside the last evaluation's, with what the episodes got right
        breakdown["after"] = measure(evaluator, model, seed)
        print(f"held-out after: {breakdown['after']}", flush=True)
    finally:
        evaluator.close()
    held_out = {0: before, **held_out}
    logs = sorted((output_dir / "grpo" / "episodes").glob("episodes-rank0.jsonl*"))
    tokens = sampled_tokens_by_step(logs[0])
    history = trainer.state.log_history
    return {
        "seed": seed,
        "arm": arm,
        "settings": dataclasses.asdict(settings),
        "tree_settings": args.tree_set if arm == "tree" else [],
        "warm_start_seed": warm_seed,
        "grpo_questions": args.grpo_questions,
        "warm_start": {k: info.get(k) for k in ("cached", "seconds", "validation_success", "cache_dir")},
        "held_out": held_out,
        "breakdown": breakdown,
        "decision_noise": args.decision_noise,
        "sampled_tokens_by_step": tokens,
        "curve": curve(held_out, tokens),
        "train_seconds": train_seconds,
        "seconds": time.monotonic() - started,
        "train_reward": [r["reward"] for r in history if "reward" in r],
        # the gradient's norm before clipping, per step: how the arms' updates compare (Adam divides by its history)
        "grad_norm": [r["grad_norm"] for r in history if "grad_norm" in r],
        "tree_metrics": {
            key: [r[key] for r in history if key in r]
            for key in sorted({k for r in history for k in r if k.startswith("tree/")})
        },
    }


def _parse(item: str) -> tuple[str, object]:
    name, sep, raw = item.partition("=")
    if not sep:
        raise ValueError(f"--tree-set {item!r}: expected NAME=VALUE")
    try:
        return name, json.loads(raw)
    except json.JSONDecodeError:
        return name, raw


def two_standard_errors(p0: float, p1: float, n: int) -> float:
    """Two standard errors of the difference of two success rates, each measured on `n` independent episodes."""
    return 2 * math.sqrt((p0 * (1 - p0) + p1 * (1 - p1)) / n)


def seed_line(flat: dict | None, tree: dict | None) -> str:
    if flat is None or tree is None:
        return "  (missing: " + ", ".join(a for a, r in (("flat", flat), ("tree", tree)) if r is None) + ")"
    flat_points, tree_points = [tuple(p) for p in flat["curve"]], [tuple(p) for p in tree["curve"]]
    flat_final, flat_tokens = flat_points[-1][2], flat_points[-1][1]
    tree_final, tree_tokens = tree_points[-1][2], tree_points[-1][1]
    reach = tokens_to_reach(tree_points[1:], flat_final)  # after training: step 0 is the shared warm start
    ratio = reach / flat_tokens if reach is not None and flat_tokens else None
    # Equal tokens: at the smaller of the two totals, each curve interpolated there.
    equal = min(flat_tokens, tree_tokens)
    flat_at, tree_at = interpolate(flat_points, equal), interpolate(tree_points, equal)
    # With the held-out set's size known, differences within two standard errors are noise: a flat arm that gained
    # less has no level to reach, and "beats at equal tokens" needs more than that margin.
    n = (flat.get("settings") or {}).get("eval_size")
    before = flat_points[0][2]
    # "Beats it at equal tokens" is judged at the flat arm's budget (the tree run spent about as much): a shorter tree run
    # ahead of the flat one at its own total has only been ahead of a run still mid-way, not beaten it.
    at_budget = tree_tokens >= (1 - BUDGET_TOLERANCE) * flat_tokens
    lead = (tree_at or 0) - (flat_at or 0)
    beats = at_budget and lead > (two_standard_errors(flat_at or 0, tree_at or 0, n) if n else 0)
    verdict = "meets" if (ratio is not None and ratio <= RATIO_GOAL) or beats else "misses"
    if flat_final <= before:
        verdict = "n/a (the flat arm did not gain: no level to reach)"
    elif n and flat_final - before <= two_standard_errors(before, flat_final, n):
        verdict = (
            f"n/a (the flat arm's gain, {flat_final - before:+.1%}, is within two standard errors, "
            f"{two_standard_errors(before, flat_final, n):.1%}, of {n} episodes)"
        )
    return (
        f"  {flat['seed']:>4} {flat_points[0][2]:>7.1%} {flat_final:>7.1%} {flat_tokens:>9,} {tree_final:>7.1%} "
        f"{tree_tokens:>9,} {('never' if reach is None else f'{reach:,}'):>9} "
        f"{('-' if ratio is None else f'{ratio:.2f}'):>6} {equal:>9,} {flat_at:>7.1%} {tree_at:>7.1%}  {verdict}"
    )


def format_report(records: dict[tuple[str, int], dict], seeds: list[int]) -> str:
    lines = [
        f"  goal: the tree arm reaches the flat arm's final held-out success with <= {RATIO_GOAL}x its sampled "
        "tokens, or beats it at equal sampled tokens",
        f"  {'seed':>4} {'before':>7} {'flat':>7} {'flat tok':>9} {'tree':>7} {'tree tok':>9} {'reach at':>9} "
        f"{'ratio':>6} {'equal tok':>9} {'flat@':>7} {'tree@':>7}",
    ]
    for seed in seeds:
        lines.append(seed_line(records.get(("flat", seed)), records.get(("tree", seed))))
    for (arm, seed), record in sorted(records.items()):
        points = " ".join(f"{step}:{tokens // 1000}k:{value:.0%}" for step, tokens, value in record["curve"])
        lines.append(f"  {arm} seed {seed} (step:tokens:success) {points}  [{record['train_seconds'] / 60:.1f} min]")
    return "\n".join(lines)


def load_records(output_dir: Path, seeds: list[int], flat_dir: Path | None = None) -> dict[tuple[str, int], dict]:
    """The runs' records in `output_dir` (the flat arm's from `flat_dir` when given: another study's flat runs)."""
    records = {}
    for arm in ARMS:
        for seed in seeds:
            path = (flat_dir if arm == "flat" and flat_dir is not None else output_dir) / f"{arm}-seed{seed}.json"
            if path.is_file():
                records[(arm, seed)] = json.loads(path.read_text())
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="Override a PipelineConfig field (both arms)."
    )
    parser.add_argument(
        "--tree-set", action="append", default=[], metavar="NAME=VALUE", help="An AgenticGRPOConfig field (tree arm)."
    )
    parser.add_argument(
        "--suite",
        choices=SUITES,
        default="precedence",
        help="precedence: the decision is the first call; precedence_lookup: three look-ups first, then the decision; "
        "precedence_plan: a plan call first (about half of an episode's sampled tokens), then the decision.",
    )
    parser.add_argument("--output-dir", default="outputs/tree_study")
    parser.add_argument("--cache-dir", default=None, help="Warm-start cache (default: the demo's).")
    parser.add_argument(
        "--warm-start-seed", type=int, default=None, help="One warm start for every seed (default: each seed's own)."
    )
    parser.add_argument(
        "--grpo-questions",
        choices=GRPO_QUESTIONS,
        default="unseen",
        help="GRPO's training questions: the train split without the warm start's demonstrated ones, or all of it.",
    )
    parser.add_argument(
        "--decision-noise",
        type=float,
        default=DECISION_NOISE,
        help="The share of warm-start demonstrations that take the wrong first operation.",
    )
    parser.add_argument(
        "--warm-start-only",
        action="store_true",
        help="Build (or load) the warm start and print its held-out success and first-operation accuracy.",
    )
    parser.add_argument("--smoke", action="store_true", help="Toy sizes: checks the plumbing.")
    parser.add_argument("--jobs", type=int, default=1, help="Runs at a time (each with one torch thread).")
    parser.add_argument("--skip-done", action="store_true", help="Skip the runs whose record is in --output-dir.")
    parser.add_argument("--report-only", action="store_true", help="Print the table from --output-dir's records.")
    parser.add_argument(
        "--flat-from", default=None, help="Compare with the flat runs in this folder (e.g. at another learning rate)."
    )
    parser.add_argument("--one-run", nargs=2, default=None, help=argparse.SUPPRESS)  # worker mode: SEED ARM
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    if args.warm_start_only:
        record = run_one(args.seeds[0], "flat", args)
        (output_dir / "warm-start.json").write_text(json.dumps(record, indent=2, default=str))
        return 0
    if args.one_run is not None:
        seed, arm = int(args.one_run[0]), args.one_run[1]
        record = run_one(seed, arm, args)
        (output_dir / f"{arm}-seed{seed}.json").write_text(json.dumps(record, indent=2))
        return 0

    if not args.report_only:
        forwarded = [a for a in (sys.argv[1:] if argv is None else argv)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        # A seed's arms one after the other (or side by side with --jobs 2): complete pairs first, the same load for
        # both arms
        queue = [(seed, arm) for seed in args.seeds for arm in args.arms]
        running: list[tuple[int, str, subprocess.Popen, object]] = []

        def wait_one() -> None:  # for whichever run ends first: a tree run may take longer than its seed's flat one
            while (ended := next((i for i, r in enumerate(running) if r[2].poll() is not None), None)) is None:
                time.sleep(1.0)
            seed, arm, process, log = running.pop(ended)
            code = process.wait()
            log.close()
            if code != 0:
                print(f"{arm} seed {seed}: failed with exit status {code}; see {log.name}", flush=True)

        for seed, arm in queue:
            log_path = output_dir / f"{arm}-seed{seed}.log"
            if args.skip_done and (output_dir / f"{arm}-seed{seed}.json").is_file():
                print(f"{arm} seed {seed}: done already ({output_dir / f'{arm}-seed{seed}.json'})", flush=True)
                continue
            while len(running) >= args.jobs:
                wait_one()
            command = [sys.executable, __file__, "--one-run", str(seed), arm, *forwarded]
            print(f"{arm} seed {seed}: running (log {log_path})", flush=True)
            log = open(log_path, "w")  # noqa: SIM115 - closed by wait_one
            running.append((seed, arm, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log))
        while running:
            wait_one()
    flat_dir = None if args.flat_from is None else Path(args.flat_from)
    print(format_report(load_records(output_dir, args.seeds, flat_dir), args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
