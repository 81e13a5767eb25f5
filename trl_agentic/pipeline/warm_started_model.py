"""The pipeline's first stage: a tiny model built locally, warm-started (SFT) on the task's demonstrations until it
*sometimes* succeeds, and cached.

GRPO amplifies successes the model can already produce; a randomly initialised tiny model produces none (its loss and
gradient stay 0). A real base model arrives knowing the chat format and how to copy text; a random one does not, and
learning that under a few hundred tokens of system prompt and tool schema is slow on CPU. So the warm start has two
phases over the same demonstrations: first the conversations alone (1-3 of them per row, `short_form_rows`), until the
loss is near 0; then the conversations exactly as the agent sends them (system prompt + tool schemas), stopped as soon
as the model solves `warm_start_target` of a few training-split tasks: it ends where the model sometimes succeeds,
whatever the seed or machine. The SFT steps themselves are `trl_agentic.warm_start.warm_start`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from ..tasks import TaskSuite
from .config import PipelineConfig, warm_start_goal
from .data import short_form_rows
from .held_out import HeldOutEvaluator, StagedCheck
from .plan import PipelinePlan, make_plan
from .printing import info, progress


def default_cache_root() -> Path:
    """`$TRL_AGENTIC_CACHE`, else `~/.cache/trl-agentic`."""
    root = os.environ.get("TRL_AGENTIC_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "trl-agentic"


class _TargetReached(Exception):
    """Raised from the warm start's step callback to end a phase once it reached its target."""


# Issue 40: a new user read the smoke run's notes as bugs.
SMOKE_NOTE = "(expected with --smoke: its sizes are too small to learn, they check that every stage runs)"


def build_warm_started(
    config: PipelineConfig,
    suite: TaskSuite,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    smoke: bool = False,
) -> tuple[Any, Any, dict[str, Any]]:
    """Return `(model, tokenizer, info)`: loaded from the cache or built, warm-started and cached.

    Phase 1 trains on the demonstrations' conversations alone for at most `short_steps`. Phase 2 trains on the
    demonstrations as the agent sends them, for at most `full_steps`, and stops as soon as the success rate on
    `validation_size` training-split tasks (not among the demonstrations), at the sampling temperature, reaches
    `warm_start_target`. `smoke`: `config` is `--smoke`'s toy one, and the notes on what falls short say that it is
    expected there. It is cached in `<cache_dir>/<key>` (default `cache_dir`: `<$TRL_AGENTIC_CACHE or
    ~/.cache/trl-agentic>/demo`), the key a hash of every setting that shapes the model and of the task's
    demonstrations and validation tasks (`warm_start_key`); `info["cache_dir"]` names that folder.

    Example:

    ```python
    >>> model, tokenizer, info = build_warm_started(PipelineConfig(), get_task("my_tasks:TASK"))
    >>> info["validation_success"]
    0.27
    ```
    """
    return warm_start_model(make_plan(suite, config, cache_dir=cache_dir, use_cache=use_cache, smoke=smoke))


