"""`trl-agentic demo`: a black-box agent gets measurably better at its task from GRPO, on CPU, in minutes.

```bash
trl-agentic demo                      # ~18 min on 2 CPU cores (~4 of them the warm start, cached for later runs)
                                      # outputs/demo/{summary.json,plots/*.png,model/}
trl-agentic demo --smoke              # the same pipeline at toy sizes (< 90 s), for CI
```

The pipeline, each stage announced as it starts:

1. Model + warm start. A tiny Qwen2-shaped model and its BPE tokenizer are built locally (nothing is downloaded),
   then fine-tuned (SFT) on the calculator suite's demonstrations until it *sometimes* succeeds. A real base model
   arrives knowing the chat format and how to copy text; a randomly initialised one does not, and learning that
   under ~270 tokens of system prompt and tool schema is slow on CPU. So the warm start has two phases over the same
   demonstrations (1- and 2-digit operands): first the conversations alone (question, tool call, tool result,
   answer; 1-3 of them per row so that the model copies from the last question, not from a fixed place: short
   rows, cheap steps), until its loss is near 0; then the conversation exactly as the agent sends it (system prompt
   + tool schema), stopped as soon as the model solves `warm_start_target` of a few training-split tasks. The
   result is cached (`--cache-dir`, else `$TRL_AGENTIC_CACHE/demo`, else `~/.cache/trl-agentic/demo`), keyed by a
   hash of every setting that shapes it, so a second run skips it.
2. Held-out evaluation before training: the bundled calculator agent (it only holds an `openai` client pointed at
   the endpoint) runs on the eval split, which shares no question with the training split, at the sampling
   temperature used for training. Success is counted over all episodes (`trl_agentic.evaluation`): an episode that
   crashed, timed out or hit the turn limit is a failure.
3. GRPO with `AgenticGRPOTrainer`: the same agent, the checker's score as the only reward, tasks of 1-, 2- and
   3-digit operands chosen by the adaptive task sampler (`trl_agentic.task_sampling`: groups go where they split,
   the 2-digit target preferred); the held-out success (2-digit, the target) is measured again every
   `--eval-every` steps by the alarms callback, which checks training reward against it. The trained model and
   tokenizer are saved to `<output-dir>/model` (and the task to `<output-dir>/task.py`).
4. Held-out evaluation after training.
5. Results: a before/after table, `summary.json`, one PNG per metric under `plots/`, and the `trl-agentic eval`
   and `trl-agentic serve` commands that use the saved model.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import shlex
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trl_agentic.evaluation import Evaluator


# ---------------------------------------------------------------------------------------------------------------------
# Settings


@dataclass
class DemoSettings:
    """Every knob of the demo. `warm_start_key()` hashes the ones that shape the warm-started model."""

    # Task (the calculator suite's difficulty knobs)
    digits: int = 2  # the target difficulty: held-out success is measured at it, and only at it
    ops: tuple[str, ...] = ("*",)  # two-digit multiplication: a 0.4M-parameter model cannot do it in its head
    # Adaptive task sampling (issue #11, trl_agentic/task_sampling.py): the warm start and GRPO draw from these
    # operand sizes; the sampler sends each group where its episodes are likely to disagree, the target keeps at
    # least `target_min_share` of the groups. `--set task_sampling=uniform --set levels=2`: the target alone, as before.
    levels: tuple[int, ...] = (1, 2, 3)
    warm_start_levels: tuple[int, ...] = (1, 2)  # demonstrations (3-digit products are too long to copy reliably)
    task_sampling: str = "adaptive"
    target_min_share: float = 0.25
    # Easier operands only while the target's groups do not split: on seeds 1-4 at 0.5, a third of the groups went to
    # 1-digit tasks while the target split, and 1-digit success rose while 2-digit success stalled or fell.
    target_affinity: float = 0.1
    # Half of the groups go back to a task whose last group split (`AdaptiveTaskSampler(revisit=)`; 0: every group a
    # new draw), then more or fewer as those split more or less often than new tasks: in a run of seed 3 revisits split
    # 97% / 84% of the time against 85% / 76% for new two-digit tasks (steps 0-99 / 100-199); late in a seed-1 run
    # 79% against 54% (README).
    sampling_revisit: float = 0.5
    # Model
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    vocab_size: int = 1500
    # Warm start (SFT on the suite's demonstrations, train split only)
    num_demonstrations: int = 2000
    short_steps: int = 600  # phase 1 (at most): 1-3 conversations per row without system prompt and tool schema...
    short_loss_target: float = 0.05  # ...stopped once the mean loss of its last 10 steps is below this
    short_batch_size: int = 32
    short_learning_rate: float = 3e-3
    full_steps: int = 200  # phase 2 (at most): the conversation as the agent sends it (stops at the target)
    full_batch_size: int = 16
    full_learning_rate: float = 1e-3
    warm_start_target: float = 0.25  # phase 2 stops once this success rate is reached (training-split tasks)
    # Chunks of a warm-start batch run at once, in threads of one torch thread each: the same losses and weights, bit
    # for bit, as one after the other (`trl_agentic.warm_start.batch_loss`), so it is not part of the cache key.
    warm_start_workers: int = 2
    # The operand sizes of the checks' tasks (always with the target): the target alone. Checked on 1- and 2-digit
    # tasks, seed 2 stopped at 22-34% with 35-37.5% held-out (2-digit) success, its 1-digit success lagging; checked
    # on 2-digit tasks after every step, its model measured 31.0% and 38.0% in two runs (no clear change).
    warm_start_check_levels: tuple[int, ...] = (2,)
    warm_start_check_every: int = 1
    # A check runs half of its tasks first and the other half only if that half reached this share of the target
    # (`StagedCheck`; 0: all at once): a slow seed's phase 2 spends most of its time in checks far below the target.
    warm_start_check_gate: float = 0.5
    validation_size: int = 64
    # Sampling (training rollouts and held-out evaluation alike)
    temperature: float = 1.0
    max_completion_length: int = 48  # tokens per model call
    max_turns: int = 4  # model calls per episode
    # GRPO
    # 200 left seed 2 at +27.5 (39.5% -> 67.0%: it learns slowly); 300 lifted it to +33.0 to +49.0 in four runs. Three
    # of five earlier 300-step runs raised `malformed_tool_calls` when it pooled the difficulties and counted calls,
    # not groups: a few 1- or 3-digit groups broken for a few steps (README).
    steps: int = 300
    # The GRPO rollouts' sampling temperature (None: `temperature`, the held-out evaluation's and the warm start's).
    # At 1.0 a seed that learns fast loses its diversity: on seed 1 the sampled tokens' entropy fell 0.10 -> 0.03 and
    # its groups stopped splitting (lowest 10-step split rate 30-40%: every episode of a task right, or every one
    # wrong); at 1.2 seeds 1 and 2 kept 65% and 67.5% and gained +59.5 and +49.0, held-out at 1.0 (README).
    grpo_temperature: float | None = 1.2
    # Optimisation (issue 13's seeds x arms study, benchmarks/seeds_arms_study.py): at a constant 4e-4 with no warmup,
    # Adam's first steps move every parameter by ~lr whatever its gradient and both arms collapsed on some seeds.
    # Issue 11's probes (docs/demo_history.md): a linear decay from a 3e-4 peak collapsed seed 0 for ~50 steps
    # once the warmup ended; 2 tasks x 8 episodes per step (300 steps) helped seed 1 and not seed 0. A 30-step warmup
    # to the same constant 2e-4: mean gain +36.9 on five fresh seeds, against +33.1 with 10 steps (README).
    learning_rate: float = 2e-4
    warmup_steps: int = 30  # linear warmup, then constant until the decay
    lr_scheduler_type: str = "constant_with_warmup"
    # > 0: the learning rate decays linearly to 0 over the last `decay_steps` steps (warmup-stable-decay). At a
    # constant rate held-out success fell by 7-14 points between steps 150 and 200 on three of nine runs; with the
    # decay it moved by -1.5 to +18.5 points over those steps on thirteen runs (README).
    decay_steps: int = 50
    # An episode whose last call was cut at `max_completion_length` scores 1 less in training
    # (`trl_agentic.rewards.cut_off_penalty`, DAPO's overlong punishment; held-out success is the checker's alone).
    # With neither this nor the filtering below, seed 3's answers grew a tail of dots after the number ("The answer is
    # 165......", the checker reads the last number) from step 155: sampled tokens per episode 34 -> 70 at the same
    # reward, and `length_drift` fired.
    cut_off_penalty: bool = True
    # TRL's `mask_truncated_completions` (DAPO's overlong filtering) leaves those episodes out of the loss instead: it
    # stopped the dots, but nothing then pushed back on what runs into the limit: 240 of seed 2's 798 malformed tool
    # calls did (143 of them a loop of `<tool_call>` openings), and `malformed_tool_calls` fired three times (README).
    mask_truncated_completions: bool = False
    steps_per_generation: int = 1  # 2 or 4: one rollout of 2x or 4x the episodes per 2 or 4 steps, no faster on CPU
    num_iterations: int = 1  # optimizer steps per rollout (TRL's mu); 2 on seeds 0 and 1: +3.5 and +23.5 at step 200
    max_grad_norm: float = 1.0
    # Episodes per task (the group). A group of G at success p splits with probability 1 - p^G - (1 - p)^G: once a
    # seed solves the target (seed 1: 0.8-0.85 training success at 1.2 over its last 60 steps), groups of 8 split
    # ~75% of the time, and its lowest 10-step split rate was 45-62.5% in eight runs; groups of 12 split ~86% there
    # and the floor was 55.0-65.0% in five runs. 16 episodes x 2 tasks (the same episodes per step) collapsed seed 1
    # at step ~225: two tasks per step are too few (docs/demo_history.md).
    num_generations: int = 12
    tasks_per_step: int = 4
    beta: float = 0.0
    train_size: int = 9000  # GRPO's tasks, over the levels (3,000 each): 300 steps draw ~1,200 groups
    # Held-out evaluation
    eval_size: int = 200
    eval_every: int = 50
    seed: int = 0
    # Engine: concurrent requests arriving within this window are sampled as one batch (CPU decoding is
    # per-step bound, so one batch of 32 costs about what one of 8 does)
    generation_batch_wait_ms: float = 50.0
    # Asynchronous rollouts (issue 30): the next step's episodes run while this one trains, at most `max_staleness`
    # optimizer steps behind (`--async-rollouts`)
    async_rollouts: bool = False
    max_staleness: int = 1

    def warm_start_key(self) -> str:
        from trl_agentic import __version__

        fields = (
            "digits", "ops", "hidden_size", "num_layers", "num_heads", "vocab_size", "num_demonstrations",
            "short_steps", "short_loss_target", "short_batch_size", "short_learning_rate", "full_steps", "full_batch_size",
            "full_learning_rate", "warm_start_target", "warm_start_check_every", "warm_start_check_gate", "validation_size",
            "temperature", "max_completion_length", "max_turns", "seed",
        )  # fmt: skip
        payload = {name: getattr(self, name) for name in fields}
        payload["ops"] = list(self.ops)
        payload["warm_start_levels"] = list(self.level_list(self.warm_start_levels))
        payload["warm_start_check_levels"] = list(self.level_list(self.warm_start_check_levels))
        payload["trl_agentic"] = __version__
        # bump when the warm-start procedure changes (4: phase 1 on 1-3 exchanges per row; 5: length-chunked batches)
        payload["format"] = 5
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def level_list(self, levels=None) -> tuple[int, ...]:
        """The difficulty levels (operand digits) of `levels` (default: `self.levels`), always including the target
        `digits`."""
        return tuple(sorted({int(level) for level in (self.levels if levels is None else levels)} | {self.digits}))


# `--smoke`: every stage of the same pipeline, at toy sizes (the model learns nothing; CI checks the plumbing).
SMOKE_OVERRIDES = dict(
    hidden_size=32,
    num_layers=1,
    num_demonstrations=16,
    short_steps=3,
    short_batch_size=4,
    full_steps=2,
    full_batch_size=2,
    validation_size=4,
    warm_start_check_every=1,
    max_completion_length=24,
    max_turns=2,
    steps=2,
    warmup_steps=1,
    num_generations=2,
    tasks_per_step=2,
    train_size=8,
    eval_size=4,
    eval_every=1,
)


# ---------------------------------------------------------------------------------------------------------------------
# Console output


def _stage(index: int, total: int, title: str) -> None:
    line = f"[{index}/{total}] {title}"
    print(f"\n{line}\n{'=' * len(line)}", flush=True)


def _info(message: str) -> None:
    print(f"  {message}", flush=True)


def _quiet_libraries() -> None:
    """Keep the console to the demo's own progress: library warnings that do not concern a demo user are muted."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("transformers", "trl", "accelerate", "datasets", "httpx", "uvicorn"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars of the cached model
    except Exception:  # noqa: BLE001
        pass


