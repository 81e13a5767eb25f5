"""The pipeline's evaluations through the endpoint: held-out success, the warm start's staged checks, and what the
alarms get during GRPO."""

from __future__ import annotations

import time
from typing import Any

from ..evaluation import Evaluator
from .data import question_of


class HeldOutEvaluator(Evaluator):
    """The pipeline's held-out evaluation: the suite's agent, once on each of a fixed set of tasks, at a fixed
    temperature, against an endpoint serving `model`; `evaluate()` may be called with the live (training) model.

    A thin user of [`trl_agentic.evaluation.Evaluator`]: `success` counts successes over all episodes (a failed or
    unscorable episode is a failure); the result adds `examples` (the first three episodes), `sampled_temperatures`
    (as the endpoint recorded them) and `seconds`, and leaves out `per_task`.

    Example:

    ```python
    >>> evaluator = HeldOutEvaluator(model, tokenizer, suite, suite.build_dataset("eval", size=200), 1.0, 48, 4)
    >>> evaluator.evaluate(model, seed=0)["success"]
    0.31
    >>> evaluator.close()
    ```
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
            max_generation_batch_size=256,  # as the pipeline's training engine: CPU decoding is per-step bound
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
                "question": question_of(task["prompt"]),
                "tool_calls": [
                    call["function"].get("arguments")
                    for turn in episode.turns
                    for call in turn.response_message.get("tool_calls") or []
                ],
                "answer": episode.result if isinstance(episode.result, str) else None,
                "status": episode.status,
                "expected": task.get("answer"),  # the checker's column, when the task names it `answer`
                "reward": reward,
            }
            for task, episode, reward in list(zip(self.tasks, episodes, rewards, strict=True))[:3]
        ]
        result["sampled_temperatures"] = sorted(
            {turn.sampling["temperature"] for e in episodes for turn in e.turns if "temperature" in turn.sampling}
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


class ReportingEvaluator:
    """The held-out evaluation as the alarms callback calls it: the reported one (`evaluator`, at `temperature`: the
    table's figures) and, when GRPO samples at another temperature, the same tasks sampled as GRPO samples
    (`alarm_evaluator`), which is what the alarms get as `success`: `reward_hacking` holds the training success against
    it, and training success at 1.2 against held-out success at 1.0 is not like with like (on the calculator's seed 1,
    held-out at 1.0 sat at ~80% from step 50 while training success at 1.2 caught up from 0.56 to 0.77, and the alarm
    fired). The reported result rides along as `reported`. Prints each result as it comes.

    Args:
        evaluator: the reported evaluation.
        first_seed: the seed of the run (the alarms callback passes `seed + step`).
        alarm_evaluator, alarm_temperature: the evaluation at GRPO's temperature, when it differs.
    """

    def __init__(
        self,
        evaluator: HeldOutEvaluator,
        first_seed: int,
        alarm_evaluator: HeldOutEvaluator | None = None,
        alarm_temperature: float | None = None,
    ):
        self.evaluator = evaluator
        self.first_seed = first_seed
        self.alarm_evaluator = alarm_evaluator
        self.alarm_temperature = alarm_temperature

    def evaluate(self, model=None, seed: int = 0, reported: dict[str, Any] | None = None) -> dict[str, Any]:
        """`reported`: the reported evaluation when already run (the one before training)."""
        if reported is None:
            reported = self.evaluator.evaluate(model, seed=seed)
        line = (
            f"\n  held-out success at step {seed - self.first_seed}: {reported['success']:.1%} "
            f"({reported['episodes']} episodes, {reported['seconds']:.0f}s)"
        )
        if self.alarm_evaluator is None:
            print(line, flush=True)
            return {**reported, "reported": reported}
        result = self.alarm_evaluator.evaluate(model, seed=seed)
        print(
            f"{line}; sampled at {self.alarm_temperature} as GRPO samples, for the alarms: "
            f"{result['success']:.1%} ({result['seconds']:.0f}s)",
            flush=True,
        )
        return {**result, "reported": reported}

    def close(self) -> None:
        pass  # the pipeline closes its evaluators itself
