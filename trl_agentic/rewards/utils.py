"""Helpers shared by reward functions: which episodes can be scored, and where an agent's final answer is.

`unscorable_unless_ok` is the rule the trainer and `trl-agentic eval` both apply to every reward function: a failed
episode gets no score unless the function scores failures itself.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

from trl.trainer.utils import get_callable_name, is_async_callable

from ..lineage import turn_conversations
from ..trace import Turn
from .process import split_turn_rewards


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


# The largest reward TRL can hold: it scores in float32, where 1e39 is inf and an inf in a group makes its advantages
# NaN, which TRL then zeroes without a word (issue 29, N5).
FLOAT32_MAX = 3.4028234663852886e38


def _check_rewards(name: str, rewards, num_expected: int | None) -> None:
    """Raise a `ValueError` naming the function when it returned the wrong number of rewards or a value TRL cannot
    hold (not a number, infinite, beyond float32). `None` and NaN are TRL's "unscorable" and pass."""
    if num_expected is not None and len(rewards) != num_expected:
        raise ValueError(
            f"The reward function {name!r} returned {len(rewards)} rewards for {num_expected} episodes; it must return "
            "exactly one per completion (None for one it cannot score)."
        )
    for index, reward in enumerate(rewards):
        if reward is None:
            continue
        try:
            value = float(reward)
        except (TypeError, ValueError):
            value = None
        if isinstance(reward, str) or value is None or math.isinf(value) or abs(value) > FLOAT32_MAX:
            raise ValueError(
                f"The reward function {name!r} returned {reward!r} for episode {index}: a reward must be a number "
                f"within float32's range (|r| <= {FLOAT32_MAX:.4g}, which TRL's rewards are held in), or None for an "
                "episode it cannot score. Clip or rescale it in the function."
            )


def check_weighted_rewards(rewards_per_func, weights, names: Sequence[str], group_size: int) -> None:
    """Raise a `ValueError` when TRL's float32 arithmetic on the final rewards would overflow: an episode's rewards
    weighted by `reward_weights` summing past float32, or a group's rewards too far apart for its mean and std.

    Each reward is checked within float32 when its function returns it (`unscorable_unless_ok`); their weighted sum
    and the group statistics TRL takes of it are not, and an overflow there made the advantages NaN: NaN parameters
    after training, the loss logged 0, and no error (issue 40).

    Args:
        rewards_per_func: (B, F) tensor of every process's rewards, NaN for unscorable (TRL's `_calculate_rewards`).
        weights: (F,) tensor of `reward_weights`.
        names: the functions' names.
        group_size: episodes per group.

    Example:

    ```python
    >>> import torch
    >>> check_weighted_rewards(torch.tensor([[3e38, 3e38], [0.0, 0.0]]), torch.ones(2), ["f", "g"], 2)
    Traceback (most recent call last):
    ...
    ValueError: The rewards of episode 0 ({'f': 3e+38, 'g': 3e+38}) weighted by reward_weights [1.0, 1.0] sum to 6e+38, ...
    ```
    """
    import torch
    from trl.trainer.utils import nanstd

    scorable = ~torch.isnan(rewards_per_func).all(dim=1)
    weighted = (rewards_per_func.double() * weights.double().to(rewards_per_func.device)).nansum(dim=1)
    for i in torch.nonzero(scorable & (weighted.abs() > FLOAT32_MAX)).flatten().tolist():
        # float32 values, shown as the function returned them (3e+38, not 2.9999999e+38)
        values = {n: None if v != v else float(f"{v:.6g}") for n, v in zip(names, rewards_per_func[i].tolist())}
        raise ValueError(
            f"The rewards of episode {i} ({values}) weighted by reward_weights {weights.tolist()} sum to "
            f"{weighted[i].item():.4g}, beyond float32 (|r| <= {FLOAT32_MAX:.4g}), which TRL's rewards are held in: "
            "its group's advantages would be NaN. Rescale the reward functions or their reward_weights."
        )
    rewards = torch.where(scorable, weighted.float(), torch.nan).view(-1, group_size)
    counts = (~torch.isnan(rewards)).sum(dim=1)
    means, stds = torch.nanmean(rewards, dim=1), nanstd(rewards, dim=1)
    broken = ((counts > 0) & ~torch.isfinite(means)) | ((counts > 1) & ~torch.isfinite(stds))
    for group in torch.nonzero(broken).flatten().tolist():
        raise ValueError(
            f"The weighted rewards of group {group} ({rewards[group].tolist()}) are too far apart for float32: their "
            "mean or standard deviation, which TRL takes in float32 for the advantages, overflows and the advantages "
            "would be NaN. Rescale the reward functions or their reward_weights (e.g. clip each reward to [-1e6, 1e6])."
        )


