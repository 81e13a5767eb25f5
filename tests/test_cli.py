"""The `trl-agentic` command line: `--help` answers without loading torch or TRL (issue 40: `demo --help` took 32 s on a
loaded machine). Checked in a fresh interpreter through `sys.modules`, not the wall clock."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "trl", "datasets")


def modules_loaded_by(argv: list[str]) -> tuple[list[str], str]:
    """Run `trl_agentic.cli.main(argv)` in a fresh interpreter; the heavy modules it loaded and what it printed."""
    code = (
        "import json, sys\n"
        "from trl_agentic import cli\n"
        "try:\n"
        f"    cli.main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]), file=sys.stderr)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stderr.strip().splitlines()[-1]), done.stdout


def test_importing_the_cli_loads_neither_torch_nor_trl():
    loaded, printed = modules_loaded_by(["--help"])
    assert loaded == []
    assert "usage: trl-agentic <command>" in printed


@pytest.mark.parametrize("command", ["demo", "eval", "inspect", "jobs"])
def test_a_commands_help_loads_neither_torch_nor_trl(command):
    loaded, printed = modules_loaded_by([command, "--help"])
    assert loaded == []
    assert f"usage: trl-agentic {command}" in printed


def test_the_package_still_exports_its_public_names():
    import trl_agentic

    assert trl_agentic.AgenticGRPOTrainer.__name__ == "AgenticGRPOTrainer"
    assert set(trl_agentic.__all__) <= set(dir(trl_agentic))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        trl_agentic.Nope  # noqa: B018
