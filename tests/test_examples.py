"""The runnable examples run as written (`examples/`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_agentic.rollout.harnesses import Harness, HarnessNotFoundError
from trl_agentic.trace import Episode


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES / "harnesses"))

from answer_file import answer_file_correct, answer_file_dataset  # noqa: E402


def test_the_answer_file_checker_reads_the_workspace_the_harness_left():
    dataset = answer_file_dataset(3, seed=1)
    assert dataset[0]["prompt"] == [
        {"role": "user", "content": f"Create a file answer.txt containing {dataset[0]['answer']}."}
    ]
    right = Episode(id="a", status="ok", result={"files": {"answer.txt": dataset[0]["answer"] + "\n"}})
    wrong = Episode(id="b", status="ok", result={"files": {"answer.txt": "nope"}})
    failed = Episode(id="c", status="agent_error")
    assert answer_file_correct(dataset["prompt"], [[]] * 3, dataset["answer"], episodes=[right, wrong, failed]) == [
        1.0,
        0.0,
        None,
    ]


@pytest.mark.parametrize(
    "example, preset",
    [
        ("mini_swe_agent", "mini-swe-agent"),
        ("claude_code", "claude-code"),
        ("codex", "codex"),
        ("gemini_cli", "gemini-cli"),
        ("opencode", "opencode"),
    ],
)
def test_each_harness_example_names_its_preset(example, preset):
    assert f'train(Harness("{preset}"))' in (EXAMPLES / "harnesses" / f"{example}.py").read_text()


def test_the_mini_swe_agent_example_trains_a_step_on_a_tiny_model(tmp_path):
    try:
        binary = Harness("mini-swe-agent").find_binary()
    except HarnessNotFoundError as error:
        pytest.skip(str(error))
    env = {**os.environ, "TRL_AGENTIC_MINI_SWE_AGENT_BIN": binary, "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "harnesses" / "mini_swe_agent.py"),
            "--model",
            "tiny:qwen2_5",
            "--steps",
            "1",
            "--num-generations",
            "2",
            "--max-tokens",
            "32",
            "--max-turns",
            "3",
            "--output-dir",
            str(tmp_path / "out"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "episodes" / "episodes-rank0.jsonl").open()]
    assert len(records) == 2 and all(r["episode"]["turns"] for r in records)  # the harness called the policy
    for record in records:
        result = record["episode"]["result"]
        if record["episode"]["status"] == "ok":
            assert result["harness"] == "mini-swe-agent" and not Path(result["workspace"]).exists()  # scored, removed
    assert not list(tmp_path.glob("trl-agentic-mini-swe-agent-*"))
