# /// script
# requires-python = ">=3.10"
# dependencies = [
#     "trl-agentic",
# ]
# ///
"""Train an agent with GRPO from a recipe: `TrlParser` semantics, but a recipe key nobody declares is an error.

```bash
trl-agentic train --config recipes/calculator/tiny/config_cpu.yaml
trl-agentic train --config recipes/calculator/Qwen2.5-1.5B-Instruct/config_lora.yaml --learning_rate 2e-5
accelerate launch --config_file recipes/accelerate_configs/zero3.yaml \
    -m trl_agentic.scripts.train --config recipes/calculator/Qwen2.5-1.5B-Instruct/config_full.yaml
```

The recipe YAML supplies defaults for the fields of [`ScriptArguments`], [`AgenticGRPOConfig`] and
[`trl.ModelConfig`] (plus TRL's `env:` block of environment variables); flags on the command line override it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from dataclasses import dataclass, field
from typing import Any

from trl import ModelConfig, TrlParser

from trl_agentic.agentic_grpo_config import AgenticGRPOConfig
from trl_agentic.imports import import_object


@dataclass
class ScriptArguments:
    """
    Arguments of the training script that are not trainer or model settings: what to train on.

    Args:
        task (`str`):
            Task suite: a bundled name (`"calculator"`, `"files"`) or an import path `"pkg.module:attr"` to a
            `TaskSuite`. It supplies the dataset, the agent and the reward functions.
        agent (`str`, *optional*):
            Import path `"pkg.module:attr"` of an agent callable (`async def agent(client, task)`) that replaces the
            task's own agent.
        agent_command (`str`, *optional*):
            Shell command run once per episode as the agent (it gets `OPENAI_BASE_URL`, `OPENAI_API_KEY` and the task
            as JSON). Mutually exclusive with `agent`.
        reward_funcs (`list[str]`, *optional*):
            Reward functions replacing the task's: bundled names (see `trl_agentic.rewards.REWARD_FUNCS`) or import
            paths `"pkg.module:function"`. Weight them with `reward_weights`.
        train_size (`int`, *optional*, defaults to `256`):
            Number of tasks in the training split.
        eval_size (`int`, *optional*, defaults to `0`):
            Number of tasks in the evaluation split; `0` builds none.
        dataset_seed (`int`, *optional*, defaults to `0`):
            Seed of the task generator (independent of the training `seed`).
    """

    task: str = field(
        metadata={"help": "Task suite: a bundled name ('calculator', 'files') or an import path 'pkg.module:attr'."}
    )
    agent: str | None = field(
        default=None, metadata={"help": "Import path 'pkg.module:attr' of an agent replacing the task's agent."}
    )
    agent_command: str | None = field(
        default=None, metadata={"help": "Shell command run per episode as the agent (exclusive with --agent)."}
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Reward functions replacing the task's: bundled names or import paths 'pkg.module:func'."},
    )
    train_size: int = field(default=256, metadata={"help": "Number of tasks in the training split."})
    eval_size: int = field(default=0, metadata={"help": "Number of tasks in the evaluation split (0: none)."})
    dataset_seed: int = field(default=0, metadata={"help": "Seed of the task generator."})

    def __post_init__(self):
        if self.agent is not None and self.agent_command is not None:
            raise ValueError(
                f"Set either agent ({self.agent!r}) or agent_command ({self.agent_command!r}), not both: each replaces "
                "the task's agent."
            )
        if self.train_size < 1:
            raise ValueError(f"train_size must be >= 1, got {self.train_size}.")
        if self.eval_size < 0:
            raise ValueError(f"eval_size must be >= 0 (0 = no evaluation split), got {self.eval_size}.")


# The dataclasses a recipe fills, in the order `make_parser` returns them.
RECIPE_DATACLASSES = (ScriptArguments, AgenticGRPOConfig, ModelConfig)


def recipe_keys() -> set[str]:
    """Every key a recipe may set (besides TrlParser's `env:` block): the fields of the three argument dataclasses."""
    return {f.name for dtype in RECIPE_DATACLASSES for f in dataclasses.fields(dtype) if f.init}


def describe_unknown_keys(unknown: list[str], known: set[str]) -> str:
    """`'lerning_rate' (did you mean 'learning_rate'?), 'foo'`: the unknown keys, with the closest known one."""
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ", ".join(hints)


class StrictTrlParser(TrlParser):
    """[`trl.TrlParser`] that rejects recipe keys no dataclass declares.

    TRL's own scripts pass unknown recipe keys on (`fail_with_unknown_args=False`), so a typo such as `lerning_rate`
    or a key TRL renamed trains silently with the default. Here it fails and names the key (open-r1's recipes rotted
    this way).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._config_path = None  # named in the unknown-key error

    def parse_args_and_config(self, args=None, **kwargs):
        args = list(sys.argv[1:] if args is None else args)
        self._config_path = args[args.index("--config") + 1] if "--config" in args[:-1] else None
        return super().parse_args_and_config(args, **kwargs)

    def set_defaults_with_config(self, **kwargs) -> list[str]:
        # TrlParser has already removed the `env:` block; every other key must be a dataclass field.
        known = {f.name for dtype in self.dataclass_types for f in dataclasses.fields(dtype) if f.init}
        unknown = [key for key in kwargs if key not in known]
        if unknown:
            owners = ", ".join(dtype.__name__ for dtype in self.dataclass_types)
            raise ValueError(
                f"Unknown key{'s' if len(unknown) > 1 else ''} {describe_unknown_keys(unknown, known)} in recipe "
                f"{self._config_path or '--config'}. A recipe may only set fields of {owners} "
                "(and an `env:` block): fix or remove it."
            )
        return super().set_defaults_with_config(**kwargs)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None) -> StrictTrlParser:
    """Parser of `ScriptArguments`, `AgenticGRPOConfig` and `ModelConfig`, with `--config recipe.yaml`.

    Example:

    ```python
    >>> parser = make_parser()
    >>> script_args, training_args, model_args = parser.parse_args_and_config(
    ...     ["--config", "recipes/calculator/tiny/config_cpu.yaml", "--max_steps", "5"]
    ... )
    >>> training_args.max_steps
    5
    ```
    """
    dataclass_types = RECIPE_DATACLASSES
    if subparsers is not None:
        # The subparser's class is the one the caller gave `add_subparsers(parser_class=...)`.
        return subparsers.add_parser("train", help="Train an agent with GRPO", dataclass_types=dataclass_types)
    return StrictTrlParser(dataclass_types, prog=prog)


def resolve_agent(script_args: ScriptArguments, task) -> Any:
    """The agent of a run: `agent_command` as a `CommandAgent`, else the `agent` import path, else the task's agent."""
    if script_args.agent_command is not None:
        from trl_agentic.rollout.agents import CommandAgent

        return CommandAgent(script_args.agent_command)
    if script_args.agent is not None:
        agent = import_object(script_args.agent)
        if not callable(agent):
            raise ValueError(f"agent {script_args.agent!r} resolved to {agent!r}, which is not callable.")
        return agent
    return task.agent


def resolve_reward_funcs(script_args: ScriptArguments, task) -> list:
    """The reward functions of a run: `reward_funcs` by name or import path, else the task's."""
    if script_args.reward_funcs is None:
        return list(task.reward_funcs)
    from trl_agentic.rewards import get_reward_func

    return [get_reward_func(name) for name in script_args.reward_funcs]


def run(script_args: ScriptArguments, training_args: AgenticGRPOConfig, model_args: ModelConfig) -> None:
    """Train, save to `output_dir`, and push to the Hub when `push_to_hub` is set."""
    import torch
    import transformers
    from packaging.version import Version
    from trl import get_peft_config, get_quantization_config

    from trl_agentic import AgenticGRPOTrainer
    from trl_agentic.tasks import get_task
    from trl_agentic.tiny_models import load_model_and_tokenizer

    # Task, agent and reward functions: resolved before the model loads, so a bad name fails in seconds
    task = get_task(script_args.task)
    agent = resolve_agent(script_args, task)
    reward_funcs = resolve_reward_funcs(script_args, task)

    # Model
    if model_args.model_name_or_path is None:
        raise ValueError(
            "No model: set `model_name_or_path` in the recipe or pass --model_name_or_path (a Hub id, a local path, "
            "or 'tiny:qwen2_5:64x2' for a tiny model built locally)."
        )
    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=dtype,
    )
    quantization_config = get_quantization_config(model_args)
    if quantization_config is not None:
        from accelerate import PartialState

        model_init_kwargs["quantization_config"] = quantization_config
        model_init_kwargs["device_map"] = {"": PartialState().local_process_index}  # one full copy per process
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    model, tokenizer = load_model_and_tokenizer(model_args.model_name_or_path, **model_init_kwargs)

    # Datasets
    train_dataset = task.build_dataset(split="train", size=script_args.train_size, seed=script_args.dataset_seed)
    eval_dataset = None
    if script_args.eval_size > 0:
        eval_dataset = task.build_dataset(split="eval", size=script_args.eval_size, seed=script_args.dataset_seed)

    # Trainer
    trainer = AgenticGRPOTrainer(
        model,
        agent=agent,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("Training completed.")

    # Save and push to the Hub
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub()
        trainer.accelerator.print(f"Model pushed to https://huggingface.co/{trainer.hub_model_id}.")

    # Finish the trackers and destroy the process group (as TRL's scripts do)
    if Version(transformers.__version__) >= Version("5.18.0"):
        trainer.end()


def main(argv: list[str] | None = None) -> int:
    """`trl-agentic train [--config recipe.yaml] [--flag value ...]`."""
    try:
        script_args, training_args, model_args = make_parser(prog="trl-agentic train").parse_args_and_config(argv)
    except ValueError as error:  # a bad recipe or flag: the message says what to fix, a traceback adds nothing
        print(f"trl-agentic train: {error}", file=sys.stderr)
        return 2
    run(script_args, training_args, model_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