def warm_start_model(plan: PipelinePlan) -> tuple[Any, Any, dict[str, Any]]:
    """[`build_warm_started`] for a resolved plan: its demonstrations, check tasks, cache key and folder."""
    import torch

    from ..tiny_models import build_tiny_model, build_tiny_tokenizer, load_model_and_tokenizer
    from ..warm_start import warm_start

    config, suite, use_cache, smoke = plan.config, plan.suite, plan.use_cache, plan.smoke
    goal = warm_start_goal(config, suite)  # the target, counted from the task's chance level
    demonstrations, tasks, key = plan.demonstrations, plan.validation_tasks, plan.warm_start_key
    cache_path = (plan.cache_dir or default_cache_root() / "demo") / key
    meta_path = cache_path / "warm_start.json"
    if use_cache and meta_path.is_file():
        model, tokenizer = load_model_and_tokenizer(str(cache_path), dtype=torch.float32)
        model.eval()
        result = json.loads(meta_path.read_text())
        result["cached"] = True
        info(f"loaded the warm-started model from the cache: {cache_path}")
        stopped_at = result.get("validation_success")
        info(
            f"(built in {result['seconds']:.0f}s"
            + (f", {stopped_at:.0%} success on training-split tasks when it stopped" if stopped_at is not None else "")
            + "; delete that folder or pass --no-cache to rebuild it)"
        )
        return model, tokenizer, result | {"cache_dir": str(cache_path)}

    started = time.monotonic()
    info(f"building a {config.hidden_size}x{config.num_layers} Qwen2-shaped model and a BPE tokenizer")
    torch.manual_seed(config.seed)
    tokenizer = build_tiny_tokenizer("qwen2_5", vocab_size=config.vocab_size, seed=config.seed)
    model = build_tiny_model(
        tokenizer,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        seed=config.seed,
    )
    num_params = sum(p.numel() for p in model.parameters())
    info(f"{num_params / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}")
    longest = longest_assistant_message(tokenizer, demonstrations[:32])
    if longest > config.max_completion_length:
        info(
            f"note: a demonstration's assistant message is {longest} tokens, more than max_completion_length="
            f"{config.max_completion_length}: the model cannot reproduce it "
            + (SMOKE_NOTE if smoke else f"(--set max_completion_length={longest + 16})")
        )
    levels = plan.warm_start_levels
    info(
        f"{len(demonstrations)} demonstrations from the training split"
        + (f", {config.describe_levels(levels)}" if levels else "")
        + f": {outline(demonstrations[0])}"
    )

    losses: dict[str, list[float]] = {"phase1": [], "phase2": []}
    bar = progress(config.short_steps, "  SFT phase 1/2 (conversation only)")

    def on_short_step(step: int, loss: float) -> None:
        losses["phase1"].append(loss)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)  # before `update`: a plain line shows this step's loss
        bar.update(1)
        recent = losses["phase1"][-10:]
        if len(recent) == 10 and sum(recent) / 10 < config.short_loss_target:
            raise _TargetReached

    # Phase 1 ends when the model copies the question into the call and the result into the answer (its loss is
    # then near 0): how many steps that takes varies from seed to seed (the copying circuit forms suddenly), and a
    # phase 2 started before it stalls at 0% success.
    try:
        if config.short_steps > 0:
            warm_start(
                model,
                tokenizer,
                short_form_rows(demonstrations, config.seed),
                steps=config.short_steps,
                batch_size=config.short_batch_size,
                learning_rate=config.short_learning_rate,
                seed=config.seed,
                on_step=on_short_step,
                workers=config.warm_start_workers,
            )
    except _TargetReached:
        pass
    finally:
        bar.close()
    model.eval()

    stages = [tasks[: len(tasks) // 2], tasks[len(tasks) // 2 :]] if config.warm_start_check_gate > 0 else [tasks]
    validator = StagedCheck(
        [
            HeldOutEvaluator(
                model,
                tokenizer,
                suite,
                stage,
                config.temperature,
                config.max_completion_length,
                config.max_turns,
                batch_wait_s=config.generation_batch_wait_ms / 1000,
            )
            for stage in stages
            if stage
        ],
        gate=config.warm_start_check_gate * goal,
    )
    checks: list[dict] = []
    chance = getattr(suite, "chance_success", None)
    if chance:
        info(
            f"phase 2 stops at {goal:.0%} success: {config.warm_start_target:.0%} of the way from the task's chance "
            f"level ({chance:.0%}, TaskSuite.chance_success) to 100%"
        )
    bar = progress(config.full_steps, "  SFT phase 2/2 (as the agent sends it)")

    def on_full_step(step: int, loss: float) -> None:
        losses["phase2"].append(loss)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)  # before `update`: a plain line shows this step's loss
        bar.update(1)
        if (step + 1) % config.warm_start_check_every == 0:
            result = validator.evaluate(model, seed=config.seed + step)
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
                f"{result['episodes']} training-split tasks (stop at {goal:.0%})"
            )
            if result["success"] >= goal:
                raise _TargetReached

    try:
        if config.full_steps > 0:
            warm_start(
                model,
                tokenizer,
                demonstrations,
                steps=config.full_steps,
                batch_size=config.full_batch_size,
                learning_rate=config.full_learning_rate,
                seed=config.seed + 1,
                on_step=on_full_step,
                workers=config.warm_start_workers,
            )
    except _TargetReached:
        pass
    finally:
        bar.close()
        validator.close()
    model.eval()
    seconds = time.monotonic() - started
    result = {
        "cached": False,
        "seconds": seconds,
        "num_parameters": num_params,
        "phase1_steps": len(losses["phase1"]),
        "phase2_steps": len(losses["phase2"]),
        "final_loss": {name: sum(v[-10:]) / len(v[-10:]) for name, v in losses.items() if v},
        "validation_checks": checks,
        "validation_success": checks[-1]["success"] if checks else None,
        "stop_at_success": goal,
        "settings": dataclasses.asdict(config),
    }
    info(f"warm start done in {seconds:.0f}s ({result['phase1_steps']} + {result['phase2_steps']} SFT steps)")
    if checks and len(checks) == 1 and checks[0]["success"] >= goal and not chance and not smoke:
        info(
            f"note: phase 2 stopped at its first check ({checks[0]['success']:.0%} success): if random play wins "
            f"this task that often, the warm start stopped before the model learned anything; give the TaskSuite "
            "its chance_success (the success rate of random play) and the stop rule counts from it"
        )
    if checks and checks[-1]["success"] < goal:
        info(
            f"note: phase 2 used all {config.full_steps} steps without reaching {goal:.0%}; "
            "GRPO needs some successes to amplify "
            + (SMOKE_NOTE if smoke else "(raise --set full_steps=... or --set short_steps=...)")
        )
    if use_cache:
        tmp = cache_path.with_name(cache_path.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "warm_start.json").write_text(json.dumps(result, indent=2))
        shutil.rmtree(cache_path, ignore_errors=True)
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, cache_path)
        info(f"cached in {cache_path}")
    return model, tokenizer, result | {"cache_dir": str(cache_path)}


def outline(demonstration: dict) -> str:
    """A demonstration's shape, e.g. `user -> calculator call -> tool result -> answer`."""
    parts = []
    for message in demonstration["messages"]:
        role = message["role"]
        if role == "assistant":
            names = [c["function"]["name"] for c in message.get("tool_calls") or []]
            parts.append(f"{', '.join(names)} call" if names else "answer")
        elif role == "tool":
            parts.append("tool result")
        elif role == "user":
            parts.append("question")
    return " -> ".join(parts)


def longest_assistant_message(tokenizer, demonstrations: list[dict]) -> int:
    """The most tokens one assistant message of `demonstrations` takes (what a model call must be allowed to sample)."""
    from ..warm_start import assistant_masked_ids

    longest = 0
    for demonstration in demonstrations:
        _, mask = assistant_masked_ids(tokenizer, demonstration["messages"], demonstration.get("tools"))
        run = 0
        for masked in [*mask, 0]:
            run = run + 1 if masked else 0
            longest = max(longest, run)
    return longest
