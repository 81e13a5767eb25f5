"""Turns → training rows: exact-prefix merge, forks, conversations, env_mask. Pure functions over int lists.

A row is one linear segment of an episode. Consecutive turns merge into one row while each turn's prompt starts with
the previous turn's prompt + completion ids (guaranteed by the endpoint's token-in continuation); the tokens in
between (tool output, user turns, template glue) get `env_mask` 0, sampled tokens get 1. A turn that does not extend
the tail of an existing row starts a row of its own: the first call of another conversation (a side call, a
sub-agent: `trl_agentic.lineage`), a fork after a history rewrite, a second choice of `n>1`. All rows of an episode
share the episode's advantage, plus, with per-turn rewards, a term per turn (`row_token_turns` says which turn sampled
each token; `trl_agentic/rewards/process.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..lineage import turn_conversations
from ..trace import Turn


ROW_KINDS = ("main", "fork", "side_call", "sub_agent", "branch")


@dataclass
class Row:
    """One training row.

    Args:
        prompt_ids: the first turn's prompt.
        completion_ids: everything after it (sampled tokens and, between turns, the context the model was shown).
        env_mask: 1 on sampled tokens, 0 elsewhere; same length as `completion_ids`.
        logprobs: sampling logprob of each sampled token, 0.0 where `env_mask` is 0.
        versions: the policy version that sampled each sampled token (`Turn.versions`), -1 where `env_mask` is 0.
        turns: indices of the turns merged into this row.
        kind: what starts the row: the first call of a conversation, named by its role (`"main"`, the episode's main
            line; `"side_call"`, e.g. a title request; `"sub_agent"`, a conversation a tool call handed a task), or,
            inside a conversation, `"fork"` (after a history rewrite, a compaction restart or a template that is not
            append-only) or `"branch"` (a second continuation of the same turn, e.g. `n>1` or a retry).
        conversation: the conversation the row belongs to (the index of its first turn, `Turn.conversation`).
        role: that conversation's role: `"main"`, `"side_call"` or `"sub_agent"` (`None` for a placeholder row).
    """

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    kind: str = "main"
    versions: list[int] = field(default_factory=list)
    conversation: int | None = None
    role: str | None = None

    @property
    def num_sampled_tokens(self) -> int:
        return sum(self.env_mask)

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version among the row's sampled tokens (`None` without any)."""
        return min((v for v, m in zip(self.versions, self.env_mask) if m), default=None)

    def to_dict(self) -> dict:
        return {
            "prompt_ids": self.prompt_ids,
            "completion_ids": self.completion_ids,
            "env_mask": self.env_mask,
            "logprobs": self.logprobs,
            "turns": self.turns,
            "kind": self.kind,
            "versions": self.versions,
            "conversation": self.conversation,
            "role": self.role,
        }


@dataclass
class RowsResult:
    rows: list[Row]
    skipped_turns: list[int]  # turns not trained: `forks=`, `side_calls=`, `sub_agents="skip"`, or cancelled calls
    capped_turns: list[int]  # turns not trained because of `max_rows`


