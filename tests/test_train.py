"""`trl-agentic train --help` (`trl_agentic/scripts/train.py`): the agent's options first, TRL's and transformers' ~200
generic ones behind `--help-all`, and the same `--task` wording as `trl-agentic eval`."""

import dataclasses
import re

import pytest
from trl import GRPOConfig, ModelConfig

from trl_agentic.agentic_grpo_config import AgenticGRPOConfig
from trl_agentic.recipes import COMMON_OPTIONS, TASK_HELP, ScriptArguments, make_train_parser
from trl_agentic.scripts import eval as eval_script
from trl_agentic.scripts.train import main


def help_text(argv, capsys, entry=main) -> str:
    try:
        code = entry(argv)
    except SystemExit as exit:  # argparse's `--help` exits
        code = exit.code
    assert code in (0, None)
    return capsys.readouterr().out


def options(text: str) -> list[str]:
    """The options a help text lists, in order (the first spelling of each)."""
    return re.findall(r"^  (--[\w-]+)", text, flags=re.MULTILINE)


def squeezed(text: str) -> str:
    return "".join(text.split())  # argparse wraps lines wherever it likes


def test_train_help_lists_the_agents_options_first_and_hides_the_generic_ones(capsys):
    text = help_text(["--help"], capsys)
    listed = options(text)
    script = [f"--{f.name}" for f in dataclasses.fields(ScriptArguments)]
    generic = {f.name for f in dataclasses.fields(GRPOConfig)}
    agentic = [f"--{f.name}" for f in dataclasses.fields(AgenticGRPOConfig) if f.name not in generic]
    common = [f"--{name}" for name in COMMON_OPTIONS]
    assert listed[:2] == ["--config", "--help-all"]  # after `-h, --help`
    # what to train on, the agent's own options, then a few common ones: nothing else, in that order
    assert [o for o in listed[2:] if not o.startswith("--no_")] == script + agentic + common
    assert "--adam_beta1" not in text and "--fsdp" not in text and "--lora_alpha" not in text
    assert len(text.splitlines()) < 300  # it was 1,512 lines, the agent's options after ~250 generic ones
    hidden = int(re.search(r"(\d+) more options of GRPOConfig", text).group(1))
    assert hidden > 150 and "--help-all" in text.split("more options")[1]


def test_train_help_all_lists_every_option(capsys):
    text = help_text(["--help-all"], capsys)
    listed = set(options(text))
    fields = {f.name for dtype in (ScriptArguments, AgenticGRPOConfig, ModelConfig) for f in dataclasses.fields(dtype)}
    assert {f"--{name}" for name in fields if f"--{name}" in listed} == {f"--{name}" for name in fields} - {
        f"--{f.name}" for dtype in (AgenticGRPOConfig, ModelConfig) for f in dataclasses.fields(dtype) if not f.init
    }
    assert text.index("--task") < text.index("--max_turns") < text.index("--learning_rate") < text.index("--adam_beta1")


def test_hidden_options_are_still_accepted(tmp_path):
    script_args, training_args, model_args = make_train_parser().parse_args_and_config(
        ["--task", "calculator", "--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false"]
        + ["--adam_beta1", "0.8", "--lora_alpha", "7"]  # two of the options `--help` does not list
    )
    assert (script_args.task, training_args.adam_beta1, model_args.lora_alpha) == ("calculator", 0.8, 7)


@pytest.mark.parametrize("entry", ["train", "eval"])
def test_train_and_eval_describe_the_task_forms_alike(entry, capsys):
    text = help_text(["--help"], capsys, main if entry == "train" else eval_script.main)
    assert squeezed(TASK_HELP) in squeezed(text)
    for form in ("'pkg.module:TASK'", "'path/to/task.py:TASK'", "'verifiers:<env-id>'", "'calculator'"):
        assert form in TASK_HELP
