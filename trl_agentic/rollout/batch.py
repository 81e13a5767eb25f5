"""Batch assembly: episodes -> rows -> TRL's padded tensors. Functions over rows and tensors, no trainer.

TRL's `_generate_and_score_completions` builds its batch from each episode's main row; the rest of an episode's rows
(forks, side calls, sub-agents) are appended here with their share of the episode's advantage
(`rollout/loss_weights.py`, and per-token advantages with per-turn rewards, `rewards/process.py`), and the generation
batch is split into micro-batches without dropping a row (REFERENCES: ROLL#409).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .loss_weights import importance_sampling_ratio, micro_batch_scale, row_advantage_scales
from .rows import Row, RowsResult


def split_rows(batch: dict[str, Any], num_chunks: int) -> list[dict[str, Any]]:
    """Split a batch of R rows into `num_chunks` micro-batches of near-equal size, dropping none (TRL's
    `split_tensor_dict` floor-divides, which would drop rows when R is not a multiple of `num_chunks`)."""
    num_rows = len(batch["prompt_ids"])
    if num_rows < num_chunks:
        raise ValueError(f"Cannot split {num_rows} rows into {num_chunks} micro-batches.")
    bounds = [round(i * num_rows / num_chunks) for i in range(num_chunks + 1)]
    chunks = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0 or isinstance(value, list):
                chunk[key] = value[start:end]
            else:
                chunk[key] = value
        chunks.append(chunk)
    return chunks


def _padded(values: list[list[float]], width: int, device) -> torch.Tensor:
    """Per-token advantages of rows, right-padded with 0 to `width`: (R, width), as TRL pads completions."""
    return torch.tensor([v + [0.0] * (width - len(v)) for v in values], dtype=torch.float32, device=device)


def importance_sampling_masked_counts(ratio: torch.Tensor, loss_mask: torch.Tensor) -> tuple[int, int, int, int]:
    """What TRL's importance-sampling correction zeroes out of the loss: `(masked rows, rows, masked tokens, tokens)`,
    counted over the trained tokens (`loss_mask` (B, T) 1) and the rows holding any. `ratio` is TRL's
    `importance_sampling_ratio`, (B, 1) in `sequence_*` modes and (B, T) in `token_*` modes; a `*_mask` mode sets it to
    0 beyond the clip bounds. A masked row is one whose every trained token is zeroed: under asynchronous rollouts
    TRL's default (`sequence_mask`, `vllm_importance_sampling_clip_max=3`) drops a whole multi-turn row once its
    summed log-ratio passes log(3), which TRL's min/mean/max ratio metrics do not show (issue 40).

    Example:

    ```python
    >>> importance_sampling_masked_counts(torch.tensor([[0.0], [1.2]]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    (1, 2, 2, 3)
    ```
    """
    trained = loss_mask.bool()  # (B, T)
    zeroed = (ratio == 0).expand_as(trained) & trained  # (B, T)
    rows = trained.any(dim=1)  # (B,)
    masked_rows = rows & (zeroed.sum(dim=1) == trained.sum(dim=1))
    counts = torch.stack([masked_rows.sum(), rows.sum(), zeroed.sum(), trained.sum()])
    return tuple(counts.tolist())


def row_scales(rows_results: list[RowsResult], loss_type: str, row_weighting: str) -> list[list[float]]:
    """Each row's share of its episode's advantage (`rollout/loss_weights.py`): `[1.0]` for an episode without rows
    (its placeholder row)."""
    return [
        row_advantage_scales([row.num_sampled_tokens for row in result.rows], loss_type, row_weighting) or [1.0]
        for result in rows_results
    ]


def spread_advantages(
    advantages: torch.Tensor,
    rows_results: list[RowsResult],
    scales: list[list[float]],
    token_advantages: list[list[list[float]]] | None,
    completion_width: int,
) -> tuple[torch.Tensor, list[Row], list]:
    """Each episode's advantage (TRL's, (B,)) spread over its rows by `scales` (`row_scales`): the main rows'
    advantages, (B,), or (B, `completion_width`) with per-token advantages (per-turn rewards,
    `rewards.process.episode_token_advantages`, which TRL's loss takes as it takes (B,)), and the extra rows (every
    row after an episode's first) with theirs (0-D tensors, or per-token lists)."""
    if token_advantages is None:
        main = advantages * torch.tensor([s[0] for s in scales], device=advantages.device)
    else:
        main = _padded([rows[0] for rows in token_advantages], completion_width, advantages.device)
    extra_rows, extra_advantages = [], []
    for i, result in enumerate(rows_results):
        for k, (row, scale) in enumerate(zip(result.rows[1:], scales[i][1:], strict=True), start=1):
            extra_rows.append(row)
            extra_advantages.append(advantages[i] * scale if token_advantages is None else token_advantages[i][k])
    return main, extra_rows, extra_advantages


def pad_extra_rows(
    extra_rows: list[Row], extra_advantages: list, num_extra: int, pad_id: int, per_token: bool, device
) -> tuple[list[Row], torch.Tensor]:
    """The extra rows padded to `num_extra` with empty, zero-advantage rows (every rank appends the same number), and
    their advantages as one tensor: (R,), or (R, T) per token."""
    extra_rows, extra_advantages = list(extra_rows), list(extra_advantages)
    while len(extra_rows) < num_extra:
        extra_rows.append(Row([pad_id], [pad_id], [0], [0.0], [], "padding"))
        extra_advantages.append(torch.zeros((), device=device) if not per_token else [0.0])
    extra = (
        torch.stack(extra_advantages)
        if not per_token
        else _padded(extra_advantages, max(len(v) for v in extra_advantages), device)
    )
    return extra_rows, extra


def append_rows(
    output: dict,
    rows: list[Row],
    advantages: torch.Tensor,
    *,
    pad_id: int,
    device,
    end_ids: set[int] | None = None,
    score: Callable[[str, torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
    importance_sampling: tuple[str, float, float] | None = None,
    gather: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> dict:
    """Append rows to TRL's padded generation batch, with the per-token logps TRL computed for the others.

    Args:
        end_ids: with `mask_truncated_completions`, the stop tokens (and pad): a row ending in another is masked.
        score: `score(key, input_ids, attention_mask, completion_width)`, the rows' `old_per_token_logps` or
            `ref_per_token_logps`, called for those `output` has.
        importance_sampling: TRL's `(mode, clip_min, clip_max)`, for the rows' ratio when `output` has one.
        gather: sums `num_items_in_batch` over processes (every rank appends).
    """
    prompt_width = max(output["prompt_ids"].size(1), max(len(r.prompt_ids) for r in rows))
    completion_width = max(output["completion_ids"].size(1), max(len(r.completion_ids) for r in rows))

    def left(values: list[list], fill) -> torch.Tensor:
        return torch.tensor([[fill] * (prompt_width - len(v)) + v for v in values], device=device)

    def right(values: list[list], fill, dtype=None) -> torch.Tensor:
        return torch.tensor([v + [fill] * (completion_width - len(v)) for v in values], device=device, dtype=dtype)

    def widen(tensor: torch.Tensor, width: int, fill, side: str) -> torch.Tensor:
        missing = width - tensor.size(1)
        if missing == 0:
            return tensor
        padding = torch.full((tensor.size(0), missing), fill, dtype=tensor.dtype, device=tensor.device)
        return torch.cat([padding, tensor] if side == "left" else [tensor, padding], dim=1)

    new = {
        "prompt_ids": left([r.prompt_ids for r in rows], pad_id),
        "prompt_mask": left([[1] * len(r.prompt_ids) for r in rows], 0),
        "completion_ids": right([r.completion_ids for r in rows], pad_id),
        "completion_mask": right([[1] * len(r.completion_ids) for r in rows], 0),
        "tool_mask": right([r.env_mask for r in rows], 1),
        # An engine that could not score a token reports None: NaN, as TRL maps it (zeroed in the IS ratio).
        "sampling_per_token_logps": right(
            [[math.nan if lp is None else lp for lp in r.logprobs] for r in rows], 0.0, torch.float32
        ),
    }
    if end_ids is not None:
        # TRL's rule for its own rows (DAPO's overlong filtering): a row whose last token is not a stop token was
        # cut at `max_tokens` and is left out of the loss; masked before scoring, as TRL does.
        ends = end_ids
        ended = torch.tensor(
            [[int(bool(r.completion_ids) and r.completion_ids[-1] in ends)] for r in rows], device=device
        )
        new["completion_mask"] = new["completion_mask"] * ended
    if "old_per_token_logps" in output or "ref_per_token_logps" in output:
        input_ids = torch.cat([new["prompt_ids"], new["completion_ids"]], dim=1)
        attention_mask = torch.cat([new["prompt_mask"], new["completion_mask"]], dim=1)
        with torch.no_grad():
            for key in ("old_per_token_logps", "ref_per_token_logps"):
                if key in output:
                    new[key] = score(key, input_ids, attention_mask, completion_width)
    if "importance_sampling_ratio" in output:
        # The rule TRL applied to the main rows (mode, clip bounds, NaN handling), with TRL's shape for the mode:
        # (B, 1) in sequence_* modes, (B, T) in token_* modes.
        new["importance_sampling_ratio"] = importance_sampling_ratio(
            new["old_per_token_logps"],
            new["sampling_per_token_logps"],
            new["completion_mask"] * new["tool_mask"],
            *importance_sampling,
        )

    merged = dict(output)
    for key, tensor in new.items():
        if key not in output and key not in ("tool_mask", "sampling_per_token_logps"):
            continue
        if key == "importance_sampling_ratio" and tensor.size(1) == 1:  # sequence_* modes: one ratio per row
            merged[key] = torch.cat([output[key], tensor], dim=0)
            continue
        current = output.get(key)
        if current is None:  # e.g. no tool_mask in TRL's output: ones
            current = torch.ones_like(output["completion_mask"]) if key == "tool_mask" else None
            if current is None:
                continue
        side = "left" if key.startswith("prompt") else "right"
        width = prompt_width if side == "left" else completion_width
        # Past a row's end a token-level IS ratio is 1, as TRL pads it (a zero difference, exp(0)).
        fill = {"prompt_ids": pad_id, "completion_ids": pad_id, "tool_mask": 1, "importance_sampling_ratio": 1.0}.get(
            key, 0
        )
        merged[key] = torch.cat([widen(current, width, fill, side), widen(tensor, width, fill, side)], dim=0)
    if advantages.dim() == 2:  # per-token advantages (per-turn rewards): padded as the completions
        merged["advantages"] = torch.cat(
            [
                widen(output["advantages"], completion_width, 0.0, "right"),
                widen(advantages, completion_width, 0.0, "right"),
            ]
        )
    else:
        merged["advantages"] = torch.cat([output["advantages"], advantages])
    loss_mask = merged["completion_mask"] * merged["tool_mask"]
    merged["num_items_in_batch"] = gather(loss_mask.sum()).sum()  # every rank appends (see above)
    return merged


def log_importance_sampling_masked(
    output: dict, metrics: dict[str, list], gather: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
) -> None:
    """`sampling/importance_sampling_masked_rows` and `_tokens`: the share of the batch's rows (those with a trained
    token, every process) and of its trained tokens that TRL's importance-sampling correction zeroed."""
    loss_mask = output["completion_mask"] * output["tool_mask"]  # (B, T): what the loss trains
    counts = importance_sampling_masked_counts(output["importance_sampling_ratio"], loss_mask)
    total = gather(torch.tensor([counts], device=loss_mask.device)).sum(dim=0).tolist()
    metrics["sampling/importance_sampling_masked_rows"].append(total[0] / total[1] if total[1] else 0.0)
    metrics["sampling/importance_sampling_masked_tokens"].append(total[2] / total[3] if total[3] else 0.0)


def micro_batches(
    batch: dict[str, Any], num_chunks: int, num_episodes: int, loss_type: str, row_weighting: str
) -> list[dict[str, Any]]:
    """A generation batch of `num_episodes` episodes' rows split into `num_chunks` micro-batches (`split_rows`), each
    one's advantages scaled so that losses normalised by the row count see B_rows rows where TRL would see
    B_episodes sequences (`rollout/loss_weights.micro_batch_scale`)."""
    chunks = split_rows(batch, num_chunks)
    # Losses normalised by the row count see B_rows rows where TRL would see B_episodes sequences.
    episodes_per_chunk = num_episodes / num_chunks
    for chunk in chunks:
        chunk["advantages"] = chunk["advantages"] * micro_batch_scale(
            len(chunk["advantages"]), episodes_per_chunk, loss_type, row_weighting
        )
    return chunks
