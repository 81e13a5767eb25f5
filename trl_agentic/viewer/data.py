"""The viewer's data: from episode records (a training or evaluation log) to what the page lists and shows."""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime, timezone
from typing import Any

from ..alarms import episode_reward
from ..lineage import turn_conversations
from ..rollout.rows import episode_to_rows
from ..trace import Turn
from .tree import link_trees, replayed_spans


def _round(value: Any, digits: int = 4) -> Any:
    return round(value, digits) if isinstance(value, float) else value


def _episode_reward(record: dict[str, Any]) -> float | None:
    if "reward" in record:  # Evaluator.write_episodes: the weighted reward
        return record["reward"]
    return episode_reward(record["episode"])  # a training log: the sum of the reward functions' scores


def _rows_of(record: dict[str, Any]) -> tuple[list[dict], list[int], list[int]]:
    """The record's rows (recomputed from its turns when the log has none, e.g. an evaluation log)."""
    if "rows" in record:
        return record["rows"], record.get("skipped_turns", []), record.get("capped_turns", [])
    result = episode_to_rows([Turn.from_dict(turn) for turn in record["episode"].get("turns", [])])
    return [row.to_dict() for row in result.rows], result.skipped_turns, result.capped_turns


def _row_label(kind: str, role: str | None) -> str:
    """`main`, `side_call`, `sub_agent`; a fork or branch says whose (`fork of sub_agent`)."""
    return f"{kind} of {role}" if kind in ("fork", "branch") and role else kind


def _short(value: Any, limit: int = 300) -> str | None:
    if value is None:
        return None
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "…"


