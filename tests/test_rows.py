"""Turns → rows, checked on plain int lists."""

from trl_agentic.rollout.rows import episode_to_rows
from trl_agentic.trace import Turn


def turn(index, prompt, completion, parent=None, source=None, fork_reason=None):
    source = source or ("continued" if parent is not None else "rendered")
    logprobs = [-0.1 * (k + 1) for k in range(len(completion))]
    return Turn(
        index,
        list(prompt),
        list(completion),
        logprobs,
        "stop",
        prompt_source=source,
        parent_turn=parent,
        fork_reason=fork_reason,
    )


def test_continuation_merges_and_masks_tool_suffix():
    t0 = turn(0, [1, 2, 3], [10, 11])
    t1 = turn(1, [1, 2, 3, 10, 11, 4, 5], [12, 13], parent=0)  # 4, 5 = tool output + template glue
    t2 = turn(2, [1, 2, 3, 10, 11, 4, 5, 12, 13, 6], [14], parent=1)
    result = episode_to_rows([t0, t1, t2])
    assert len(result.rows) == 1
    row = result.rows[0]
    assert row.prompt_ids == [1, 2, 3]
    assert row.completion_ids == [10, 11, 4, 5, 12, 13, 6, 14]
    assert row.env_mask == [1, 1, 0, 0, 1, 1, 0, 1]
    assert row.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.1, -0.2, 0.0, -0.1]
    assert row.turns == [0, 1, 2] and row.kind == "main"


def test_fork_starts_new_row_and_every_sampled_token_is_in_one_row():
    t0 = turn(0, [1, 2, 3], [10, 11])
    t1 = turn(1, [1, 2, 3, 10, 11, 4], [12], parent=0)
    t2 = turn(2, [1, 2, 7, 4], [15, 16], source="rendered", fork_reason="history_rewritten")  # agent rewrote history
    t3 = turn(3, [1, 2, 7, 4, 15, 16, 8], [17], parent=2)
    result = episode_to_rows([t0, t1, t2, t3])
    assert [r.kind for r in result.rows] == ["main", "fork"]
    assert result.rows[1].prompt_ids == [1, 2, 7, 4]
    assert result.rows[1].completion_ids == [15, 16, 8, 17]
    assert result.rows[1].env_mask == [1, 1, 0, 1]
    sampled = sorted(t for r in result.rows for t, m in zip(r.completion_ids, r.env_mask) if m)
    assert sampled == sorted([10, 11, 12, 15, 16, 17])


def test_side_call_is_its_own_row_and_main_line_continues():
    t0 = turn(0, [1, 2], [10])
    t1 = turn(1, [50, 51], [60], source="rendered", fork_reason="side_call")  # e.g. a title request
    t2 = turn(2, [1, 2, 10, 3], [11], parent=0)
    result = episode_to_rows([t0, t1, t2])
    assert [(r.kind, r.turns) for r in result.rows] == [("main", [0, 2]), ("side_call", [1])]
    assert result.rows[0].env_mask == [1, 0, 1]
    skipped = episode_to_rows([t0, t1, t2], side_calls="skip")
    assert [r.turns for r in skipped.rows] == [[0, 2]] and skipped.skipped_turns == [1]


def test_branch_of_same_parent_starts_new_row():
    t0 = turn(0, [1], [10])
    t1 = turn(1, [1, 10, 2], [11], parent=0)
    t2 = turn(2, [1, 10, 2], [12], parent=0)  # second choice of the same request (n=2)
    result = episode_to_rows([t0, t1, t2])
    assert [(r.kind, r.prompt_ids, r.completion_ids, r.env_mask) for r in result.rows] == [
        ("main", [1], [10, 2, 11], [1, 0, 1]),
        ("branch", [1, 10, 2], [12], [1]),
    ]


def test_cap_and_skip_drop_continuations_of_untrained_rows():
    t0 = turn(0, [1], [10])
    t1 = turn(1, [5], [20], source="rendered", fork_reason="history_rewritten")
    t2 = turn(2, [5, 20, 6], [21], parent=1)
    t3 = turn(3, [7], [30], source="rendered", fork_reason="history_rewritten")
    capped = episode_to_rows([t0, t1, t2, t3], max_rows=2)
    assert [r.turns for r in capped.rows] == [[0], [1, 2]] and capped.capped_turns == [3]
    capped1 = episode_to_rows([t0, t1, t2, t3], max_rows=1)
    assert [r.turns for r in capped1.rows] == [[0]] and capped1.capped_turns == [1, 2, 3]
    skipped = episode_to_rows([t0, t1, t2, t3], forks="skip")
    assert [r.turns for r in skipped.rows] == [[0]] and skipped.skipped_turns == [1, 2, 3]
