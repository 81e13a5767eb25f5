"""Recipes: what a recipe YAML may say, how it is parsed, and how the names in it become objects.

One module for `trl-agentic train`, `trl-agentic eval` and `trl-agentic jobs submit`, so that the three read a recipe
the same way: the keys are the fields of [`ScriptArguments`], [`AgenticGRPOConfig`] and [`trl.ModelConfig`] (plus
TRL's `env:` block), an unknown key fails with a did-you-mean, and names (task, agent, reward functions) are resolved
to callables here, never in the trainer (open-r1's rule).

Example:

```python
>>> from trl_agentic.recipes import agent_from_recipe, load_recipe, resolve_reward_funcs, ScriptArguments
>>> recipe = load_recipe("recipes/calculator/tiny/config_cpu.yaml")
>>> recipe["task"], recipe["max_turns"]
('calculator', 2)
```
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml
from trl import GRPOConfig, ModelConfig, TrlParser

from .agentic_grpo_config import AgenticGRPOConfig
from .imports import TASK_HELP, import_object
from .rewards import cut_off_penalty
from .rollout.agents import CommandAgent
from .rollout.harnesses import Harness
from .sandbox import SANDBOXES
from .tasks import TaskSuite
from .tasks.calculator import calculator_correct
from .tasks.files import files_correct


# Reward functions a recipe may name (`reward_funcs: [calculator_correct]`); anything else is an import path.
REWARD_FUNCS: dict[str, Callable] = {
    "calculator_correct": calculator_correct,
    "cut_off_penalty": cut_off_penalty,
    "files_correct": files_correct,
}


def get_reward_func(name: str) -> Callable:
    """Resolve a reward function by bundled name (see `REWARD_FUNCS`) or import path `"pkg.module:attr"`.

    Args:
        name: a bundled name, e.g. `"calculator_correct"`, or an import path, e.g. `"my_rewards:length_penalty"`.

    Example:

    ```python
    >>> get_reward_func("files_correct")
    <function files_correct at ...>
    ```
    """
    if name in REWARD_FUNCS:
        return REWARD_FUNCS[name]
    if ":" not in name:
        raise ValueError(
            f"Unknown reward function {name!r}. Use one of the bundled names {sorted(REWARD_FUNCS)} or an import path "
            "'pkg.module:function'."
        )
    func = import_object(name)
    if not callable(func):
        raise ValueError(f"Reward function {name!r} resolved to {func!r}, which is not callable.")
    return func


# What `--task` (and a recipe's `task:`) accepts: `trl_agentic.tasks.get_task`'s forms, one wording for every command.
@dataclass
class ScriptArguments:
    """
    Arguments of the training script that are not trainer or model settings: what to train on.

    Args:
        task (`str`):
            Task suite, in any of the forms of `TASK_HELP` (a bundled name, `"pkg.module:TASK"`,
            `"path/to/task.py:TASK"`, `"verifiers:<env-id>"`). It supplies the dataset, the agent and the reward
            functions.
        agent (`str`, *optional*):
            Import path `"pkg.module:attr"` of an agent callable (`async def agent(client, task)`) that replaces the
            task's own agent, or `"harness:<preset>"` for a CLI coding agent (`trl_agentic.rollout.harnesses`, e.g.
            `"harness:mini-swe-agent"`).
        agent_command (`str`, *optional*):
            Shell command run once per episode as the agent (it gets `OPENAI_BASE_URL`, `OPENAI_API_KEY` and the task
            as JSON). Mutually exclusive with `agent`.
        sandbox (`str`, *optional*, defaults to `"auto"`):
            Where `agent_command` and a `harness:<preset>` agent run each episode (`trl_agentic.sandbox`): `"auto"`
            (bubblewrap where it works, else `$TRL_AGENTIC_SANDBOX`, else an error saying what to install), `"bwrap"`,
            `"docker"`, or `"none"` (unsandboxed: the agent can read what the trainer can; warns once).
        sandbox_binds (`list[str]`, *optional*):
            Host paths the sandboxed agent sees read-only, besides its program's own folder (its scripts, its data).
        reward_funcs (`list[str]`, *optional*):
            Reward functions replacing the task's: bundled names (see `trl_agentic.recipes.REWARD_FUNCS`) or import
            paths `"pkg.module:function"`. Weight them with `reward_weights`.
        train_size (`int`, *optional*, defaults to `256`):
            Number of tasks in the training split.
        eval_size (`int`, *optional*, defaults to `0`):
            Number of tasks in the evaluation split; `0` builds none.
        dataset_seed (`int`, *optional*, defaults to `0`):
            Seed of the task generator (independent of the training `seed`).
        mixed_difficulty (`bool`, *optional*, defaults to `False`):
            Train on the task's `difficulty_levels` mixed in one dataset (a `difficulty` column), for
            `task_sampling: adaptive`; `target_difficulty` defaults to the task's own. The eval split stays at the
            task's own difficulty.
    """

    task: str = field(metadata={"help": TASK_HELP})
    agent: str | None = field(
        default=None,
        metadata={
            "help": "Import path 'pkg.module:attr' of an agent replacing the task's agent, or "
            "'harness:<preset>' for a CLI coding agent (e.g. harness:mini-swe-agent)."
        },
    )
    agent_command: str | None = field(
        default=None, metadata={"help": "Shell command run per episode as the agent (exclusive with --agent)."}
    )
    sandbox: str = field(
        default="auto",
        metadata={"help": f"Where agent_command / harness agents run each episode: one of {list(SANDBOXES)}."},
    )
    sandbox_binds: list[str] | None = field(
        default=None, metadata={"help": "Host paths the sandboxed agent sees read-only (its scripts, its data)."}
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Reward functions replacing the task's: bundled names or import paths 'pkg.module:func'."},
    )
    train_size: int = field(default=256, metadata={"help": "Number of tasks in the training split."})
    eval_size: int = field(default=0, metadata={"help": "Number of tasks in the evaluation split (0: none)."})
    dataset_seed: int = field(default=0, metadata={"help": "Seed of the task generator."})
    mixed_difficulty: bool = field(
        default=False, metadata={"help": "Train on the task's difficulty levels mixed (for adaptive task sampling)."}
    )

    def __post_init__(self):
        if self.agent is not None and self.agent_command is not None:
            raise ValueError(
                f"Set either agent ({self.agent!r}) or agent_command ({self.agent_command!r}), not both: each replaces "
                "the task's agent."
            )
        if self.sandbox not in SANDBOXES:
            raise ValueError(f"sandbox={self.sandbox!r}: use one of {list(SANDBOXES)} (docs/trust_model.md).")
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


def agent_from_recipe(script_args: ScriptArguments, task: TaskSuite) -> Any:
    """The agent a recipe names: `agent_command` as a `CommandAgent`, else the `agent` import path, else the task's.

    What it returns is what `AgenticGRPOTrainer(agent=...)` accepts (the trainer normalizes it with
    `trl_agentic.rollout.agents.resolve_agent`).

    Example:

    ```python
    >>> script_args = ScriptArguments(task="calculator", agent_command="python my_agent.py")
    >>> agent_from_recipe(script_args, get_task("calculator"))
    CommandAgent(command='python my_agent.py', env={}, cwd=None, inherit_env=(), sandbox='auto', binds=(), limits=None, sandbox_image=None)
    ```
    """
    sandbox = {"sandbox": script_args.sandbox, "binds": tuple(script_args.sandbox_binds or ())}
    if script_args.agent_command is not None:
        return CommandAgent(script_args.agent_command, **sandbox)
    if script_args.agent is not None and script_args.agent.startswith("harness:"):
        return Harness(script_args.agent.removeprefix("harness:"), **sandbox)  # a CLI coding agent's preset
    if script_args.agent is not None:
        agent = import_object(script_args.agent)
        if not callable(agent):
            raise ValueError(f"agent {script_args.agent!r} resolved to {agent!r}, which is not callable.")
        return agent
    return task.agent


def resolve_reward_funcs(script_args: ScriptArguments, task: TaskSuite) -> list[Callable]:
    """The reward functions a recipe names: `reward_funcs` by name or import path, else the task's."""
    if script_args.reward_funcs is None:
        return list(task.reward_funcs)
    return [get_reward_func(name) for name in script_args.reward_funcs]


