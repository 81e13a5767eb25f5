"""Reward functions by name, for scripts and recipes (open-r1 style: `reward_funcs: [calculator_correct]`).

Names are resolved here, never in the trainer, which only ever sees callables. Every reward function has TRL's
signature, `f(prompts, completions, **kwargs) -> list[float | None]`; `None` marks an episode that cannot be scored.

Example:

```python
>>> from trl_agentic.rewards import get_reward_func
>>> get_reward_func("calculator_correct").__name__
'calculator_correct'
```
"""

from __future__ import annotations

from collections.abc import Callable

from ..imports import import_object
from .utils import episode_for, final_assistant_text, is_scorable, message_text


# Name -> "module:attribute", imported on first use so that importing this package stays cheap and has no cycle with
# `trl_agentic.tasks` (whose checkers use `rewards.utils`).
REWARD_FUNCS: dict[str, str] = {
    "calculator_correct": "trl_agentic.tasks.calculator:calculator_correct",
    "files_correct": "trl_agentic.tasks.files:files_correct",
}


def get_reward_func(name: str) -> Callable:
    """Resolve a reward function by bundled name (see `REWARD_FUNCS`) or dotted import path `"pkg.module:attr"`.

    Args:
        name: a bundled name, e.g. `"calculator_correct"`, or an import path, e.g. `"my_rewards:length_penalty"`.

    Example:

    ```python
    >>> get_reward_func("files_correct")
    <function files_correct at ...>
    ```
    """
    path = REWARD_FUNCS.get(name, name)
    if ":" not in path:
        raise ValueError(
            f"Unknown reward function {name!r}. Use one of the bundled names {sorted(REWARD_FUNCS)} or an import path "
            "'pkg.module:function'."
        )
    func = import_object(path)
    if not callable(func):
        raise ValueError(f"Reward function {name!r} resolved to {func!r}, which is not callable.")
    return func


__all__ = ["REWARD_FUNCS", "episode_for", "final_assistant_text", "get_reward_func", "is_scorable", "message_text"]