def unscorable_unless_ok(reward_func: Callable) -> Callable:
    """Wrap a reward function so that episodes whose status is not `"ok"` get `None` (unscorable), and so that what it
    returns is checked.

    A crashed, timed-out or cut-off episode says nothing about the policy's skill at the task: with `None` it is left
    out of the group baseline (advantage 0) instead of being trained on as a silent 0. A function that scores failed
    episodes itself (e.g. a penalty for timeouts) declares `scores_failed_episodes = True` and is not masked. A reward
    model (a model id or an `nn.Module`, as TRL accepts them) becomes a [`RewardModelFunc`] first, so the rule holds
    for it too (TRL would otherwise score failed episodes with it, issue #9).

    A function may also reward each turn: per episode, a list of per-turn rewards or `{"final": r, "turns": [...]}`
    (`trl_agentic.rewards.process`); the per-turn part is kept in `episode.metadata["turn_rewards"]` and the final
    reward (`None` for a bare list) is what is returned.

    Either way, a function returning another number of rewards than episodes, or a reward TRL's float32 cannot hold
    (inf, 1e39, a string), raises a `ValueError` naming the function and the value (issue 29, N4/N5). `None` and NaN
    mean "unscorable", as in TRL.

    Example:

    ```python
    >>> from trl_agentic.trace import Episode
    >>> always_one = unscorable_unless_ok(lambda prompts, completions, **kwargs: [1.0] * len(prompts))
    >>> always_one(["q", "q"], [[], []], episodes=[Episode(id="a", status="ok"), Episode(id="b", status="timeout")])
    [1.0, None]
    ```
    """
    from torch import nn

    if isinstance(reward_func, str | nn.Module):
        reward_func = RewardModelFunc(reward_func)
    if not callable(reward_func):
        return reward_func
    # TRL's own name for it (a partial's function, an instance's class): the key of its `reward_weights` for the
    # per-turn rewards filed under it, and of `rewards/<name>/mean` (issue 40)
    name = get_callable_name(reward_func)
    masks = not getattr(reward_func, "scores_failed_episodes", False)

    def finish(rewards, episodes):
        # TRL takes any iterable; per-turn rewards (lists, {"final", "turns"} dicts) go to the episodes (process.py)
        rewards = split_turn_rewards(name, list(rewards), episodes, skip_failed=masks)
        _check_rewards(name, rewards, len(episodes) if episodes is not None else None)
        if masks and episodes is not None:
            return [
                None if ep is not None and ep.status != "ok" else r for r, ep in zip(rewards, episodes, strict=True)
            ]
        return rewards

    if is_async_callable(reward_func):  # an `async def __call__` too, which `inspect.iscoroutinefunction` misses

        @functools.wraps(reward_func)
        async def wrapped(*args, episodes=None, **kwargs):
            return finish(await reward_func(*args, episodes=episodes, **kwargs), episodes)

    else:

        @functools.wraps(reward_func)
        def wrapped(*args, episodes=None, **kwargs):
            return finish(reward_func(*args, episodes=episodes, **kwargs), episodes)

    wrapped.__name__ = name  # `functools.wraps` copies none from a partial or an instance
    return wrapped


class RewardModelFunc:
    """A reward model as a reward function, scoring the way TRL's `GRPOTrainer` scores an `nn.Module` reward: prompt +
    completion rendered with the reward model's chat template (conversational data) or concatenated, then the first
    logit of a one-label sequence classifier.

    Args:
        model: a model id or path (loaded with `AutoModelForSequenceClassification`, `num_labels=1`, as TRL does) or a
            loaded sequence classifier.
        tokenizer: its tokenizer (default: loaded from the model's `name_or_path`).

    The model runs on the accelerator's device of the run (moved there at the first call), one full copy per process.

    Example:

    ```python
    >>> reward = unscorable_unless_ok("my-org/my-reward-model")  # a RewardModelFunc, failed episodes left unscored
    ```
    """

    def __init__(self, model, tokenizer=None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if isinstance(model, str):
            model = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1)
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        if tokenizer is None:
            if not name or name == type(model).__name__:
                raise ValueError(
                    f"The reward model {type(model).__name__} has no name_or_path to load its tokenizer "
                    "from; pass RewardModelFunc(model, tokenizer=...)."
                )
            tokenizer = AutoTokenizer.from_pretrained(name)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id
        self.model, self.tokenizer = model.eval(), tokenizer
        self.__name__ = name.rstrip("/").split("/")[-1]  # the name TRL logs a reward model under

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        import torch
        from accelerate import PartialState
        from trl.data_utils import apply_chat_template, is_conversational

        if is_conversational({"prompt": prompts[0]}):
            texts = [
                apply_chat_template({"messages": p + c}, self.tokenizer)["text"]
                for p, c in zip(prompts, completions, strict=True)
            ]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        device = PartialState().device
        self.model.to(device)
        inputs = self.tokenizer(
            text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        ).to(device)
        with torch.inference_mode():
            return self.model(**inputs).logits[:, 0].float().tolist()


