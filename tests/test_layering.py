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
        ("tasks", "trl_agentic.envs"),  # envs adapt other systems into tasks; `get_task` finds them by TASK_SOURCES
    ],
)
def test_lower_layers_do_not_import_upper_ones(folder, forbidden):
    def excepted(path: str, name: str) -> bool:  # an EXCEPTIONS pair: `name` is the module allowed or in it
        module = "trl_agentic." + path.removesuffix(".py").replace("/", ".")
        return any(module == m and (name == t or name.startswith(t + ".")) for m, t in EXCEPTIONS)

    found = {path: [n for n in hits if not excepted(path, n)] for path, hits in imports_of(folder, forbidden).items()}
    assert {path: hits for path, hits in found.items() if hits} == {}


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


# --- the whole graph ----------------------------------------------------------------------------------------------
# Issue 41: the package's import graph has no cycle and no arrow from a lower layer up to a higher one. Every import
# counts, function-local and `TYPE_CHECKING` ones included: a lazy import defers the arrow, it does not remove it
# (tasks importing envs inside `get_task` while envs imports tasks at the top was a circle all the same).

# The layers, lowest first, by top-level module or folder of `trl_agentic/` ("__init__": the package's own facade).
# A unit imports units of the layers below its own only: never one of a higher layer, never a peer of its own layer.
# A new module or folder takes its place here (the test below names any that has none).
LAYERS = [
    {"imports", "quiet", "trace", "tiny_models"},  # import nothing of the package
    # generation: the engines; lineage: calls -> conversations over trace; sandbox: where agents' processes run;
    # store: closed episodes, rewards and users of online training, durable (SQLite or PostgreSQL)
    {"console", "lineage", "generation", "sandbox", "store"},
    {"endpoint", "rollout"},  # peers over generation and trace: the runner talks to an EpisodeServer protocol
    {"rewards"},  # checkers' helpers, the judge, per-turn rewards over rows
    {"tasks"},  # suites: dataset + agent + checker; other systems' specs through `imports.TASK_SOURCES`
    {
        "envs",
        "evaluation",
        "task_sampling",
        "shared_prefix",
        "prefix_tree",
        "plots",
        "warm_start",
        "agentic_grpo_config",
        "episode_log",
    },
    # checkpoint_state: the trainer's state, the episode log's included; rollouts: its endpoint and episodes
    {"alarms", "recipes", "checkpoint_state", "rollouts"},
    {"agentic_grpo_trainer", "viewer", "jobs"},
    # pipeline: warm start -> held-out eval -> GRPO (the trainer) -> report; online_trainer: GRPO on the store's
    # rewarded episodes of live traffic, each step a candidate version
    {"pipeline", "online_trainer"},
    {"scripts", "bundled", "cli"},
    {"__init__"},
]
# (importing module, imported module) pairs allowed across a peer or upward, each with its reason. Keep it short.
EXCEPTIONS = {
    # The rollout process's child (`_serve`, function-local) builds the endpoint its producer talks to: the one
    # module of rollout/ that starts an endpoint, and only through `endpoint.launch`; nothing in rollout/ imports it.
    ("trl_agentic.rollout.process", "trl_agentic.endpoint.launch")
}


def package_modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def facade_exports() -> dict[str, str]:
    """`trl_agentic.Name` -> the module `trl_agentic/__init__.py` loads it from on first use (its `_EXPORTS`)."""
    for node in ast.parse((PACKAGE / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["_EXPORTS"]:
            return {f"trl_agentic.{k}": f"trl_agentic{v}" for k, v in ast.literal_eval(node.value).items()}
    raise AssertionError("trl_agentic/__init__.py has no _EXPORTS")


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (`from .x import Name` -> `x`; `from . import x` -> the package and
    `x`), itself left out."""
    modules = package_modules()
    facade = facade_exports()

    def module_of(name: str) -> str | None:
        if name == "trl_agentic.__version__":
            return None  # a constant of the package, no arrow
        name = facade.get(name, name)  # `from trl_agentic import AgenticGRPOTrainer`: the module that defines it
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        # `from trl_agentic import X` counts as an import of X's module, not of the facade (which imports everything)
        targets = {module_of(n) for n in imported_modules(path) if n.startswith("trl_agentic.")}
        graph[module] = targets - {None, module}
    return graph


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_import_graph_has_no_cycle_between_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_import_graph_has_no_cycle_between_folders():
    units: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        units.setdefault(unit_of(module), set()).update(unit_of(t) for t in targets if unit_of(t) != unit_of(module))
    cycle = find_cycle(units)
    assert cycle is None, " -> ".join(cycle)


def test_every_folder_and_module_has_a_layer():
    placed = set().union(*LAYERS)
    assert sum(len(layer) for layer in LAYERS) == len(placed), "a unit in two layers"
    units = {unit_of(m) for m in package_modules()}
    assert not units - placed, f"{sorted(units - placed)}: put each in LAYERS, in the lowest layer above all it imports"
    assert not placed - units, f"{sorted(placed - units)}: in LAYERS, but no such module or folder"


def test_no_import_goes_up_a_layer_or_across_to_a_peer():
    layer = {unit: index for index, units in enumerate(LAYERS) for unit in units}
    wrong = sorted(
        f"{module} -> {target} ({unit_of(module)} is layer {layer[unit_of(module)]}, "
        f"{unit_of(target)} layer {layer[unit_of(target)]})"
        for module, targets in import_graph().items()
        for target in targets
        if unit_of(target) != unit_of(module)
        and layer[unit_of(target)] >= layer[unit_of(module)]
        and (module, target) not in EXCEPTIONS
    )
    assert wrong == [], "\n".join(wrong)
