"""Per-row advantage scales and micro-batch factors (the pure half of the row weighting; the trainer-level proof of
the per-token weights is in tests/test_learning_parity.py)."""

import pytest

from trl_agentic.rollout.loss_weights import micro_batch_scale, row_advantage_scales


def test_row_advantage_scales_by_loss_type():
    assert row_advantage_scales([30, 10], "dapo") == [1.0, 1.0]  # token-level: every row carries the advantage
    assert row_advantage_scales([30, 10], "dr_grpo") == [1.0, 1.0]
    assert row_advantage_scales([30, 10], "grpo") == [0.75, 0.25]  # row mean: a row's share of the tokens
    assert row_advantage_scales([30, 10], "grpo", row_weighting="episode") == [0.5, 0.5]
    assert row_advantage_scales([30, 10], "grpo", row_weighting="row") == [1.0, 1.0]
    assert row_advantage_scales([7], "grpo") == [1.0]  # one row: TRL's batch as is
    assert row_advantage_scales([0, 0], "sapo") == [0.5, 0.5]  # nothing sampled: an even split
    with pytest.raises(ValueError, match="row_weighting must be"):
        row_advantage_scales([1, 2], "grpo", row_weighting="token")


def test_micro_batch_scale():
    assert micro_batch_scale(10, 8, "grpo") == 1.25
    assert micro_batch_scale(10, 8, "dr_grpo") == 1.25
    assert micro_batch_scale(10, 8, "dapo") == 1.0
    assert micro_batch_scale(10, 8, "grpo", row_weighting="episode") == 1.0
    assert micro_batch_scale(8, 8, "grpo") == 1.0
