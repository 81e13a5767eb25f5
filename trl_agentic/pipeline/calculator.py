"""The calculator demo's configuration (`trl-agentic demo` without `--task`): two-digit multiplication, and every
value the README's per-seed figures were measured with.

Why each value differs from [`PipelineConfig`]'s (the measurements: README and docs/demo_history.md):

- `digits=2`, `ops=("*",)`: two-digit multiplication, which a 0.4M-parameter model cannot do in its head.
- `levels=(1, 2, 3)` with adaptive sampling (issue #11): the sampler sends each group where its episodes are likely to
  disagree; `--set task_sampling=uniform --set levels=2`: the target alone, as before. `target_affinity=0.1`: on seeds
  1-4 at 0.5, a third of the groups went to 1-digit tasks while the target split, and 1-digit success rose while
  2-digit success stalled or fell. `sampling_revisit=0.5`: in a run of seed 3 revisits split 97% / 84% of the time
  against 85% / 76% for new two-digit tasks (steps 0-99 / 100-199).
- `warm_start_levels=(1, 2)`: 3-digit products are too long to copy reliably. `warm_start_check_levels=(2,)`: checked
  on 1- and 2-digit tasks, seed 2 stopped at 22-34% with 35-37.5% held-out (2-digit) success, its 1-digit success
  lagging.
- `steps=300`: 200 left seed 2 at +27.5 (39.5% -> 67.0%: it learns slowly); 300 lifted it to +33.0 to +49.0 in four
  runs. `train_size=9000`: 3,000 tasks per level, so 300 steps' ~1,200 groups are mostly first visits.
- `grpo_temperature=1.2`: at 1.0 seed 1's sampled tokens' entropy fell 0.10 -> 0.03 and its groups stopped splitting;
  at 1.2 seeds 1 and 2 kept 65% and 67.5% and gained +59.5 and +49.0.
- `learning_rate=2e-4` after `warmup_steps=30`, then `decay_steps=50` (issue 13's seeds x arms study): at a constant
  4e-4 with no warmup both arms collapsed on some seeds; with the decay held-out success moved by -1.5 to +18.5 points
  over steps 150-200 on thirteen runs, against falls of 7-14 points on three of nine without.
- `cut_off_penalty=True`: without it, seed 3's answers grew a tail of dots after the number from step 155 (tokens per
  episode 34 -> 70 at the same reward). TRL's `mask_truncated_completions` stopped the dots but let 240 of seed 2's
  798 malformed tool calls run into the limit.
- `max_completion_length=48`: a calculator call is ~35 tokens of the tiny tokenizer.
- `num_generations=12` x `tasks_per_step=4`: groups of 8 split ~75% of the time once a seed solves the target, 12 ~86%;
  16 x 2 tasks collapsed seed 1 at step ~225.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import PipelineConfig


@dataclass
class CalculatorDemoConfig(PipelineConfig):
    """[`PipelineConfig`] with the calculator demo's values, plus the calculator's own knobs `digits` (the target
    difficulty: held-out success is measured at it, and only at it), `ops` and `agent` (`"python"`: the reference
    agent in the trainer's process; `"command"`: the same tool loop as a `CommandAgent` in each episode's sandbox,
    `--set agent=command`, docs/sandboxes.md).

    Example:

    ```python
    >>> config = CalculatorDemoConfig(seed=3)
    >>> run_pipeline(config.suite(), config, "outputs/demo", task_file_source=config.task_file_source())
    ```
    """

    levels: tuple[float, ...] | None = (1, 2, 3)
    warm_start_levels: tuple[float, ...] | None = (1, 2)
    warm_start_check_levels: tuple[float, ...] | None = (2,)
    max_completion_length: int = 48
    steps: int = 300
    train_size: int = 9000
    digits: int = 2
    ops: tuple[str, ...] = ("*",)
    agent: str = "python"

    def suite(self):
        """The calculator [`TaskSuite`] at `digits` and `ops`."""
        from ..tasks.calculator import make_calculator_suite

        return make_calculator_suite(digits=self.digits, ops=self.ops, agent=self.agent)

    def task_file_source(self) -> str:
        """The text of the run's `task.py`."""
        return (
            '"""The task of `trl-agentic demo`, for `trl-agentic eval --task <this file>:TASK`."""\n\n'
            "from trl_agentic.tasks.calculator import make_calculator_suite\n\n"
            f"TASK = make_calculator_suite(digits={self.digits}, ops={tuple(self.ops)!r}, agent={self.agent!r})\n"
        )

    def describe_task(self, suite) -> str:
        return f"calculator agent, {self.digits}-digit operands, ops {' '.join(self.ops)}"

    def describe_levels(self, levels) -> str:
        return f"operands of {'/'.join(str(int(level)) for level in levels)} digits"