def load_recipe(path: str, prog: str = "trl-agentic eval") -> dict[str, Any]:
    """Read a recipe as `trl-agentic train` does (same keys, unknown keys rejected, `env:` block applied), without
    building `TrainingArguments`, so that a GPU recipe can be read on a CPU.

    Returns:
        Every recipe key (the fields of `ScriptArguments`, `AgenticGRPOConfig` and `ModelConfig`), with the recipe's
        value or the field's default.
    """
    with open(path) as f:
        config = yaml.safe_load(f)
    if not isinstance(config, dict):
        raise ValueError(f"Recipe {path} must contain a YAML mapping.")
    env = config.pop("env", {}) or {}
    if not isinstance(env, dict):
        raise ValueError(f"The `env` block of {path} must be a mapping of variable names to values.")
    parser = make_parser(prog=prog)
    parser._config_path = path  # named in the unknown-key error
    parser.set_defaults_with_config(**config)  # raises on a key no dataclass declares, with a did-you-mean hint
    for key, value in env.items():
        os.environ[key] = str(value)
    values: dict[str, Any] = {}
    for dtype in RECIPE_DATACLASSES:
        for f in dataclasses.fields(dtype):
            if not f.init or f.name in values:
                continue
            if f.name in config:
                values[f.name] = config[f.name]
            elif f.default is not dataclasses.MISSING:
                values[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                values[f.name] = f.default_factory()
    return values


__all__ = [
    "COMMON_OPTIONS",
    "RECIPE_DATACLASSES",
    "REWARD_FUNCS",
    "ScriptArguments",
    "StrictTrlParser",
    "agent_from_recipe",
    "describe_unknown_keys",
    "get_reward_func",
    "load_recipe",
    "make_parser",
    "make_train_parser",
    "recipe_keys",
    "resolve_reward_funcs",
]


# `--help` shows these of TRL's and transformers' ~210 options after the agent's own; `--help-all` shows every one.
COMMON_OPTIONS = """model_name_or_path dtype use_peft lora_r output_dir max_steps learning_rate num_generations
per_device_train_batch_size gradient_accumulation_steps temperature max_completion_length beta use_vllm seed report_to
logging_steps save_steps push_to_hub resume_from_checkpoint""".split()


def make_train_parser(help_all: bool = False) -> StrictTrlParser:
    """The recipe parser (`trl_agentic.recipes.make_parser`) with its help in groups: what to train on, the agent's
    own options (`AgenticGRPOConfig`'s fields beyond `GRPOConfig`), then `COMMON_OPTIONS`. The other options of
    `GRPOConfig`, `TrainingArguments` and `ModelConfig` are accepted as ever, and listed with `help_all`."""
    parser = make_parser(prog="trl-agentic train")
    parser.usage = "trl-agentic train [--config RECIPE.yaml] [--FIELD VALUE ...] [-h] [--help-all]"
    parser.description = "Train an agent with GRPO. A recipe YAML gives defaults for any option; flags override it."
    parser.add_argument("--config", default=argparse.SUPPRESS, metavar="RECIPE.yaml", help="A recipe YAML.")
    parser.add_argument("--help-all", action="store_true", default=argparse.SUPPRESS, help="Every option, then exit.")
    actions: dict[str, list[argparse.Action]] = {}  # field -> its options (`--alarms` and `--no_alarms` share one)
    for action in parser._optionals._group_actions:
        if action.dest not in ("help", "help_all", "config"):
            actions.setdefault(action.dest, []).append(action)
    generic = {f.name for f in dataclasses.fields(GRPOConfig)}
    groups = {
        "what to train on (ScriptArguments)": [f.name for f in dataclasses.fields(ScriptArguments)],
        "the agent's episodes, rewards and alarms (AgenticGRPOConfig)": [
            f.name for f in dataclasses.fields(AgenticGRPOConfig) if f.name not in generic
        ],
        "common model and training options (trl.ModelConfig, trl.GRPOConfig)": COMMON_OPTIONS,
    }
    rest = [name for name in actions if all(name not in names for names in groups.values())]
    if help_all:
        groups["all other options (trl.GRPOConfig, transformers.TrainingArguments, trl.ModelConfig)"] = rest
    for title, names in groups.items():
        group = parser.add_argument_group(title)
        for action in (action for name in names for action in actions[name]):
            parser._optionals._group_actions.remove(action)
            group._group_actions.append(action)
    if not help_all:
        for action in (action for name in rest for action in actions[name]):
            action.help = argparse.SUPPRESS
        parser.epilog = (
            f"{len(rest)} more options of GRPOConfig, TrainingArguments and ModelConfig are accepted (in a recipe "
            "too): `trl-agentic train --help-all` lists them."
        )
    return parser
