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
from transformers import DynamicCache


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


def _trie(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> tuple | None:
    """The rows' real tokens as a trie: `(tokens, depths, parents, paths, prompt_lengths, completion_lengths, ends)`,
    one entry per node (`parents`: -1 for a root), each row's path of nodes, and `ends[node]`: its subtree is the
    nodes `node .. ends[node] - 1`. `None` out of TRL's layout (see [`packed_prefix_tree`]).

    The rows are taken in sorted order, so each row shares with the one before it exactly its longest common prefix
    with any earlier row, and the nodes, numbered as created, are in depth-first order.
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
    parents: list[int] = []
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
    ends = list(range(1, len(tokens) + 1))
    for node in reversed(range(len(tokens))):
        if parents[node] >= 0 and ends[node] > ends[parents[node]]:
            ends[parents[node]] = ends[node]
    return tokens, depths, parents, paths, prompt_lengths, completion_lengths, ends


def _columns(paths, prompt_lengths, completion_lengths, scorer: dict, logits_to_keep: int) -> tuple:
    """`(index, scored)`, `(B, logits_to_keep)`: the position scoring TRL's column `c` of row `b`, and where TRL
    scores a token at all (else its 0 padding)."""
    rows = len(paths)
    index = torch.zeros(rows, logits_to_keep, dtype=torch.long)
    scored = torch.zeros(rows, logits_to_keep, dtype=torch.bool)
    for b in range(rows):
        start, n = prompt_lengths[b], completion_lengths[b]
        if n:
            index[b, :n] = torch.tensor([scorer[node] for node in paths[b][start : start + n]])
            scored[b, :n] = True
    return index, scored


def packed_prefix_tree(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> PackedTree | None:
    """Pack TRL's rows `[left padding | prompt | completion | right padding]` (the completion in the last
    `logits_to_keep` columns) into one sequence, a node per distinct prefix in depth-first order, then the copies of
    branch points; token `i` attends to node `j` exactly when `j <= i < ends[j]` (`j`'s subtree). `None` when the rows
    are not in that layout (a prompt that is not right-aligned, a hole in a completion's mask, a row with a
    completion but no prompt)."""
    trie = _trie(input_ids, attention_mask, logits_to_keep)
    if trie is None:
        return None
    tokens, depths, parents, paths, prompt_lengths, completion_lengths, ends = trie
    nodes = list(range(len(tokens)))
    scored_nodes = set()
    for b, path in enumerate(paths):
        scored_nodes.update(path[prompt_lengths[b] : prompt_lengths[b] + completion_lengths[b]])
    in_row_order = [node for path in paths for node in path]
    scorer, labels, copies = _scorers(in_row_order, scored_nodes, parents, tokens, nodes, len(nodes))
    ids, positions, allowed, shift_labels = _tree_tensors(tokens, depths, nodes, copies, labels, ends, input_ids.dtype)
    index, scored = _columns(paths, prompt_lengths, completion_lengths, scorer, logits_to_keep)
    device = input_ids.device
    return PackedTree(
        input_ids=ids.to(device),
        position_ids=positions.to(device),
        allowed=allowed.to(device),
        shift_labels=shift_labels.to(device),
        index=index.to(device),
        scored=scored.to(device),
        real_tokens=sum(map(len, paths)),
    )


@dataclass
class SplitTree:
    """A packed tree split in two passes: the trunk (the nodes two rows or more share, packed as a `PackedTree`), run
    once with its key/value states kept, then each row's own tail (the nodes only that row has) as one row of a
    batch that attends to the trunk's states (expanded over the rows, not copied) and to itself. The dense attention
    of one long packed sequence becomes the trunk's plus each tail's over its own ancestors.

    Attributes:
        trunk (`PackedTree`): the trunk; its `index`/`scored` are unused.
        tail_ids, tail_positions, tail_labels (`torch.Tensor`): `(R, T)` the tails, right-padded, each starting with
            a copy of its branch point in the trunk (it scores the tail's first token), -100 labels where none.
        tail_allowed (`torch.Tensor`): `(R, 1, T, trunk length + T)` bool: trunk ancestors and the tail's own
            earlier tokens (a padding query attends to itself only).
        index, scored (`torch.Tensor`): `(B, logits_to_keep)` into `[trunk scores | tail scores flattened]`.
        length (`int`): tokens run through the model (both passes, the tails' padding included).
    """

    trunk: PackedTree
    tail_ids: torch.Tensor
    tail_positions: torch.Tensor
    tail_labels: torch.Tensor
    tail_allowed: torch.Tensor
    index: torch.Tensor
    scored: torch.Tensor
    length: int
    real_tokens: int


def _tree_tensors(tokens, depths, nodes, copies, labels, ends, dtype) -> tuple:
    """`(input_ids, position_ids, allowed, shift_labels)` of a packed sequence of `nodes` (depth-first, closed under
    ancestors) and then `copies` (of nodes), `labels` by position."""
    length = len(nodes) + len(copies)
    ids = torch.tensor([tokens[n] for n in nodes] + [tokens[n] for n in copies], dtype=dtype)
    positions = torch.tensor([depths[n] for n in nodes] + [depths[n] for n in copies], dtype=torch.long)
    shift_labels = torch.full((length,), -100, dtype=dtype)
    if labels:
        shift_labels[torch.tensor(list(labels))] = torch.tensor(list(labels.values()), dtype=dtype)
    order = torch.tensor(nodes, dtype=torch.long)
    node_ends = torch.tensor([ends[n] for n in nodes], dtype=torch.long)
    allowed = torch.zeros(length, length, dtype=torch.bool)
    allowed[: len(nodes), : len(nodes)] = (order[None, :] <= order[:, None]) & (order[:, None] < node_ends[None])
    if copies:  # a copy attends to its node's ancestors and itself
        where = {n: i for i, n in enumerate(nodes)}
        source = torch.tensor([where[n] for n in copies])
        extra = torch.arange(len(nodes), length)
        allowed[extra] = allowed[source]
        allowed[extra, source] = False
        allowed[extra, extra] = True
    return ids[None], positions[None], allowed, shift_labels[None]


def _scorers(nodes_in_order, scored_nodes, parents, tokens, position_of, first_copy) -> tuple[dict, dict, list]:
    """Which position scores each scored node: its parent's (`position_of`), or, where the parent already scores
    another child, a new copy of the parent (numbered from `first_copy`). `(scorer, labels, copies)`."""
    scorer: dict[int, int] = {}
    labels: dict[int, int] = {}
    copies: list[int] = []
    for node in nodes_in_order:
        if node not in scored_nodes or node in scorer:
            continue
        position = position_of[parents[node]]
        if position in labels:
            position = first_copy + len(copies)
            copies.append(parents[node])
        scorer[node] = position
        labels[position] = tokens[node]
    return scorer, labels, copies


def split_prefix_tree(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> SplitTree | None:
    """The rows as a trunk and tails (`SplitTree`); `None` out of TRL's layout or when the rows share nothing."""
    trie = _trie(input_ids, attention_mask, logits_to_keep)
    if trie is None:
        return None
    tokens, depths, parents, paths, prompt_lengths, completion_lengths, ends = trie
    rows = input_ids.size(0)
    counts = [0] * len(tokens)
    for path in paths:
        for node in path:
            counts[node] += 1
    trunk_nodes = [n for n in range(len(tokens)) if counts[n] >= 2]
    if not trunk_nodes:
        return None
    scored_nodes = set()
    for b in range(rows):
        scored_nodes.update(paths[b][prompt_lengths[b] : prompt_lengths[b] + completion_lengths[b]])

    # Trunk: its scored nodes whose parent is in the trunk.
    trunk_position = {n: i for i, n in enumerate(trunk_nodes)}
    trunk_scored = {n for n in trunk_nodes if n in scored_nodes and parents[n] >= 0}
    trunk_scorer, trunk_labels, trunk_copies = _scorers(
        trunk_nodes, trunk_scored, parents, tokens, trunk_position, len(trunk_nodes)
    )
    ids, positions, allowed, labels = _tree_tensors(
        tokens, depths, trunk_nodes, trunk_copies, trunk_labels, ends, input_ids.dtype
    )
    trunk_length = ids.size(1)

    # Tails: [copy of the branch point] + the row's own nodes.
    tails = []  # (row, branch point or -1, own nodes)
    for b in range(rows):
        path = paths[b]
        k = next((t for t, n in enumerate(path) if counts[n] == 1), len(path))
        if k < len(path):
            tails.append((b, path[k - 1] if k else -1, path[k:]))
    width = max((len(own) + (branch >= 0) for _, branch, own in tails), default=1)
    tail_ids = torch.zeros(len(tails), width, dtype=input_ids.dtype)
    tail_positions = torch.zeros(len(tails), width, dtype=torch.long)
    tail_labels = torch.full((len(tails), width), -100, dtype=input_ids.dtype)
    tail_allowed = torch.zeros(len(tails), 1, width, trunk_length + width, dtype=torch.bool)
    own_causal = torch.ones(width, width, dtype=torch.bool).tril()
    tail_scorer: dict[int, int] = {}
    for r, (b, branch, own) in enumerate(tails):
        start = int(branch >= 0)
        sequence = ([branch] if start else []) + own
        tail_ids[r, : len(sequence)] = torch.tensor([tokens[n] for n in sequence])
        tail_positions[r, : len(sequence)] = torch.tensor([depths[n] for n in sequence])
        tail_positions[r, len(sequence) :] = depths[sequence[-1]] + 1
        for j, node in enumerate(own):
            if node in scored_nodes and (j or start):
                position = j - 1 + start  # the previous query: the tail's previous node, or the branch point's copy
                tail_labels[r, position] = tokens[node]
                tail_scorer[node] = trunk_length + r * width + position
        block = tail_allowed[r, 0]
        block[:, trunk_length:] = own_causal
        if start:
            context = allowed[trunk_position[branch]]  # the branch point's ancestors and itself
            block[:, :trunk_length] = context
            block[0, trunk_position[branch]] = False  # its copy: the ancestors, and itself
            block[1:, trunk_length] = False  # the own nodes see the original branch point, not the copy
        block[len(sequence) :, :] = False
        block[torch.arange(len(sequence), width), trunk_length + torch.arange(len(sequence), width)] = True

    index, scored = _columns(paths, prompt_lengths, completion_lengths, {**tail_scorer, **trunk_scorer}, logits_to_keep)
    device = input_ids.device
    trunk = PackedTree(
        input_ids=ids.to(device),
        position_ids=positions.to(device),
        allowed=allowed.to(device),
        shift_labels=labels.to(device),
        index=index[:0],
        scored=scored[:0],
        real_tokens=0,
    )
    return SplitTree(
        trunk=trunk,
        tail_ids=tail_ids.to(device),
        tail_positions=tail_positions.to(device),
        tail_labels=tail_labels.to(device),
        tail_allowed=tail_allowed.to(device),
        index=index.to(device),
        scored=scored.to(device),
        length=trunk_length + tail_ids.numel(),  # the tails' padding runs too
        real_tokens=sum(map(len, paths)),
    )


def _attention_mask(model, allowed: torch.Tensor) -> torch.Tensor:
    """A 4D mask as the model's attention takes it: boolean for sdpa, additive (0 / dtype minimum) for eager."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa":
        return allowed
    dtype = model.get_input_embeddings().weight.dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def split_tree_logps(model, tree: SplitTree, compute_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(logps, entropies)` as [`prefix_tree_logps`], from the trunk's forward (its key/value states kept, and
    differentiable) and the tails' forward on them."""
    trunk = tree.trunk
    cache = DynamicCache()
    first = model(
        input_ids=trunk.input_ids,
        attention_mask=_attention_mask(model, trunk.allowed[None, None]),
        position_ids=trunk.position_ids,
        shift_labels=trunk.shift_labels,
        cache=cache,
        fused_lm_head=True,
    )
    log_probs, entropy = [first.log_probs.flatten()], [first.entropy.flatten() if compute_entropy else None]
    if tree.tail_ids.size(0):
        rows = tree.tail_ids.size(0)
        states = [
            (layer.keys.expand(rows, -1, -1, -1), layer.values.expand(rows, -1, -1, -1)) for layer in cache.layers
        ]
        second = model(
            input_ids=tree.tail_ids,
            attention_mask=_attention_mask(model, tree.tail_allowed),
            position_ids=tree.tail_positions,
            shift_labels=tree.tail_labels,
            cache=DynamicCache(ddp_cache_data=states),
            fused_lm_head=True,
        )
        log_probs.append(second.log_probs.flatten())
        entropy.append(second.entropy.flatten() if compute_entropy else None)
    logps = torch.cat(log_probs)[tree.index].masked_fill(~tree.scored, 0.0)
    entropies = None
    if compute_entropy:
        entropies = torch.cat(entropy)[tree.index].masked_fill(~tree.scored, 0.0)
    return logps, entropies


def prefix_tree_logps(
    model, tree: PackedTree, compute_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(logps, entropies)` of TRL's completion columns, `(B, logits_to_keep)` (0 in TRL's padding columns), from one
    forward of the packed tree. `model` is TRL's model with its fused LM head."""
    outputs = model(
        input_ids=tree.input_ids,
        attention_mask=_attention_mask(model, tree.allowed[None, None]),
        position_ids=tree.position_ids,
        shift_labels=tree.shift_labels,
        fused_lm_head=True,
    )
    logps = outputs.log_probs[0][tree.index].masked_fill(~tree.scored, 0.0)
    entropies = None
    if compute_entropy:
        entropies = outputs.entropy[0][tree.index].masked_fill(~tree.scored, 0.0)
    return logps, entropies


def prefix_tree_mode(
    unwrapped_model, *, enabled: bool, compute_aux_loss: bool, model_inputs: dict, distributed: bool
) -> str | None:
    """How rows may be scored as a prefix tree: `None` (not asked for with `enabled`, not text-only, MoE with an aux
    loss, or an attention that takes no custom 4D mask, see `TREE_MASK_ATTENTION`); `"split"` (trunk, then tails on
    its key/value states: two forwards) on a plain model on one process without gradient checkpointing; else
    `"packed"` (one forward per chunk, as TRL's: wrappers and checkpointed layers see what they see in TRL's)."""
    if not enabled or compute_aux_loss:
        return None
    if any(value is not None for value in model_inputs.values()):
        return None
    config = getattr(unwrapped_model, "config", None)
    if getattr(config, "_attn_implementation", None) not in TREE_MASK_ATTENTION:
        return None
    checkpointing = getattr(unwrapped_model, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(unwrapped_model, "is_gradient_checkpointing", False)
    return "packed" if distributed or checkpointing else "split"


def chunked_prefix_tree_logps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None,
    compute_entropy: bool,
    score_chunk: Callable,
    autocast: Callable = contextlib.nullcontext,
    mode: str = "split",
    stats: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TRL's per-token logps (and entropies) of rows in chunks of `batch_size`, each chunk scored as a prefix tree
    (`mode`, see [`prefix_tree_mode`]) when that saves tokens (`MAX_PACKED_SHARE`), else `score_chunk(ids, mask)` (the
    scoring without a tree). `stats`, when given, counts `forward_tokens` (run through the model) and `flat_tokens`
    (TRL's, padding included)."""
    build, score = (split_prefix_tree, split_tree_logps) if mode == "split" else (packed_prefix_tree, prefix_tree_logps)
    batch_size = batch_size or input_ids.size(0)
    all_logps, all_entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
        tree = build(ids, mask, logits_to_keep)
        packed = tree is not None and tree.length <= MAX_PACKED_SHARE * tree.real_tokens
        with autocast():
            if packed:
                logps, entropies = score(model, tree, compute_entropy=compute_entropy)
            else:
                logps, entropies = score_chunk(ids, mask)
        if stats is not None:
            stats["forward_tokens"] = stats.get("forward_tokens", 0) + (tree.length if packed else ids.numel())
            stats["flat_tokens"] = stats.get("flat_tokens", 0) + ids.numel()
        all_logps.append(logps)
        all_entropies.append(entropies)
    entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
    return torch.cat(all_logps, dim=0), entropies
