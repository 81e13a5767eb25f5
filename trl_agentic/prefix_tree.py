"""Prefix-tree training: the rows of a chunk packed into one sequence, every token they share computed once.

TRL's `_get_per_token_logps_and_entropies` runs every row whole, in the forward and again in the backward. Rows often
share far more than a prompt: a group's rows share the system prompt and the task, a fork's rows share the turns
before the fork, and a tree's branches share turns 0..k. [`packed_prefix_tree`] merges the rows of a chunk into a
trie of tokens (one node per distinct prefix) and lays its nodes out as one sequence; [`prefix_tree_logps`] runs it
through the model once with a tree attention mask (each token attends to its own ancestors and itself: a 4D additive
mask, which transformers passes to the eager and sdpa attention as is) and each token's position its depth in its row.
Every node's hidden state is then exactly the hidden state of that token in every row that contains it (rotary
embeddings see the same distances; float rounding aside), and the backward sums the gradients of every row through
the one computation, as the flat forward's backward sums them over the rows' copies.

Scoring uses TRL's fused LM head (`model(..., shift_labels=..., fused_lm_head=True)`: temperature, soft-capping,
entropies as TRL computes them). The hidden state of node `p` scores `p`'s child in a row; where rows branch after
`p` (several scored children), each further child is scored from a copy of `p` (same token, same position, same
ancestors, no descendants): one token more per extra branch, the same value and gradient as `p`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch


# Attention implementations that take a custom 4D additive mask as is (flash attention takes none).
TREE_MASK_ATTENTION = ("eager", "sdpa")
# A chunk is packed only when the packed sequence is at most this share of its real tokens: below the saving, the
# quadratic attention of one long sequence does not pay (measured in benchmarks/prefix_tree_training.py).
MAX_PACKED_SHARE = 0.9


@dataclass
class PackedTree:
    """The rows of a chunk as one packed sequence.

    Attributes:
        input_ids (`torch.Tensor`): `(1, S)` the packed tokens: one per trie node, then one copy of each branch point
            per extra scored branch.
        position_ids (`torch.Tensor`): `(1, S)` each token's index in the rows that contain it.
        allowed (`torch.Tensor`): `(S, S)` bool, `allowed[i, j]`: token `i` attends to token `j` (its ancestors and
            itself).
        shift_labels (`torch.Tensor`): `(1, S)` the token each position's hidden state scores, -100 where none.
        index (`torch.Tensor`): `(B, logits_to_keep)` the position whose score is TRL's column `c` of row `b`.
        scored (`torch.Tensor`): `(B, logits_to_keep)` bool, where TRL scores a token (else its 0 padding).
        real_tokens (`int`): the rows' real tokens (what TRL's flat forward runs, padding aside).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    allowed: torch.Tensor
    shift_labels: torch.Tensor
    index: torch.Tensor
    scored: torch.Tensor
    real_tokens: int

    @property
    def length(self) -> int:
        return self.input_ids.size(1)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """`(1, 1, S, S)`: 0 where attended, the dtype's minimum elsewhere (transformers' eager and sdpa masks)."""
        mask = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
        return mask.masked_fill_(~self.allowed, torch.finfo(dtype).min)[None, None]