# ---------------------------------------------------------------------------------------------------------------------
# Cache


def default_cache_root() -> Path:
    root = os.environ.get("TRL_AGENTIC_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "trl-agentic"


def warm_start_cache_dir(settings: DemoSettings, cache_dir: str | Path | None) -> Path:
    """`<cache_dir>/<hash>` when `cache_dir` is given, else `<$TRL_AGENTIC_CACHE or ~/.cache/trl-agentic>/demo/<hash>`."""
    base = Path(cache_dir).expanduser() if cache_dir else default_cache_root() / "demo"
    return base / settings.warm_start_key()


# ---------------------------------------------------------------------------------------------------------------------
# Warm start


def short_form(demonstration: dict) -> dict:
    """The demonstration's conversation without its system prompt and tool schemas (phase 1 of the warm start)."""
    messages = [m for m in demonstration["messages"] if m["role"] != "system"]
    return {"messages": messages, "tools": None}


def short_form_rows(demonstrations: list[dict], seed: int, max_exchanges: int = 3) -> list[dict]:
    """Phase-1 rows: each demonstration's conversation (system prompt and tool schemas left out) after 0 to
    `max_exchanges - 1` other demonstrations' conversations.

    With the question always at the start of the row, a tiny model learns to copy it into the call from a fixed
    place, and that copy breaks when phase 2 puts ~270 tokens of system prompt and tool schema in front (on some seeds
    phase 2 then stalls at 0% success for 60+ steps). Earlier exchanges in front make it copy from the *last* question.
    """
    rng = random.Random(seed)
    rows = []
    for demonstration in demonstrations:
        messages = short_form(demonstration)["messages"]
        for _ in range(rng.randrange(max_exchanges)):
            other = demonstrations[rng.randrange(len(demonstrations))]
            messages = short_form(other)["messages"] + messages
        rows.append({"messages": messages, "tools": None})
    return rows


class _TargetReached(Exception):
    """Raised from the warm start's step callback to end a phase once it reached its target."""


def warm_start_demonstrations(suite, settings: DemoSettings) -> list[dict]:
    """`num_demonstrations` successful conversations, evenly over the warm-start difficulty levels, shuffled."""
    levels = settings.level_list(settings.warm_start_levels)
    per_level = -(-settings.num_demonstrations // len(levels))
    demonstrations = []
    for level in levels:
        demonstrations += suite.demonstrations(per_level, seed=settings.seed, **suite.difficulty_levels[level])
    random.Random(settings.seed).shuffle(demonstrations)
    return demonstrations[: settings.num_demonstrations]


def validation_tasks(suite, demonstrations: list[dict], size: int, seed: int, levels=None):
    """Training-split tasks, evenly over `levels`, that are not among the demonstrations (the eval split stays
    untouched until stage 2)."""
    from trl_agentic.tasks import build_difficulty_dataset

    seen = {d["messages"][1]["content"] for d in demonstrations}
    if levels:
        dataset = build_difficulty_dataset(suite, split="train", size=size * 4, seed=seed + 10_000, levels=levels)
    else:
        dataset = suite.build_dataset(split="train", size=size * 4, seed=seed + 10_000)
    rows = [row for row in dataset if row["prompt"][-1]["content"] not in seen]
    rows = rows if len(rows) >= size else list(dataset)
    random.Random(seed).shuffle(rows)
    return rows[:size]


def grpo_tasks(suite, settings: DemoSettings, demonstrations: list[dict]):
    """GRPO's training tasks: `train_size` training-split tasks over `settings.level_list()`, without the questions
    the warm start was trained on wherever a level has others (1-digit products are all demonstrated: that level
    keeps them).

    Drawn with the demonstrations' seed, as they once were, they were the demonstrations: all 642 of seed 0's 2-digit
    GRPO tasks had been trained on in the warm start, so training success measured recall as much as skill, and the
    sampler's "new" tasks were not new to the model.
    """
    from trl_agentic.tasks import build_difficulty_dataset

    dataset = build_difficulty_dataset(
        suite, split="train", size=settings.train_size, seed=settings.seed + 20_000, levels=list(settings.level_list())
    )
    seen = {d["messages"][1]["content"] for d in demonstrations}
    unseen = [prompt[-1]["content"] not in seen for prompt in dataset["prompt"]]
    levels = dataset["difficulty"]
    with_unseen = {level for ok, level in zip(unseen, levels) if ok}
    keep = [i for i, (ok, level) in enumerate(zip(unseen, levels)) if ok or level not in with_unseen]
    return dataset.select(keep) if len(keep) < len(dataset) else dataset


def build_warm_started(settings: DemoSettings, suite, cache_path: Path, use_cache: bool = True):
    """Return `(model, tokenizer, info)`: loaded from `cache_path` or built, warm-started and saved there.

    Phase 1 trains on the demonstrations' conversations alone for `short_steps`. Phase 2 trains on the
    demonstrations as the agent sends them, for at most `full_steps`, and stops as soon as the success rate on
    `validation_size` training-split tasks (not among the demonstrations), at the sampling temperature, reaches
    `warm_start_target`: the warm start ends where the model *sometimes* succeeds, whatever the seed or machine.
    """
    import torch
    from tqdm.auto import tqdm

    from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer, load_model_and_tokenizer
    from trl_agentic.warm_start import warm_start

    meta_path = cache_path / "warm_start.json"
    if use_cache and meta_path.is_file():
        model, tokenizer = load_model_and_tokenizer(str(cache_path), dtype=torch.float32)
        model.eval()
        info = json.loads(meta_path.read_text())
        info["cached"] = True
        _info(f"loaded the warm-started model from the cache: {cache_path}")
        stopped_at = info.get("validation_success")
        _info(
            f"(built in {info['seconds']:.0f}s"
            + (f", {stopped_at:.0%} success on training-split tasks when it stopped" if stopped_at is not None else "")
            + "; delete that folder or pass --no-cache to rebuild it)"
        )
        return model, tokenizer, info

    started = time.monotonic()
    _info(f"building a {settings.hidden_size}x{settings.num_layers} Qwen2-shaped model and a BPE tokenizer")
    torch.manual_seed(settings.seed)
    tokenizer = build_tiny_tokenizer("qwen2_5", vocab_size=settings.vocab_size, seed=settings.seed)
    model = build_tiny_model(
        tokenizer,
        hidden_size=settings.hidden_size,
        num_layers=settings.num_layers,
        num_heads=settings.num_heads,
        seed=settings.seed,
    )
    num_params = sum(p.numel() for p in model.parameters())
    _info(f"{num_params / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}")
    demonstrations = warm_start_demonstrations(suite, settings)
    _info(
        f"{len(demonstrations)} demonstrations from the training split, operands of "
        f"{'/'.join(map(str, settings.level_list(settings.warm_start_levels)))} digits: question -> calculator "
        "call -> tool result -> "
        "'The answer is N.'"
    )

    losses: dict[str, list[float]] = {"phase1": [], "phase2": []}
    bar = tqdm(
        total=settings.short_steps,
        desc="  SFT phase 1/2 (conversation only)",
        unit="step",
        file=sys.stdout,
        mininterval=1.0,
        dynamic_ncols=True,
    )

    def on_short_step(step: int, loss: float) -> None:
        losses["phase1"].append(loss)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        recent = losses["phase1"][-10:]
        if len(recent) == 10 and sum(recent) / 10 < settings.short_loss_target:
            raise _TargetReached

    # Phase 1 ends when the model copies the question into the call and the result into the answer (its loss is
    # then near 0): how many steps that takes varies from seed to seed (the copying circuit forms suddenly), and a
    # phase 2 started before it stalls at 0% success.
    try:
        if settings.short_steps > 0:
            warm_start(
                model,
                tokenizer,
                short_form_rows(demonstrations, settings.seed),
                steps=settings.short_steps,
                batch_size=settings.short_batch_size,
                learning_rate=settings.short_learning_rate,
                seed=settings.seed,
                on_step=on_short_step,
                workers=settings.warm_start_workers,
            )
    except _TargetReached:
        pass
    finally:
        bar.close()
    model.eval()

    tasks = validation_tasks(
        suite,
        demonstrations,
        settings.validation_size,
        settings.seed,
        settings.level_list(settings.warm_start_check_levels),
    )
    stages = [tasks[: len(tasks) // 2], tasks[len(tasks) // 2 :]] if settings.warm_start_check_gate > 0 else [tasks]
    validator = StagedCheck(
        [
            HeldOutEvaluator(
                model,
                tokenizer,
                suite,
                stage,
                settings.temperature,
                settings.max_completion_length,
                settings.max_turns,
                batch_wait_s=settings.generation_batch_wait_ms / 1000,
            )
            for stage in stages
            if stage
        ],
        gate=settings.warm_start_check_gate * settings.warm_start_target,
    )
    checks: list[dict] = []
    bar = tqdm(
        total=settings.full_steps,
        desc="  SFT phase 2/2 (as the agent sends it)",
        unit="step",
        file=sys.stdout,
        mininterval=1.0,
        dynamic_ncols=True,
    )

    def on_full_step(step: int, loss: float) -> None:
        losses["phase2"].append(loss)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if (step + 1) % settings.warm_start_check_every == 0:
            result = validator.evaluate(model, seed=settings.seed + step)
            checks.append(
                {
                    "step": step + 1,
                    "success": result["success"],
                    "episodes": result["episodes"],
                    "malformed_tool_call_rate": result["malformed_tool_call_rate"],
                }
            )
            bar.write(
                f"  after {step + 1} phase-2 steps: success {result['success']:.1%} on "
                f"{result['episodes']} training-split tasks (stop at {settings.warm_start_target:.0%})"
            )
            if result["success"] >= settings.warm_start_target:
                raise _TargetReached

    try:
        if settings.full_steps > 0:
            warm_start(
                model,
                tokenizer,
                demonstrations,
                steps=settings.full_steps,
                batch_size=settings.full_batch_size,
                learning_rate=settings.full_learning_rate,
                seed=settings.seed + 1,
                on_step=on_full_step,
                workers=settings.warm_start_workers,
            )
    except _TargetReached:
        pass
    finally:
        bar.close()
        validator.close()
    model.eval()
    seconds = time.monotonic() - started
    info = {
        "cached": False,
        "seconds": seconds,
        "num_parameters": num_params,
        "phase1_steps": len(losses["phase1"]),
        "phase2_steps": len(losses["phase2"]),
        "final_loss": {name: sum(v[-10:]) / len(v[-10:]) for name, v in losses.items() if v},
        "validation_checks": checks,
        "validation_success": checks[-1]["success"] if checks else None,
        "settings": dataclasses.asdict(settings),
    }
    _info(f"warm start done in {seconds:.0f}s ({info['phase1_steps']} + {info['phase2_steps']} SFT steps)")
    if checks and checks[-1]["success"] < settings.warm_start_target:
        _info(
            f"note: phase 2 used all {settings.full_steps} steps without reaching {settings.warm_start_target:.0%}; "
            "GRPO needs some successes to amplify (raise --set full_steps=... or --set short_steps=...)"
        )
    if use_cache:
        tmp = cache_path.with_name(cache_path.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "warm_start.json").write_text(json.dumps(info, indent=2))
        shutil.rmtree(cache_path, ignore_errors=True)
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, cache_path)
        _info(f"cached in {cache_path}")
    return model, tokenizer, info


# ---------------------------------------------------------------------------------------------------------------------
# Held-out evaluation through the endpoint


class HeldOutEvaluator(Evaluator):
    """The demo's held-out evaluation: the suite's agent, once on each of a fixed set of tasks, at the training
    temperature, against an endpoint serving `model`; `evaluate()` may be called with the live (training) model.

    A thin user of [`trl_agentic.evaluation.Evaluator`]: `success` counts successes over all episodes (a failed or
    unscorable episode is a failure); the result adds `examples` (the first three episodes) and leaves out
    `per_task`.
    """

    def __init__(
        self,
        model,
        tokenizer,
        suite,
        dataset,
        temperature: float,
        max_tokens: int,
        max_turns: int,
        timeout: float = 300.0,
        batch_wait_s: float = 0.05,
    ):
        super().__init__(
            model,
            tokenizer,
            suite,
            dataset,
            num_samples=1,
            temperature=temperature,
            max_tokens=max_tokens,
            max_turns=max_turns,
            episode_timeout=timeout,
            concurrency=256,  # every held-out task at once
            max_generation_batch_size=256,  # as the demo's training engine: CPU decoding is per-step bound
            generation_batch_wait_ms=batch_wait_s * 1000,
        )

    def evaluate(self, model=None, seed: int = 0) -> dict[str, Any]:
        started = time.monotonic()
        episodes = self.run(model, seed)
        rewards, per_func, _ = self.score(episodes)
        result = self.summarize(episodes, rewards, per_func)
        del result["per_task"], result["note"]
        result["examples"] = [
            {
                "question": task["prompt"][-1]["content"],
                "tool_calls": [
                    call["function"].get("arguments")
                    for turn in episode.turns
                    for call in turn.response_message.get("tool_calls") or []
                ],
                "answer": episode.result if isinstance(episode.result, str) else None,
                "expected": task.get("answer"),
                "reward": reward,
            }
            for task, episode, reward in list(zip(self.tasks, episodes, rewards, strict=True))[:3]
        ]
        # what the episodes were sampled at, as the endpoint recorded it
        result["sampled_temperatures"] = sorted(
            {
                turn.sampling["temperature"]
                for episode in episodes
                for turn in episode.turns
                if "temperature" in turn.sampling
            }
        )
        result["seconds"] = time.monotonic() - started
        return result


class StagedCheck:
    """The warm start's success check, in stages: each stage's evaluator runs only while the success over the stages
    run so far is at least `gate`; the result is over the stages that ran.

    With two halves of the validation tasks and `gate` at half the stop target, a check far below the target (most of
    a slow seed's phase 2) costs half; the stop decision is the one-stage one unless the whole set reaches the target
    while its first half scores under half of it (for 64 tasks at a 25% target: at most 3 successes in the first half
    and 13+ in the second, which at any success rate is rarer than 1 in 1,000).
    """

    def __init__(self, evaluators: list[HeldOutEvaluator], gate: float):
        self.evaluators = evaluators
        self.gate = gate

    def evaluate(self, model=None, seed: int = 0) -> dict[str, Any]:
        successes = episodes = malformed = calls = 0.0
        for evaluator in self.evaluators:
            result = evaluator.evaluate(model, seed=seed)
            successes += result["success"] * result["episodes"]
            episodes += result["episodes"]
            malformed += result["malformed_tool_calls"]
            calls += result["mean_turns"] * result["episodes"]
            if successes / episodes < self.gate:
                break
        return {
            "success": successes / episodes,
            "episodes": round(episodes),
            "malformed_tool_call_rate": malformed / calls if calls else 0.0,
        }

    def close(self) -> None:
        for evaluator in self.evaluators:
            evaluator.close()


# ---------------------------------------------------------------------------------------------------------------------
# GRPO


class _ReportingEvaluator:
    """The demo's held-out evaluation as the alarms callback calls it: the reported one (`evaluator`, at
    `temperature`: the table's figures) and, when GRPO samples at another temperature, the same tasks sampled as GRPO
    samples (`alarm_evaluator`), which is what the alarms get as `success`: `reward_hacking` holds the training
    success against it, and training success at 1.2 against held-out success at 1.0 is not like with like (on seed 1,
    held-out at 1.0 sat at ~80% from step 50 while training success at 1.2 caught up from 0.56 to 0.77, and the
    alarm fired). The reported result rides along as `reported`. Prints each result as it comes."""

    def __init__(
        self, evaluator: HeldOutEvaluator, settings: DemoSettings, alarm_evaluator: HeldOutEvaluator | None = None
    ):
        self.evaluator = evaluator
        self.alarm_evaluator = alarm_evaluator
        self.settings = settings

    def evaluate(self, model=None, seed: int = 0, reported: dict[str, Any] | None = None) -> dict[str, Any]:
        """`reported`: the reported evaluation when already run (the one before training)."""
        if reported is None:
            reported = self.evaluator.evaluate(model, seed=seed)
        line = (
            f"\n  held-out success at step {seed - self.settings.seed}: {reported['success']:.1%} "
            f"({reported['episodes']} episodes, {reported['seconds']:.0f}s)"
        )
        if self.alarm_evaluator is None:
            print(line, flush=True)
            return {**reported, "reported": reported}
        result = self.alarm_evaluator.evaluate(model, seed=seed)
        print(
            f"{line}; sampled at {self.settings.grpo_temperature} as GRPO samples, for the alarms: "
            f"{result['success']:.1%} ({result['seconds']:.0f}s)",
            flush=True,
        )
        return {**result, "reported": reported}

    def close(self) -> None:
        pass  # the demo closes its evaluators itself


def _make_callbacks(
    evaluator: HeldOutEvaluator,
    settings: DemoSettings,
    held_out: dict[int, float] | None = None,
    evaluations: dict[int, dict] | None = None,
    held_out_evaluation: bool = True,
    alarm_evaluator: HeldOutEvaluator | None = None,
    alarm_held_out: dict[int, dict] | None = None,
):
    """`(alarms_callback, progress_class)`: the alarms, checked against held-out success measured every `eval_every`
    steps and at the last step (issue #11: reward hacking is training reward rising while held-out success does
    not), and a concise progress line. `held_out` / `evaluations` (the reported evaluation, `evaluator`) and
    `alarm_held_out` (what the alarms got: `alarm_evaluator`'s when given, see `_ReportingEvaluator`), when given,
    are filled in after training. `held_out_evaluation=False`: the alarms without held-out evaluation (a caller that
    evaluates by itself)."""
    from transformers.trainer_callback import ProgressCallback

    from trl_agentic.alarms import AlarmsCallback

    class DemoAlarms(AlarmsCallback):
        def on_train_end(self, args, state, control, **kwargs):
            super().on_train_end(args, state, control, **kwargs)
            for step, result in sorted(self.held_out_results.items()):
                reported = result.get("reported", result)
                if held_out is not None:
                    held_out[step] = reported["success"]
                if evaluations is not None:
                    evaluations[step] = reported
                if alarm_held_out is not None:
                    alarm_held_out[step] = {k: v for k, v in result.items() if k not in ("reported", "examples")}

    eval_every = settings.eval_every if settings.eval_every > 0 else settings.steps
    alarms = (
        DemoAlarms(
            held_out=_ReportingEvaluator(evaluator, settings, alarm_evaluator), held_out_eval_steps=max(1, eval_every)
        )
        if held_out_evaluation
        else DemoAlarms()
    )

    class ConciseProgress(ProgressCallback):
        """TRL's progress bar, plus one short line every `every` steps: metric means over those steps."""

        every = max(1, settings.steps // 15)
        fields = [
            ("reward", "reward", "{:.2f}"),
            ("sampling/split_rate", "split groups", "{:.2f}"),
            ("sampling/difficulty_mean", "digits", "{:.2f}"),
            ("completions/mean_length", "tokens/episode", "{:.1f}"),
            ("episodes/malformed_tool_calls_mean", "malformed calls/episode", "{:.2f}"),
        ]

        def __init__(self):
            super().__init__()
            self.window: dict[str, list[float]] = {}
            self.window_start = 1

        def on_log(self, args, state, control, logs=None, **kwargs):
            last = state.global_step == state.max_steps
            if not state.is_world_process_zero or self.training_bar is None or not logs:
                return
            if "reward" not in logs and not (last and self.window):
                return
            for key, _, _ in self.fields:
                if isinstance(logs.get(key), (int, float)):
                    self.window.setdefault(key, []).append(float(logs[key]))
            # Rollout metrics arrive once per rollout (every num_iterations * steps_per_generation steps): a line
            # closes once its window spans at least `every` steps.
            if state.global_step - self.window_start + 1 < self.every and not last:
                return
            first, self.window_start = self.window_start, state.global_step + 1
            parts = [
                f"{label} {fmt.format(sum(v) / len(v))}"
                for key, label, fmt in self.fields
                if (v := self.window.get(key))
            ]
            self.training_bar.write(f"  steps {first:>3}-{state.global_step:<3} " + "  ".join(parts))
            self.window = {}

    return alarms, ConciseProgress


def grpo_config(settings: DemoSettings, output_dir: Path):
    """The demo's `AgenticGRPOConfig`."""
    from trl_agentic import AgenticGRPOConfig

    warmup_steps = min(settings.warmup_steps, settings.steps)
    decay_steps = min(settings.decay_steps, settings.steps - warmup_steps)  # runs shorter than the schedule (--smoke)
    return AgenticGRPOConfig(
        output_dir=str(output_dir / "grpo"),
        max_steps=settings.steps,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="warmup_stable_decay" if decay_steps > 0 else settings.lr_scheduler_type,
        lr_scheduler_kwargs={"num_decay_steps": decay_steps, "decay_type": "linear"} if decay_steps > 0 else None,
        steps_per_generation=settings.steps_per_generation,
        num_iterations=settings.num_iterations,
        warmup_steps=warmup_steps,
        max_grad_norm=settings.max_grad_norm,
        num_generations=settings.num_generations,
        per_device_train_batch_size=settings.num_generations * settings.tasks_per_step,
        gradient_accumulation_steps=1,
        beta=settings.beta,
        temperature=settings.temperature if settings.grpo_temperature is None else settings.grpo_temperature,
        max_completion_length=settings.max_completion_length,
        mask_truncated_completions=settings.mask_truncated_completions,
        max_turns=settings.max_turns,
        max_concurrent_episodes=256,
        max_generation_batch_size=256,
        generation_batch_wait_ms=settings.generation_batch_wait_ms,
        episode_timeout=300,
        use_cpu=True,
        bf16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        log_episodes=True,
        seed=settings.seed,
        data_seed=settings.seed,
        disable_tqdm=False,
        # TRL turns it on by default; recomputing a 2-layer model's activations only costs time on CPU (3.98 -> 3.26
        # s/step measured on seed 1, 2 threads)
        gradient_checkpointing=False,
        task_sampling=settings.task_sampling,
        target_difficulty=settings.digits,
        target_min_share=settings.target_min_share,
        target_affinity=settings.target_affinity,
        sampling_revisit=settings.sampling_revisit,
        async_rollouts=settings.async_rollouts,
        max_staleness=settings.max_staleness,
    )


def grpo_reward_funcs(suite, settings: DemoSettings) -> list:
    """The training reward: the suite's checker, and `cut_off_penalty` unless switched off."""
    from trl_agentic.rewards import cut_off_penalty

    return [*suite.reward_funcs, *([cut_off_penalty] if settings.cut_off_penalty else [])]


def train_grpo(model, tokenizer, suite, settings: DemoSettings, output_dir: Path, callbacks):
    from trl_agentic import AgenticGRPOTrainer

    alarms_callback, progress_class = callbacks
    train_dataset = grpo_tasks(suite, settings, warm_start_demonstrations(suite, settings))
    config = grpo_config(settings, output_dir)
    trainer = AgenticGRPOTrainer(
        model,
        agent=suite.agent,
        reward_funcs=grpo_reward_funcs(suite, settings),
        args=config,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        callbacks=[alarms_callback],
    )
    from transformers.trainer_callback import ProgressCallback

    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(progress_class())
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


# ---------------------------------------------------------------------------------------------------------------------
# Saved model


def save_trained_model(model, tokenizer, settings: DemoSettings, output_dir: Path) -> dict[str, str]:
    """Save the trained policy (model + tokenizer) to `<output_dir>/model` and the demo's task to
    `<output_dir>/task.py`; return the `trl-agentic eval` and `trl-agentic serve` commands that use them.

    The eval command measures what the demo's held-out evaluation measures (same eval-split tasks, one episode each,
    same sampling and turn limit); its `success` is the demo's "after" figure up to sampling noise.
    """
    model_dir = output_dir / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    task_file = output_dir / "task.py"
    task_file.write_text(
        '"""The task of `trl-agentic demo`, for `trl-agentic eval --task <this file>:TASK`."""\n\n'
        "from trl_agentic.tasks.calculator import make_calculator_suite\n\n"
        f"TASK = make_calculator_suite(digits={settings.digits}, ops={tuple(settings.ops)!r})\n"
    )
    sampling = [
        "--temperature",
        str(settings.temperature),
        "--max-tokens",
        str(settings.max_completion_length),
        "--max-turns",
        str(settings.max_turns),
    ]
    evaluate = [
        "trl-agentic",
        "eval",
        "--task",
        f"{task_file}:TASK",
        "--model",
        str(model_dir),
        "--split",
        "eval",
        "--size",
        str(settings.eval_size),
        "--dataset-seed",
        str(settings.seed),
        "--num-samples",
        "1",
        *sampling,
        "--seed",
        str(settings.seed),
    ]
    serve = ["trl-agentic", "serve", "--model", str(model_dir), *sampling]
    return {"eval": shlex.join(evaluate), "serve": shlex.join(serve)}


# ---------------------------------------------------------------------------------------------------------------------
# Report


def format_table(before: dict, after: dict) -> str:
    statuses = [s for s in before["status"] if before["status"][s] or after["status"].get(s)]
    rows = [
        ("held-out success", f"{before['success']:.1%}", f"{after['success']:.1%}"),
        ("mean model calls (turns)", f"{before['mean_turns']:.2f}", f"{after['mean_turns']:.2f}"),
        ("mean tool calls", f"{before['mean_tool_calls']:.2f}", f"{after['mean_tool_calls']:.2f}"),
        (
            "malformed tool-call rate",
            f"{before['malformed_tool_call_rate']:.1%}",
            f"{after['malformed_tool_call_rate']:.1%}",
        ),
        ("mean sampled tokens", f"{before['mean_sampled_tokens']:.1f}", f"{after['mean_sampled_tokens']:.1f}"),
    ]
    rows += [(f"episodes {s}", str(before["status"].get(s, 0)), str(after["status"].get(s, 0))) for s in statuses]
    width = max(len(r[0]) for r in rows)
    lines = [f"  {'':<{width}}  {'before':>10}  {'after':>10}", f"  {'-' * (width + 24)}"]
    lines += [f"  {name:<{width}}  {b:>10}  {a:>10}" for name, b, a in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Main


def parse_args(argv: list[str]) -> argparse.Namespace:
    defaults = DemoSettings()
    parser = argparse.ArgumentParser(
        prog="trl-agentic demo",
        description="CPU demo: warm-start a tiny model, train the calculator agent with GRPO through the endpoint, "
        "and compare held-out success before and after.",
    )
    parser.add_argument("--output-dir", default="outputs/demo", help="Where summary.json and plots/ go.")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="Seed of the whole run (data, model, RL).")
    parser.add_argument("--steps", type=int, default=None, help=f"GRPO steps (default {defaults.steps}).")
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
        "--set max_staleness=N for another bound).",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="Override any DemoSettings field, e.g. --set num_generations=16 --set ops=+,* (repeatable).",
    )
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> DemoSettings:
    settings = DemoSettings(seed=args.seed)
    if args.smoke:
        settings = dataclasses.replace(settings, **SMOKE_OVERRIDES)
    for name, value in (
        ("steps", args.steps),
        ("eval_size", args.eval_size),
        ("eval_every", args.eval_every),
        ("learning_rate", args.learning_rate),
        ("async_rollouts", args.async_rollouts or None),
    ):
        if value is not None:
            settings = dataclasses.replace(settings, **{name: value})
    types = {f.name: f.type for f in dataclasses.fields(DemoSettings)}
    for item in args.set:
        name, sep, raw = item.partition("=")
        if not sep or name not in types:
            raise SystemExit(f"--set {item!r}: expected NAME=VALUE with NAME one of {sorted(types)}")
        current = getattr(settings, name)
        if isinstance(current, tuple):
            value = tuple(v.strip() for v in raw.split(",") if v.strip())
        elif isinstance(current, bool):
            value = raw.lower() in ("1", "true", "yes")
        elif "None" in str(types[name]):  # the optional numbers (grpo_temperature): a float or "none"
            value = None if raw.lower() == "none" else float(raw)
        else:
            value = type(current)(raw)
        settings = dataclasses.replace(settings, **{name: value})
    return settings


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    settings = settings_from_args(args)
    _quiet_libraries()
    started = time.monotonic()

    import torch
    from transformers import set_seed

    from trl_agentic.plots import plot_training_curves
    from trl_agentic.tasks.calculator import make_calculator_suite

    if args.threads < 0:
        raise SystemExit(f"--threads {args.threads}: expected 0 (all cores) or a positive thread count")
    if args.threads:
        torch.set_num_threads(args.threads)
    set_seed(settings.seed)
    random.seed(settings.seed)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    suite = make_calculator_suite(digits=settings.digits, ops=settings.ops)
    timings: dict[str, float] = {}
    total_stages = 5

    print(
        f"trl-agentic demo{' (smoke)' if args.smoke else ''}: calculator agent, {settings.digits}-digit operands, "
        f"ops {' '.join(settings.ops)}, seed {settings.seed}; outputs in {output_dir}",
        flush=True,
    )

    # 1-2. Model and warm start
    _stage(1, total_stages, "Tiny model + warm start (SFT on demonstrations)")
    cache_path = warm_start_cache_dir(settings, args.cache_dir)
    t = time.monotonic()
    model, tokenizer, warm_info = build_warm_started(settings, suite, cache_path, use_cache=not args.no_cache)
    timings["warm_start"] = time.monotonic() - t

    # 3. Held-out evaluation before
    _stage(2, total_stages, "Held-out evaluation BEFORE GRPO")
    eval_dataset = suite.build_dataset(split="eval", size=settings.eval_size, seed=settings.seed)
    evaluator = HeldOutEvaluator(
        model, tokenizer, suite, eval_dataset, settings.temperature, settings.max_completion_length, settings.max_turns
    )
    grpo_temperature = settings.grpo_temperature if settings.grpo_temperature is not None else settings.temperature
    alarm_evaluator = (
        HeldOutEvaluator(
            model, tokenizer, suite, eval_dataset, grpo_temperature, settings.max_completion_length, settings.max_turns
        )
        if grpo_temperature != settings.temperature
        else None
    )
    try:
        _info(
            f"{len(eval_dataset)} eval-split tasks (no question is in the training split), temperature "
            f"{settings.temperature}"
        )
        t = time.monotonic()
        before = evaluator.evaluate(model, seed=settings.seed)
        timings["eval_before"] = time.monotonic() - t
        _info(
            f"success {before['success']:.1%} of {before['episodes']} episodes ({before['scored_episodes']} scored, "
            f"{before['seconds']:.0f}s)"
        )
        for example in before["examples"][:2]:
            _info(
                f"e.g. {example['question']!r} -> calls {example['tool_calls']} -> {example['answer']!r} "
                f"(expected {example['expected']})"
            )
        held_out: dict[int, float] = {}
        evaluations: dict[int, dict] = {}
        alarm_held_out: dict[int, dict] = {}

        # 4. GRPO
        _stage(
            3,
            total_stages,
            f"GRPO: {settings.steps} steps x {settings.tasks_per_step} tasks x "
            f"{settings.num_generations} episodes, reward = the checker's score"
            + (", -1 for an answer cut at the token limit" if settings.cut_off_penalty else " only"),
        )
        t = time.monotonic()
        _info(
            f"training tasks: operands of {'/'.join(map(str, settings.level_list()))} digits, "
            f"{settings.task_sampling} task sampling (target: {settings.digits} digits, at least "
            f"{settings.target_min_share:.0%} of the groups)"
            if settings.task_sampling == "adaptive"
            else f"training tasks: operands of {'/'.join(map(str, settings.level_list()))} digits, uniform sampling"
        )
        callbacks = _make_callbacks(
            evaluator, settings, held_out, evaluations, alarm_evaluator=alarm_evaluator, alarm_held_out=alarm_held_out
        )
        # the alarms compare against step 0: the reported evaluation is not run twice
        callbacks[0].record_held_out(0, callbacks[0].held_out.evaluate(model, seed=settings.seed, reported=before))
        trainer = train_grpo(model, tokenizer, suite, settings, output_dir, callbacks)
        timings["grpo"] = time.monotonic() - t
        # the alarms' own evaluations (step 0's too) ran inside the GRPO phase; without `alarm_evaluator` they are the
        # reported ones, already counted
        eval_seconds_in_grpo = sum(e["seconds"] for s, e in evaluations.items() if s > 0)
        if alarm_evaluator is not None:
            eval_seconds_in_grpo += sum(e["seconds"] for e in alarm_held_out.values())
        grpo_only = timings["grpo"] - eval_seconds_in_grpo
        _info(
            f"{settings.steps} steps in {timings['grpo']:.0f}s ({grpo_only / max(settings.steps, 1):.2f} s/step "
            f"without the held-out evaluations)"
        )
        commands = save_trained_model(trainer.model, tokenizer, settings, output_dir)
        _info(f"trained model saved to {output_dir / 'model'}")

        # 5. Held-out evaluation after (the alarms' evaluation at the last step)
        _stage(4, total_stages, "Held-out evaluation AFTER GRPO")
        after = evaluations[trainer.state.global_step]
        _info(
            f"success {after['success']:.1%} of {after['episodes']} episodes ({after['scored_episodes']} scored, "
            f"{after['seconds']:.0f}s)"
        )
    finally:
        evaluator.close()
        if alarm_evaluator is not None:
            alarm_evaluator.close()

    # Report
    _stage(5, total_stages, "Results")
    print(format_table(before, after), flush=True)
    delta = after["success"] - before["success"]
    print(
        f"\n  held-out success: {before['success']:.1%} -> {after['success']:.1%} ({delta * 100:+.1f} points)",
        flush=True,
    )
    print("  held-out success by step: " + ", ".join(f"{s}: {v:.0%}" for s, v in sorted(held_out.items())), flush=True)
    signal = split_rate_summary(trainer.state.log_history)
    if (line := format_split_rate(signal)) is not None:
        print(f"  {line}", flush=True)
    alarms = trainer.alarms
    print(
        "  alarms: "
        + (
            "none fired"
            if not alarms
            else "; ".join(f"{a['name']} (steps {a['step']}-{a['last_step']})" for a in alarms)
        ),
        flush=True,
    )
    plots = plot_training_curves(trainer.state.log_history, held_out, output_dir / "plots")
    timings["total"] = time.monotonic() - started
    summary = {
        "before": {k: v for k, v in before.items() if k != "examples"},
        "after": {k: v for k, v in after.items() if k != "examples"},
        "improvement_points": delta * 100,
        "held_out_success_by_step": {str(k): v for k, v in sorted(held_out.items())},
        # what the alarms held training success against (sampled as GRPO samples; see `_ReportingEvaluator`)
        "alarm_held_out_success_by_step": {str(k): v["success"] for k, v in sorted(alarm_held_out.items())},
        "alarm_held_out_sampled_temperatures": sorted(
            {t for v in alarm_held_out.values() for t in v.get("sampled_temperatures", [])}
        ),
        "split_rate": signal,
        "alarms": alarms,
        "examples": {"before": before["examples"], "after": after["examples"]},
        "settings": dataclasses.asdict(settings),
        "smoke": args.smoke,
        "torch_threads": torch.get_num_threads(),
        "warm_start": {k: v for k, v in warm_info.items() if k != "settings"} | {"cache_dir": str(cache_path)},
        "timings_seconds": timings,
        "seconds_per_grpo_step": grpo_only / max(settings.steps, 1),
        "plots": [str(p) for p in plots],
        "model_dir": str(output_dir / "model"),
        "commands": commands,
        "episode_log": str(output_dir / "grpo" / "episodes" / "episodes-rank0.jsonl"),
        "log_history": trainer.state.log_history,
    }
    summary_path = output_dir / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2, default=_json_default))
    print(
        f"\n  summary: {summary_path}\n  plots:   {output_dir / 'plots'} ({len(plots)} PNGs)\n"
        f"  model:   {output_dir / 'model'}\n"
        f"  wall time: {timings['total'] / 60:.1f} min ("
        + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items() if k != "total")
        + ")",
        flush=True,
    )
    print(
        f"\n  evaluate the trained model again:\n    {commands['eval']}\n"
        f"  serve it to any OpenAI-compatible agent:\n    {commands['serve']}",
        flush=True,
    )
    return 0


