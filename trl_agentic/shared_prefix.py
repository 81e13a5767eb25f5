"""Scoring rows that share a prompt prefix: the prefix once, then every row's rest against its key/value states.

An agent's episodes all start with the same system prompt and tool schemas (on the calculator demo, ~270 of each
row's ~370 tokens), and TRL's `_get_per_token_logps_and_entropies` runs the whole of every row through the model, in
the forward and again in the backward. [`shared_prefix_logps`] runs the common prefix once (one row), expands its
key/value states over the rows (the backward sums their gradients back into the one computation) and runs only each
row's rest. The log-probabilities and entropies are TRL's, computed by TRL's fused LM head, up to float rounding; each
row's tokens keep their positions relative to the prefix, so rotary embeddings see the same distances as in TRL's
left-padded layout.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from transformers import DynamicCache


# Rows whose common prefix is shorter than this are scored TRL's way: the saving would not pay for the extra call.
MIN_SHARED_PREFIX = 32


def shared_prefix_length(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> int:
    """The number of leading real tokens every row has in common, stopping before the last prompt token of the row
    with the shortest prompt (the hidden state there predicts its first completion token: it must be in the rest).

    Rows are TRL's layout: `[left padding | prompt | completion | right padding]`, the completion in the last
    `logits_to_keep` columns.
    """
    prompt_width = input_ids.size(1) - logits_to_keep
    prompt_lengths = attention_mask[:, :prompt_width].sum(dim=1)
    limit = int(prompt_lengths.min()) - 1
    if limit <= 0:
        return 0
    starts = prompt_width - prompt_lengths  # first real column of each row
    columns = starts.unsqueeze(1) + torch.arange(limit, device=input_ids.device)  # (B, limit)
    heads = input_ids.gather(1, columns)
    differs = (heads != heads[:1]).any(dim=0).nonzero()
    return int(differs[0]) if len(differs) else limit


def shared_prefix_logps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    prefix_length: int,
    compute_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(logps, entropies)` of the last `logits_to_keep` columns, shaped as TRL's (rows, logits_to_keep), with the
    first `prefix_length` real tokens of every row (identical, see [`shared_prefix_length`]) computed once.

    `model` is TRL's model with its fused LM head (`model(..., labels=..., fused_lm_head=True)`).
    """
    rows, width = input_ids.shape
    device = input_ids.device
    prompt_width = width - logits_to_keep
    prompt_lengths = attention_mask[:, :prompt_width].sum(dim=1)
    lengths = attention_mask.sum(dim=1)  # real tokens per row (prompt + completion up to its right padding)
    starts = prompt_width - prompt_lengths

    # The prefix: one row, its key/value states kept (and differentiable).
    first = int(starts[0])
    prefix = input_ids[:1, first : first + prefix_length]
    outputs = model(input_ids=prefix, attention_mask=torch.ones_like(prefix), use_cache=True, logits_to_keep=1)
    states = [
        (layer.keys.expand(rows, -1, -1, -1), layer.values.expand(rows, -1, -1, -1)) for layer in outputs.cache.layers
    ]
    cache = DynamicCache(ddp_cache_data=states)

    # The rests, right-padded: row b's real tokens after the prefix.
    rest_lengths = lengths - prefix_length
    # At least 2 columns: with every completion masked (`mask_truncated_completions`) and one prompt shared whole,
    # nothing is left after the prefix; the padding columns are scored and masked as TRL's are.
    rest_width = max(int(rest_lengths.max()), 2)
    offsets = torch.arange(rest_width, device=device)
    columns = (starts + prefix_length).unsqueeze(1) + offsets  # (B, rest_width) in the input layout
    real = offsets.unsqueeze(0) < rest_lengths.unsqueeze(1)
    rest = input_ids.gather(1, columns.clamp(max=width - 1)).masked_fill(~real, 0)
    rest_mask = torch.cat(
        [torch.ones(rows, prefix_length, dtype=attention_mask.dtype, device=device), real.to(attention_mask.dtype)],
        dim=1,
    )
    # Score the completion tokens only, as TRL does: in the rest, row b's completion starts at its prompt's end.
    completion_start = prompt_lengths - prefix_length  # (B,) index in the rest of the first completion token
    in_completion = offsets.unsqueeze(0) >= completion_start.unsqueeze(1)
    labels = rest.masked_fill(~(real & in_completion), -100)
    position_ids = (prefix_length + offsets).unsqueeze(0).expand(rows, -1)
    scored = model(
        input_ids=rest,
        attention_mask=rest_mask,
        position_ids=position_ids,
        cache=cache,
        labels=labels,
        fused_lm_head=True,
    )

    # Back to TRL's columns: completion column c of row b is rest token completion_start[b] + c, whose log-prob the
    # fused head returns at index completion_start[b] + c - 1 (it scores token j + 1 from position j).
    index = (completion_start.unsqueeze(1) - 1 + torch.arange(logits_to_keep, device=device)).clamp(
        min=0, max=rest_width - 2
    )
    inside = torch.arange(logits_to_keep, device=device).unsqueeze(0) < (lengths - prompt_lengths).unsqueeze(
        1
    )  # columns past a row's completion: TRL's padding
    logps = scored.log_probs.gather(1, index).masked_fill(~inside, 0.0)
    entropies = None
    if compute_entropy:
        entropies = scored.entropy.gather(1, index).masked_fill(~inside, 0.0)
    return logps, entropies


