"""Control for the demo: the same task and warm start, trained by TRL's own `GRPOTrainer(tools=[calculator])` loop.

The demo trains a black-box agent through the endpoint (`AgenticGRPOTrainer`); this script trains the same warm-started
model on the same questions with plain `trl.GRPOTrainer`, whose `_tool_call_loop` runs the calculator itself, and
prints both side by side: held-out success before/after (measured identically, with the black-box agent through the
endpoint, on the eval split) and seconds per optimizer step.

```bash
python benchmarks/demo_control.py                       # demo defaults (warm start from the demo's cache)
python benchmarks/demo_control.py --steps 60 --seed 1
python benchmarks/demo_control.py --smoke               # toy sizes, seconds
```

Same prompt, token for token: the Python tool below renders exactly the JSON schema the agent sends
(`CALCULATOR_TOOLS`): same name, description and parameter description, and no return annotation (a `-> str` would add
a `"return"` key to TRL's schema, REFERENCES "Measured here"). The script checks this and stops if they differ.
Remaining differences, by construction of TRL's loop: a tool failure reaches the model as `{'error': '...'}` in TRL
and as `Error: ...` from the agent (bad arguments are reported with a different wording); TRL caps the whole
completion (calls + tool results) at `max_completion_length` while the endpoint caps each call, so the control gets
`max_turns * max_completion_length` tokens in total; TRL scores a completion by its last assistant message, the
agent's checker by the agent's return value (the same text here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from trl_agentic.tasks.calculator import CALCULATOR_TOOLS, calculator_correct
from trl_agentic.tasks.calculator import calculator as _calculator


def calculator(expression: str):
    """
    Evaluate an arithmetic expression with numbers, + - * / // % and parentheses.

    Args:
        expression: The expression, e.g. '12 * (3 + 4)'.
    """
    try:
        return _calculator(expression)
    except ValueError as error:  # the agent's loop shows tool failures as "Error: ..." text; so does this tool
        return f"Error: {error}"


def check_same_schema() -> None:
    from transformers.utils import get_json_schema

    rendered = get_json_schema(calculator)
    if json.dumps(rendered) != json.dumps(CALCULATOR_TOOLS[0]):
        raise SystemExit(
            "The control's tool schema differs from the agent's:\n"
            f"  TRL:   {json.dumps(rendered)}\n  agent: {json.dumps(CALCULATOR_TOOLS[0])}"
        )


def train_trl_control(model, tokenizer, suite, settings, output_dir: Path, progress_class=None):
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    train_dataset = suite.build_dataset(split="train", size=settings.train_size, seed=settings.seed)
    config = GRPOConfig(
        output_dir=str(output_dir / "trl_control"),
        max_steps=settings.steps,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=settings.warmup_steps,
        max_grad_norm=settings.max_grad_norm,
        num_generations=settings.num_generations,
        per_device_train_batch_size=settings.num_generations * settings.tasks_per_step,
        gradient_accumulation_steps=1,
        beta=settings.beta,
        temperature=settings.temperature,
        max_completion_length=settings.max_completion_length * settings.max_turns,
        max_tool_calling_iterations=settings.max_turns - 1,
        use_cpu=True,
        bf16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=settings.seed,
        data_seed=settings.seed,
        disable_tqdm=False,
    )
    trainer = GRPOTrainer(
        model,
        reward_funcs=[calculator_correct],
        args=config,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        tools=[calculator],
    )
    if progress_class is not None:
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(progress_class())
    trainer.train()
    return trainer


def main(argv: list[str] | None = None) -> int:
    from trl_agentic import pipeline
    from trl_agentic.pipeline.grpo import make_callbacks, train_grpo
    from trl_agentic.pipeline.printing import quiet_libraries
    from trl_agentic.scripts import demo

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default="outputs/demo_control")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--learning-rate", type=float, default=None)
    parser.add_argument("--eval-size", type=int, default=None)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    check_same_schema()

    demo_args = demo.parse_args(
        # Both arms on the target difficulty alone, in TRL's order: this compares the loops, not the task sampler.
        [f"--seed={args.seed}", "--set=task_sampling=uniform", "--set=levels=2"]
        + (["--smoke"] if args.smoke else [])
        + ([f"--steps={args.steps}"] if args.steps is not None else [])
        + ([f"--learning-rate={args.learning_rate}"] if args.learning_rate is not None else [])
        + ([f"--eval-size={args.eval_size}"] if args.eval_size is not None else [])
    )
    settings = dataclasses.replace(demo.config_from_args(demo_args), eval_every=0)
    quiet_libraries()

    import torch
    from transformers import set_seed

    from trl_agentic.tasks.calculator import make_calculator_suite

    if args.threads:
        torch.set_num_threads(args.threads)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    suite = make_calculator_suite(digits=settings.digits, ops=settings.ops)
    eval_dataset = suite.build_dataset(split="eval", size=settings.eval_size, seed=settings.seed)

    results = {}
    for name in ("agentic", "trl_tools"):
        print(f"\n=== {name}: {settings.steps} GRPO steps, lr {settings.learning_rate} ===", flush=True)
        set_seed(settings.seed)
        model, tokenizer, _ = pipeline.build_warm_started(settings, suite, args.cache_dir)
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
            before = evaluator.evaluate(model, seed=settings.seed)
            print(f"  held-out before: {before['success']:.1%}", flush=True)
            started = time.monotonic()
            callbacks = make_callbacks(settings)
            if name == "agentic":
                trainer = train_grpo(model, tokenizer, suite, settings, output_dir / name, callbacks)
            else:
                trainer = train_trl_control(model, tokenizer, suite, settings, output_dir, callbacks[1])
            seconds = time.monotonic() - started
            after = evaluator.evaluate(trainer.model, seed=settings.seed)
            print(f"  held-out after:  {after['success']:.1%}  ({seconds / settings.steps:.2f} s/step)", flush=True)
        finally:
            evaluator.close()
        rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
        results[name] = {
            "before": before["success"],
            "after": after["success"],
            "seconds_per_step": seconds / settings.steps,
            "train_reward_first_10": sum(rewards[:10]) / max(len(rewards[:10]), 1),
            "train_reward_last_10": sum(rewards[-10:]) / max(len(rewards[-10:]), 1),
        }

    labels = {"agentic": "AgenticGRPOTrainer (black-box agent)", "trl_tools": "GRPOTrainer(tools=[calculator])"}
    header = (
        f"  {'':<37} {'held-out before':>15} {'held-out after':>15} {'train reward first/last 10':>27} {'s/step':>7}"
    )
    print("\n" + header + "\n  " + "-" * (len(header) - 2))
    for name, r in results.items():
        rewards = f"{r['train_reward_first_10']:.2f} / {r['train_reward_last_10']:.2f}"
        print(
            f"  {labels[name]:<37} {r['before']:>15.1%} {r['after']:>15.1%} {rewards:>27} {r['seconds_per_step']:>7.2f}"
        )
    (output_dir / "control.json").write_text(
        json.dumps({"results": results, "settings": dataclasses.asdict(settings)}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
