"""Resolve `"pkg.module:attr"` import paths (tasks, agents, reward functions named in recipes), or `"file.py:attr"`;
and `TASK_SOURCES`, the task specs other systems' adapters register (`"verifiers:<env-id>"`)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any


# What `--task` accepts (train, eval, demo). Here, in a module without heavy imports, so that `--help` stays fast.
TASK_HELP = (
    "Task: a bundled name ('calculator', 'files', 'latency'), an import path 'pkg.module:TASK', a file "
    "'path/to/task.py:TASK' (it may import modules next to it), 'verifiers:<env-id>', or a BFCL multi-turn category "
    "'bfcl:multi_turn_base' (docs/bfcl.md)."
)

# Task specs that name a task of another system by its id (`"verifiers:<env-id>"`, `"bfcl:<category>"`): prefix ->
# `"pkg.module:loader"`, `loader(id) -> TaskSuite`, imported on first use. The environment adapters add theirs
# (`trl_agentic/envs/__init__.py`), so `tasks.get_task` resolves them without importing `envs` (issue 41: no circle).
TASK_SOURCES: dict[str, str] = {}


def register_task_source(prefix: str, loader: str) -> None:
    """Let `get_task("<prefix>:<id>")` return `loader(id)`, where `loader` is the import path `"pkg.module:function"`
    of a function that builds the [`TaskSuite`] (imported on the first such task, so its extra is needed only then).

    Example:

    ```python
    >>> register_task_source("verifiers", "trl_agentic.envs.verifiers:load_verifiers_suite")
    >>> get_task("verifiers:vf-gsm8k")  # load_verifiers_suite("vf-gsm8k")
    ```
    """
    if not prefix or ":" in prefix or "." in prefix:
        raise ValueError(f"A task source prefix is a plain name like 'verifiers', got {prefix!r}.")
    TASK_SOURCES[prefix] = loader


def import_object(path: str) -> Any:
    """Import `"pkg.module:attr"` (or `"pkg.module.attr"`), looking in the working directory too, like TRL's scripts;
    or load `attr` from a Python file, `"path/to/file.py:attr"` (what `trl-agentic demo` prints for its task).

    Example:

    ```python
    >>> import_object("trl_agentic.tasks:get_task")
    <function get_task at ...>
    ```
    """
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"Expected an import path 'pkg.module:attr', got {path!r}.")
    if module_name.endswith(".py"):
        return _attribute_of_file(Path(module_name), attr, path)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a module next to the recipe, e.g. `my_agent:solve`
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"Cannot load {path!r}: {error}") from error


def _attribute_of_file(file: Path, attr: str, path: str) -> Any:
    if not file.is_file():
        raise ValueError(f"Cannot load {path!r}: no file {file}.")
    name = f"_trl_agentic_file_{file.stem}_{abs(hash(str(file.resolve())))}"
    module = sys.modules.get(name)
    if module is None:  # loaded once per process, like an imported module
        folder = str(file.resolve().parent)
        if folder not in sys.path:  # its sibling modules import as they do when the file runs as a script
            sys.path.insert(0, folder)
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look their module up by name
        spec.loader.exec_module(module)
    try:
        return getattr(module, attr)
    except AttributeError as error:
        raise ValueError(f"Cannot load {path!r}: {error}") from error
