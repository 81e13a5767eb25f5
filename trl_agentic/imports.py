"""Resolve `"pkg.module:attr"` import paths (tasks, agents, reward functions named in recipes)."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def import_object(path: str) -> Any:
    """Import `"pkg.module:attr"` (or `"pkg.module.attr"`), looking in the working directory too, like TRL's scripts.

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
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a module next to the recipe, e.g. `my_agent:solve`
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"Cannot load {path!r}: {error}") from error
