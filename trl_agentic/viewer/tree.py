"""The viewer's tree of branch episodes (tree rollouts, issue 42; `docs/tree_rollouts.md`).

A branch episode records what replay did in `episode.metadata["replay"]` (`parent`, `branch_point`, `replayed_calls`,
`diverged`, `divergence`), each of its turns whether it was replayed (`Turn.replayed`) and, on the call where replay
ended early, why (`Turn.replay_divergence`). A trainer that trains on trees adds to each episode record a `tree` field
(also in the episode's `metadata["tree"]`): `{"root", "parent", "branch_point", "segments": [{"turns": [first, last],
"advantage", "owned"}]}`. The viewer draws from the replay metadata always and from `tree` when present (never
requiring it), so a log of branches run by hand (`branch_episode`) and a tree-rollout training log are drawn alike.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ..rollout.rows import row_token_turns
from ..trace import Turn


CALL_MARKS = {"replayed": "r", "sampled": "s", "diverged": "d", "cancelled": "x"}


def _call_mark(turn: dict[str, Any]) -> str:
    if turn.get("replayed"):
        return CALL_MARKS["replayed"]
    if turn.get("replay_divergence"):
        return CALL_MARKS["diverged"]
    return CALL_MARKS["cancelled"] if turn.get("finish_reason") == "cancelled" else CALL_MARKS["sampled"]


def episode_tree(record: dict[str, Any]) -> dict[str, Any] | None:
    """An episode's own part of the tree (before `link_trees`), or `None` for an episode that is neither a branch
    nor in a logged tree.

    `calls` marks each turn: `r` replayed from the parent's record, `s` sampled, `d` the call where replay ended
    early (sampled), `x` cancelled. `divergence` is the replay's first divergence (the turn's, with its decoded
    contexts, merged over the metadata's), with `turn`, the index of the turn it is on (`None` when the agent ended
    before the branch point). `segments` are the trainer's (`None` without a `tree` field)."""
    episode = record["episode"]
    replay = (episode.get("metadata") or {}).get("replay")
    logged = record.get("tree")  # the trainer copies the episode's metadata["tree"] into its record
    logged = logged if isinstance(logged, dict) else (episode.get("metadata") or {}).get("tree")
    logged = logged if isinstance(logged, dict) else None
    turns = episode.get("turns") or []
    calls = "".join(_call_mark(turn) for turn in turns)
    if replay is None and logged is None and not calls.strip("sx"):
        return None
    replay = replay if isinstance(replay, dict) else {}
    divergence = None
    on_turn = next((turn for turn in turns if turn.get("replay_divergence")), None)
    if replay.get("divergence") or on_turn is not None:
        divergence = {
            **(replay.get("divergence") or {}),
            **(on_turn["replay_divergence"] if on_turn is not None else {}),
            "turn": on_turn["index"] if on_turn is not None else None,
        }
    logged = logged or {}
    return {
        "parent": logged["parent"] if "parent" in logged else replay.get("parent"),
        "root": logged.get("root"),
        "branch_point": logged["branch_point"] if "branch_point" in logged else replay.get("branch_point"),
        "replayed_calls": replay.get("replayed_calls", calls.count(CALL_MARKS["replayed"])),
        "diverged": bool(replay.get("diverged", divergence is not None)),
        "divergence": divergence,
        "calls": calls,
        "segments": logged.get("segments"),
    }


def link_trees(records: list[dict[str, Any]], entries: list[dict[str, Any]]) -> None:
    """Add `tree` to the viewer's episode `entries` (one per record, in order) of every episode in a tree: its own part
    (`episode_tree`) and, from the parent links, `root` (the logged root, else the topmost ancestor, or the parent's id
    when the parent is not in the log), `depth`, `children` (ids, in branch-point order) and `parent_in_log`. A parent
    that is not a branch itself gets a root's entry. Episodes in no tree get no `tree` (the data is as it was)."""
    trees = [episode_tree(record) for record in records]
    if not any(trees):
        return
    by_id: dict[str, int] = {}
    for i, entry in enumerate(entries):
        by_id.setdefault(entry["id"], i)

    def own(i: int) -> dict[str, Any]:
        if trees[i] is None:  # a parent that is not a branch: a root
            calls = "".join(_call_mark(turn) for turn in records[i]["episode"].get("turns") or [])
            trees[i] = {
                "parent": None,
                "root": None,
                "branch_point": None,
                "replayed_calls": 0,
                "diverged": False,
                "divergence": None,
                "calls": calls,
                "segments": None,
            }
        return trees[i]

    for i in range(len(entries)):
        tree = trees[i]
        if tree is not None and tree["parent"] is not None and tree["parent"] in by_id:
            own(by_id[tree["parent"]])
    children: dict[str, list[int]] = {}
    for i, tree in enumerate(trees):
        if tree is None:
            continue
        depth, root, seen, parent = 0, entries[i]["id"], {entries[i]["id"]}, tree["parent"]
        while parent is not None and parent not in seen:  # (a cycle in a hand-edited log stops the walk)
            seen.add(parent)
            depth, root = depth + 1, parent
            parent = trees[by_id[parent]]["parent"] if parent in by_id and trees[by_id[parent]] else None
        if tree["parent"] is not None:
            children.setdefault(tree["parent"], []).append(i)
        entries[i]["tree"] = {
            **tree,
            "root": tree["root"] or root,
            "depth": depth,
            "parent_in_log": tree["parent"] is None or tree["parent"] in by_id,
        }
    for i, tree in enumerate(trees):
        if tree is not None:
            kids = sorted(children.get(entries[i]["id"], []), key=lambda j: (trees[j]["branch_point"] or 0, j))
            entries[i]["tree"]["children"] = [entries[j]["id"] for j in kids]


def replayed_spans(row: dict[str, Any], turns: list[dict[str, Any]], replayed: set[int]) -> list[list[int]]:
    """`[[start, end), ...]`: where `row`'s completion holds tokens of the `replayed` turns (the parent's tokens, not
    sampled by this episode), from which turn sampled each token (`rows.row_token_turns`)."""
    by_index = {turn["index"]: turn for turn in turns}
    if not any(index in replayed for index in row.get("turns") or []):
        return []
    owners = row_token_turns(
        SimpleNamespace(turns=row["turns"], prompt_ids=row["prompt_ids"], completion_ids=row["completion_ids"]),
        [Turn.from_dict(by_index[index]) for index in row["turns"] if index in by_index],
    )
    spans: list[list[int]] = []
    for position, owner in enumerate(owners):
        if owner in replayed:
            if spans and spans[-1][1] == position:
                spans[-1][1] = position + 1
            else:
                spans.append([position, position + 1])
    return spans