def split_rate_summary(log_history: list[dict], after_step: int = 20, window: int = 10) -> dict[str, Any]:
    """The split rate (`sampling/split_rate`) after `after_step`: its mean and its lowest `window`-step mean."""
    values = [
        entry["sampling/split_rate"]
        for entry in log_history
        if entry.get("step", 0) > after_step and isinstance(entry.get("sampling/split_rate"), int | float)
    ]
    means = [sum(values[i : i + window]) / window for i in range(0, len(values) - window + 1)]
    return {
        "after_step": after_step,
        "window": window,
        "steps": len(values),
        "mean": sum(values) / len(values) if values else None,
        "lowest_window_mean": min(means) if means else None,
    }


def format_split_rate(signal: dict[str, Any]) -> str | None:
    """The results line of `split_rate_summary(...)`; `None` when no step came after `after_step`."""
    if not signal["steps"]:
        return None
    line = f"split rate (groups whose rewards differ) after step {signal['after_step']}: mean {signal['mean']:.0%}"
    if signal["lowest_window_mean"] is not None:  # a run shorter than after_step + window has no window
        line += f", lowest {signal['window']}-step mean {signal['lowest_window_mean']:.0%}"
    return line


def _json_default(value):
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if hasattr(value, "item"):
        return value.item()
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
