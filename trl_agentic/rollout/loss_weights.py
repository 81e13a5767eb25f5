"""Rows → what TRL's loss multiplies them by: per-row advantages and vLLM importance-sampling ratios. Pure functions.

An episode may become several rows (a fork after a history rewrite, a side call). TRL's loss never sees episodes, only
rows, so how an episode's advantage is spread over its rows decides how much each sampled token weighs. The rule here
("auto"): every sampled token weighs what TRL's loss would give it if the whole episode were one sequence.

- Token-level losses (`dapo`, `bnpo`, `cispo`, `vespo`: a sum over every sampled token of the batch, divided by a
  token count) already weigh each token alone: every row carries the episode's advantage A.
- `dr_grpo` and `luspo` sum a row's tokens and divide by the number of rows B of the micro-batch: every row carries A,
  and the micro-batch's advantages are rescaled by B_rows / B_episodes (`micro_batch_scale`), so that extra rows do not
  dilute everyone else's weight.
- `grpo` and `sapo` average a row's tokens, then average over rows: a row of T_r of the episode's T sampled tokens
  carries A * T_r / T (its share), plus the same micro-batch rescaling.

With one row per episode every factor is 1 and the batch is exactly TRL's. What stays per row, by construction: the
KL term (`beta > 0`) of sequence-level losses, and sequence-level importance sampling (GSPO), which TRL computes over
a row's tokens.
"""

from __future__ import annotations

import math

import torch


TOKEN_LEVEL_LOSSES = ("dapo", "bnpo", "cispo", "vespo")  # sum over tokens / token count: rows need no rescaling
ROW_SUM_LOSSES = ("dr_grpo", "luspo")  # sum over a row's tokens, then / number of rows (times a constant)
ROW_MEAN_LOSSES = ("grpo", "sapo")  # mean over a row's tokens, then mean over rows
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def row_advantage_scales(row_sampled_tokens: list[int], loss_type: str, row_weighting: str = "auto") -> list[float]:
    """How much of its episode's advantage each row of one episode carries.

    Args:
        row_sampled_tokens: sampled (trained) tokens of each of the episode's rows.
        loss_type: TRL's `loss_type`.
        row_weighting: `"auto"` (each sampled token weighs what it would in one sequence, see the module docstring),
            `"episode"` (the rows split the advantage equally) or `"row"` (every row carries it fully).

    Example:

    ```python
    >>> row_advantage_scales([30, 10], "dapo")
    [1.0, 1.0]
    >>> row_advantage_scales([30, 10], "grpo")
    [0.75, 0.25]
    >>> row_advantage_scales([30, 10], "grpo", row_weighting="episode")
    [0.5, 0.5]
    ```
    """
    num_rows = len(row_sampled_tokens)
    if row_weighting == "row" or num_rows <= 1:
        return [1.0] * num_rows
    if row_weighting == "episode":
        return [1.0 / num_rows] * num_rows
    if row_weighting != "auto":
        raise ValueError(f"row_weighting must be 'auto', 'episode' or 'row', got {row_weighting!r}.")
    if loss_type in ROW_MEAN_LOSSES:
        total = sum(row_sampled_tokens)
        return [tokens / total for tokens in row_sampled_tokens] if total else [1.0 / num_rows] * num_rows
    return [1.0] * num_rows


def micro_batch_scale(num_rows: int, num_episodes: float, loss_type: str, row_weighting: str = "auto") -> float:
    """Factor on a micro-batch's advantages so that losses normalised by the row count weigh a token as TRL would
    with one row per episode (`num_episodes` = the episodes TRL would put in this micro-batch).

    Example:

    ```python
    >>> micro_batch_scale(10, 8, "grpo")  # 2 extra rows among 8 episodes
    1.25
    >>> micro_batch_scale(10, 8, "dapo")
    1.0
    ```
    """
    if row_weighting != "auto" or loss_type not in ROW_SUM_LOSSES + ROW_MEAN_LOSSES or num_episodes <= 0:
        return 1.0
    return num_rows / num_episodes


def importance_sampling_ratio(
    old_per_token_logps: torch.Tensor,  # (B, T) the trainer's logps of the sampled tokens
    sampling_per_token_logps: torch.Tensor,  # (B, T) the generation engine's logps (NaN = unavailable)
    mask: torch.Tensor,  # (B, T) 1 on sampled tokens
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """TRL's vLLM importance-sampling correction, as `GRPOTrainer._generate_and_score_completions` computes it for
    the rows it generated, for rows appended after it. Shape: (B, T) in `token_*` modes, (B, 1) in `sequence_*`
    modes. `*_truncate` clamps the ratio to [clip_min, clip_max]; `*_mask` sets it to 0 outside that range.
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(
            f"Unknown vllm_importance_sampling_mode {mode!r}; expected one of {IMPORTANCE_SAMPLING_MODES}."
        )
    diff = torch.nan_to_num((old_per_token_logps - sampling_per_token_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