def shared_prefix_applies(
    unwrapped_model, *, enabled: bool, compute_aux_loss: bool, model_inputs: dict, distributed: bool
) -> bool:
    """Whether rows may be scored with their shared prefix computed once: asked for (`enabled`), text-only (no
    `model_inputs`), not MoE (no aux loss), and a plain model on one process (`distributed`: a DDP, DeepSpeed or FSDP
    wrapper expects one forward per backward; checkpointed layers drop the key/value states the rest attends to)."""
    if not enabled or compute_aux_loss:
        return False
    if any(value is not None for value in model_inputs.values()):
        return False
    if distributed:
        return False
    # `is_activation_checkpointing` from transformers 5 (the old name warns on every call), else the old name
    checkpointing = getattr(unwrapped_model, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(unwrapped_model, "is_gradient_checkpointing", False)
    return not checkpointing


def chunked_shared_prefix_logps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None,
    compute_entropy: bool,
    score_chunk: Callable,
    autocast: Callable = contextlib.nullcontext,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TRL's per-token logps (and entropies) of rows in chunks of `batch_size`, each chunk's common prefix computed
    once when it is at least `MIN_SHARED_PREFIX` long, else `score_chunk(ids, mask)` (TRL's own scoring)."""
    batch_size = batch_size or input_ids.size(0)
    all_logps, all_entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
        prefix_length = shared_prefix_length(ids, mask, logits_to_keep)
        with autocast():
            if prefix_length < MIN_SHARED_PREFIX:
                logps, entropies = score_chunk(ids, mask)
            else:
                logps, entropies = shared_prefix_logps(
                    model, ids, mask, logits_to_keep, prefix_length, compute_entropy=compute_entropy
                )
        all_logps.append(logps)
        all_entropies.append(entropies)
    entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
    return torch.cat(all_logps, dim=0), entropies


class RowScoring:
    """The trainer's scoring of rows, no trainer: TRL's `_get_per_token_logps_and_entropies` with the shared prefix
    computed once ([`logps_and_entropies`]), and the old or reference logps of the rows appended to TRL's batch
    ([`appended_row_logps`]).

    Args:
        args: the trainer's config, read at each call (`shared_prefix_scoring`, `per_device_train_batch_size`).
        trl_scoring: TRL's own `_get_per_token_logps_and_entropies`, bound: used when the shared prefix does not apply,
            and for the chunks whose rows share too short a prefix.
        unwrap: accelerate's `unwrap_model` (the plain model, to check its gradient checkpointing and its adapters).
        autocast: accelerate's `autocast` context, around each chunk's forward.
        distributed: the model is wrapped for several processes (DDP, DeepSpeed or FSDP): TRL's scoring runs.
        tree_mode, tree_logps: prefix-tree training (`prefix_tree.prefix_tree_mode`, `chunked_prefix_tree_logps`,
            under `args.prefix_tree_training`): every prefix the rows share computed once; `None`: not offered.
    """

    def __init__(
        self,
        args,
        trl_scoring: Callable,
        *,
        unwrap: Callable = lambda model: model,
        autocast: Callable = contextlib.nullcontext,
        distributed: bool = False,
        tree_mode: Callable | None = None,
        tree_logps: Callable | None = None,
    ):
        self.args, self.trl_scoring = args, trl_scoring
        self.unwrap, self.autocast, self.distributed = unwrap, autocast, distributed
        self.tree_mode, self.tree_logps = tree_mode, tree_logps
        self.tree_stats: dict[str, int] = {}  # prefix-tree scoring's `forward_tokens` / `flat_tokens`, summed

    def applies(self, model, compute_aux_loss: bool, model_inputs: dict) -> bool:
        """Whether rows may be scored with their shared prefix computed once ([`shared_prefix_applies`])."""
        return shared_prefix_applies(
            self.unwrap(model),
            enabled=self.args.shared_prefix_scoring,
            compute_aux_loss=compute_aux_loss,
            model_inputs=model_inputs,
            distributed=self.distributed,
        )

    def logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **model_inputs,
    ):
        """TRL's `(logps, entropies, aux_loss)`, with the prompt prefix the rows share (system prompt, tool schemas, the
        task) computed once per chunk instead of once per row (`args.shared_prefix_scoring`), or every prefix the rows
        share computed once (`args.prefix_tree_training`, `trl_agentic/prefix_tree.py`)."""
        tree = None
        if self.tree_mode is not None:
            tree = self.tree_mode(
                self.unwrap(model),
                enabled=getattr(self.args, "prefix_tree_training", False),
                compute_aux_loss=compute_aux_loss,
                model_inputs=model_inputs,
                distributed=self.distributed,
            )
        if not tree and not self.applies(model, compute_aux_loss, model_inputs):
            return self.trl_scoring(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **model_inputs,
            )

        def score_chunk(ids, mask):  # TRL's own, for a chunk whose rows share too short a prefix
            logps, entropies, _ = self.trl_scoring(model, ids, mask, logits_to_keep, compute_entropy=compute_entropy)
            return logps, entropies

        chunked = (
            functools.partial(self.tree_logps, mode=tree, stats=self.tree_stats)
            if tree
            else chunked_shared_prefix_logps
        )
        logps, entropies = chunked(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, score_chunk, self.autocast
        )
        return logps, entropies, None

    def appended_row_logps(
        self, key: str, input_ids, attention_mask, logits_to_keep, *, model, ref_model, score: Callable
    ) -> torch.Tensor:
        """Appended rows' `old_per_token_logps` (the policy's) or `ref_per_token_logps` (the reference's: `ref_model`,
        else the policy with its `"ref"` adapter, or with its adapters disabled), as TRL computes them for its rows.
        `score` is the trainer's `_get_per_token_logps_and_entropies`."""
        batch_size = self.args.per_device_train_batch_size
        if key != "ref_per_token_logps":
            return score(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size)[0]
        if ref_model is not None:
            return score(ref_model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size)[0]
        from trl.trainer.utils import use_adapter  # (not trl.models.utils: the import failed there on TRL 1.16)

        unwrapped = self.unwrap(model)
        with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
            return score(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size)[0]