def cut_off_penalty(prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
    """-1.0 for an episode whose main line's last model call was cut at its token limit (`finish_reason ==
    "length"`), else 0.0: DAPO's overlong punishment, in its hard form, for agents. Added to a checker's score, an
    answer cut off mid-way scores at most 0 and a cut-off failure -1. The main line's last call is the one that gave
    the answer (`trl_agentic.lineage`): a title or summary request sent after it does not count.

    It scores the episodes that ended `ok` and those whose agent raised (`agent_error`) right after a cut-off call,
    and declares `scores_failed_episodes` for it: an agent framework may refuse an answer cut at the limit instead of
    returning it. The OpenAI Agents SDK does, for the Responses API's `status: "incomplete"` (`ModelBehaviorError`),
    so with a checker alone every such episode was unscorable and a policy that ran long got no signal. Other failed
    episodes (timeout, context overflow, limits) stay unscored (`None`): the cut is not what ended them.

    TRL's `mask_truncated_completions` leaves such episodes out of the loss instead, and so never pushes the policy
    away from what runs into the limit. On the CPU demo, with it, 240 of one seed's 798 malformed tool calls ran into
    the limit (143 of them a loop of `<tool_call>` openings), and `malformed_tool_calls` fired three times.

    Needs the `episodes` the [`AgenticGRPOTrainer`] passes: the finish reason is not in the messages.

    Example:

    ```python
    >>> from trl_agentic.trace import Episode, Turn
    >>> cut, done = Turn(0, [1], [2, 3], [-0.1, -0.2], "length"), Turn(0, [1], [2, 0], [-0.1, -0.2], "stop")
    >>> episodes = [Episode("a", status="ok", turns=[cut]), Episode("b", status="ok", turns=[done]),
    ...             Episode("c", status="agent_error", turns=[cut])]
    >>> cut_off_penalty([None] * 3, [[]] * 3, episodes=episodes)
    [-1.0, 0.0, -1.0]
    ```
    """
    if kwargs.get("episodes") is None:
        raise ValueError(
            "cut_off_penalty reads the finish reason of each episode's last call from the `episodes` column, which "
            "AgenticGRPOTrainer passes to reward functions; plain TRL does not (use `mask_truncated_completions`)."
        )
    penalties: list[float | None] = []
    for episode in kwargs["episodes"][: len(completions)]:
        # The main line's last call gives the answer: a title or summary request after it may be cut, the answer not
        # (issue 40). No model call: nothing was cut.
        last = _main_line_last_call(episode.turns)
        cut = last is not None and last.finish_reason == "length"
        if episode.status == "ok" or (cut and episode.status == "agent_error"):
            penalties.append(-1.0 if cut else 0.0)
        else:
            penalties.append(None)
    return penalties


def _main_line_last_call(turns: list[Turn]) -> Turn | None:
    """The last delivered call of the episode's main line (`trl_agentic.lineage`), `None` without one."""
    roles = turn_conversations(turns)
    return next((t for t in reversed(turns) if roles.get(t.index, (None, None))[1] == "main"), None)


cut_off_penalty.scores_failed_episodes = True  # an agent that raised on a cut-off answer is scored (see above)


def reward_model_funcs(reward_funcs, reward_processing_classes=None) -> list:
    """TRL's `reward_funcs` and `reward_processing_classes`: entry i of the second tokenizes for reward model i (a
    model id or an `nn.Module`, which becomes a [`RewardModelFunc`]), `None` for plain functions and for reward models
    whose tokenizer loads from their path."""
    import torch

    if not isinstance(reward_funcs, list):
        reward_funcs = [reward_funcs]
    if reward_processing_classes is None:
        reward_processing_classes = [None] * len(reward_funcs)
    elif not isinstance(reward_processing_classes, list):
        reward_processing_classes = [reward_processing_classes]
    if len(reward_processing_classes) != len(reward_funcs):
        raise ValueError(
            f"The number of reward processing classes ({len(reward_processing_classes)}) must match the "
            f"number of reward functions ({len(reward_funcs)}): give `None` for the functions that are not "
            "reward models."
        )
    return [
        RewardModelFunc(f, tokenizer=tok) if isinstance(f, str | torch.nn.Module) else f
        for f, tok in zip(reward_funcs, reward_processing_classes, strict=True)
    ]
