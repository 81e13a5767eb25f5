"""The CPU pipeline for any task with a reference solver: warm start -> held-out eval -> GRPO -> held-out eval -> plots,
saved model, summary. `trl-agentic demo` runs it (on the calculator, or `--task module:TASK`).

Example:

```python
>>> from trl_agentic.pipeline import PipelineConfig, run_pipeline
>>> summary = run_pipeline("my_tasks:TASK", PipelineConfig(steps=60), output_dir="outputs/my_task")
>>> summary["improvement_points"]
24.5
```

What a task needs (docs/pipeline.md): a [`TaskSuite`] whose `demonstrations(n, seed=0, **knobs)` returns successful
conversations on training-split tasks (a reference solver), a `build_dataset` whose `"train"` and `"eval"` splits are
disjoint, and checkers that score the agent's episodes; `difficulty_levels` (easier and harder than the target) give
GRPO tasks whose episodes disagree, which is where its learning signal comes from.
"""

import importlib
from typing import TYPE_CHECKING


# Loaded on first use (PEP 562): `trl-agentic demo --help` reads `CalculatorDemoConfig` and `PipelineConfig`, which
# need neither torch nor TRL, and must not wait for them (issue 40).
_EXPORTS = {
    "CalculatorDemoConfig": ".calculator",
    "SMOKE_OVERRIDES": ".config",
    "PipelineConfig": ".config",
    "with_overrides": ".config",
    "check_task": ".data",
    "grpo_tasks": ".data",
    "short_form_rows": ".data",
    "validation_tasks": ".data",
    "warm_start_demonstrations": ".data",
    "HeldOutEvaluator": ".held_out",
    "StagedCheck": ".held_out",
    "PipelinePlan": ".plan",
    "make_plan": ".plan",
    "run_pipeline": ".run",
    "run_plan": ".run",
    "build_warm_started": ".warm_started_model",
}

if TYPE_CHECKING:
    from .calculator import CalculatorDemoConfig
    from .config import SMOKE_OVERRIDES, PipelineConfig, with_overrides
    from .data import check_task, grpo_tasks, short_form_rows, validation_tasks, warm_start_demonstrations
    from .held_out import HeldOutEvaluator, StagedCheck
    from .plan import PipelinePlan, make_plan
    from .run import run_pipeline, run_plan
    from .warm_started_model import build_warm_started


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trl_agentic.pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "SMOKE_OVERRIDES",
    "CalculatorDemoConfig",
    "HeldOutEvaluator",
    "PipelineConfig",
    "PipelinePlan",
    "StagedCheck",
    "build_warm_started",
    "check_task",
    "grpo_tasks",
    "make_plan",
    "run_pipeline",
    "run_plan",
    "short_form_rows",
    "validation_tasks",
    "warm_start_demonstrations",
    "with_overrides",
]
