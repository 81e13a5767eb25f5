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

import os
import sys

from trl import ModelConfig

from trl_agentic.agentic_grpo_config import AgenticGRPOConfig
from trl_agentic.recipes import ScriptArguments, agent_from_recipe, make_train_parser, resolve_reward_funcs
from trl_agentic.tasks import build_difficulty_dataset


def resume_checkpoint(training_args: AgenticGRPOConfig) -> str | None:
    """The checkpoint `--resume_from_checkpoint` names: `true` means the latest `checkpoint-N` in `output_dir` (as in
    TRL's scripts; the string "true" reached the trainer as a path), `false` none, anything else a path.

    Example:

    ```python
    >>> resume_checkpoint(AgenticGRPOConfig(output_dir="out", resume_from_checkpoint="true"))
    'out/checkpoint-500'
    ```
    """
    from transformers.trainer_utils import get_last_checkpoint

    value = training_args.resume_from_checkpoint
    if value is None or str(value).strip().lower() in ("", "false", "no", "0", "none"):
        return None
    if str(value).strip().lower() not in ("true", "yes", "1", "latest"):
        return str(value)
    output_dir = training_args.output_dir
    latest = get_last_checkpoint(output_dir) if output_dir and os.path.isdir(output_dir) else None
    if latest is None:
        raise ValueError(
            f"resume_from_checkpoint={value!r} resumes the latest checkpoint in output_dir, but {output_dir!r} holds no "
            "checkpoint-N directory; pass the path of a checkpoint, or drop the flag to start from scratch."
        )
    return latest


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
    agent = agent_from_recipe(script_args, task)
    reward_funcs = resolve_reward_funcs(script_args, task)
    if script_args.reward_funcs is None and training_args.reward_weights is None:
        training_args.reward_weights = task.reward_weights  # the task's own checkers, with its weights
    # The agent's task: the columns the recipe names plus those the task suite declares its agent needs.
    training_args.agent_columns = list(dict.fromkeys([*training_args.agent_columns, *task.agent_columns]))

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
    if script_args.mixed_difficulty:
        train_dataset = build_difficulty_dataset(
            task,
            split="train",
            size=script_args.train_size,
            seed=script_args.dataset_seed,
            column=training_args.difficulty_column or "difficulty",
        )
        if training_args.target_difficulty is None:
            training_args.target_difficulty = task.target_difficulty
    else:
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
    trainer.train(resume_from_checkpoint=resume_checkpoint(training_args))
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
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help-all" in argv:  # here, not as an argparse action: the namespace may hold dataclass fields only
        make_train_parser(help_all=True).print_help()
        return 0
    try:
        script_args, training_args, model_args = make_train_parser().parse_args_and_config(argv)
    except ValueError as error:  # a bad recipe or flag: the message says what to fix, a traceback adds nothing
        print(f"trl-agentic train: {error}", file=sys.stderr)
        return 2
    run(script_args, training_args, model_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
