"""trl-agentic: GRPO for black-box LLM agents at the OpenAI-compatible API boundary, on top of TRL."""

__version__ = "0.1.0"

import importlib
from typing import TYPE_CHECKING

from . import envs  # noqa: F401 - registers the environment adapters' task specs ("verifiers:<env-id>") for get_task
from .quiet import quiet_known_warnings


quiet_known_warnings()  # before the config: TRL's defaults trip transformers 5 deprecations a user cannot act on

# The public names load on first use (PEP 562): `import trl_agentic.cli` and `trl-agentic demo --help` must not pay
# for torch, transformers and TRL (32 s on a loaded machine, issue 40); `from trl_agentic import X` works as before.
_EXPORTS = {
    "AgenticGRPOConfig": ".agentic_grpo_config",
    "AgenticGRPOTrainer": ".agentic_grpo_trainer",
    "CommandAgent": ".rollout.agents",
    "Row": ".rollout.rows",
    "episode_to_rows": ".rollout.rows",
    "ToolAgent": ".tasks.agent_loop",
    "Episode": ".trace",
    "Turn": ".trace",
}

if TYPE_CHECKING:
    from .agentic_grpo_config import AgenticGRPOConfig
    from .agentic_grpo_trainer import AgenticGRPOTrainer
    from .rollout.agents import CommandAgent
    from .rollout.rows import Row, episode_to_rows
    from .tasks.agent_loop import ToolAgent
    from .trace import Episode, Turn


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trl_agentic' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "AgenticGRPOConfig",
    "AgenticGRPOTrainer",
    "CommandAgent",
    "Episode",
    "Row",
    "ToolAgent",
    "Turn",
    "episode_to_rows",
]
