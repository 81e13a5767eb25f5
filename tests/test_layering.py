"""The package's layers import downwards only, read from the source (no import runs): the data path stays readable
from the folder names (task -> agent -> endpoint -> engine -> trace -> rows -> TRL loss)."""

import ast
from pathlib import Path

import pytest


PACKAGE = Path(__file__).resolve().parents[1] / "trl_agentic"


def imported_modules(path: Path) -> set[str]:
    """Absolute names of every module `path` imports (relative imports resolved), at any depth in the file."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)  # `from . import x` imports module x
    return names


def modules_in(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


def imports_of(folder: str, prefix: str) -> dict[str, list[str]]:
    found = {}
    for path in modules_in(folder):
        hits = sorted(name for name in imported_modules(path) if name == prefix or name.startswith(prefix + "."))
        if hits:
            found[str(path.relative_to(PACKAGE))] = hits
    return found


def test_import_resolution_on_a_known_module():
    names = imported_modules(PACKAGE / "endpoint" / "launch.py")
    assert {"trl_agentic.endpoint.app", "trl_agentic.generation.transformers_engine"} <= names  # `.app`, `..gen...`
    assert "trl_agentic.endpoint.SERVED_MODEL_NAME" in names  # `from . import SERVED_MODEL_NAME`
    assert "trl_agentic.trace" in imported_modules(PACKAGE / "rollout" / "runner.py")  # `from ..trace import ...`


@pytest.mark.parametrize(
    "folder, forbidden",
    [
        ("rollout", "trl_agentic.endpoint"),  # the runner talks to an EpisodeServer protocol, not to endpoint/
        ("endpoint", "trl_agentic.rollout"),  # both import trace.py, neither imports the other
        ("generation", "trl_agentic.endpoint"),
        ("rewards", "trl_agentic.tasks"),  # tasks' checkers use rewards.utils: no loop back
        ("rewards", "trl_agentic.agentic_grpo_trainer"),
        ("tasks", "trl_agentic.agentic_grpo_trainer"),
        ("rollout", "trl_agentic.tasks"),  # rollout/tool_loop.py is below both the tasks' agents and the envs' ones
        ("rollout", "trl_agentic.envs"),
    ],
)
def test_lower_layers_do_not_import_upper_ones(folder, forbidden):
    assert imports_of(folder, forbidden) == {}


def test_trace_imports_nothing_of_the_package():
    assert {n for n in imported_modules(PACKAGE / "trace.py") if n.startswith("trl_agentic")} == set()


def test_the_tool_loop_imports_nothing_of_the_package():
    names = imported_modules(PACKAGE / "rollout" / "tool_loop.py")
    assert {n for n in names if n.startswith("trl_agentic")} == set()


def model_calls(path: Path) -> int:
    """How many `....chat.completions.create(...)` calls `path` makes."""
    return sum(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "create"
        and isinstance(node.func.value, ast.Attribute)
        and node.func.value.attr == "completions"
        for node in ast.walk(ast.parse(path.read_text()))
    )


def test_one_tool_loop_for_every_agent():
    """`ToolAgent` and the environment agents write hooks of `rollout/tool_loop.py`'s `ToolLoop`, never a loop of their
    own: none of them calls the model itself."""
    agents = ["tasks/agent_loop.py", "envs/mcp.py", "envs/environment_factory.py", "envs/openenv.py"]
    for agent in agents:
        assert "trl_agentic.rollout.tool_loop.ToolLoop" in imported_modules(PACKAGE / agent), agent
    callers = {str(p.relative_to(PACKAGE)) for p in [*modules_in("tasks"), *modules_in("envs")] if model_calls(p)}
    assert callers == set()
    assert model_calls(PACKAGE / "rollout" / "tool_loop.py") == 1


def test_scripts_do_not_import_scripts():
    for path in modules_in("scripts"):
        others = {n for n in imported_modules(path) if n.startswith("trl_agentic.scripts")}
        assert others == set(), f"{path.name} imports {others}: move shared helpers into the library"


def test_eval_and_jobs_do_not_import_the_trainer():
    for path in (
        PACKAGE / "scripts" / "eval.py",
        PACKAGE / "evaluation.py",
        PACKAGE / "jobs.py",
        PACKAGE / "recipes.py",
    ):
        names = imported_modules(path)
        assert not {n for n in names if n.startswith("trl_agentic.agentic_grpo_trainer")}, path.name
        assert "trl_agentic.AgenticGRPOTrainer" not in names, path.name


def test_one_resolve_agent():
    # `rollout.agents.resolve_agent` normalizes what a user passes; the recipe-level one is `agent_from_recipe`.
    defining = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if "def resolve_agent(" in p.read_text()]
    assert defining == ["rollout/agents.py"]


def test_wire_formats_are_adapters_over_the_service():
    """One internal path (DESIGN.md): each wire format's module imports the service, never the app or another format,
    and the service knows no wire format's module."""
    adapters = ["chat_completions", "responses", "anthropic_messages", "gemini"]

    def endpoint_modules(path: Path) -> set[str]:  # `trl_agentic.endpoint.x.Name` -> `x`
        return {n.split(".")[2] for n in imported_modules(path) if n.startswith("trl_agentic.endpoint.")}

    for adapter in adapters:
        names = endpoint_modules(PACKAGE / "endpoint" / f"{adapter}.py")
        assert "service" in names and not names & ({"app", *adapters} - {adapter}), adapter
    assert not endpoint_modules(PACKAGE / "endpoint" / "service.py") & {"app", *adapters}
