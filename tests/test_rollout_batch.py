"""`rollout/batch.py` without a trainer: rows appended to a TRL-shaped batch, advantages spread, rows padded."""

import torch

from trl_agentic.rollout.batch import append_rows, pad_extra_rows, row_scales, split_rows, spread_advantages
from trl_agentic.rollout.rows import Row, RowsResult


PAD = 0


def trl_batch() -> dict:
    """Two main rows as TRL pads them: prompts left, completions right."""
    return {
        "prompt_ids": torch.tensor([[0, 1, 2], [1, 2, 3]]),
        "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
        "completion_ids": torch.tensor([[10, 11], [12, 0]]),
        "completion_mask": torch.tensor([[1, 1], [1, 0]]),
        "advantages": torch.tensor([1.0, -1.0]),
    }


def test_appended_rows_are_padded_as_trl_pads_and_counted_in_the_loss():
    rows = [Row([1, 2, 3, 4], [20, 21, 22], [1, 0, 1], [-0.5, 0.0, -0.25], [1], "fork")]
    merged = append_rows(trl_batch(), rows, torch.tensor([0.5]), pad_id=PAD, device="cpu")
    assert merged["prompt_ids"].tolist() == [[0, 0, 1, 2], [0, 1, 2, 3], [1, 2, 3, 4]]  # widened on the left
    assert merged["prompt_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]]
    assert merged["completion_ids"].tolist() == [[10, 11, 0], [12, 0, 0], [20, 21, 22]]  # and on the right
    assert merged["completion_mask"].tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
    assert merged["tool_mask"].tolist() == [[1, 1, 1], [1, 1, 1], [1, 0, 1]]  # TRL's rows: ones
    assert merged["advantages"].tolist() == [1.0, -1.0, 0.5]
    assert merged["num_items_in_batch"].item() == 2 + 1 + 2


def test_rows_cut_at_max_tokens_are_masked_with_end_ids():
    rows = [Row([1], [20, 99], [1, 1], [0.0, 0.0], [1], "fork"), Row([1], [20, 21], [1, 1], [0.0, 0.0], [2], "fork")]
    merged = append_rows(trl_batch(), rows, torch.zeros(2), pad_id=PAD, device="cpu", end_ids={99, PAD})
    assert merged["completion_mask"][-2:].tolist() == [[1, 1], [0, 0]]


def test_advantages_spread_over_an_episodes_rows_and_extra_rows_padded():
    results = [
        RowsResult([Row([1], [10, 11], [1, 1]), Row([1], [12, 13], [1, 1], kind="fork")], [], []),
        RowsResult([Row([1], [14], [1])], [], []),
    ]
    scales = row_scales(results, "grpo", "auto")  # grpo averages a row's tokens: each row its share of the tokens
    assert scales == [[0.5, 0.5], [1.0]]
    main, extra_rows, extra_advantages = spread_advantages(torch.tensor([2.0, -1.0]), results, scales, None, 2)
    assert main.tolist() == [1.0, -1.0] and [r.completion_ids for r in extra_rows] == [[12, 13]]
    assert [a.item() for a in extra_advantages] == [1.0]
    rows, extra = pad_extra_rows(extra_rows, extra_advantages, 3, PAD, False, "cpu")
    assert [r.kind for r in rows] == ["fork", "padding", "padding"] and extra.tolist() == [1.0, 0.0, 0.0]
    per_token = [[[1.0, 2.0], [3.0, 4.0]], [[5.0]]]  # per-turn rewards: one advantage per token
    main, _, extra_advantages = spread_advantages(torch.tensor([2.0, -1.0]), results, scales, per_token, 3)
    assert main.tolist() == [[1.0, 2.0, 0.0], [5.0, 0.0, 0.0]] and extra_advantages == [[3.0, 4.0]]
    assert pad_extra_rows([], [], 1, PAD, True, "cpu")[1].tolist() == [[0.0]]


def test_split_rows_keeps_every_row():
    chunks = split_rows({"prompt_ids": list(range(5)), "num_items_in_batch": 7}, 2)
    assert [c["prompt_ids"] for c in chunks] == [[0, 1], [2, 3, 4]] and chunks[0]["num_items_in_batch"] == 7
