"""What reward functions share: TRL's signature, the failed-episode rule, and where an agent's answer is.

Every reward function has TRL's signature, `f(prompts, completions, **kwargs) -> list[float | None]`; `None` marks
an episode that cannot be scored. `unscorable_unless_ok` is the rule the trainer and `trl-agentic eval` apply to
each: an episode that did not end `ok` is unscorable unless the function scores failures itself. The checkers live
with their tasks (`trl_agentic.tasks.calculator.calculator_correct`, ...), which import these helpers; recipes name
them through `trl_agentic.recipes.get_reward_func`.

Beyond a checker (issue 34): [`TrajectoryJudge`] scores episodes with an LLM judge against a plain-text rubric
(`judge.py`), and a function may reward each turn as well as the episode (`process.py`: per-token advantages).

Example:

```python
>>> from trl_agentic.rewards import final_assistant_text
>>> final_assistant_text([{"role": "assistant", "content": "The answer is 4."}])
'The answer is 4.'
```
"""

from __future__ import annotations

from .judge import TrajectoryJudge
from .utils import (
    RewardModelFunc,
    cut_off_penalty,
    episode_for,
    final_assistant_text,
    is_scorable,
    message_text,
    unscorable_unless_ok,
)


__all__ = [
    "RewardModelFunc",
    "TrajectoryJudge",
    "cut_off_penalty",
    "episode_for",
    "final_assistant_text",
    "is_scorable",
    "message_text",
    "unscorable_unless_ok",
]
