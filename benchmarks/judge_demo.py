"""The demo's calculator task trained three ways (issue 34): the checker (baseline), the checker plus a per-turn term
for well-formed tool calls, and a trajectory judge alone (no checker).

- `baseline`: the demo's training reward (`calculator_correct` + `cut_off_penalty`).
- `turn_term`: the same, plus `well_formed_calls`, a per-turn reward (1 for a model call without a malformed tool call,
  0 for one with), turned into per-token advantages (`turn_reward_weight`, `turn_reward_discount`, group-normalised:
  trl_agentic/rewards/process.py).
- `judge`: no checker. A `TrajectoryJudge` in relative mode scores each group of episodes through the OpenAI-compatible
  path a real judge uses: this project's endpoint on loopback, its model replaced by a rule that reads the judge's
  request as an LLM judge would (a CPU stand-in, `RuleJudgeEngine`). The rule never sees the answer column: it scores
  how faithfully a trajectory used the tool on the question's numbers and reported the tool's result.

Every variant starts from the same warm start (the demo's, cached) and is measured identically, before and after, by
the demo's held-out evaluation (the black-box agent on the eval split, success by the exact checker over all
episodes): held-out success is the objective measure the judge is held to.

```bash
python benchmarks/judge_demo.py --seed 0 --steps 60 --eval-size 100       # one seed, reduced steps
python benchmarks/judge_demo.py --smoke                                   # toy sizes: the plumbing, in a minute
```
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

from trl_agentic.generation.engine import GenerationOutput, SamplingParams


VARIANTS = ("baseline", "turn_term", "judge")


def well_formed_calls(prompts, completions, episodes, **kwargs):
    """Per turn: 1.0 for a model call without a malformed tool call, 0.0 for one with (a per-turn reward)."""
    return [[0.0 if turn.malformed_tool_call else 1.0 for turn in episode.turns] for episode in episodes]


# ---------------------------------------------------------------------------------------------------------------------
# The judge's stand-in: a rule behind the OpenAI-compatible endpoint

_NUMBER = re.compile(r"-?\d+")


def faithfulness_score(question: str, lines: list[dict]) -> float:
    """How faithfully a calculator trajectory used its tool, read from the judge's request (no reference answer):
    1.0 when a calculator call used exactly the question's numbers and the final answer reports that call's result;
    0.5 when the final answer reports the last tool result but the call was not on the question's numbers; 0.25 when
    the tool was called but the answer does not report its result; 0 without a tool call."""
    asked = sorted(_NUMBER.findall(question))
    calls, results, final = [], [], None
    for line in lines:
        for call in line.get("tool_calls") or []:
            arguments = call.get("arguments")
            text = arguments if isinstance(arguments, str) else json.dumps(arguments)
            calls.append(sorted(_NUMBER.findall(text)))
        if line.get("role") == "tool":
            results.append(_NUMBER.findall(line.get("content") or "")[-1:] or [None])
        if line.get("role") == "assistant" and line.get("content") and not line.get("tool_calls"):
            final = line["content"]
    if not calls:
        return 0.0
    answered = (_NUMBER.findall(final or "")[-1:] or [None])[0]
    for expression, result in zip(calls, results, strict=False):
        if expression == asked and answered is not None and result[0] == answered:
            return 1.0
    if results and answered is not None and results[-1][0] == answered:
        return 0.5
    return 0.25


class RuleJudgeEngine:
    """A `GenerationEngine` that answers a `TrajectoryJudge` request with the scores of `faithfulness_score`, as JSON
    (the judge's parse and retry path is the one a real judge's answers take)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.policy_version, self.max_context_length = tokenizer, 0, 1 << 22

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationOutput:
        text = self.tokenizer.decode(prompt_ids)
        context = text.split("<context>", 1)[1].split("</context>", 1)[0] if "<context>" in text else ""
        question = next((json.loads(x)["content"] for x in context.strip().splitlines() if '"role": "user"' in x), "")
        blocks = re.findall(r'<trajectory id="(\d+)">\n(.*?)\n</trajectory>', text, re.DOTALL)
        scores = [
            {"trajectory_id": int(i), "score": faithfulness_score(question, [json.loads(x) for x in body.splitlines()])}
            for i, body in blocks
        ]
        ids = self.tokenizer.encode(json.dumps({"scores": scores}), add_special_tokens=False)
        return GenerationOutput(ids + [self.tokenizer.eos_token_id], [0.0] * (len(ids) + 1), "stop")


def start_judge(tokenizer):
    """The judge endpoint (this project's, on loopback) and a `TrajectoryJudge` pointed at it."""
    from trl_agentic.endpoint.app import EndpointSettings, create_app
    from trl_agentic.endpoint.chat import ChatRenderer
    from trl_agentic.endpoint.server import EndpointServer
    from trl_agentic.rewards import TrajectoryJudge

    app = create_app(RuleJudgeEngine(tokenizer), ChatRenderer(tokenizer), EndpointSettings(default_max_tokens=8192))
    server = EndpointServer(app).start()
    session = server.open_episode()
    judge = TrajectoryJudge(model="policy", base_url=server.base_url, api_key=session.key, max_concurrent_requests=4)
    return server, judge


