"""trl-agentic: GRPO for black-box LLM agents at the OpenAI-compatible API boundary, on top of TRL."""

__version__ = "0.1.0"

from .agentic_grpo_config import AgenticGRPOConfig
from .agentic_grpo_trainer import AgenticGRPOTrainer
from .rollout.agents import CommandAgent
from .rollout.rows import Row, episode_to_rows
from .trace import Episode, Turn

__all__ = ["AgenticGRPOConfig", "AgenticGRPOTrainer", "CommandAgent", "Episode", "Row", "Turn", "episode_to_rows"]
