"""`trl-agentic eval` (`trl_agentic/scripts/eval.py`): the command line over `trl_agentic.evaluation`."""

import json

import pytest

from trl_agentic.scripts.eval import main


def test_cli_reads_the_recipe_and_writes_json(tmp_path, capsys):
    output = tmp_path / "out" / "eval.json"
    code = main(
        [
            "--config",
            "recipes/calculator/tiny/config_cpu.yaml",  # tiny:qwen2_5:64x2, calculator, max_turns 2
            "--size",
            "2",
            "--num-samples",
            "2",  # 2 tasks x 2 samples
            "--max-tokens",
            "4",  # short calls keep the test fast
            "--output",
            str(output),
            "--no-progress",
        ]
    )
    assert code == 0
    written = json.loads(output.read_text())
    printed = json.loads(capsys.readouterr().out)
    assert printed == {k: v for k, v in written.items() if k != "per_task"}
    assert written["task"] == "calculator" and written["model"] == "tiny:qwen2_5:64x2" and written["split"] == "eval"
    assert written["num_tasks"] == 2 and written["episodes"] == 4 == sum(written["status"].values())
    assert written["max_tokens"] == 4 and written["max_turns"] == 2 and written["seed"] == 42  # recipe's seed
    assert written["temperature"] == 1.0 and len(written["per_task"]) == 2
    assert 0.0 <= written["pass@1"] <= written["pass@2"] <= 1.0
    assert set(written["scored_reward_funcs"]) == {"calculator_correct"}
    assert written["success"] == written["pass@1"]  # one definition of success: over all episodes


def test_cli_errors_say_how_to_fix(tmp_path):
    with pytest.raises(SystemExit, match="no task"):
        main(["--model", "tiny:qwen2_5:64x2"])
    with pytest.raises(SystemExit, match="no model"):
        main(["--task", "calculator"])
    with pytest.raises(SystemExit, match="--size must be >= 1"):
        main(["--task", "calculator", "--model", "tiny:qwen2_5:64x2", "--size", "0"])
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("task: calculator\nmodel_name_or_path: tiny:qwen2_5:64x2\ntemprature: 0.7\n")
    with pytest.raises(ValueError, match="did you mean 'temperature'"):
        main(["--config", str(recipe)])
