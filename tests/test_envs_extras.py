"""The environment packages' extras (issue 45): each installs its package's supported releases with their own
requirements (never `--no-deps`), and CI runs the tests of those that cannot share [dev]'s environment (`mcp` < 2)
in its second venv.
"""

import re
from pathlib import Path

import pytest


tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
CI = (ROOT / ".ci" / "run").read_text()


def test_the_environment_extras_pin_the_supported_releases():
    assert EXTRAS["verifiers"] == ["verifiers>=0.4,<0.5", "uv>=0.5"]  # the current release (envs/verifiers_v1.py)
    assert EXTRAS["verifiers-legacy"] == ["verifiers>=0.3.1,<0.4"]  # its 0.3 API (envs/verifiers_legacy.py)
    assert EXTRAS["openenv"] == ["openenv>=0.10,<0.11"]
    assert EXTRAS["openenv-core"] == ["openenv-core>=0.3.0,<0.4"]
    assert EXTRAS["mcp"] == ["mcp>=2.0,<3"]  # 2.0.0 (verifiers 0.4's pin) runs it too
    # [dev] shares the MCP agent's environment: nothing in it may need mcp<2.
    assert not [r for r in EXTRAS["dev"] if re.match(r"(verifiers|openenv)\b(?!-core)", r)]


def test_nothing_is_installed_without_its_requirements():
    """Except bfcl-eval, whose pins (numpy 1.26, model SDKs) are unworkable beside [dev]: its data, backends and
    checker are used, and [bfcl] lists what they import (issue 45 allows it, said in docs/bfcl.md)."""
    for path in [ROOT / ".ci" / "run", ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")]:
        lines = re.findall(r"pip install[^\n]*--no-deps[^\n]*", path.read_text())
        assert all(re.search(r"--no-deps bfcl-eval==", line) for line in lines), (path.name, lines)


def test_ci_runs_the_tests_of_the_mcp_1_extras_in_their_own_venv():
    install = re.search(r'pip --python \.venv-envs/bin/python install -q -e "\.\[(.*?)\]"', CI)
    assert install is not None and set(install.group(1).split(",")) == {"verifiers-legacy", "openenv"}
    command = re.search(r"\.venv-envs/bin/python -m pytest .*", CI).group(0)
    for test in ("tests/test_envs_verifiers.py", "tests/test_envs_openenv.py"):
        assert test in command and (ROOT / test).exists()
    # It comes after the main suite, which runs every other test (these two skip without their package, or run
    # with OpenEnv's 0.3 distribution).
    assert CI.index(".venv-envs/bin/python -m pytest") > CI.index("\npython -m pytest -q -x --timeout 600")


def test_ci_runs_verifiers_0_4_in_a_third_venv_with_uv_on_path():
    # verifiers 0.4 pins openai<3 (beside [dev]'s openai-agents, openai 3) and mcp==2.0.0 (beside verifiers 0.3's mcp<2).
    install = re.search(r'pip --python \.venv-vf/bin/python install -q -e "\.\[(.*?)\]"', CI)
    assert install is not None and install.group(1) == "verifiers"
    command = re.search(r'PATH="\$PWD/\.venv-vf/bin:\$PATH" \.venv-vf/bin/python -m pytest .*', CI).group(0)
    assert "tests/test_envs_verifiers_v1.py" in command and (ROOT / "tests/test_envs_verifiers_v1.py").exists()
    assert CI.index(".venv-vf/bin/python -m pytest") > CI.index("\npython -m pytest -q -x --timeout 600")
