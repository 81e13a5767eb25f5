"""Helpers shared by reward functions: which episodes can be scored, and where an agent's final answer is.

`unscorable_unless_ok` is the rule the trainer and `trl-agentic eval` both apply to every reward function: a failed
episode gets no score unless the function scores failures itself.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any


def episode_for(kwargs: dict[str, Any], index: int) -> Any | None:
    """Return the `Episode` of completion `index` from a reward function's kwargs, or `None` outside the trainer.

    The [`AgenticGRPOTrainer`] passes `episodes=[Episode, ...]` aligned with `completions`; plain TRL does not.

    Example:

    ```python
    >>> episode_for({"episodes": ["e0", "e1"]}, 1)
    'e1'
    >>> episode_for({}, 0) is None
    True
    ```
    """
    episodes = kwargs.get("episodes")
    if episodes is None:
        return None
    return episodes[index]


def is_scorable(episode: Any | None) -> bool:
    """Whether a checker may score `episode`: only episodes that ended with status `"ok"` (or no episode at all).

    A crashed, timed-out or cut-off episode says nothing about the policy's skill at the task, so checkers return
    `None` for it (excluded from the group baseline, advantage 0) instead of a silent 0.

    Example:

    ```python
    >>> from trl_agentic.trace import Episode
    >>> is_scorable(Episode(id="e", status="ok")), is_scorable(Episode(id="e", status="timeout"))
    (True, False)
    ```
    """
    return episode is None or episode.status == "ok"


def message_text(message: dict[str, Any]) -> str:
    """Text of a message whose `content` is a string, `None`, or a list of OpenAI content parts.

    Example:

    ```python
    >>> message_text({"role": "assistant", "content": [{"type": "text", "text": "The answer is 4."}]})
    'The answer is 4.'
    ```
    """
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def final_assistant_text(completion: Sequence[dict[str, Any]] | str) -> str:
    """Text of the last assistant message of a completion (a message list), or the completion itself if it is text.

    Example:

    ```python
    >>> final_assistant_text([
    ...     {"role": "assistant", "content": None, "tool_calls": [...]},
    ...     {"role": "tool", "tool_call_id": "c0", "content": "4"},
    ...     {"role": "assistant", "content": "The answer is 4."},
    ... ])
    'The answer is 4.'
    ```
    """
    if isinstance(completion, str):
        return completion
    for message in reversed(completion):
        if message.get("role") == "assistant":
            return message_text(message)
    return ""


def unscorable_unless_ok(reward_func: Callable) -> Callable:
    """Wrap a reward function so that episodes whose status is not `"ok"` get `None` (unscorable).

    A crashed, timed-out or cut-off episode says nothing about the policy's skill at the task: with `None` it is left
    out of the group baseline (advantage 0) instead of being trained on as a silent 0. A function that scores failed
    episodes itself (e.g. a penalty for timeouts) declares `scores_failed_episodes = True` and is returned unwrapped,
    and so is anything that is not a plain callable (a reward model, a model id).

    Example:

    ```python
    >>> from trl_agentic.trace import Episode
    >>> always_one = unscorable_unless_ok(lambda prompts, completions, **kwargs: [1.0] * len(prompts))
    >>> always_one(["q", "q"], [[], []], episodes=[Episode(id="a", status="ok"), Episode(id="b", status="timeout")])
    [1.0, None]
    ```
    """
    from torch import nn

    if not callable(reward_func) or isinstance(reward_func, nn.Module):
        return reward_func
    if getattr(reward_func, "scores_failed_episodes", False):
        return reward_func

    def mask(rewards, episodes):
        return [None if ep is not None and ep.status != "ok" else r for r, ep in zip(rewards, episodes, strict=True)]

    if inspect.iscoroutinefunction(reward_func):

        @functools.wraps(reward_func)
        async def wrapped(*args, episodes=None, **kwargs):
            rewards = await reward_func(*args, episodes=episodes, **kwargs)
            return mask(rewards, episodes) if episodes is not None else rewards

    else:

        @functools.wraps(reward_func)
        def wrapped(*args, episodes=None, **kwargs):
            rewards = reward_func(*args, episodes=episodes, **kwargs)
            return mask(rewards, episodes) if episodes is not None else rewards

    return wrapped
