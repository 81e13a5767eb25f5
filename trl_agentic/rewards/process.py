"""Per-turn (process) rewards: what a reward function may return besides one number per episode, and the per-token
advantages the trainer makes of them (issue 34).

Every token of an episode otherwise shares one advantage: a 40-call run that passed pushes up its three mistakes, one
that failed pushes down its 37 good calls. A reward function may also score each model call (turn). For each episode
it returns one of:

- a number or `None`: the episode's final reward, TRL's contract, unchanged;
- a list with one entry per turn of the episode (`episode.turns`, in call order), each a number or `None` (that turn
  not rewarded): per-turn rewards only; the function gives the episode no final reward (`None` to TRL);
- a dict `{"final": r, "turns": [...]}`: both (either may be `None` or left out).

How a token sampled in turn t of episode i gets its advantage (the `turn_reward_*` fields of [`AgenticGRPOConfig`]):

    m[i, t] = sum_{k >= t in c(t)} gamma^d(t, k) * n(r[i, k]) / sum_{k >= t in c(t)} gamma^d(t, k)
    A[i, t] = A[i] + w * m[i, t] / max(1, M)

- `A[i]`: TRL's advantage of the final rewards, normalised in the group exactly as without per-turn rewards;
- `r[i, k] = sum_f weight_f * r_f[i, k]`: the turn's reward, summed over the functions that rewarded it with their
  `reward_weights` (`None` when none did: such a turn is left out of both sums);
- `n`: `turn_reward_normalization` over every rewarded turn of the group: `"group"` `(r - mean) / (std + 1e-4)` (the
  process supervision of DeepSeekMath's GRPO, arXiv:2402.03300 section 4.1.3), `"mean"` `r - mean`, `"none"` `r`;
- `c(t)`: turn t's conversation, as lineage labelled it (`trl_agentic.lineage`), and `d(t, k)` how many of its turns
  lie from t to k: rewards flow along a conversation in its own order, never across (a title call, a sub-agent's turn
  says nothing of the main line's earlier calls; issue 40);
- `m[i, t]`: a `gamma`-weighted mean, 0 when no turn of c(t) from t on is rewarded (`gamma = turn_reward_discount`;
  1: the reward-to-go of DeepSeekMath, as a mean; 0: each turn's own reward);
- `M`: the largest `|m|` of the group, so no term exceeds `w = turn_reward_weight` (default 0.5).

A mean and a bound, not DeepSeekMath's sum (issue 40): a sum grows with the turns left (+5.96 at the first of 40
turns, against TRL's advantage of about +-1), which pays the policy for making more calls, and it can sum past
float32 (NaN parameters). With `w = 0.5` two episodes' terms differ by at most 1, less than the smallest gap TRL's group
normalization puts between a passed and a failed episode (`2 sqrt((G - 1) / G) >= 1.41`): the per-turn term orders
calls within an outcome, it cannot outweigh the outcome.

Tokens between turns (tool output, template glue) are not trained and keep `A[i]`. TRL's loss is untouched: from TRL
1.16 `_compute_loss` takes advantages of shape (B, T) as well as (B,), so the trainer hands it one advantage per
completion token whenever a batch holds per-turn rewards, and the usual (B,) otherwise (episodes with only final
rewards train exactly as before).

Example:

```python
>>> from trl_agentic.trace import Episode, Turn
>>> def well_formed_calls(prompts, completions, episodes, **kwargs):  # 0.1 per turn without a malformed tool call
...     return [[0.0 if turn.malformed_tool_call else 0.1 for turn in episode.turns] for episode in episodes]
>>> turn_advantage_terms([[1.0, 0.0], [0.0, 0.0]], group_size=2, discount=1.0, normalization="none", weight=1.0)
[[0.5, 0.0], [0.0, 0.0]]
```
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ..lineage import turn_conversations
from ..rollout.rows import Row, row_token_turns
from ..trace import Episode, Turn


TURN_REWARDS_KEY = "turn_rewards"  # episode.metadata[TURN_REWARDS_KEY] = {reward function name: [r or None per turn]}
TURN_REWARD_NORMALIZATIONS = ("group", "mean", "none")
_FLOAT32_MAX = 3.4028234663852886e38


def split_turn_rewards(
    name: str, outputs: Sequence[Any], episodes: Sequence[Episode | None] | None, skip_failed: bool = True
) -> list[Any]:
    """Split what reward function `name` returned into final rewards (returned, for TRL) and per-turn rewards (kept in
    each episode's `metadata["turn_rewards"][name]`).

    Args:
        name: the function's name (as TRL logs it).
        outputs: one entry per episode: a number or `None`, a list of per-turn rewards, or `{"final": ..., "turns":
            [...]}`.
        episodes: the episodes, aligned with `outputs` (`None` outside the [`AgenticGRPOTrainer`]).
        skip_failed: keep no per-turn rewards for an episode that did not end `ok` (its final reward is masked too).

    Raises a `ValueError` naming the function and the episode when the per-turn list does not have one entry per turn,
    holds something else than numbers and `None`, or when there are no episodes to count turns on.

    Example:

    ```python
    >>> from trl_agentic.trace import Episode, Turn
    >>> episode = Episode("e", status="ok", turns=[Turn(0, [1], [2], [-0.1], "stop"), Turn(1, [1, 2, 3], [4], [-0.2], "stop")])
    >>> split_turn_rewards("f", [{"final": 1.0, "turns": [0.5, None]}], [episode])
    [1.0]
    >>> episode.metadata["turn_rewards"]
    {'f': [0.5, None]}
    ```
    """
    finals = []
    for index, output in enumerate(outputs):
        if isinstance(output, dict):
            unknown = set(output) - {"final", "turns"}
            if unknown:
                raise ValueError(
                    f"The reward function {name!r} returned a dict with keys {sorted(unknown)} for episode {index}; "
                    'a reward dict has a "final" reward and/or "turns" (one reward per turn).'
                )
            final, turns = output.get("final"), output.get("turns")
        elif isinstance(output, list | tuple):
            final, turns = None, output
        else:
            finals.append(output)
            continue
        finals.append(final)
        if turns is None:
            continue
        episode = episodes[index] if episodes is not None else None
        if episode is None:
            raise ValueError(
                f"The reward function {name!r} returned per-turn rewards, which need the episodes' turns: the "
                "AgenticGRPOTrainer (and `trl-agentic eval`) pass `episodes=`; plain TRL does not."
            )
        if skip_failed and episode.status != "ok":
            continue
        turns = list(turns)
        if len(turns) != len(episode.turns):
            raise ValueError(
                f"The reward function {name!r} returned {len(turns)} per-turn rewards for episode {index}, which has "
                f"{len(episode.turns)} turns: give one per turn of `episode.turns` (None for a turn not rewarded)."
            )
        for turn, reward in enumerate(turns):
            if reward is not None and not _finite_number(reward):
                raise ValueError(
                    f"The reward function {name!r} returned {reward!r} for turn {turn} of episode {index}: a per-turn "
                    "reward must be a finite number within float32's range, or None for a turn it does not reward."
                )
        episode.metadata.setdefault(TURN_REWARDS_KEY, {})[name] = [None if r is None else float(r) for r in turns]
    return finals


def _finite_number(value: Any) -> bool:
    if isinstance(value, bool | str):
        return False
    try:
        number = float(value)
    except (TypeError, ValueError):
        return False
    return math.isfinite(number) and abs(number) <= _FLOAT32_MAX


def combine_turn_rewards(episode: Episode, weights: dict[str, float]) -> list[float | None] | None:
    """The episode's per-turn rewards summed over the reward functions that gave them, each with its weight (`None`
    for a turn no function rewarded); `None` when no function gave per-turn rewards.

    Example:

    ```python
    >>> episode = Episode("e", metadata={"turn_rewards": {"f": [1.0, None], "g": [0.5, None]}})
    >>> combine_turn_rewards(episode, {"f": 1.0, "g": 2.0})
    [2.0, None]
    ```
    """
    per_function = episode.metadata.get(TURN_REWARDS_KEY)
    if not per_function:
        return None
    combined: list[float | None] = [None] * len(episode.turns or next(iter(per_function.values())))
    for name, rewards in per_function.items():
        weight = weights.get(name, 1.0)
        for turn, reward in enumerate(rewards):
            if reward is not None:
                combined[turn] = (combined[turn] or 0.0) + weight * reward
    return combined


def turn_conversation_ids(episode: Episode) -> list[int | None]:
    """The conversation of each of the episode's turns (`episode.turns`, call order), as lineage labelled it
    (`trl_agentic.lineage.turn_conversations`); `None` for a cancelled call, which belongs to none.

    Example:

    ```python
    >>> first = Turn(0, [1, 2], [3], [-0.1], "stop")
    >>> second = Turn(1, [1, 2, 3, 4], [5], [-0.1], "stop", prompt_source="continued", parent_turn=0)
    >>> turn_conversation_ids(Episode("e", turns=[first, second]))
    [0, 0]
    ```
    """
    conversations = turn_conversations(episode.turns)
    return [conversations[turn.index][0] if turn.index in conversations else None for turn in episode.turns]


def turn_advantage_terms(
    turn_rewards: Sequence[Sequence[float | None] | None],
    group_size: int,
    discount: float = 1.0,
    normalization: str = "group",
    weight: float = 0.5,
    conversations: Sequence[Sequence[int | None] | None] | None = None,
) -> list[list[float] | None]:
    """The per-turn term of each episode's advantage (see the module docstring), `None` for an episode without
    per-turn rewards: for turn t, `m[t]`, the `discount`-weighted mean of the normalised rewards of the rewarded turns
    from t on in t's conversation, then `weight * m[t] / max(1, largest |m| of the group)`.

    Args:
        turn_rewards: per episode, its combined per-turn rewards (`combine_turn_rewards`) or `None`; the episodes of a
            group are `group_size` consecutive entries, as in TRL's batch.
        group_size: episodes per group (`num_generations`).
        discount: `gamma` in [0, 1].
        normalization: `"group"`, `"mean"` or `"none"` (over every rewarded turn of the group).
        weight: `w`, the largest magnitude a term can have.
        conversations: per episode, the conversation of each turn (`turn_conversation_ids`; `None`: a call of its
            own); `None` (for all, or for an episode): its turns are one conversation, in call order.

    Example (one group of two episodes, rewards 1 and 0 on the first turn, 0 and 0 on the second; hand-computed: mean
    0.25, sample std 0.5, so the rewards normalise to 1.5, -0.5, -0.5, -0.5 up to the 1e-4; gamma 0.5: the first
    turn's mean is (1.5 - 0.5 * 0.5) / 1.5 = 0.833, and nothing exceeds 1, so no scaling):

    ```python
    >>> terms = turn_advantage_terms([[1.0, 0.0], [0.0, 0.0]], group_size=2, discount=0.5, weight=1.0)
    >>> [[round(x, 3) for x in term] for term in terms]
    [[0.833, -0.5], [-0.5, -0.5]]
    ```
    """
    if normalization not in TURN_REWARD_NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {TURN_REWARD_NORMALIZATIONS}, got {normalization!r}.")
    if len(turn_rewards) % group_size:
        raise ValueError(f"{len(turn_rewards)} episodes do not make whole groups of {group_size}.")
    terms: list[list[float] | None] = []
    for start in range(0, len(turn_rewards), group_size):
        group = turn_rewards[start : start + group_size]
        values = [r for rewards in group if rewards is not None for r in rewards if r is not None]
        mean = sum(values) / len(values) if values else 0.0
        # TRL's `nanstd` (the sample std, n - 1), and TRL's 1e-4; one rewarded turn: no spread, it normalises to 0
        std = math.sqrt(sum((r - mean) ** 2 for r in values) / (len(values) - 1)) if len(values) > 1 else 0.0
        means: list[list[float] | None] = []
        for offset, rewards in enumerate(group):
            if rewards is None:
                means.append(None)
                continue
            normalised = [
                None
                if r is None
                else (r - mean) / (std + 1e-4)
                if normalization == "group"
                else r - mean
                if normalization == "mean"
                else r
                for r in rewards
            ]
            labels = conversations[start + offset] if conversations is not None else None
            means.append(_conversation_means(normalised, labels, discount))
        # A mean, not DeepSeekMath's sum: a sum grows with the turns left (+5.96 at the first of 40 turns against
        # TRL's advantage of about +-1), which pays for making more calls (issue 40). Scaled by the group's largest so
        # that no term exceeds `weight`, whatever the rewards' scale (they may sum past float32).
        largest = max((abs(m) for ms in means if ms is not None for m in ms), default=0.0)
        scale = weight / max(1.0, largest)
        terms += [None if ms is None else [scale * m for m in ms] for ms in means]
    return terms


def _conversation_means(
    normalised: Sequence[float | None], labels: Sequence[int | None] | None, discount: float
) -> list[float]:
    """Per turn, the discount-weighted mean of the normalised rewards (`None`: not rewarded, left out) of its
    conversation's turns from it on; 0 when none of them is rewarded. Rewards never flow across conversations: a
    title call or a sub-agent's turn says nothing about the main line's earlier calls."""
    if labels is None:
        labels = [0] * len(normalised)
    following: dict[int | None, tuple[float, float]] = {}  # conversation -> (weighted sum, weights) of later turns
    means = [0.0] * len(normalised)
    for turn in reversed(range(len(normalised))):
        label = labels[turn] if labels[turn] is not None else ("alone", turn)
        total, weights = following.get(label, (0.0, 0.0))
        total, weights = discount * total, discount * weights
        if normalised[turn] is not None:
            total, weights = total + normalised[turn], weights + 1.0
        following[label] = (total, weights)
        means[turn] = total / weights if weights > 0 else 0.0
    return means


def row_token_advantages(
    rows: Sequence[Row], turns: Sequence[Turn], advantage: float, terms: Sequence[float] | None, scales: Sequence[float]
) -> list[list[float]]:
    """One advantage per completion token of each of an episode's rows: `scale * (advantage + terms[t])` on a token
    sampled in turn t (`scale`: the row's share of the episode's advantage, `rollout/loss_weights.py`), `scale *
    advantage` elsewhere (context tokens, which the loss masks).

    Example:

    ```python
    >>> t0 = Turn(0, prompt_ids=[1, 2], completion_ids=[10, 11], logprobs=[-0.1, -0.2], finish_reason="stop")
    >>> t1 = Turn(1, prompt_ids=[1, 2, 10, 11, 4], completion_ids=[12], logprobs=[-0.3], finish_reason="stop",
    ...           prompt_source="continued", parent_turn=0)
    >>> from trl_agentic.rollout.rows import episode_to_rows
    >>> row_token_advantages(episode_to_rows([t0, t1]).rows, [t0, t1], 1.0, [0.5, -0.25], [1.0])
    [[1.5, 1.5, 1.0, 0.75]]
    ```
    """
    position = {turn.index: k for k, turn in enumerate(turns)}
    per_row = []
    for row, scale in zip(rows, scales, strict=True):
        owners = row_token_turns(row, list(turns))
        per_row.append(
            [scale * (advantage + (terms[position[t]] if terms is not None and t >= 0 else 0.0)) for t in owners]
        )
    return per_row


def episode_token_advantages(
    episodes: Sequence[Episode],
    rows: Sequence[Sequence[Row]],
    advantages: Sequence[float],
    terms: Sequence[Sequence[float] | None],
    scales: Sequence[Sequence[float]],
) -> list[list[list[float]]]:
    """`row_token_advantages` of each episode of a batch (its `rows`, its `advantages`, its per-turn `terms`); an
    episode without model calls gets its advantage on its placeholder row."""
    return [
        row_token_advantages(episode_rows, ep.turns, advantages[i], terms[i], scales[i])
        or [[advantages[i]]]  # the placeholder row of an episode without model calls
        for i, (ep, episode_rows) in enumerate(zip(episodes, rows, strict=True))
    ]


def batch_turn_advantage_terms(
    episodes: Sequence[Episode],
    weights: dict[str, float],
    group_size: int,
    *,
    discount: float,
    normalization: str,
    weight: float,
    metrics: dict[str, list],
    process_index: int = 0,
    gather: Callable[[list], list] = lambda local: local,
) -> list[list[float] | None] | None:
    """The per-turn term of each of this process's episodes' advantages (`turn_advantage_terms` over the groups of
    every process, `gather`), or `None` when no episode of the batch, on any process, has per-turn rewards (or
    `weight` is 0). Logs `turn_rewards/*` in `metrics` and each episode's terms in its metadata."""
    # Groups may span processes; rewards flow along each conversation (lineage), never across (issue 40)
    gathered = gather([(combine_turn_rewards(ep, weights), turn_conversation_ids(ep)) for ep in episodes])
    everyone = [rewards for rewards, _ in gathered]
    if all(rewards is None for rewards in everyone):
        return None
    terms = turn_advantage_terms(
        everyone,
        group_size,
        discount=discount,
        normalization=normalization,
        weight=weight,
        conversations=[conversations for _, conversations in gathered],
    )
    rewarded = [r for rewards in everyone if rewards is not None for r in rewards if r is not None]
    metrics["turn_rewards/mean"].append(sum(rewarded) / len(rewarded) if rewarded else math.nan)
    metrics["turn_rewards/rewarded_turns"].append(float(len(rewarded)))
    start = process_index * len(episodes)
    local = terms[start : start + len(episodes)]
    for episode, term in zip(episodes, local, strict=True):
        if term is not None:
            episode.metadata["turn_advantages"] = term  # in the episode log, beside the episode's advantage
    return local if weight != 0 else None
