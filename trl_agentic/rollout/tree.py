"""Tree advantages: a group of tree rollouts (episodes that branch from turns of other episodes) as a tree of
segments, each segment's advantage from the leaf rewards under it, laid out per token as TRL's loss takes them.

A *segment* is the run of tokens between two branch points: the trunk from the start of an episode to its first
branch point, then each branch up to the next one, down to the leaves (the episodes' ends, one reward each). The
rows are the leaves' episodes, each holding its whole path (the shared segments are in every row under them).

For a segment `s` with scorable leaves `L(s)` under it, `V(s)` is their mean reward, `V(group)` the mean of every
scorable leaf of the group (GRPO's baseline) and `σ` their standard deviation (unbiased, as TRL's). Then

    A(s) = ((V(s) - V(group)) + local_weight * (V(s) - V(parent(s)))) / (σ + 1e-4)

the group-relative term plus, below the roots, the local term that tells sibling branches apart: what choosing this
branch at its branch point changed (TreeRL's global + local advantage; Tree-GRPO's intra-tree and inter-tree
terms). A root has no local term, so a group without branches gets GRPO's advantages exactly (`scale=False`: no
division by `σ + 1e-4`). A segment with no scorable leaf under it (crashed or timed-out episodes only) gets no
advantage: it is left out of the loss, never zeroed in it.

A segment shared by several leaves counts once in the loss: its tokens carry `A(s)` in one row only (its *owner*, the
first row under it), and 0 in the others, which `owned` marks so that the trainer can also leave those copies out of
the loss's token count (TRL's `completion_mask`). Counting it once per leaf would weigh a trunk by its leaf count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TreeAdvantages:
    """Advantages of a tree of segments.

    Attributes:
        segments (`list[float | None]`): `A(s)` per segment (`None`: no scorable leaf under it).
        leaves (`list[int]`): the leaf segment of each row, in row order (leaves in segment order).
        rows (`list[list[float]]`): per row, one advantage per completion token of its path (root first): `A(s)` on
            the tokens of the segments the row owns, 0 elsewhere. TRL's per-token (B, T) advantages, unpadded.
        owned (`list[list[bool]]`): per row, per token, whether the row carries the token in the loss.
    """

    segments: list[float | None]
    leaves: list[int]
    rows: list[list[float]]
    owned: list[list[bool]]


def tree_advantages(
    parents: Sequence[int | None],
    lengths: Sequence[int],
    rewards: Mapping[int, float | None],
    *,
    local_weight: float = 1.0,
    scale: bool = True,
) -> TreeAdvantages:
    """Per-segment and per-token advantages of a group's tree of segments (see the module's docstring for `A(s)`).

    Args:
        parents (`Sequence[int | None]`):
            Each segment's parent segment, `None` for a root (the group's root episodes); a parent comes before its
            children.
        lengths (`Sequence[int]`):
            Each segment's number of completion tokens in a row (the prompt is no segment's).
        rewards (`Mapping[int, float | None]`):
            The reward of each leaf segment (a segment without children), `None` for an unscorable episode.
        local_weight (`float`, *optional*, defaults to `1.0`):
            Weight of the local term `V(s) - V(parent(s))`; 0 gives every segment its group-relative term only.
        scale (`bool`, *optional*, defaults to `True`):
            Divide by the standard deviation of the group's leaf rewards (+1e-4), as TRL's `scale_rewards="group"`.
    """
    count = len(parents)
    if len(lengths) != count:
        raise ValueError(f"parents has {count} segments but lengths has {len(lengths)}; give one length per segment.")
    children: list[list[int]] = [[] for _ in range(count)]
    for s, parent in enumerate(parents):
        if parent is not None:
            if not 0 <= parent < s:
                raise ValueError(f"segment {s}'s parent is {parent}: a parent must be an earlier segment.")
            children[parent].append(s)
    leaves = [s for s in range(count) if not children[s]]
    if set(rewards) != set(leaves):
        raise ValueError(
            f"rewards are given for segments {sorted(rewards)} but the leaves are {leaves}: give one reward (or None "
            "for an unscorable episode) per leaf, and none for inner segments."
        )

    # Sums and counts of scorable leaf rewards under each segment, children before parents.
    totals, scorable = [0.0] * count, [0] * count
    for s in reversed(range(count)):
        if not children[s] and rewards[s] is not None:
            totals[s], scorable[s] = float(rewards[s]), 1
        if parents[s] is not None:
            totals[parents[s]] += totals[s]
            scorable[parents[s]] += scorable[s]
    scored = [float(rewards[s]) for s in leaves if rewards[s] is not None]
    group_mean = sum(scored) / len(scored) if scored else 0.0
    std = math.sqrt(sum((r - group_mean) ** 2 for r in scored) / (len(scored) - 1)) if len(scored) > 1 else 0.0
    divisor = std + 1e-4 if scale else 1.0

    segments: list[float | None] = []
    for s in range(count):
        if not scorable[s]:
            segments.append(None)
            continue
        value = totals[s] / scorable[s]
        term = value - group_mean
        if parents[s] is not None:
            parent = parents[s]
            term += local_weight * (value - totals[parent] / scorable[parent])
        segments.append(term / divisor)

    owner: dict[int, int] = {}  # segment -> the row that carries it
    rows, owned = [], []
    for row, leaf in enumerate(leaves):
        path, s = [], leaf
        while s is not None:
            path.append(s)
            s = parents[s]
        advantages, mine = [], []
        for s in reversed(path):
            carries = owner.setdefault(s, row) == row and segments[s] is not None
            advantages += [segments[s] if carries else 0.0] * lengths[s]
            mine += [carries] * lengths[s]
        rows.append(advantages)
        owned.append(mine)
    return TreeAdvantages(segments=segments, leaves=leaves, rows=rows, owned=owned)


@dataclass(frozen=True)
class GroupTree:
    """A group of tree rollouts as a tree of segments over its episodes' main rows (`group_tree`).

    Attributes:
        parents (`list[int | None]`): each episode's parent in the tree (an index in the group), `None` for a root; a
            branch that shares no completion token with its parent (replay ended at call 0, or branched at 0) is a root.
        shared (`list[int]`): completion tokens each episode's main row shares with its parent's (0 for a root).
        segment_parents (`list[int | None]`), segment_lengths (`list[int]`): the segments, for `tree_advantages`.
        spans (`list[list[tuple[int, int, int]]]`): per episode, the segments of its path, root first, as
            `(segment, start, end)` in its row's completion tokens.
    """

    parents: list[int | None]
    shared: list[int]
    segment_parents: list[int | None]
    segment_lengths: list[int]
    spans: list[list[tuple[int, int, int]]]

    def advantages(
        self, rewards: Sequence[float | None], *, local_weight: float = 1.0, scale: bool = True
    ) -> TreeAdvantages:
        """`tree_advantages` with each episode's reward on its leaf (the last segment of its path): rows in episode
        order."""
        leaves = {spans[-1][0]: rewards[e] for e, spans in enumerate(self.spans)}
        result = tree_advantages(
            self.segment_parents, self.segment_lengths, leaves, local_weight=local_weight, scale=scale
        )
        if result.leaves != [spans[-1][0] for spans in self.spans]:  # segments are numbered episode by episode
            raise AssertionError("tree segments out of episode order")
        return result


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def group_tree(
    parents: Sequence[int | None],
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    replayed: Sequence[int | None],
) -> GroupTree:
    """The tree of one group's episodes (children after their parents) from their main rows.

    Args:
        parents: each episode's parent episode (an index in the group, earlier than it), `None` for a root.
        prompts, completions: each episode's main row (`Row.prompt_ids`, `Row.completion_ids`).
        replayed: for a branch, how many of its row's completion tokens were replayed from its parent: the offset in
            its row of the completion of its first call that was sampled, not replayed (the row's length when every
            call was replayed); `None` for a root.

    A branch shares with its parent the completion tokens of its replayed calls and the context up to its first
    sampled call, capped at the tokens the two rows have in common (a replay that diverged shares less): those are the
    parent's tokens (its segments; the branch's row holds copies). A branch whose shared part ends at or before its
    parent's own branch point is a child of the parent's parent (it shares nothing the parent sampled).
    """
    count = len(parents)
    shared, tree_parents = [0] * count, [None] * count
    for e, parent in enumerate(parents):
        if parent is None:
            continue
        if not 0 <= parent < e:
            raise ValueError(f"episode {e}'s parent is {parent}: a parent must be an earlier episode of the group.")
        length = 0
        if list(prompts[e]) == list(prompts[parent]):
            length = min(replayed[e] or 0, _common_prefix(completions[e], completions[parent]))
        while parent is not None and length <= shared[parent]:
            parent = tree_parents[parent]
        if parent is not None and length > 0:
            shared[e], tree_parents[e] = length, parent
    children: list[list[int]] = [[] for _ in range(count)]
    for e, parent in enumerate(tree_parents):
        if parent is not None:
            children[parent].append(e)

    segment_parents: list[int | None] = []
    segment_lengths: list[int] = []
    spans: list[list[tuple[int, int, int]]] = []
    ending_at: list[dict[int, int]] = []  # per episode: end offset -> its segment ending there
    for e in range(count):
        parent = tree_parents[e]
        path = [] if parent is None else [span for span in spans[parent] if span[2] <= shared[e]]
        above = None if parent is None else ending_at[parent][shared[e]]
        cuts = sorted({shared[c] for c in children[e]} | {shared[e]})
        own = {}
        bounds = cuts + [len(completions[e])]
        for start, end in zip(bounds[:-1], bounds[1:]):
            segment_parents.append(above)
            segment_lengths.append(end - start)
            above = len(segment_parents) - 1
            own.setdefault(end, above)  # a zero-length leaf after a cut at the row's end keeps its own
            path.append((above, start, end))
        spans.append(path)
        ending_at.append({**({} if parent is None else ending_at[parent]), **own})
    return GroupTree(tree_parents, shared, segment_parents, segment_lengths, spans)
