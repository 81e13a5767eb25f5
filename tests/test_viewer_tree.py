"""The viewer draws tree rollouts (issue 42, item 6): a real log of branch episodes (`rollout/replay.py`'s
`branch_episode` against a real endpoint, written by the trainer's `EpisodeLog`) becomes, per group, the tree of its
episodes (the root, branches hanging from the call they branched at, branches of branches), replayed calls apart from
sampled ones, where and why replay diverged, and segment advantages where the log has a `tree` field."""

import json
import re
import uuid

import pytest

from conftest import ScriptedEngine
from test_viewer import chromium, needs_chromium
from trl_agentic.episode_log import EpisodeLog
from trl_agentic.rollout.agents import resolve_agent
from trl_agentic.rollout.replay import branch_episode
from trl_agentic.rollout.rows import episode_to_rows
from trl_agentic.rollout.runner import run_episode, run_rollout
from trl_agentic.tasks.calculator import CALCULATOR, build_calculator_dataset, calculator_agent
from trl_agentic.tiny_models import build_tiny_tokenizer
from trl_agentic.viewer import build_viewer_data, load_records, split_by_step


ROUNDS = 3  # tool calls before the answer: 4 model calls per episode
GROUP = 4  # episodes per group (tree): slots 0-3 and 4-7 of the batch


def counting_engine(tokenizer):
    """Calls the calculator until the prompt holds `ROUNDS` tool results, then answers; every answer carries the
    engine's call count, so a sampled call never repeats an earlier one (only a replayed call does)."""
    count = iter(range(10**6))

    def respond(prompt_ids):
        n = next(count)
        results = tokenizer.decode(prompt_ids).count("<tool_response>")
        if results >= ROUNDS:
            return f"The answer is {n}."
        return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{results} + {n}"}}}}\n</tool_call>'

    return ScriptedEngine(tokenizer, respond)


async def clocked(client, task):
    """The calculator agent with a request id in its system prompt: no replayed call of a branch ever matches."""
    task = {**task, "prompt": [{"role": "system", "content": f"Request {uuid.uuid4().hex}."}, *task["prompt"][1:]]}
    return await calculator_agent(client, task)


