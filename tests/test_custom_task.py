"""examples/custom_task/: a task defined outside the package trains through `trl-agentic demo --task file.py:TASK`,
and a task the pipeline cannot warm-start fails at once with what to provide."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_agentic.pipeline import PipelineConfig, check_task
from trl_agentic.tasks import TaskSuite, get_task
from trl_agentic.tasks.splits import split_of
from trl_agentic.trace import Episode


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_task" / "unit_converter.py"
SPEC = f"{EXAMPLE}:TASK"


def test_the_unit_converters_reference_solver_is_right_and_its_splits_are_apart():
    task = get_task(SPEC)  # a file task importing `converter_tool` from its own folder
    dataset = task.build_dataset("train", 40, seed=3, digits=2)
    demonstrations = task.demonstrations(40, seed=3, digits=2)
    # the solver answers the training split's questions, and every answer passes the checker
    assert [d["messages"][1]["content"] for d in demonstrations] == [r["prompt"][-1]["content"] for r in dataset]
    episodes = [
        Episode(id=str(i), status="ok", result=d["messages"][-1]["content"]) for i, d in enumerate(demonstrations)
    ]
    (checker,) = task.reward_funcs
    assert checker(None, None, answer=dataset["answer"], episodes=episodes) == [1.0] * 40
    # 1% off passes, 2% off does not; the checker reads the last number of the final text
    for factor, reward in ((1.009, 1.0), (1.02, 0.0)):
        episode = Episode(id="a", status="ok", result=f"{7} gives {dataset[0]['answer'] * factor:.6f}, I think.")
        assert checker(None, None, answer=dataset["answer"][:1], episodes=[episode]) == [reward]
    # no eval question is ever a training question, at any level
    for digits in (1, 2, 3):
        eval_questions = {r["prompt"][-1]["content"] for r in task.build_dataset("eval", 100, 0, digits=digits)}
        assert {split_of(q) for q in eval_questions} == {"eval"}
        assert not eval_questions & {
            r["prompt"][-1]["content"] for r in task.build_dataset("train", 500, 0, digits=digits)
        }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_unit_converter_trains_through_the_demo_command(tmp_path):
    """The command docs/pipeline.md gives, at toy sizes: every stage runs, the task's checker is the reward, and the
    saved task.py loads the task again from any folder."""
    output_dir = tmp_path / "out"
    command = [sys.executable, "-m", "trl_agentic.cli", "demo", "--task", f"{EXAMPLE.relative_to(Path.cwd())}:TASK"]
    command += ["--smoke", "--no-cache", "--output-dir", str(output_dir)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env={**os.environ})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "task 'unit_converter'" in result.stdout and "[5/5] Results" in result.stdout
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["task"] == "unit_converter" and summary["settings"]["levels"] is None  # the suite's own levels
    logs = [r for r in summary["log_history"] if "reward" in r]
    assert len(logs) == 2 and all("rewards/within_one_percent/mean" in r for r in logs)
    assert all(1.0 <= r["sampling/difficulty_mean"] <= 3.0 for r in logs)  # adaptive sampling over its 3 levels
    assert summary["before"]["episodes"] == summary["after"]["episodes"] == 4
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from trl_agentic.tasks import get_task; print(get_task({str(output_dir / 'task.py:TASK')!r}).name)",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert loaded.stdout.strip() == "unit_converter", loaded.stderr[-2000:]
    assert f"--task {output_dir / 'task.py'}:TASK" in summary["commands"]["eval"]


def broken_task(**changes) -> TaskSuite:
    task = get_task(SPEC)
    return TaskSuite(**{**{f: getattr(task, f) for f in task.__dataclass_fields__}, **changes})


@pytest.mark.parametrize(
    "demonstrations, problem",
    [
        (None, "has no demonstrations for the warm start"),
        (lambda n, seed=0, **knobs: [], "not a non-empty list"),
        (lambda n, seed=0, **knobs: [{"messages": [{"role": "user", "content": "hi"}]}] * n, "no 'messages' list"),
        (
            lambda n, seed=0, **knobs: (
                [
                    {
                        "messages": [
                            {"role": "user", "content": "Convert 1 m to cm."},
                            {"role": "assistant", "tool_calls": [{"function": {"name": "convert", "arguments": "{}"}}]},
                        ]
                    }
                ]
                * n
            ),
            "arguments are not a dict",
        ),
    ],
)
def test_a_task_without_usable_demonstrations_says_what_to_provide(demonstrations, problem):
    with pytest.raises(ValueError, match=problem) as error:
        check_task(broken_task(demonstrations=demonstrations), PipelineConfig())
    assert "a reference solver returning n successful conversations" in str(error.value)


def test_the_demo_command_rejects_such_a_task_before_building_a_model(tmp_path, capsys):
    from trl_agentic.scripts.demo import main

    task_file = tmp_path / "no_solver.py"
    task_file.write_text(
        "from trl_agentic.tasks import TaskSuite\n"
        f"from trl_agentic.tasks import get_task\n\nBASE = get_task({SPEC!r})\n"
        "TASK = TaskSuite(**{f: getattr(BASE, f) for f in BASE.__dataclass_fields__} | {'demonstrations': None})\n"
    )
    assert main(["--task", f"{task_file}:TASK", "--smoke", "--output-dir", str(tmp_path / "out")]) == 2
    assert "has no demonstrations for the warm start" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # levels the task does not have: named, with the ones it has
    with pytest.raises(ValueError, match=r"Difficulty level 7 is not one of task 'unit_converter'"):
        check_task(get_task(SPEC), PipelineConfig(levels=(7,)))
