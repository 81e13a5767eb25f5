"""trl-agentic: GRPO for black-box LLM agents at the OpenAI-compatible API boundary, on top of TRL."""

__version__ = "0.1.0"

from .console import quiet_known_warnings


quiet_known_warnings()  # before the config: TRL's defaults trip transformers 5 deprecations a user cannot act on

from .agentic_grpo_config import AgenticGRPOConfig  # noqa: E402
from .agentic_grpo_trainer import AgenticGRPOTrainer  # noqa: E402
from .rollout.agents import CommandAgent  # noqa: E402
from .rollout.rows import Row, episode_to_rows  # noqa: E402
from .tasks.agent_loop import ToolAgent  # noqa: E402
from .trace import Episode, Turn  # noqa: E402


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