@pytest.fixture(scope="module")
def tree_log(start_server, tmp_path_factory):
    """One step of two groups, as a tree-rollout trainer logs them: group 0 is the calculator agent's parent `P` with
    branches at calls 1 and 2 and a branch of that branch at call 3, with the trainer's `tree` field (segments and their
    advantages); group 1 is a clocked agent whose branches diverge at their first call, with no `tree` field."""
    tokenizer = build_tiny_tokenizer("qwen2_5")
    server = start_server(counting_engine(tokenizer), tokenizer)
    tasks = build_calculator_dataset(size=2)
    calc, clock = resolve_agent(CALCULATOR.agent), resolve_agent(clocked)

    p = run_rollout(run_episode(server, calc, tasks[0], task_index=0, seed=1))
    p1 = branch_episode(server, calc, tasks[0], p, 1, seed=2, group_index=1)
    p2 = branch_episode(server, calc, tasks[0], p, 2, seed=3, group_index=2)
    p23 = branch_episode(server, calc, tasks[0], p2, 3, seed=4, group_index=3)
    q = run_rollout(run_episode(server, clock, tasks[1], task_index=GROUP, seed=5))
    q2 = branch_episode(server, clock, tasks[1], q, 2, seed=6, group_index=1)
    q0 = branch_episode(server, clock, tasks[1], q, 0, seed=7, group_index=2)
    q21 = branch_episode(server, clock, tasks[1], q2, 1, seed=8, group_index=3)
    episodes = [p, p1, p2, p23, q, q2, q0, q21]
    assert all(e.status == "ok" and len(e.turns) == ROUNDS + 1 for e in episodes)

    folder = tmp_path_factory.mktemp("tree") / "episodes"
    rows = [episode_to_rows(e.turns) for e in episodes]
    advantages = [0.5, -0.5, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0]
    EpisodeLog(folder).write(episodes, rows, advantages, [{} for _ in episodes], step=0, mode="train")
    # The trainer's tree field (branch i42-tree), on group 0's records only: the viewer never requires it.
    trees = {
        p.id: {"root": p.id, "parent": None, "branch_point": None, "segments": [
            {"turns": [0, 0], "advantage": 0.25, "owned": True},
            {"turns": [1, 1], "advantage": 0.125, "owned": True},
            {"turns": [2, 3], "advantage": -0.5, "owned": True}]},
        p1.id: {"root": p.id, "parent": p.id, "branch_point": 1, "segments": [
            {"turns": [0, 0], "advantage": 0.25, "owned": False},
            {"turns": [1, 3], "advantage": -0.75, "owned": True}]},
        p2.id: {"root": p.id, "parent": p.id, "branch_point": 2, "segments": [
            {"turns": [0, 1], "advantage": None, "owned": False},
            {"turns": [2, 2], "advantage": 0.5, "owned": True},
            {"turns": [3, 3], "advantage": 1.5, "owned": True}]},
        p23.id: {"root": p.id, "parent": p2.id, "branch_point": 3, "segments": [
            {"turns": [0, 2], "advantage": None, "owned": False},
            {"turns": [3, 3], "advantage": -1.5, "owned": True}]},
    }  # fmt: skip
    lines = (folder / "episodes-rank0.jsonl").read_text().splitlines()
    with (folder / "episodes-rank0.jsonl").open("w") as f:
        for line in lines:
            record = json.loads(line)
            if record["episode"]["id"] in trees:
                record["tree"] = trees[record["episode"]["id"]]
            f.write(json.dumps(record) + "\n")
    build_tiny_tokenizer("qwen2_5").save_pretrained(folder.parent)
    return folder.parent, episodes, trees


def test_each_episode_knows_its_place_in_the_tree(tree_log):
    """Parents, roots, depths, branch points, children, and per call whether it was replayed (`r`), sampled (`s`) or
    the call where replay diverged (`d`), exactly as the branches were run."""
    folder, (p, p1, p2, p23, q, q2, q0, q21), trees = tree_log
    records = load_records([folder / "episodes" / "episodes-rank0.jsonl"])
    summary, details = build_viewer_data(records)
    by_id = {e["id"]: e for e in summary["episodes"]}
    shape = {
        i: (t["parent"], t["root"], t["depth"], t["branch_point"], t["calls"], t["replayed_calls"], t["diverged"])
        for i, t in ((i, by_id[i]["tree"]) for i in by_id)
    }
    assert shape == {
        p.id: (None, p.id, 0, None, "ssss", 0, False),
        p1.id: (p.id, p.id, 1, 1, "rsss", 1, False),
        p2.id: (p.id, p.id, 1, 2, "rrss", 2, False),
        p23.id: (p2.id, p.id, 2, 3, "rrrs", 3, False),
        q.id: (None, q.id, 0, None, "ssss", 0, False),
        q2.id: (q.id, q.id, 1, 2, "dsss", 0, True),
        q0.id: (q.id, q.id, 1, 0, "ssss", 0, False),
        q21.id: (q2.id, q.id, 2, 1, "dsss", 0, True),
    }
    # Children in branch-point order, the tree's groups as the trainer laid them out (4 slots per group).
    assert {i: by_id[i]["tree"]["children"] for i in by_id} == {
        p.id: [p1.id, p2.id], p1.id: [], p2.id: [p23.id], p23.id: [],
        q.id: [q0.id, q2.id], q2.id: [q21.id], q0.id: [], q21.id: [],
    }  # fmt: skip
    assert [by_id[e.id]["group"] for e in (p, p1, p2, p23, q, q2, q0, q21)] == [0, 0, 0, 0, 1, 1, 1, 1]
    # Where and why replay diverged: the branch's first call (a request id the parent's prompt did not have).
    for branch in (q2, q21):
        divergence = by_id[branch.id]["tree"]["divergence"]
        assert divergence["reason"] == "prompt_mismatch" and divergence["call"] == 0 and divergence["turn"] == 0
        assert divergence["token_index"] == branch.turns[0].replay_divergence["token_index"] > 0
        assert "Request" in divergence["request_context"] and "Request" in divergence["recorded_context"]
    assert by_id[q0.id]["tree"]["divergence"] is None
    # The turns table: replayed flags and the divergence on its turn, as the episode's turns have them.
    for episode, entry in zip((p, p1, p2, p23, q, q2, q0, q21), summary["episodes"], strict=True):
        turns = details[entry["i"]]["turns"]
        assert [t["replayed"] for t in turns] == [t.replayed for t in episode.turns]
        assert [t["divergence"] for t in turns] == [t.replay_divergence for t in episode.turns]
        # In the row, the tokens of the replayed calls (the parent's) are told apart from those the branch sampled.
        (row,) = details[entry["i"]]["rows"]
        replayed = [row["ids"][i] for a, b in row.get("replayed", []) for i in range(a, b)]
        assert replayed == [i for t in episode.turns if t.replayed for i in t.completion_ids]
        assert ("replayed" in row) == any(t.replayed for t in episode.turns)


