"""The two test tiers stay apart: a test that trains in a subprocess is marked `slow`.

`pytest -m "not slow"` is the edit-test loop (every unit and contract test, a few minutes on 2 cores); the full suite
(README's test command, what `.ci/run` runs) adds the `slow` tests: end-to-end trainings, real harnesses and
environment servers, the examples and the demo smoke (CONTRIBUTING.md). A subprocess training costs 10-30 s on 2 cores,
so one left unmarked would cost the fast tier more than most of its files; this check reads the test files (no test is
run) and names any test that starts a subprocess which trains, from its own body or through a helper or fixture of its
module, without the mark.
"""

import ast
import re
from pathlib import Path


TESTS = Path(__file__).parent
SUBPROCESS = re.compile(r"\bsubprocess\.(run|Popen|check_call|check_output)\(|create_subprocess_exec\(")
# What a training subprocess names: the CLI's `train`/`demo` commands, a script's training knobs, torch's launcher
# (a `--dry_run` of jobs/train.py prints the command it would run and trains nothing).
TRAINING = re.compile(r'"(train|demo)"|jobs/train\.py|--steps|--max_steps|torch\.distributed\.run|"launch"')
DRY_RUN = re.compile(r'"--dry_run"')


def is_slow(decorators) -> bool:
    return any("mark.slow" in ast.unparse(d) for d in decorators)


def unmarked_subprocess_trainings(path: Path) -> list[str]:
    source = path.read_text()
    tree = ast.parse(source)
    if any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and "mark.slow" in ast.unparse(node.value)
        for node in tree.body
    ):
        return []
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def reached(function) -> set[str]:
        """The module's helpers a function calls, transitively, itself included (fixtures are left out: a test may read
        what a fixture trained in-process beside a subprocess of its own that does not train)."""
        seen, todo = set(), [function.name]
        while todo:
            name = todo.pop()
            if name in seen or name not in functions:
                continue
            seen.add(name)
            node = functions[name]
            todo += [c.func.id for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
        return seen

    unmarked = []
    for name, node in functions.items():
        if not name.startswith("test_") or is_slow(node.decorator_list):
            continue
        text = "\n".join(ast.get_source_segment(source, functions[n]) for n in reached(node))
        if SUBPROCESS.search(text) and TRAINING.search(text) and not DRY_RUN.search(text):
            unmarked.append(f"{path.name}::{name}")
    return unmarked


def test_every_subprocess_training_is_marked_slow():
    paths = sorted(set(TESTS.glob("test_*.py")) - {Path(__file__)})
    unmarked = [test for path in paths for test in unmarked_subprocess_trainings(path)]
    assert unmarked == [], f"mark these @pytest.mark.slow (they train in a subprocess): {unmarked}"


def test_the_check_sees_a_subprocess_training_through_a_helper(tmp_path):
    path = tmp_path / "test_example.py"
    path.write_text(
        "import subprocess, sys\nimport pytest\n\n"
        "def launch(*args):\n    return subprocess.run([sys.executable, '-m', 'trl_agentic.cli', *args])\n\n"
        "def test_trains():\n    launch('demo', '--steps', '1')\n\n"
        "@pytest.mark.slow\ndef test_trains_marked():\n    launch('train')\n\n"
        "def test_serves():\n    subprocess.run([sys.executable, '-c', 'print(1)'])\n"
    )
    assert unmarked_subprocess_trainings(path) == ["test_example.py::test_trains"]


def pytest_command(text: str) -> str:
    """The `python -m pytest ...` command at the end of a line (README's install-and-test line, `.ci/run`'s), not the
    second venv's (`.venv-envs/bin/python -m pytest ...`, the environments that need mcp<2)."""
    (command,) = re.findall(r"(?:^|&& )(python -m pytest [^\n&|;]*?)\s*$", text, re.MULTILINE)
    return command


def test_readme_and_quickstart_give_the_test_command_ci_runs():
    # CONTRIBUTING's timings are measured with it: `-n 2` (pytest-xdist, in the [dev] extra) is part of it.
    repo = TESTS.parent
    ci = pytest_command((repo / ".ci" / "run").read_text())
    assert pytest_command((repo / "README.md").read_text()) == ci
    assert pytest_command((repo / "docs" / "quickstart.md").read_text()) == ci
    if " -n " in ci:
        dev = re.search(r"^dev = \[(.*?)^\]", (repo / "pyproject.toml").read_text(), re.MULTILINE | re.DOTALL)
        assert '"pytest-xdist' in dev.group(1), "the [dev] extra must install pytest-xdist for `-n`"