def build_viewer_data(
    records: list[dict[str, Any]], tokenizer=None, source: str = "", alarms: list[dict[str, Any]] | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The viewer's data: `(summary, details)`. `summary` holds one small entry per episode (what the list shows and
    filters on), the interned prompts and the decoded vocabulary; `details[i]` is episode `i`'s messages, turns and
    rows.

    Each row and turn carries its conversation's role (`main`, `side_call`, `sub_agent`: `trl_agentic.lineage`).
    Rows keep their token ids; `mask` is the row's `env_mask` as a string of `0`/`1`, `lp` the logprobs of its sampled
    tokens only (rounded to 4 digits). A row's prompt is stored once per distinct prompt (`prompts`): the episodes of a
    group share it. `conversations` holds, per row, the messages of its last model call and the reply.

    An episode in a tree of branch episodes (tree rollouts) has a `tree` entry (`viewer.tree.link_trees`: its parent,
    root, depth, branch point, children, per call replayed/sampled/diverged, the replay's divergence, the trainer's
    segment advantages when logged), and each of its turns `replayed` and `divergence`.
    """
    prompts: dict[tuple[int, ...], int] = {}
    used_ids: set[int] = set()
    episodes, details = [], []
    # Trainer logs: task_index is the episode's slot in the batch, G consecutive slots per group (one task).
    group_size: dict[tuple, int] = {}
    for record in records:
        key = (record["rank"], record.get("mode", "train"), record.get("step", 0))
        group_size[key] = max(group_size.get(key, 1), record["episode"].get("group_index", 0) + 1)

    for index, record in enumerate(records):
        episode = record["episode"]
        turns = episode.get("turns", [])
        step, mode = record.get("step", 0), record.get("mode", "train" if "sample" not in record else "eval")
        if "sample" in record:  # Evaluator.write_episodes: one task per task_index
            group, sample = record.get("task_index", episode.get("task_index", 0)), record["sample"]
        else:
            size = group_size[(record["rank"], record.get("mode", "train"), step)]
            group, sample = episode.get("task_index", 0) // size, episode.get("group_index", 0)
        rows, skipped, capped = _rows_of(record)
        messages = episode.get("messages") or (turns[-1]["request_messages"] if turns else [])
        # Each turn's conversation and its role (labelled when the episode closed; decided now for an older log).
        roles = turn_conversations([Turn.from_dict(turn) for turn in turns])
        main = next((t for t in turns if roles.get(t["index"], (None, None))[1] == "main"), turns[0] if turns else None)
        # The task: the last user message of the main line's first call (later calls may have rewritten the history;
        # the episode's first call may be a title request).
        first_request = (main.get("request_messages") or messages) if main else messages
        prompt_text = next(
            (
                m.get("content")
                for m in reversed(first_request)
                if m.get("role") == "user" and isinstance(m.get("content"), str)
            ),
            None,
        )
        reward = _episode_reward(record)
        conversation_roles = Counter(role for _, role in set(roles.values()))
        episodes.append(
            {
                "i": index,
                "id": episode.get("id", str(index)),
                "step": step,
                "mode": mode,
                "rank": record["rank"],
                "group": group,
                "sample": sample,
                "status": episode.get("status", "?"),
                "reward": _round(reward),
                "rewards": {
                    k: _round(v)
                    for k, v in (
                        (record.get("rewards") or (episode.get("metadata") or {}).get("rewards") or {}).items()
                    )
                },
                "advantage": _round(record.get("advantage")),
                "turns": len(turns),
                "tool_calls": sum(len((t.get("response_message") or {}).get("tool_calls") or []) for t in turns),
                "malformed": sum(bool(t.get("malformed_tool_call")) for t in turns),
                "forks": sum(1 for t in turns[1:] if t.get("prompt_source") != "continued"),
                "conversations": {role: conversation_roles[role] for role in ("main", "sub_agent", "side_call")},
                "tokens": sum(len(t.get("completion_ids", [])) for t in turns),
                "rows": len(rows),
                "wall": _round(episode.get("wall_time"), 2),
                "error": _short(episode.get("error")),
                "result": _short(episode.get("result"), 120),
                "task": _short(prompt_text, 160),
            }
        )
        metadata = episode.get("metadata") or {}
        if "staleness" in metadata:  # asynchronous rollouts: the version it started on, its oldest trained token's gap
            episodes[-1].update(
                start_version=metadata.get("start_version"),
                staleness=metadata["staleness"],
                dropped=bool(metadata.get("dropped")),
            )
        if "difficulty" in record:  # a run with a difficulty column (a curriculum): the task's level
            episodes[-1].update(difficulty=record["difficulty"], target=bool(record.get("target")))

        detail_rows = []
        replayed = {turn["index"] for turn in turns if turn.get("replayed")}  # a branch's replayed prefix
        for row in rows:
            prompt_key = tuple(row["prompt_ids"])
            if prompt_key not in prompts:
                prompts[prompt_key] = len(prompts)
                used_ids.update(prompt_key)
            used_ids.update(row["completion_ids"])
            mask = row["env_mask"]
            detail_rows.append(
                {
                    "kind": row.get("kind", "main"),
                    "turns": row.get("turns", []),
                    "prompt": prompts[prompt_key],
                    "role": row.get("role") or roles.get((row.get("turns") or [None])[0], (None, None))[1],
                    "ids": row["completion_ids"],
                    "mask": "".join("1" if m else "0" for m in mask),
                    "lp": [
                        None if lp is None else round(lp, 4) for lp, m in zip(row["logprobs"], mask, strict=True) if m
                    ],
                }
            )
            if replayed:  # the completion tokens of replayed turns: the parent's, not sampled by this episode
                detail_rows[-1]["replayed"] = replayed_spans(row, turns, replayed)
        # What the model saw and said, per row: the request of the row's last turn and its reply (a fork's main line
        # and its rewritten history differ; the episode's final messages hold only the last).
        by_index = {turn["index"]: turn for turn in turns}

        def conversation(turn: dict) -> list[dict]:
            return [
                *(turn.get("request_messages") or []),
                *([turn["response_message"]] if turn.get("response_message") else []),
            ]

        conversations = [
            {
                "label": f"row {r} · {_row_label(row.get('kind', 'main'), detail_rows[r]['role'])}",
                "messages": conversation(by_index[row["turns"][-1]]),
            }
            for r, row in enumerate(rows)
            if row.get("turns") and row["turns"][-1] in by_index
        ]
        in_rows = {t for row in rows for t in row.get("turns", [])}
        untrained = []
        for turn in turns:
            if turn["index"] not in in_rows:  # skipped or capped: not in any row, still worth seeing
                used_ids.update(turn["completion_ids"])
                untrained.append(
                    {
                        "turn": turn["index"],
                        "ids": turn["completion_ids"],
                        "lp": [None if lp is None else round(lp, 4) for lp in turn["logprobs"]],
                        "why": "capped" if turn["index"] in capped else "skipped",
                    }
                )
                role = roles.get(turn["index"], (None, None))[1]
                conversations.append(
                    {
                        "label": f"turn {turn['index']}{' · ' + role if role else ''} (not trained)",
                        "messages": conversation(turn),
                    }
                )
        if not conversations:
            conversations = [{"label": "messages", "messages": messages}]
        details.append(
            {
                "conversations": conversations,
                "tools": [(tool.get("function") or {}).get("name") for tool in (main.get("request_tools") or [])]
                if main
                else [],
                "turns": [
                    {
                        "index": t["index"],
                        "source": t.get("prompt_source"),
                        "parent": t.get("parent_turn"),
                        "conversation": roles.get(t["index"], (None, None))[0],
                        "role": roles.get(t["index"], (None, None))[1],
                        "spawned_by": t.get("spawned_by"),
                        "forked_from": t.get("forked_from"),
                        "fork_reason": t.get("fork_reason"),
                        "drift": t.get("drift", 0),
                        "finish": t.get("finish_reason"),
                        "malformed": bool(t.get("malformed_tool_call")),
                        "forced": t.get("forced_tokens", 0),
                        "prompt_tokens": len(t.get("prompt_ids", [])),
                        "sampled_tokens": len(t.get("completion_ids", [])),
                        # A call that decoded across a weight update (asynchronous rollouts): the versions it spans
                        "version": t.get("policy_version")
                        if not t.get("token_versions")
                        else f"{min(t['token_versions'])}-{max(t['token_versions'])}",
                        "wall": _round(t.get("wall_time"), 3),
                        "requested": t.get("requested_sampling") or {},
                        # A branch episode (tree rollouts): answered from its parent's record, or where replay ended
                        "replayed": bool(t.get("replayed")),
                        "divergence": t.get("replay_divergence"),
                    }
                    for t in turns
                ],
                "rows": detail_rows,
                "untrained": untrained,
                "skipped_turns": skipped,
                "capped_turns": capped,
                "result": episode.get("result"),
                "error": episode.get("error"),
                "metadata": episode.get("metadata") or {},
            }
        )

    link_trees(records, episodes)  # tree rollouts: each branch's parent, branch point, replayed calls, segments
    vocab = None
    if tokenizer is not None:
        vocab = {
            str(i): tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            for i in sorted(used_ids)
        }
    summary = {
        "source": source,
        "generated": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "tokenizer": tokenizer.name_or_path if tokenizer is not None else None,
        "episodes": episodes,
        "prompts": [list(p) for p in prompts],
        "vocab": vocab,
        "alarms": alarms or [],
    }
    return summary, details