def packed_prefix_tree(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> PackedTree | None:
    """Pack TRL's rows `[left padding | prompt | completion | right padding]` (the completion in the last
    `logits_to_keep` columns) into one sequence, a node per distinct prefix; `None` when the rows are not in that
    layout (a prompt that is not right-aligned, a hole in a completion's mask, a row with a completion but no prompt).

    The rows are taken in sorted order, so each row shares with the one before it exactly its longest common prefix
    with any earlier row, and the nodes, numbered as created, are in depth-first order: a node's subtree is the
    contiguous range from it to `ends[node]`, and token `i` attends to token `j` exactly when `j <= i < ends[j]`.
    """
    rows, width = input_ids.shape
    device = input_ids.device
    prompt_width = width - logits_to_keep
    prompt_lengths = attention_mask[:, :prompt_width].sum(dim=1)
    completion_lengths = attention_mask[:, prompt_width:].sum(dim=1)
    columns = torch.arange(width, device=device)
    starts = prompt_width - prompt_lengths
    expected = (columns >= starts[:, None]) & (columns < (prompt_width + completion_lengths)[:, None])
    if not torch.equal(expected, attention_mask.bool()):
        return None  # holes: a prompt not right-aligned, or a completion's mask not a run from its first column
    if bool(((prompt_lengths == 0) & (completion_lengths > 0)).any()):
        return None  # TRL scores its first completion token from a padding column's hidden state
    ids = input_ids.tolist()
    prompt_lengths, completion_lengths = prompt_lengths.tolist(), completion_lengths.tolist()
    sequences = [ids[b][prompt_width - prompt_lengths[b] : prompt_width + completion_lengths[b]] for b in range(rows)]

    tokens: list[int] = []
    depths: list[int] = []
    parents: list[int] = []  # -1: a root
    paths: list[list[int]] = [[] for _ in range(rows)]
    previous: list[int] = []
    previous_path: list[int] = []
    for b in sorted(range(rows), key=lambda b: sequences[b]):
        sequence = sequences[b]
        common = 0
        limit = min(len(sequence), len(previous))
        while common < limit and sequence[common] == previous[common]:
            common += 1
        path = previous_path[:common]
        parent = path[-1] if path else -1
        for depth in range(common, len(sequence)):
            path.append(len(tokens))
            tokens.append(sequence[depth])
            depths.append(depth)
            parents.append(parent)
            parent = path[-1]
        paths[b], previous, previous_path = path, sequence, path

    # Which position scores each scored node (a token of some row's completion): its parent's, or a copy's.
    num_nodes = len(tokens)
    scorer: dict[int, int] = {}  # scored node -> position in the packed sequence
    label_of: dict[int, int] = {}  # position -> the token it scores
    copies: list[int] = []  # the node each extra position copies
    for b in range(rows):
        path, start = paths[b], prompt_lengths[b]
        for node in path[start : start + completion_lengths[b]]:
            if node in scorer:
                continue
            position = parents[node]
            if position in label_of:
                position = num_nodes + len(copies)
                copies.append(parents[node])
            scorer[node] = position
            label_of[position] = tokens[node]

    length = num_nodes + len(copies)
    node_ids = torch.tensor(tokens + [tokens[p] for p in copies], dtype=input_ids.dtype)
    positions = torch.tensor(depths + [depths[p] for p in copies], dtype=torch.long)
    labels = torch.full((length,), -100, dtype=input_ids.dtype)
    if label_of:
        labels[torch.tensor(list(label_of))] = torch.tensor(list(label_of.values()), dtype=input_ids.dtype)

    # Tree mask from subtree ranges: node j's subtree is j .. ends[j] - 1 (depth-first numbering).
    ends = list(range(1, num_nodes + 1))
    for node in reversed(range(num_nodes)):
        if parents[node] >= 0 and ends[node] > ends[parents[node]]:
            ends[parents[node]] = ends[node]
    order = torch.arange(num_nodes)
    allowed = torch.zeros(length, length, dtype=torch.bool)
    allowed[:num_nodes, :num_nodes] = (order[None, :] <= order[:, None]) & (order[:, None] < torch.tensor(ends)[None])
    if copies:  # a copy attends to its node's ancestors and itself
        source = torch.tensor(copies)
        extra = torch.arange(num_nodes, length)
        allowed[extra] = allowed[source]
        allowed[extra, source] = False
        allowed[extra, extra] = True

    index = torch.zeros(rows, logits_to_keep, dtype=torch.long)
    scored = torch.zeros(rows, logits_to_keep, dtype=torch.bool)
    for b in range(rows):
        start, n = prompt_lengths[b], completion_lengths[b]
        if n:
            index[b, :n] = torch.tensor([scorer[node] for node in paths[b][start : start + n]])
            scored[b, :n] = True
    return PackedTree(
        input_ids=node_ids[None].to(device),
        position_ids=positions[None].to(device),
        allowed=allowed.to(device),
        shift_labels=labels[None].to(device),
        index=index.to(device),
        scored=scored.to(device),
        real_tokens=sum(map(len, sequences)),
    )


def prefix_tree_logps(
    model, tree: PackedTree, compute_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(logps, entropies)` of TRL's completion columns, `(B, logits_to_keep)` (0 in TRL's padding columns), from one
    forward of the packed tree. `model` is TRL's model with its fused LM head."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa":
        mask = tree.allowed[None, None]  # sdpa takes a boolean mask (True: attended) as is
    else:
        mask = tree.additive_mask(model.get_input_embeddings().weight.dtype)
    outputs = model(
        input_ids=tree.input_ids,
        attention_mask=mask,
        position_ids=tree.position_ids,
        shift_labels=tree.shift_labels,
        fused_lm_head=True,
    )
    logps = outputs.log_probs[0][tree.index].masked_fill(~tree.scored, 0.0)
    entropies = None
    if compute_entropy:
        entropies = outputs.entropy[0][tree.index].masked_fill(~tree.scored, 0.0)
    return logps, entropies


def prefix_tree_applies(unwrapped_model, *, enabled: bool, compute_aux_loss: bool, model_inputs: dict) -> bool:
    """Whether rows may be packed into a prefix tree: asked for (`enabled`), text-only (no `model_inputs`), not MoE
    (no aux loss), and an attention that takes a custom 4D mask (`TREE_MASK_ATTENTION`). One forward per chunk, as
    TRL's: gradient checkpointing and wrappers see what they see in TRL's scoring."""
    if not enabled or compute_aux_loss:
        return False
    if any(value is not None for value in model_inputs.values()):
        return False
    config = getattr(unwrapped_model, "config", None)
    return getattr(config, "_attn_implementation", None) in TREE_MASK_ATTENTION


def chunked_prefix_tree_logps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None,
    compute_entropy: bool,
    score_chunk: Callable,
    autocast: Callable = contextlib.nullcontext,
    stats: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TRL's per-token logps (and entropies) of rows in chunks of `batch_size`, each chunk packed into a prefix tree
    when that saves tokens (`MAX_PACKED_SHARE`), else `score_chunk(ids, mask)` (the scoring without a tree).
    `stats`, when given, counts `forward_tokens` (run through the model) and `flat_tokens` (TRL's, padding included)."""
    batch_size = batch_size or input_ids.size(0)
    all_logps, all_entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
        tree = packed_prefix_tree(ids, mask, logits_to_keep)
        packed = tree is not None and tree.length <= MAX_PACKED_SHARE * tree.real_tokens
        with autocast():
            if packed:
                logps, entropies = prefix_tree_logps(model, tree, compute_entropy=compute_entropy)
            else:
                logps, entropies = score_chunk(ids, mask)
        if stats is not None:
            stats["forward_tokens"] = stats.get("forward_tokens", 0) + (tree.length if packed else ids.numel())
            stats["flat_tokens"] = stats.get("flat_tokens", 0) + ids.numel()
        all_logps.append(logps)
        all_entropies.append(entropies)
    entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
    return torch.cat(all_logps, dim=0), entropies
