"""Environments users already have, run as episodes over the endpoint: MCP tool servers (`MCPAgent`), gym-style text
games (`gym_text_suite`), ...

Each adapter lives in a module of its own and needs its package's extra (`pip install 'trl-agentic[mcp]'`); names are
imported lazily, so `import trl_agentic.envs` imports none of those packages.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..imports import register_task_source


# The task specs these adapters resolve, for `get_task` (tasks/ never imports envs/): `"verifiers:<env-id>"`.
register_task_source("verifiers", "trl_agentic.envs.verifiers:load_verifiers_suite")
# `"bfcl:<category>[?classes=A,B&schemas=compact]"`: BFCL's multi-turn entries (docs/bfcl.md).
register_task_source("bfcl", "trl_agentic.envs.bfcl:load_bfcl_suite")

# Public name -> the module of this package that defines it.
_EXPORTS = {
    "EnvironmentAgent": "environment_factory",
    "environment_suite": "environment_factory",
    "record_demonstrations": "demonstrations",
    "with_solver": "demonstrations",
    "gym_text_suite": "gym_text",
    "textarena_game": "gym_text",
    "TextGameEnvironment": "gym_text",
    "MCPAgent": "mcp",
    "VerifiersAgent": "verifiers",
    "from_verifiers": "verifiers",
    "OpenEnvAgent": "openenv",
    "from_openenv": "openenv",
    "openenv_reward": "openenv",
    "BFCLAgent": "bfcl",
    "from_bfcl": "bfcl",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trl_agentic.envs' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)