def episode_to_rows(
    turns: list[Turn],
    max_rows: int | None = None,
    forks: str = "train",
    side_calls: str = "train",
    sub_agents: str = "train",
) -> RowsResult:
    """Merge an episode's turns into rows, the main line's first.

    Args:
        turns: the episode's turns in call order (`Turn.parent_turn` links continuations; `Turn.conversation` and
            `Turn.role` say which conversation each belongs to, decided from the turns when they do not).
        max_rows: most rows; the rows past it (main line first, then the others in call order) are not trained.
        forks: `"train"` or `"skip"` rows that start with a fork or a branch.
        side_calls: `"train"` or `"skip"` the rows of side-call conversations (title and summary requests).
        sub_agents: `"train"` or `"skip"` the rows of sub-agent conversations.

    Example:

    ```python
    >>> t0 = Turn(0, prompt_ids=[1, 2, 3], completion_ids=[10, 11], logprobs=[-0.1, -0.2], finish_reason="stop")
    >>> t1 = Turn(1, prompt_ids=[1, 2, 3, 10, 11, 4, 5], completion_ids=[12], logprobs=[-0.3], finish_reason="stop",
    ...           prompt_source="continued", parent_turn=0)
    >>> episode_to_rows([t0, t1]).rows[0].env_mask
    [1, 1, 0, 0, 1]
    ```
    """
    rows: list[Row] = []
    row_of_turn: dict[int, int | None] = {}  # turn index -> row index (None = not trained)
    tail_of_row: dict[int, int] = {}  # row index -> index of its last turn
    skipped = []
    by_index = {turn.index: turn for turn in turns}
    conversations = turn_conversations(turns)
    untrained_roles = {role for role, how in (("side_call", side_calls), ("sub_agent", sub_agents)) if how == "skip"}

    for turn in turns:
        if turn.finish_reason == "cancelled":
            # Its client disconnected before the answer was delivered: nothing the agent saw, nothing to train, and
            # the retry continues from the turn before it.
            row_of_turn[turn.index] = None
            skipped.append(turn.index)
            continue
        parent_row = row_of_turn.get(turn.parent_turn) if turn.prompt_source == "continued" else None
        if turn.prompt_source == "continued" and turn.parent_turn in row_of_turn and parent_row is None:
            # The parent was not trained (skipped): its continuation is not trained either.
            row_of_turn[turn.index] = None
            skipped.append(turn.index)
            continue
        if parent_row is not None and tail_of_row[parent_row] == turn.parent_turn:
            row = rows[parent_row]
            parent = by_index[turn.parent_turn]
            exact = parent.prompt_ids + parent.completion_ids
            # The row ends with exactly the parent's prompt + completion; the endpoint guarantees the turn extends it.
            if len(row.prompt_ids) + len(row.completion_ids) == len(exact) and turn.prompt_ids[: len(exact)] == exact:
                context = turn.prompt_ids[len(exact) :]
                row.completion_ids += context + turn.completion_ids
                row.env_mask += [0] * len(context) + [1] * len(turn.completion_ids)
                row.logprobs += [0.0] * len(context) + list(turn.logprobs)
                row.versions += [-1] * len(context) + turn.versions
                row.turns.append(turn.index)
                tail_of_row[parent_row] = turn.index
                row_of_turn[turn.index] = parent_row
                continue
        conversation, role = conversations[turn.index]
        if turn.index == conversation:
            kind = role
        else:
            kind = "branch" if turn.prompt_source == "continued" else "fork"
        if role in untrained_roles or (kind in ("fork", "branch") and forks == "skip"):
            row_of_turn[turn.index] = None
            skipped.append(turn.index)
            continue
        rows.append(
            Row(
                prompt_ids=list(turn.prompt_ids),
                completion_ids=list(turn.completion_ids),
                env_mask=[1] * len(turn.completion_ids),
                logprobs=list(turn.logprobs),
                turns=[turn.index],
                kind=kind,
                versions=turn.versions,
                conversation=conversation,
                role=role,
            )
        )
        tail_of_row[len(rows) - 1] = turn.index
        row_of_turn[turn.index] = len(rows) - 1

    # The main line's rows first (the trainer hands the first row to TRL as the episode's sequence), then the others
    # in call order; a row's ancestors stay before it, so a cap never keeps a branch whose parent it dropped.
    rows.sort(key=lambda row: row.role != "main")
    capped = []
    if max_rows is not None and len(rows) > max_rows:
        capped = sorted(index for row in rows[max_rows:] for index in row.turns)
        rows = rows[:max_rows]
    return RowsResult(rows=rows, skipped_turns=sorted(skipped), capped_turns=capped)


def row_token_turns(row: Row, turns: list[Turn]) -> list[int]:
    """The turn (its `Turn.index`) that sampled each completion token of `row`, `-1` on the context between turns
    (tool output, template glue) and on a placeholder row's padding: what per-turn (process) rewards are spread by.

    Example:

    ```python
    >>> t0 = Turn(0, prompt_ids=[1, 2, 3], completion_ids=[10, 11], logprobs=[-0.1, -0.2], finish_reason="stop")
    >>> t1 = Turn(1, prompt_ids=[1, 2, 3, 10, 11, 4, 5], completion_ids=[12], logprobs=[-0.3], finish_reason="stop",
    ...           prompt_source="continued", parent_turn=0)
    >>> row_token_turns(episode_to_rows([t0, t1]).rows[0], [t0, t1])
    [0, 0, -1, -1, 1]
    ```
    """
    by_index = {turn.index: turn for turn in turns}
    owners: list[int] = []
    for position, index in enumerate(row.turns):
        turn = by_index[index]
        if position:  # the context the model was shown before this turn: its prompt past the row so far
            owners += [-1] * (len(turn.prompt_ids) - len(row.prompt_ids) - len(owners))
        owners += [index] * len(turn.completion_ids)
    return owners + [-1] * (len(row.completion_ids) - len(owners))