def test_segment_advantages_are_drawn_from_the_trainers_tree_field_when_logged(tree_log):
    folder, episodes, trees = tree_log
    summary, _ = build_viewer_data(load_records([folder / "episodes" / "episodes-rank0.jsonl"]))
    by_id = {e["id"]: e for e in summary["episodes"]}
    for episode in episodes[:4]:
        assert by_id[episode.id]["tree"]["segments"] == trees[episode.id]["segments"]
    for episode in episodes[4:]:  # no tree field: the tree comes from the replay metadata alone, with no segments
        assert by_id[episode.id]["tree"]["segments"] is None


def test_the_logged_tree_field_alone_is_enough_and_a_flat_log_has_no_tree(tree_log):
    """A log whose branches carry the trainer's `tree` field but no replay metadata (an older endpoint) still draws the
    tree; episodes of a run without branches get no `tree` entry (the viewer's data is as before)."""
    folder, (p, p1, p2, p23, *_), trees = tree_log
    records = load_records([folder / "episodes" / "episodes-rank0.jsonl"])[:4]
    for record in records:
        record["episode"]["metadata"].pop("replay", None)
    summary, _ = build_viewer_data(records)
    assert [(e["tree"]["parent"], e["tree"]["root"], e["tree"]["branch_point"]) for e in summary["episodes"]] == [
        (None, p.id, None),
        (p.id, p.id, 1),
        (p.id, p.id, 2),
        (p2.id, p.id, 3),
    ]
    assert [e["tree"]["calls"] for e in summary["episodes"]] == ["ssss", "rsss", "rrss", "rrrs"]  # Turn.replayed
    for record in records:  # the same, from the episode's metadata["tree"] (where the trainer keeps it)
        record["episode"]["metadata"]["tree"] = record.pop("tree")
    moved, _ = build_viewer_data(records)
    assert [e["tree"] for e in moved["episodes"]] == [e["tree"] for e in summary["episodes"]]
    flat = load_records([folder / "episodes" / "episodes-rank0.jsonl"])[:1]
    flat[0].pop("tree")
    summary, _ = build_viewer_data(flat)
    assert "tree" not in summary["episodes"][0]


def test_a_branch_whose_parent_is_not_in_the_log_says_so(tree_log):
    folder, (p, p1, *_), _ = tree_log
    records = [r for r in load_records([folder / "episodes" / "episodes-rank0.jsonl"]) if r["episode"]["id"] == p1.id]
    records[0].pop("tree")
    summary, _ = build_viewer_data(records)
    tree = summary["episodes"][0]["tree"]
    assert (tree["parent"], tree["root"], tree["depth"], tree["parent_in_log"]) == (p.id, p.id, 1, False)


