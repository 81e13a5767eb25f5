"""Tree advantages (`rollout/tree.py`): a three-level tree's segment advantages and the gradient they give, by hand.

The tree (segment: parent, completion tokens; leaves with their rewards), and a second root episode without branches:

    R (3) ─┬─ A (2) ─┬─ A1 (1)  reward 1
           │         └─ A2 (2)  reward 0
           └─ B (2) ─┬─ B1 (2)  reward 1
                     └─ B2 (1)  reward 1
    C (4)                       reward 0

Group: leaf rewards 1, 0, 1, 1, 0: mean 0.6, unbiased std sqrt(0.3). Values (mean leaf reward under a segment):
V(R) = 0.75, V(A) = 0.5, V(B) = 1, V(A1) = 1, V(A2) = 0, V(B1) = V(B2) = 1, V(C) = 0.
"""

import math

import pytest
import torch

from trl_agentic.rollout.tree import tree_advantages


PARENTS = [None, 0, 0, 1, 1, 2, 2, None]  # R A B A1 A2 B1 B2 C
LENGTHS = [3, 2, 2, 1, 2, 2, 1, 4]
REWARDS = {3: 1.0, 4: 0.0, 5: 1.0, 6: 1.0, 7: 0.0}
D = math.sqrt(0.3) + 1e-4


def test_three_level_tree_advantages_by_hand():
    result = tree_advantages(PARENTS, LENGTHS, REWARDS)
    # A(s) = ((V(s) - 0.6) + (V(s) - V(parent))) / D; roots have no local term.
    by_hand = [
        0.15 / D,  # R: 0.75 - 0.6
        ((0.5 - 0.6) + (0.5 - 0.75)) / D,  # A: -0.35
        ((1 - 0.6) + (1 - 0.75)) / D,  # B: 0.65
        ((1 - 0.6) + (1 - 0.5)) / D,  # A1: 0.9
        ((0 - 0.6) + (0 - 0.5)) / D,  # A2: -1.1
        ((1 - 0.6) + (1 - 1)) / D,  # B1: 0.4
        ((1 - 0.6) + (1 - 1)) / D,  # B2: 0.4
        -0.6 / D,  # C
    ]
    assert result.segments == pytest.approx(by_hand, abs=1e-12)
    assert result.leaves == [3, 4, 5, 6, 7]
    r, a, b, a1, a2, b1, b2, c = by_hand
    # Each shared segment is carried by the first row under it, 0 in the others.
    expected = [
        [r, r, r, a, a, a1],  # A1's row carries R and A
        [0, 0, 0, 0, 0, a2, a2],
        [0, 0, 0, b, b, b1, b1],  # B1's row carries B
        [0, 0, 0, 0, 0, b2],
        [c, c, c, c],
    ]
    assert len(result.rows) == len(expected)
    for row, expected_row in zip(result.rows, expected, strict=True):
        assert row == pytest.approx(expected_row, abs=1e-12)
    assert result.owned == [
        [True] * 6,
        [False] * 5 + [True] * 2,
        [False] * 3 + [True] * 4,
        [False] * 5 + [True],
        [True] * 4,
    ]
    assert sum(map(sum, result.owned)) == sum(LENGTHS)  # every token of the tree once


def test_a_group_without_branches_gets_grpos_advantages():
    rewards = [0.0, 1.0, 1.0, 0.5]
    result = tree_advantages([None] * 4, [2, 1, 3, 1], dict(enumerate(rewards)))
    values = torch.tensor(rewards, dtype=torch.float64)
    trl = (values - values.mean()) / (values.std() + 1e-4)  # TRL's scale_rewards="group"
    assert result.segments == pytest.approx(trl.tolist(), abs=1e-12)
    unscaled = tree_advantages([None] * 4, [2, 1, 3, 1], dict(enumerate(rewards)), scale=False)
    assert unscaled.segments == pytest.approx((values - values.mean()).tolist(), abs=1e-12)


