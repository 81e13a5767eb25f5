"""[`quiet_known_warnings`]: the warnings filter `import trl_agentic` installs, in a module that imports neither torch
nor transformers (the command line's `--help` must not load them, issue 40)."""

from __future__ import annotations

import logging
import warnings


MAX_WARNING_CHARS = 400


class _ShortenWarnings(logging.Filter):
    """TRL's warning for an episode every reward function returned `None` for, in one line; any other warning of
    these loggers cut at `MAX_WARNING_CHARS` characters."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("All reward functions returned None"):
            record.msg, record.args = (
                "An episode got no reward from any reward function (unscorable: it failed, or every checker returned "
                "None); it carries no learning signal. The share is logged as episodes/unscorable; the episode log "
                "(log_episodes=True) has each one's status and error.",
                None,
            )
        elif len(message) > MAX_WARNING_CHARS:
            cut = len(message) - MAX_WARNING_CHARS
            record.msg, record.args = f"{message[:MAX_WARNING_CHARS]}... [{cut} more characters]", None
        return True


_FILTER = _ShortenWarnings()


def quiet_known_warnings() -> None:
    """Silence the warnings a user of `AgenticGRPOTrainer` cannot act on, and shorten the long ones (idempotent)."""
    # Deprecations raised by TRL's own calls into transformers (not the user's code)
    for name in (
        "gradient_checkpointing_enable",
        "gradient_checkpointing_disable",
        "is_gradient_checkpointing",
        "gradient_checkpointing",
    ):  # the last: TRL's GRPOConfig default, renamed by transformers 5
        warnings.filterwarnings("ignore", message=f"`{name}` is deprecated", category=FutureWarning)
    for name in ("trl.trainer.grpo_trainer", "trl_agentic.agentic_grpo_trainer"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


__all__ = ["MAX_WARNING_CHARS", "quiet_known_warnings"]