def test_the_step_file_carries_the_tree(tree_log):
    folder, episodes, _ = tree_log
    summary, details = build_viewer_data(load_records([folder / "episodes" / "episodes-rank0.jsonl"]))
    index, (step,) = split_by_step(summary, details)
    assert [e["tree"]["parent"] for e in step["episodes"]] == [None, *[episodes[0].id] * 2, episodes[2].id] + [
        None,
        *[episodes[4].id] * 2,
        episodes[5].id,
    ]
    assert index["steps"][0]["branches"] == 6  # the step list says how many branches a step ran, without loading it


def tree_rows(html: str) -> list[tuple[str, str, str, str]]:
    """`(id, parent, branch point, calls)` of each row of a drawn tree, top to bottom; calls as `r`/`s`/`d` marks."""
    rows = re.findall(
        r'<tr class="tnode[^"]*" data-id="([^"]+)" data-parent="([^"]*)" data-bp="([^"]*)">(.*?)</tr>', html, re.S
    )
    return [(i, parent, bp, "".join(re.findall(r'<td class="tcall (\w)', cells))) for i, parent, bp, cells in rows]


@pytest.mark.slow  # a real browser: a few seconds
@needs_chromium
def test_the_browser_draws_the_tree_of_the_opened_episodes_group(tree_log, tmp_path):
    from trl_agentic.cli import main as cli_main

    folder, (p, p1, p2, p23, q, q2, q0, q21), _ = tree_log
    out = tmp_path / "viewer"
    assert cli_main(["inspect", str(folder), "-o", str(out)]) == 0
    dom = chromium("--dump-dom", f"{(out / 'index.html').as_uri()}#episode={p23.id}&step=train:0").stdout
    detail = dom[dom.index('<section id="detail">') : dom.index('<div id="tokinfo">')]
    # The tree, root first, each branch under its parent, at its branch point.
    assert tree_rows(detail) == [
        (p.id, "", "", "ssss"),
        (p1.id, p.id, "1", "rsss"),
        (p2.id, p.id, "2", "rrss"),
        (p23.id, p2.id, "3", "rrrs"),
    ]
    assert 'class="tnode current"' in detail and f"branch of {p2.id} at call 3" in detail
    replayed = re.findall(r'<span class="t s rp[^"]*" data-id="(\d+)"', detail)  # the row's replayed tokens
    assert [int(i) for i in replayed] == [i for t in p23.turns[:3] for i in t.completion_ids]
    assert "A -1.5" in detail and "A 0.125" in detail  # segment advantages, from the tree field
    # The step list shows each group as its tree: the branches under their parents.
    listed = re.findall(r'<div class="ep[^"]*" data-e="0\.(\d+)"[^>]*>.*?<span class="tree">([^<]*)</span>', dom)
    assert [(int(j), mark.strip()) for j, mark in listed] == [
        (0, "root"), (1, "↳ call 1"), (2, "↳ call 2"), (3, "↳↳ call 3"),
        (4, "root"), (6, "↳ call 0"), (5, "↳ call 2 ✗"), (7, "↳↳ call 1 ✗"),
    ]  # fmt: skip

    dom = chromium("--dump-dom", f"{(out / 'index.html').as_uri()}#episode={q21.id}&step=train:0").stdout
    detail = dom[dom.index('<section id="detail">') : dom.index('<div id="tokinfo">')]
    assert tree_rows(detail) == [
        (q.id, "", "", "ssss"),
        (q0.id, q.id, "0", "ssss"),
        (q2.id, q.id, "2", "dsss"),
        (q21.id, q2.id, "1", "dsss"),
    ]
    assert "replay diverged at call 0: prompt_mismatch" in detail and "Request" in detail
    assert 'class="seg' not in detail  # no tree field in this group's records: no segment advantages