def test_unscorable_leaves_are_left_out_never_zeroed():
    # A2 crashed: it counts in no value; B's leaves both crashed: B's segments get no advantage and leave the loss.
    rewards = {3: 1.0, 4: None, 5: None, 6: None, 7: 0.0}
    result = tree_advantages(PARENTS, LENGTHS, rewards)
    d = math.sqrt(0.5) + 1e-4  # scorable leaves 1 and 0: mean 0.5
    assert result.segments[2] is None and result.segments[4:7] == [None, None, None]
    assert result.segments[0] == pytest.approx(0.5 / d)  # V(R) = 1 (A1 only)
    assert result.segments[1] == pytest.approx(0.5 / d)  # V(A) = 1: 0.5 + 0
    assert result.owned[1] == [False] * 7  # A2's row carries nothing: R and A are A1's, A2 is unscorable
    assert result.owned[2] == [False] * 7 and result.rows[2] == [0.0] * 7


@pytest.mark.parametrize(
    "parents, lengths, rewards, message",
    [
        ([None, 2, None], [1, 1, 1], {1: 1.0, 2: 0.0}, "must be an earlier segment"),
        ([None, 0], [1], {1: 1.0}, "one length per segment"),
        ([None, 0], [1, 1], {0: 1.0, 1: 1.0}, "one reward"),
    ],
)
def test_malformed_trees_say_how_to_fix_them(parents, lengths, rewards, message):
    with pytest.raises(ValueError, match=message):
        tree_advantages(parents, lengths, rewards)


def test_the_gradient_of_a_three_level_tree_by_hand():
    """A toy policy, token t's log-prob `log softmax(W h_t)[y_t]`, and TRL's DAPO loss on the rows at ratio 1
    (`-sum(exp(logp - logp.detach()) * advantage * mask) / mask.sum()`, the mask being `owned`): its gradient is, by
    hand, `-1/N * sum over segments s of A(s) * sum over s's tokens t of (onehot(y_t) - softmax(W h_t)) h_t^T`, each
    segment once, with N the tree's tokens."""
    generator = torch.Generator().manual_seed(0)
    vocab, features = 5, 4
    weight = torch.randn(vocab, features, generator=generator, dtype=torch.float64)
    segment_features = [torch.randn(n, features, generator=generator, dtype=torch.float64) for n in LENGTHS]
    segment_targets = [torch.randint(0, vocab, (n,), generator=generator) for n in LENGTHS]
    result = tree_advantages(PARENTS, LENGTHS, REWARDS)

    # By hand: every segment once.
    by_hand = torch.zeros_like(weight)
    for s, (h, y) in enumerate(zip(segment_features, segment_targets, strict=True)):
        probs = torch.softmax(h @ weight.T, dim=-1)
        by_hand -= result.segments[s] * (torch.nn.functional.one_hot(y, vocab).double() - probs).T @ h
    by_hand /= sum(LENGTHS)

    # Through the rows: each leaf's row holds its whole path, padded to (B, T) as TRL's tensors.
    def path(leaf):
        segments = []
        while leaf is not None:
            segments.append(leaf)
            leaf = PARENTS[leaf]
        return segments[::-1]

    def row_gradient(advantages, mask):
        w = weight.clone().requires_grad_()
        width = max(len(a) for a in advantages)
        loss_terms, count = [], 0
        for leaf, row_advantages, row_mask in zip(result.leaves, advantages, mask, strict=True):
            h = torch.cat([segment_features[s] for s in path(leaf)])
            y = torch.cat([segment_targets[s] for s in path(leaf)])
            logps = torch.log_softmax(h @ w.T, dim=-1).gather(1, y[:, None]).squeeze(1)
            padded = torch.nn.functional.pad(logps, (0, width - len(logps)))
            a = torch.tensor(row_advantages + [0.0] * (width - len(row_advantages)), dtype=torch.float64)
            m = torch.tensor(row_mask + [False] * (width - len(row_mask)), dtype=torch.float64)
            loss_terms.append((-torch.exp(padded - padded.detach()) * a * m).sum())
            count += m.sum()
        (sum(loss_terms) / count).backward()
        return w.grad

    torch.testing.assert_close(row_gradient(result.rows, result.owned), by_hand, atol=1e-12, rtol=1e-10)
    # Counted once per leaf instead (every row carrying its whole path), the trunk would weigh its leaf count.
    per_leaf = [[result.segments[s] for s in path(leaf) for _ in range(LENGTHS[s])] for leaf in result.leaves]
    inflated = row_gradient(per_leaf, [[True] * len(a) for a in per_leaf])
    assert (inflated - by_hand).abs().max() > 1e-3