# ---------------------------------------------------------------------------------------------------------------------
# One variant


def train_variant(variant: str, model, tokenizer, suite, settings, output_dir: Path, callbacks):
    """`trl_agentic.pipeline.grpo.train_grpo` with the variant's rewards."""
    from trl_agentic.pipeline.grpo import grpo_config, grpo_reward_funcs, train_grpo

    config = grpo_config(settings, suite, output_dir)
    server = judge = None
    if variant == "baseline":
        reward_funcs = grpo_reward_funcs(suite, settings)
    elif variant == "turn_term":
        reward_funcs = [*grpo_reward_funcs(suite, settings), well_formed_calls]
        config.turn_reward_weight, config.turn_reward_discount = 0.5, 0.0  # each call's own well-formedness
    else:
        server, judge = start_judge(tokenizer)
        reward_funcs = [judge]
    try:
        trainer = train_grpo(model, tokenizer, suite, settings, output_dir, callbacks, reward_funcs, config)
    finally:
        if server is not None:
            server.stop()
    return trainer, judge


def run(seed: int, variants: list[str], demo_argv: list[str], output_dir: Path, cache_dir: str | None) -> dict:
    import torch
    from transformers import set_seed

    from trl_agentic.pipeline import HeldOutEvaluator, build_warm_started
    from trl_agentic.pipeline.grpo import make_callbacks
    from trl_agentic.pipeline.printing import quiet_libraries
    from trl_agentic.scripts import demo

    settings = dataclasses.replace(demo.config_from_args(demo.parse_args([f"--seed={seed}", *demo_argv])), eval_every=0)
    quiet_libraries()
    suite = settings.suite()
    eval_dataset = suite.build_dataset(split="eval", size=settings.eval_size, seed=settings.seed)
    record: dict = {"seed": seed, "steps": settings.steps, "eval_size": settings.eval_size}
    started = time.monotonic()
    set_seed(seed)
    _, _, info = build_warm_started(settings, suite, cache_dir)
    record["warm_start_seconds"] = 0.0 if info.get("cached") else info["seconds"]
    for variant in variants:
        set_seed(seed)
        model, tokenizer, _ = build_warm_started(settings, suite, cache_dir)  # the same weights for each
        evaluator = HeldOutEvaluator(
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
                record["before"] = evaluator.evaluate(model, seed=seed)["success"]
            variant_started = time.monotonic()
            callbacks = make_callbacks(settings)  # the alarms alone: held-out success is measured here
            trainer, judge = train_variant(
                variant, model, tokenizer, suite, settings, output_dir / f"seed{seed}" / variant, callbacks
            )
            train_seconds = time.monotonic() - variant_started
            after = evaluator.evaluate(trainer.model, seed=seed)
        finally:
            evaluator.close()
        logs = [entry for entry in trainer.state.log_history if "reward" in entry]
        result = {
            "after": after["success"],
            "malformed_tool_call_rate": after["malformed_tool_call_rate"],
            "seconds_per_step": train_seconds / max(settings.steps, 1),
            "train_reward_first_10": sum(e["reward"] for e in logs[:10]) / max(len(logs[:10]), 1),
            "train_reward_last_10": sum(e["reward"] for e in logs[-10:]) / max(len(logs[-10:]), 1),
        }
        if judge is not None:
            stats = judge.stats
            result["judge"] = {
                "requests": stats.requests,
                "failed": stats.failed,
                "prompt_tokens": stats.prompt_tokens,
                "completion_tokens": stats.completion_tokens,
                "mean_latency_s": stats.latency_s / max(stats.requests, 1),
            }
        if variant == "turn_term":
            turn_means = [e["turn_rewards/mean"] for e in trainer.state.log_history if "turn_rewards/mean" in e]
            result["turn_reward_first_10"] = sum(turn_means[:10]) / max(len(turn_means[:10]), 1)
            result["turn_reward_last_10"] = sum(turn_means[-10:]) / max(len(turn_means[-10:]), 1)
        record[variant] = result
        print(f"  seed {seed} {variant}: {record['before']:.1%} -> {result['after']:.1%}", flush=True)
        del trainer
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    record["seconds"] = time.monotonic() - started
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=60, help="GRPO steps per variant.")
    parser.add_argument("--eval-size", type=int, default=100, help="Held-out tasks per evaluation.")
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="A CalculatorDemoConfig override."
    )
    parser.add_argument("--output-dir", default="outputs/judge_demo")
    parser.add_argument("--cache-dir", default=None, help="Warm-start cache (default: the demo's).")
    parser.add_argument("--smoke", action="store_true", help="Toy sizes: checks the plumbing.")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    demo_argv = (
        [f"--steps={args.steps}", f"--eval-size={args.eval_size}"]
        + [f"--set={s}" for s in args.set]
        + (["--smoke"] if args.smoke else [])
    )
    record = run(args.seed, args.variants, demo_argv, output_dir, args.cache_dir)
    (output_dir / f"seed{args.seed}.json").write_text(json.dumps(record, indent=2))
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
