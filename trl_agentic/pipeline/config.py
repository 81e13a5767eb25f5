"""[`PipelineConfig`]: every knob of the CPU pipeline (warm start -> held-out eval -> GRPO -> held-out eval).

The defaults fit a tiny model trained on CPU in minutes on a task with a reference solver. The calculator demo's own
values, measured over many runs, are [`trl_agentic.pipeline.calculator.CalculatorDemoConfig`].
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass


EPISODE_LOG_FORMATS = ("gzip", "jsonl")


@dataclass
class PipelineConfig:
    """Configuration of [`run_pipeline`]: the tiny model, its warm start, GRPO and the held-out evaluations.

    Every field can be set from the command line, `trl-agentic demo --set NAME=VALUE` (tuples as `1,2`, `None` as
    `none`). Why each value: see the calculator's measurements in `CalculatorDemoConfig` and docs/demo_history.md.

    > Parameters that control the task's difficulty levels (`TaskSuite.difficulty_levels`; ignored when it has none)

    levels: GRPO draws its tasks from these levels (`None`: all the suite's), always with the suite's
        `target_difficulty`, where held-out success is measured.
    warm_start_levels: the demonstrations' levels (`None`: those up to the target).
    warm_start_check_levels: the levels of the warm start's success checks (`None`: the target alone).
    task_sampling: `"adaptive"` (groups go where they split, `trl_agentic.task_sampling`) or `"uniform"`.
    target_min_share, target_affinity, sampling_revisit: the adaptive sampler's knobs (`AgenticGRPOConfig`).

    > Parameters that control the tiny model (built locally, `trl_agentic.tiny_models`)

    hidden_size, num_layers, num_heads, vocab_size: its shape and BPE vocabulary.

    > Parameters that control the warm start (SFT on the suite's demonstrations, training split only)

    num_demonstrations: conversations from the reference solver, evenly over `warm_start_levels`.
    short_steps, short_loss_target, short_batch_size, short_learning_rate: phase 1, the conversations without system
        prompt and tool schemas (1-3 per row), stopped once the mean loss of its last 10 steps is under the target.
    full_steps, full_batch_size, full_learning_rate: phase 2, the conversations as the agent sends them...
    warm_start_target: ...stopped once the model solves this share of `validation_size` training-split tasks, counted
        from the task's chance level (`TaskSuite.chance_success`): it stops at `chance + target x (1 - chance)`
        ([`warm_start_goal`]), so a game won 27% of the time by random play does not stop at 25%, where the model has
        learned nothing. A suite that does not state its chance level is taken as 0 (the rule is then absolute).
    warm_start_workers: chunks of a batch run at once (the same weights bit for bit: not part of the cache key).
    warm_start_check_every, warm_start_check_gate: check every N phase-2 steps; run the check's second half only
        when the first reached `gate` x the target (`0`: all at once).

    > Parameters that control sampling (training rollouts and held-out evaluation alike)

    temperature, max_completion_length, max_turns: the held-out evaluation's and warm-start checks' sampling, tokens
        per model call and model calls per episode.
    grpo_temperature: GRPO's sampling temperature (`None`: `temperature`); above 1 a fast learner keeps splitting.

    > Parameters that control GRPO (`AgenticGRPOConfig`)

    steps, learning_rate, warmup_steps, lr_scheduler_type, decay_steps (a linear decay to 0 over the last steps),
    cut_off_penalty (an episode cut at `max_completion_length` scores 1 less), mask_truncated_completions,
    steps_per_generation, num_iterations, max_grad_norm, num_generations (episodes per task), tasks_per_step, beta,
    train_size (GRPO's tasks), generation_batch_wait_ms, async_rollouts, max_staleness, rollout_process,
    rollout_tree, tree_branches, tree_branch_points, tree_depth (tree rollouts, docs/tree_rollouts.md).

    > Parameters that control the held-out evaluation (the eval split, never trained on)

    eval_size: tasks (one episode each); eval_every: also every N GRPO steps (and the last); seed: the whole run's.

    > Parameters that control what the run keeps

    episode_log: GRPO's episode log, `<output_dir>/grpo/episodes/`: `"gzip"` keeps every episode, compressed once
        training ends (`episodes-rank0.jsonl.gz`; benchmarks/viewer_benchmark.py's demo-shaped 300-step log: 125.2
        MB -> 5.0 MB, the smoke run's 9x smaller; `trl-agentic inspect` and `trl_agentic.viewer` read it as it is), `"jsonl"` keeps it as the trainer wrote it.
    """

    # Difficulty levels and task sampling
    levels: tuple[float, ...] | None = None
    warm_start_levels: tuple[float, ...] | None = None
    warm_start_check_levels: tuple[float, ...] | None = None
    task_sampling: str = "adaptive"
    target_min_share: float = 0.25
    target_affinity: float = 0.1
    sampling_revisit: float = 0.5
    # Model
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    vocab_size: int = 1500
    # Warm start
    num_demonstrations: int = 2000
    short_steps: int = 600
    short_loss_target: float = 0.05
    short_batch_size: int = 32
    short_learning_rate: float = 3e-3
    full_steps: int = 200
    full_batch_size: int = 16
    full_learning_rate: float = 1e-3
    warm_start_target: float = 0.25
    warm_start_workers: int = 2
    warm_start_check_every: int = 1
    warm_start_check_gate: float = 0.5
    validation_size: int = 64
    # Sampling
    temperature: float = 1.0
    max_completion_length: int = 64
    max_turns: int = 4
    # GRPO
    steps: int = 150
    grpo_temperature: float | None = 1.2
    learning_rate: float = 2e-4
    warmup_steps: int = 30
    lr_scheduler_type: str = "constant_with_warmup"
    decay_steps: int = 50
    cut_off_penalty: bool = True
    mask_truncated_completions: bool = False
    steps_per_generation: int = 1
    num_iterations: int = 1
    max_grad_norm: float = 1.0
    num_generations: int = 12
    tasks_per_step: int = 4
    beta: float = 0.0
    train_size: int = 3000
    # Held-out evaluation
    eval_size: int = 200
    eval_every: int = 50
    seed: int = 0
    # Engine and asynchronous rollouts
    generation_batch_wait_ms: float = 50.0
    async_rollouts: bool = False
    max_staleness: int = 1
    rollout_process: bool = False
    # Tree rollouts (each group: roots, then branches replaying their parent's first calls)
    rollout_tree: bool = False
    tree_branches: int = 4
    tree_branch_points: str = "uniform"
    tree_depth: int = 1
    # What the run keeps
    episode_log: str = "gzip"

    def __post_init__(self):
        if self.episode_log not in EPISODE_LOG_FORMATS:
            raise ValueError(
                f"episode_log={self.episode_log!r}: expected one of {', '.join(EPISODE_LOG_FORMATS)} "
                "(gzip: every episode, compressed; jsonl: every episode, as the trainer wrote it)."
            )

    # The fields that shape the warm-started model (with the task's demonstrations and validation tasks: the cache key)
    WARM_START_FIELDS: typing.ClassVar[tuple[str, ...]] = (
        "hidden_size", "num_layers", "num_heads", "vocab_size", "num_demonstrations", "short_steps",
        "short_loss_target", "short_batch_size", "short_learning_rate", "full_steps", "full_batch_size",
        "full_learning_rate", "warm_start_target", "warm_start_check_every", "warm_start_check_gate", "validation_size",
        "temperature", "max_completion_length", "max_turns", "seed",
    )  # fmt: skip

    def describe_task(self, suite) -> str:
        """One line naming the task, printed first."""
        return f"task {suite.name!r}"

    def describe_levels(self, levels: tuple[float, ...]) -> str:
        """How the console names a set of difficulty levels."""
        return f"difficulty {'/'.join(map(_level_text, levels))}"


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


def _level_text(level: float) -> str:
    return str(int(level)) if float(level).is_integer() else str(level)


def level_list(suite, levels: tuple[float, ...] | None) -> tuple[float, ...]:
    """The difficulty levels `levels` (`None`: all of the suite's), always with the suite's `target_difficulty`;
    `()` for a suite without difficulty levels.

    Example:

    ```python
    >>> level_list(make_calculator_suite(digits=2), (1, 2))
    (1, 2)
    >>> level_list(make_calculator_suite(digits=2), (3,))
    (2, 3)
    ```
    """
    if not suite.difficulty_levels:
        return ()
    chosen = suite.difficulty_levels if levels is None else levels
    found = {_as_level(suite, level) for level in chosen}
    if suite.target_difficulty is not None:
        found.add(suite.target_difficulty)
    return tuple(sorted(found))


def warm_start_levels(suite, config: PipelineConfig) -> tuple[float, ...]:
    """The demonstrations' levels: `config.warm_start_levels`, else the suite's levels up to its target."""
    if config.warm_start_levels is not None or suite.target_difficulty is None:
        return level_list(suite, config.warm_start_levels)
    return level_list(suite, [level for level in suite.difficulty_levels if level <= suite.target_difficulty])


def check_levels(suite, config: PipelineConfig) -> tuple[float, ...]:
    """The warm-start checks' levels: `config.warm_start_check_levels`, else the target alone."""
    return level_list(suite, config.warm_start_check_levels if config.warm_start_check_levels is not None else ())


def _as_level(suite, level) -> float:
    """`level` as the key the suite uses (`"2"` from the command line is the calculator's `2`)."""
    for known in suite.difficulty_levels:
        if float(known) == float(level):
            return known
    raise ValueError(
        f"Difficulty level {level!r} is not one of task {suite.name!r}'s difficulty_levels "
        f"{list(suite.difficulty_levels)}; set the levels fields (levels, warm_start_levels, warm_start_check_levels) "
        "to a subset of those."
    )


def warm_start_key(config: PipelineConfig, suite, demonstrations: list[dict], validation: list[dict]) -> str:
    """The warm-start cache key: a hash of every setting that shapes the warm-started model, the task's name, its
    demonstrations and its validation tasks (so a change to the reference solver or the task builds a new model)."""
    from trl_agentic import __version__

    payload = {name: getattr(config, name) for name in config.WARM_START_FIELDS}
    payload["task"] = suite.name
    payload["demonstrations"] = _digest(demonstrations)
    payload["validation_tasks"] = _digest(validation)
    payload["trl_agentic"] = __version__
    if getattr(suite, "chance_success", None):  # the stop rule counts from it (absent: the keys stay as they were)
        payload["chance_success"] = suite.chance_success
    payload["format"] = 6  # bump when the warm-start procedure changes (6: keyed by the task's data)
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def warm_start_goal(config: PipelineConfig, suite) -> float:
    """The warm start's stop rule: `warm_start_target` of the way from the task's chance level
    (`suite.chance_success`, `None` taken as 0) to 100%.

    Example:

    ```python
    >>> warm_start_goal(PipelineConfig(), get_task("calculator"))  # no chance level: the target itself
    0.25
    >>> round(warm_start_goal(PipelineConfig(), guess_suite), 3)  # chance_success=0.27
    0.453
    ```
    """
    chance = getattr(suite, "chance_success", None) or 0.0
    if not 0.0 <= chance < 1.0:
        raise ValueError(
            f"Task {suite.name!r} has chance_success={chance}: expected a share in [0, 1) (the success rate of random "
            "play)."
        )
    return chance + config.warm_start_target * (1.0 - chance)


def _number_or_text(text: str) -> float | str:
    try:
        number = float(text)
    except ValueError:
        return text  # the calculator's `ops`
    return int(number) if number.is_integer() else number


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def with_overrides(config: PipelineConfig, items: list[str]) -> PipelineConfig:
    """`config` with `NAME=VALUE` overrides applied (what `trl-agentic demo --set` parses): tuples as `1,2`, booleans
    as `true`/`false`, optional fields as `none`.

    Example:

    ```python
    >>> with_overrides(PipelineConfig(), ["num_generations=16", "levels=1,2", "grpo_temperature=none"]).levels
    (1, 2)
    ```
    """
    fields = {f.name: f for f in dataclasses.fields(config)}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"--set {item!r}: expected NAME=VALUE with NAME one of {sorted(fields)}")
        current, annotation = getattr(config, name), str(fields[name].type)
        if raw.lower() == "none" and "None" in annotation:
            value = None
        elif isinstance(current, tuple) or annotation.startswith("tuple"):
            value = tuple(_number_or_text(v.strip()) for v in raw.split(",") if v.strip())
        elif isinstance(current, bool):
            value = raw.lower() in ("1", "true", "yes")
        elif current is None or "None" in annotation:  # the optional numbers (grpo_temperature)
            value = float(raw)
        else:
            try:
                value = type(current)(raw)
            except ValueError:
                raise ValueError(f"--set {item!r}: {name} takes a {type(current).__name__}") from None
        config = dataclasses.replace(config, **{name: value})
    return config
