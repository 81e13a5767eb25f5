"""Every recipe parses with the training script's parser; typos fail; the CPU recipe trains end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers.training_args
import yaml

from trl_agentic.recipes import make_parser


REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES_DIR = REPO_ROOT / "recipes"
ACCELERATE_CONFIGS = sorted((RECIPES_DIR / "accelerate_configs").glob("*.yaml"))
TRAINING_RECIPES = sorted(path for path in RECIPES_DIR.rglob("*.yaml") if "accelerate_configs" not in path.parts)
CPU_RECIPE = RECIPES_DIR / "calculator" / "tiny" / "config_cpu.yaml"


def _name(path: Path) -> str:
    return str(path.relative_to(RECIPES_DIR))


@pytest.fixture
def bf16_anywhere(monkeypatch):
    # GPU recipes set `bf16: true`, which TrainingArguments rejects on a machine without a bf16 GPU. Parsing is what
    # is tested here, not the hardware.
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)


def _write_recipe(tmp_path: Path, **overrides) -> Path:
    recipe = yaml.safe_load(CPU_RECIPE.read_text())
    recipe.update(overrides)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_resume_from_checkpoint_true_means_the_latest_checkpoint(tmp_path):
    """`--resume_from_checkpoint true` resumes the latest checkpoint-N of output_dir, as in TRL's scripts (it used to
    reach the trainer as the path "true"); `false` starts from scratch; a path is kept (issue #9)."""
    from trl_agentic.scripts.train import resume_checkpoint

    def parsed(value):
        _, training_args, _ = make_parser().parse_args_and_config(
            ["--config", str(CPU_RECIPE), "--output_dir", str(tmp_path), "--resume_from_checkpoint", value]
        )
        return training_args

    with pytest.raises(ValueError, match="no checkpoint-N directory"):
        resume_checkpoint(parsed("true"))
    for step in (2, 10, 9):
        (tmp_path / f"checkpoint-{step}").mkdir()
    assert resume_checkpoint(parsed("true")) == str(tmp_path / "checkpoint-10")
    assert resume_checkpoint(parsed("false")) is None
    assert resume_checkpoint(parsed(str(tmp_path / "checkpoint-2"))) == str(tmp_path / "checkpoint-2")


def test_recipes_exist():
    names = {_name(path) for path in TRAINING_RECIPES}
    assert {
        "calculator/tiny/config_cpu.yaml",
        "calculator/Qwen2.5-1.5B-Instruct/config_full.yaml",
        "calculator/Qwen2.5-1.5B-Instruct/config_lora.yaml",
        "files/Qwen3-4B/config_vllm.yaml",
    } <= names
    assert {path.stem for path in ACCELERATE_CONFIGS} >= {"single_gpu", "ddp", "zero2", "zero3"}


@pytest.mark.parametrize("recipe", TRAINING_RECIPES, ids=_name)
def test_recipe_parses(recipe, bf16_anywhere):
    script_args, training_args, model_args = make_parser().parse_args_and_config(["--config", str(recipe)])
    raw = yaml.safe_load(recipe.read_text())
    assert model_args.model_name_or_path == raw["model_name_or_path"]
    assert script_args.task == raw["task"]
    assert training_args.learning_rate == raw["learning_rate"]
    assert training_args.num_generations == raw["num_generations"]
    assert training_args.output_dir.startswith("outputs/")  # .gitignored, and jobs derive the Hub repo name from it


@pytest.mark.parametrize("recipe", TRAINING_RECIPES, ids=_name)
def test_recipe_names_resolve(recipe):
    # Task and reward names are only resolved when training starts: check them here, without a model.
    from trl_agentic.recipes import get_reward_func
    from trl_agentic.tasks import get_task

    raw = yaml.safe_load(recipe.read_text())
    get_task(raw["task"])
    for name in raw.get("reward_funcs") or []:
        assert callable(get_reward_func(name))


def test_gpu_recipes_are_realistic(bf16_anywhere):
    for recipe in TRAINING_RECIPES:
        if recipe == CPU_RECIPE:
            continue
        _, training_args, model_args = make_parser().parse_args_and_config(["--config", str(recipe)])
        assert training_args.bf16 and training_args.gradient_checkpointing, _name(recipe)
        assert training_args.num_generations == 8, _name(recipe)
        assert 1e-7 <= training_args.learning_rate <= (1e-4 if model_args.use_peft else 1e-5), _name(recipe)
    _, training_args, model_args = make_parser().parse_args_and_config(
        ["--config", str(RECIPES_DIR / "calculator" / "Qwen2.5-1.5B-Instruct" / "config_lora.yaml")]
    )
    assert model_args.use_peft and model_args.lora_r > 0
    _, training_args, _ = make_parser().parse_args_and_config(
        ["--config", str(RECIPES_DIR / "files" / "Qwen3-4B" / "config_vllm.yaml")]
    )
    assert training_args.use_vllm and training_args.vllm_mode == "colocate"


def test_cpu_recipe_is_tiny():
    script_args, training_args, model_args = make_parser().parse_args_and_config(["--config", str(CPU_RECIPE)])
    assert model_args.model_name_or_path.startswith("tiny:")  # built locally, nothing downloaded
    assert training_args.use_cpu and not training_args.bf16
    assert training_args.max_steps == 2
    assert 2 <= training_args.num_generations <= 4
    assert training_args.report_to == []


@pytest.mark.parametrize("config", ACCELERATE_CONFIGS, ids=lambda path: path.stem)
def test_accelerate_config(config):
    raw = yaml.safe_load(config.read_text())
    assert {"compute_environment", "distributed_type", "mixed_precision", "num_machines", "num_processes"} <= set(raw)
    assert raw["mixed_precision"] == "bf16"  # the GPU recipes train in bf16
    assert raw["num_machines"] == 1 and raw["use_cpu"] is False
    expected = {"single_gpu": "NO", "ddp": "MULTI_GPU", "zero2": "DEEPSPEED", "zero3": "DEEPSPEED"}
    if config.stem in expected:
        assert raw["distributed_type"] == expected[config.stem]
    if config.stem.startswith("zero"):
        assert raw["deepspeed_config"]["zero_stage"] == int(config.stem[-1])
    if config.stem == "single_gpu":
        assert raw["num_processes"] == 1


def test_unknown_key_fails_naming_it(tmp_path):
    recipe = _write_recipe(tmp_path, lerning_rate=1e-5)
    with pytest.raises(ValueError, match=r"'lerning_rate' \(did you mean 'learning_rate'\?\)") as error:
        make_parser().parse_args_and_config(["--config", str(recipe)])
    assert str(recipe) in str(error.value)


def test_main_reports_a_bad_recipe_without_traceback(tmp_path, capsys):
    from trl_agentic.scripts.train import main

    assert main(["--config", str(_write_recipe(tmp_path, lerning_rate=1e-5))]) == 2
    assert "'lerning_rate'" in capsys.readouterr().err


def test_unknown_cli_flag_fails():
    with pytest.raises(ValueError, match="lerning_rate"):
        make_parser().parse_args_and_config(["--config", str(CPU_RECIPE), "--lerning_rate", "1e-5"])


def test_env_block_is_allowed(tmp_path, monkeypatch):
    monkeypatch.delenv("TRL_AGENTIC_TEST_RECIPE_VAR", raising=False)
    recipe = _write_recipe(tmp_path, env={"TRL_AGENTIC_TEST_RECIPE_VAR": "set-by-recipe"})
    make_parser().parse_args_and_config(["--config", str(recipe)])
    assert os.environ.pop("TRL_AGENTIC_TEST_RECIPE_VAR") == "set-by-recipe"


def test_cli_flag_overrides_yaml():
    script_args, training_args, model_args = make_parser().parse_args_and_config(
        [
            "--config",
            str(CPU_RECIPE),
            "--max_steps",
            "7",
            "--learning_rate",
            "3e-5",
            "--task",
            "files",
            "--model_name_or_path",
            "tiny:qwen2_5:32x1",
            "--reward_funcs",
            "files_correct",
        ]
    )
    assert training_args.max_steps == 7
    assert training_args.learning_rate == 3e-5
    assert script_args.task == "files"
    assert script_args.reward_funcs == ["files_correct"]
    assert model_args.model_name_or_path == "tiny:qwen2_5:32x1"
    assert training_args.num_generations == 2  # untouched values still come from the recipe


def test_task_is_required():
    with pytest.raises(SystemExit):  # argparse: "the following arguments are required: --task"
        make_parser().parse_args_and_config(["--use_cpu", "true"])


def test_agent_and_agent_command_are_exclusive():
    with pytest.raises(ValueError, match="either agent"):
        make_parser().parse_args_and_config(
            ["--config", str(CPU_RECIPE), "--agent", "my_agents:solve", "--agent_command", "python agent.py"]
        )


@pytest.mark.slow
def test_train_cpu_recipe_end_to_end(tmp_path):
    # `trl-agentic train` on the CPU recipe, as a user runs it; the flags after the recipe are overrides.
    output_dir = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trl_agentic.cli",
            "train",
            "--config",
            str(CPU_RECIPE),
            "--output_dir",
            str(output_dir),
            "--save_strategy",
            "steps",
            "--save_steps",
            "2",
        ],  # one checkpoint at the last step, to read its state
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    state = json.loads((output_dir / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert [entry["step"] for entry in state["log_history"] if "loss" in entry] == [1, 2]  # logging_steps: 1
    # The recipe's `mixed_difficulty: true` + `task_sampling: adaptive`: per-bucket metrics over 1-3 digit operands.
    logs = [entry for entry in state["log_history"] if "loss" in entry]
    assert all("sampling/split_rate" in e and 1.0 <= e["sampling/difficulty_mean"] <= 3.0 for e in logs)
    assert all("sampling/estimate/2" in e for e in logs)  # the adaptive sampler's running estimates
    assert (output_dir / "config.json").is_file()  # save_model after training
    assert (output_dir / "model.safetensors").is_file()


def test_cut_off_penalty_is_a_bundled_reward_name():
    from trl_agentic.recipes import get_reward_func
    from trl_agentic.rewards import cut_off_penalty

    assert (
        get_reward_func("cut_off_penalty") is cut_off_penalty
    )  # `reward_funcs: [calculator_correct, cut_off_penalty]`
