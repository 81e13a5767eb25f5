"""Tree rollouts in the trainer (`rollout_tree=True`, issue 42 item 3): a group as roots plus branches that replay
their parent's first calls (`rollout/tree_groups.py`), its tree of segments over the rows (`rollout/tree.py`,
`group_tree`), and the per-token advantages and owned tokens TRL's loss gets, checked by hand on int lists.

The trainer-level test records a real three-level tree through the endpoint on a tiny model (an append-only agent
whose tool answers are constant, so replay never diverges) and checks the replayed ids, the loss mask, the (B, T)
advantages and the per-token gradient of TRL's DAPO loss (at ratio 1 a token with advantage A gets -A / N, N the
tokens the loss counts: a shared segment once).
"""

import math
import random
import warnings

import pytest
import torch

from test_learning_parity import KNOBS, dataset, loss_and_gradients, micro_batches, three_turn_agent
from test_rollout_replay import counting_engine
from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.rollout.agents import resolve_agent
from trl_agentic.rollout.producer import RolloutProducer
from trl_agentic.rollout.rows import Row, RowsResult
from trl_agentic.rollout.runner import run_rollout
from trl_agentic.rollout.tree import group_tree
from trl_agentic.rollout.tree_groups import (
    TREE_KEY,
    TreeSpec,
    batch_tree,
    branch_candidates,
    first_tool_error,
    run_tree_groups,
    trie_tokens,
)
from trl_agentic.tasks.calculator import CALCULATOR, build_calculator_dataset
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer
from trl_agentic.trace import Episode, Turn


# A three-level tree on int lists: two roots; episode 2 branches root 0 after 2 completion tokens (its replayed
# part); episode 3 branches episode 2 after 3.
PROMPT = [1, 2]
COMPLETIONS = [[10, 11, 12, 13, 14, 15], [20, 21, 22], [10, 11, 30, 31, 32], [10, 11, 30, 40, 41]]


def test_group_tree_of_a_three_level_tree_by_hand():
    tree = group_tree([None, None, 0, 2], [PROMPT] * 4, COMPLETIONS, [None, None, 2, 3])
    assert tree.parents == [None, None, 0, 2] and tree.shared == [0, 0, 2, 3]
    # s0 = ep0[0:2] (shared by 0, 2, 3), s1 = ep0[2:6], s2 = ep1, s3 = ep2[2:3] (shared by 2, 3), s4 = ep2[3:5],
    # s5 = ep3[3:5]
    assert tree.segment_parents == [None, 0, None, 0, 3, 3]
    assert tree.segment_lengths == [2, 4, 3, 1, 2, 2]
    assert tree.spans == [
        [(0, 0, 2), (1, 2, 6)],
        [(2, 0, 3)],
        [(0, 0, 2), (3, 2, 3), (4, 3, 5)],
        [(0, 0, 2), (3, 2, 3), (5, 3, 5)],
    ]
    result = tree.advantages([1.0, 0.0, 0.0, 1.0])
    d = math.sqrt(1 / 3) + 1e-4  # leaf rewards 1, 0, 0, 1: mean 0.5, unbiased std sqrt(1/3)
    v0 = 2 / 3  # episodes 0, 2, 3 under s0
    a = [
        (v0 - 0.5) / d,
        ((1 - 0.5) + (1 - v0)) / d,
        (0 - 0.5) / d,
        ((0.5 - 0.5) + (0.5 - v0)) / d,
        ((0 - 0.5) + (0 - 0.5)) / d,
        ((1 - 0.5) + (1 - 0.5)) / d,
    ]
    assert result.segments == pytest.approx(a, abs=1e-12)
    expected = [[a[0]] * 2 + [a[1]] * 4, [a[2]] * 3, [0, 0, a[3], a[4], a[4]], [0, 0, 0, a[5], a[5]]]
    for row, want in zip(result.rows, expected, strict=True):
        assert row == pytest.approx(want, abs=1e-12)
    assert [[int(x) for x in row] for row in result.owned] == [[1] * 6, [1] * 3, [0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]


def test_a_branch_at_or_before_its_parents_branch_point_is_its_grandparents_child():
    # Episode 3 replays only 2 tokens of episode 2, which shares 2 with root 0: it branches root 0 (a sibling of 2).
    tree = group_tree([None, None, 0, 2], [PROMPT] * 4, COMPLETIONS[:3] + [[10, 11, 50]], [None, None, 2, 2])
    assert tree.parents == [None, None, 0, 0] and tree.shared == [0, 0, 2, 2]
    assert tree.segment_parents == [None, 0, None, 0, 0]
    # Replay that diverged shares only the common prefix; one that shares nothing (or another prompt) is a root.
    tree = group_tree([None, 0, 0], [PROMPT, PROMPT, [9]], [[10, 11, 12], [10, 99, 98], [10, 11]], [None, 2, 1])
    assert tree.shared == [0, 1, 0] and tree.parents == [None, 0, None]
    # A branch whose whole row is its parent's (a zero-length leaf of its own) still has a leaf of its own.
    tree = group_tree([None, 0], [PROMPT, PROMPT], [[10, 11], [10, 11]], [None, 2])
    assert tree.segment_lengths == [2, 0, 0] and tree.segment_parents == [None, 0, 0]
    result = tree.advantages([1.0, 0.0], scale=False)
    assert result.segments == [0.0, 1.0, -1.0] and result.rows == [[0.0, 0.0], [0.0, 0.0]]


def test_a_group_without_branches_gets_grpos_advantages():
    tree = group_tree([None] * 3, [PROMPT] * 3, [[10], [11, 12], [13]], [None] * 3)
    result = tree.advantages([1.0, 0.0, None])  # an unscorable episode: no advantage, out of the loss
    d = math.sqrt(0.5) + 1e-4
    assert sum(result.rows, []) == pytest.approx([0.5 / d, -0.5 / d, -0.5 / d, 0.0])
    assert result.owned == [[True], [True, True], [False]]


def turn(index, prompt, completion, logprobs=None, messages=None, replayed=False, malformed=False):
    return Turn(
        index,
        list(prompt),
        list(completion),
        logprobs or [-0.5] * len(completion),
        "stop",
        request_messages=messages or [],
        prompt_source="continued" if index else "rendered",
        parent_turn=index - 1 if index else None,
        replayed=replayed,
        malformed_tool_call=malformed,
    )


def test_branch_point_rules():
    user = [{"role": "user", "content": "go"}]
    reply, ok, error = (
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42"},
        {"role": "tool", "content": "Error: division by zero"},
    )
    calls = [
        turn(0, [1], [5], [-0.1], user),
        turn(1, [1, 5, 6], [7], [-3.0], user + [reply, ok]),
        turn(2, [1, 5, 6, 7, 8], [9], [-1.0], user + [reply, ok, reply, ok]),
        turn(3, [1, 5, 6, 7, 8, 9, 4], [3], [-2.0], user + [reply, ok, reply, ok, reply, error]),
    ]
    episode = Episode("e", turns=calls)
    rng = random.Random(0)
    assert branch_candidates(episode, "entropy", rng) == [1, 3, 2]  # mean -logprob 3, 2, 1 (call 0 is never one)
    assert first_tool_error(episode) == 2  # call 2's reply was answered with an error
    assert branch_candidates(episode, "tool_error", rng)[0] == 2
    assert sorted(branch_candidates(episode, "uniform", rng)) == [1, 2, 3]
    assert branch_candidates(episode, "first", rng) == [1, 2, 3]  # after the first call, then in order
    # A branch is branched after its own branch point only; a one-call episode not at all.
    episode.metadata[TREE_KEY] = {"root": "r", "parent": "r", "branch_point": 2}
    assert branch_candidates(episode, "entropy", rng) == [3]
    assert branch_candidates(episode, "first", rng) == [3]
    assert branch_candidates(Episode("one", turns=calls[:1]), "uniform", rng) == []
    assert branch_candidates(Episode("one", turns=calls[:1]), "first", rng) == []
    # "call:K": call K and no other (a branch of a branch at K or later, or a parent of K calls or fewer: none)
    root = Episode("root", turns=calls)
    assert [branch_candidates(root, f"call:{k}", rng) for k in (1, 2, 3, 4)] == [[1], [2], [3], []]
    assert branch_candidates(Episode("short", turns=calls[:3]), "call:3", rng) == []
    assert branch_candidates(episode, "call:2", rng) == [] and branch_candidates(episode, "call:3", rng) == [3]
    assert first_tool_error(Episode("m", turns=[turn(0, [1], [5], malformed=True), calls[1]])) == 0


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(tree_branches=4), "tree_branches <= num_generations - 1"),
        (dict(tree_branches=0), "tree_branches must be >= 1"),
        (dict(tree_depth=3), "tree_depth in [1, tree_branches]"),
        (dict(tree_branch_points="best"), "tree_branch_points must be one of"),
        (dict(tree_branch_points="call:0"), "write 'call:K' with K an integer >= 1"),
        (dict(tree_branch_points="call:x"), "write 'call:K' with K an integer >= 1"),
        (dict(scale_rewards="batch"), "scale_rewards='group'"),
        (dict(tree_local_weight=-1.0), "tree_local_weight"),
    ],
)
def test_tree_settings_are_checked_with_the_fix(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        AgenticGRPOConfig(output_dir=str(tmp_path), num_generations=4, use_cpu=True, rollout_tree=True, **settings)
    if "tree" in next(iter(settings)):  # the tree's settings are not checked while it is off
        AgenticGRPOConfig(output_dir=str(tmp_path), num_generations=4, use_cpu=True, rollout_tree=False, **settings)


def test_one_root_per_group_is_warned_about(tmp_path):
    """With one root its prefix is every episode's: advantage 0 always, never corrected (the third study's collapse)."""
    settings = dict(output_dir=str(tmp_path), num_generations=4, use_cpu=True, rollout_tree=True)
    with pytest.warns(UserWarning, match=r"leaves one root per group.*tree_branches <= num_generations - 2"):
        AgenticGRPOConfig(tree_branches=3, **settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AgenticGRPOConfig(tree_branches=2, **settings)
    assert not [w for w in caught if "root" in str(w.message)]


def test_trie_tokens_and_batch_tree_metadata():
    assert trie_tokens([[1, 2, 3], [1, 2, 4], [1, 5], [7]]) == 6  # 1 2 3 4 5 7
    rows = [RowsResult([Row(PROMPT, c, [1] * len(c), [0.0] * len(c), [0])], [], []) for c in COMPLETIONS]
    episodes = [Episode(f"e{i}", turns=[turn(0, PROMPT, c)]) for i, c in enumerate(COMPLETIONS)]
    for i, parent in ((2, 0), (3, 2)):
        episodes[i].metadata[TREE_KEY] = {"root": "e0", "parent": f"e{parent}", "branch_point": 1}
        episodes[i].turns = [
            turn(0, PROMPT, COMPLETIONS[i][:i], replayed=True),
            turn(1, PROMPT + COMPLETIONS[i][:i], COMPLETIONS[i][i:]),
        ]
        rows[i].rows[0].turns = [0, 1]
    tree = batch_tree(episodes, rows, [1.0, 0.0, 0.0, 1.0], 4)
    assert tree.branches == 2 and tree.groups == 1
    assert tree.owned == [[1] * 6, [1] * 3, [0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert tree.flat_tokens == 2 * 4 + 6 + 3 + 5 + 5 and tree.tree_tokens == 2 + 6 + 3 + 3 + 2
    segments = episodes[3].metadata[TREE_KEY]["segments"]
    assert [(s["turns"], s["owned"]) for s in segments] == [([0, 0], False), ([0, 0], False), ([1, 1], True)]
    assert segments[2]["advantage"] == pytest.approx(1.0 / (math.sqrt(1 / 3) + 1e-4))


# The real trainer: a three-level tree on a tiny model


def reward_of_last_call(prompts, completions, episodes, **kwargs):
    """A deterministic, spread-out reward of what the episode's last call sampled."""
    return [sum(ep.turns[-1].completion_ids) % 7 / 7 for ep in episodes]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


def tree_trainer(tmp_path, tokenizer, reward_funcs=reward_of_last_call, **settings):
    return AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=three_turn_agent,
        reward_funcs=reward_funcs,
        processing_class=tokenizer,
        train_dataset=dataset(),
        args=AgenticGRPOConfig(
            output_dir=str(tmp_path),
            loss_type="dapo",
            steps_per_generation=1,
            gradient_accumulation_steps=1,
            log_episodes=True,
            **dict(KNOBS, num_generations=4, per_device_train_batch_size=4, **settings),
        ),
    )


@pytest.mark.parametrize("prefix_tree_training", [False, True])
def test_a_three_level_tree_through_the_trainer_by_hand(tmp_path, tokenizer, prefix_tree_training):
    # (seed 1: the uniform draw branches slot 2 at call 1, leaving call 2 to branch it at; others branch at 2)
    trainer = tree_trainer(
        tmp_path,
        tokenizer,
        rollout_tree=True,
        tree_branches=2,
        tree_depth=2,
        seed=1,
        prefix_tree_training=prefix_tree_training,  # the same loss and gradients, the shared tokens forwarded once
    )
    inputs = [dict(dataset()[0]) for _ in range(4)]
    try:
        trainer.model.train()
        output = trainer._generate_and_score_completions(inputs)
        episodes = [x["episodes"] for x in inputs]
        # Roots in slots 0 and 1; slot 2 branches root 0 at call 1; slot 3 branches slot 2 at call 2.
        trees = [ep.metadata[TREE_KEY] for ep in episodes]
        assert [(t["parent"], t["branch_point"]) for t in trees] == [
            (None, None),
            (None, None),
            (episodes[0].id, 1),
            (episodes[2].id, 2),
        ]
        assert all(t["root"] == episodes[0].id for t in trees[2:])
        assert [len(ep.turns) for ep in episodes] == [3, 3, 3, 3]
        for ep, parent, k in ((episodes[2], episodes[0], 1), (episodes[3], episodes[2], 2)):
            assert ep.replay["diverged"] is False and ep.num_replayed_calls == k
            for j in range(k):  # replayed calls: the parent's int lists
                assert ep.turns[j].completion_ids == parent.turns[j].completion_ids
                assert ep.turns[j].logprobs == parent.turns[j].logprobs
            assert ep.turns[k].prompt_ids == parent.turns[k].prompt_ids

        # By hand: each row's layout (c0, context, c1, context, c2) and where calls 1 and 2 start in it.
        def start(ep, j):
            return len(ep.turns[j].prompt_ids) - len(ep.turns[0].prompt_ids)

        lengths = [
            len(ep.turns[2].prompt_ids) - len(ep.turns[0].prompt_ids) + len(ep.turns[2].completion_ids)
            for ep in episodes
        ]
        # slot 2 shares [0, l2) of root 0 (call 0 and the context before call 1); slot 3 [0, l3) of slot 2
        l2, l3 = start(episodes[0], 1), start(episodes[2], 2)
        ids = output["completion_ids"].tolist()
        assert ids[0][:l2] == ids[2][:l2] and ids[2][:l3] == ids[3][:l3] and start(episodes[3], 2) == l3
        r = [reward_of_last_call(None, None, [ep])[0] for ep in episodes]
        mean = sum(r) / 4
        d = math.sqrt(sum((x - mean) ** 2 for x in r) / 3) + 1e-4
        v0, v3 = (r[0] + r[2] + r[3]) / 3, (r[2] + r[3]) / 2  # under the trunk of root 0, under slot 2's own part
        a0 = (v0 - mean) / d
        a1 = ((r[0] - mean) + (r[0] - v0)) / d
        a2 = (r[1] - mean) / d
        a3 = ((v3 - mean) + (v3 - v0)) / d
        a4 = ((r[2] - mean) + (r[2] - v3)) / d
        a5 = ((r[3] - mean) + (r[3] - v3)) / d
        by_hand = [
            [a0] * l2 + [a1] * (lengths[0] - l2),
            [a2] * lengths[1],
            [0.0] * l2 + [a3] * (l3 - l2) + [a4] * (lengths[2] - l3),
            [0.0] * l3 + [a5] * (lengths[3] - l3),
        ]
        owned = [
            [1] * lengths[0],
            [1] * lengths[1],
            [0] * l2 + [1] * (lengths[2] - l2),
            [0] * l3 + [1] * (lengths[3] - l3),
        ]
        width = output["completion_ids"].size(1)
        expected = torch.tensor([row + [0.0] * (width - len(row)) for row in by_hand])
        torch.testing.assert_close(output["advantages"], expected, rtol=0, atol=1e-6)
        env = [[1] * len(ep.turns[0].completion_ids) for ep in episodes]
        for e, ep in enumerate(episodes):  # the sampled tokens (1) and the context between calls (0)
            for j in (1, 2):
                env[e] += [0] * (start(ep, j) - len(env[e])) + [1] * len(ep.turns[j].completion_ids)
        mask = [[m * o for m, o in zip(env[e], owned[e], strict=True)] for e in range(4)]
        got = (output["completion_mask"] * output["tool_mask"]).tolist()
        assert [row[: lengths[e]] for e, row in enumerate(got)] == mask
        n = sum(map(sum, mask))
        assert int(output["num_items_in_batch"]) == n  # a shared segment counted once

        # TRL's loss, untouched: every token's gradient is -A / N on the tokens the rows own, 0 on the copies.
        output["row_id"] = torch.arange(4)
        (chunk,) = micro_batches(trainer, output, inputs, 1)
        loss, token_grads, _ = loss_and_gradients(trainer, chunk, 1)
        loss_mask = torch.zeros(4, width)
        for e in range(4):
            loss_mask[e, : lengths[e]] = torch.tensor(mask[e], dtype=torch.float32)
        torch.testing.assert_close(loss, -(expected * loss_mask).sum() / n)
        order = chunk["row_id"].tolist()
        torch.testing.assert_close(token_grads, (-expected * loss_mask / n)[order], rtol=1e-5, atol=1e-7)

        metrics = trainer._metrics["train"]
        assert metrics["tree/branches"] == [2.0] and metrics["tree/replayed_calls"] == [1.5]
        assert 0 < metrics["tree/forward_tokens_saved"][0] < 1  # what a prefix tree would save (nothing ran yet)
        if prefix_tree_training:  # the next batch logs what the training forward above saved, as it counted it
            stats = dict(trainer._scoring.tree_stats)
            assert stats["forward_tokens"] < stats["flat_tokens"]
            AgenticGRPOTrainer._generate_and_score_completions(trainer, [dict(dataset()[1]) for _ in range(4)])
            assert metrics["tree/forward_tokens_saved"][1] == 1 - stats["forward_tokens"] / stats["flat_tokens"]
    finally:
        trainer.close()
    record = [line for line in (tmp_path / "episodes" / "episodes-rank0.jsonl").read_text().splitlines()][3]
    assert '"tree": {"root": ' in record and '"branch_point": 2' in record and '"segments": [' in record


def test_rollout_tree_off_trains_as_before(tmp_path, tokenizer):
    trainer = tree_trainer(tmp_path, tokenizer)
    inputs = [dict(dataset()[0]) for _ in range(4)]
    try:
        trainer.model.train()
        output = trainer._generate_and_score_completions(inputs)
    finally:
        trainer.close()
    episodes = [x["episodes"] for x in inputs]
    assert all(TREE_KEY not in ep.metadata and ep.replay is None for ep in episodes)
    assert output["advantages"].dim() == 1 and "tree/branches" not in trainer._metrics["train"]
    r = torch.tensor(reward_of_last_call(None, None, episodes))
    torch.testing.assert_close(output["advantages"], (r - r.mean()) / (r.std() + 1e-4))


def test_tree_spec_layout():
    assert TreeSpec(3, depth=2).level_sizes() == [2, 1] and TreeSpec(2).roots(4) == 2


# The asynchronous producer: a tree is one unit, admitted under one version; branches start when their parent closed


def test_the_producer_runs_each_group_as_a_tree_under_one_version(start_server, tokenizer):
    server = start_server(counting_engine(tokenizer), tokenizer)
    tree = TreeSpec(branches=3, branch_points="entropy", depth=2)
    producer = RolloutProducer(server, resolve_agent(CALCULATOR.agent), max_staleness=0, timeout=60, tree=tree)
    tasks = [dict(task) for task in build_calculator_dataset(size=2) for _ in range(4)]  # 2 groups of 4
    try:
        producer.submit(0, tasks, [i % 4 for i in range(8)], consume_version=0, unit_size=4, seed=7)
        episodes, _ = producer.result(0, timeout=60)
    finally:
        producer.close()
    assert [ep.metadata["start_version"] for ep in episodes] == [0] * 8
    for group in (episodes[:4], episodes[4:]):
        ids = [ep.id for ep in group]
        trees = [ep.metadata[TREE_KEY] for ep in group]
        # One root (4 - 3 branches); level 1: two branches of the root; level 2: one branch of a level-1 branch,
        # after its own branch point; each branch replayed its parent's calls before its branch point, token for token
        assert [t["parent"] for t in trees[:3]] == [None, ids[0], ids[0]]
        assert trees[3]["parent"] in ids[1:3] and trees[3]["root"] == ids[0]
        assert trees[3]["branch_point"] > trees[ids.index(trees[3]["parent"])]["branch_point"]
        assert trees[1]["branch_point"] != trees[2]["branch_point"]  # a parent's next branch takes its next call
        for ep, info in zip(group[1:], trees[1:]):
            parent = group[ids.index(info["parent"])]
            assert ep.replay["diverged"] is False and ep.num_replayed_calls == info["branch_point"]
            for j in range(info["branch_point"]):
                assert ep.turns[j].completion_ids == parent.turns[j].completion_ids
            assert not ep.turns[info["branch_point"]].replayed
        assert [ep.group_index for ep in group] == [0, 1, 2, 3]


def test_per_turn_rewards_with_trees_are_refused_with_the_fix(tmp_path, tokenizer):
    def per_turn(prompts, completions, episodes, **kwargs):
        return [{"final": 1.0, "turns": [0.1] * len(ep.turns)} for ep in episodes]

    trainer = tree_trainer(tmp_path, tokenizer, reward_funcs=per_turn, rollout_tree=True, tree_branches=1)
    try:
        trainer.model.train()
        with pytest.raises(ValueError, match="turn_reward_weight=0"):
            trainer._generate_and_score_completions([dict(dataset()[0]) for _ in range(4)])
    finally:
        trainer.close()


def test_run_tree_groups_needs_whole_groups(start_server, tokenizer):
    server = start_server(counting_engine(tokenizer), tokenizer)
    agent = resolve_agent(CALCULATOR.agent)
    with pytest.raises(ValueError, match="multiple of num_generations"):
        run_rollout(run_tree_groups(server, agent, [{"prompt": []}] * 3, 2, TreeSpec(1)))


def test_trees_train_under_asynchronous_rollouts(tmp_path, tokenizer):
    """The trainer's producer runs the trees (one unit per group) ahead of the trainer, within the staleness bound."""
    trainer = tree_trainer(
        tmp_path,
        tokenizer,
        rollout_tree=True,
        tree_branches=2,
        tree_depth=2,
        async_rollouts=True,
        max_steps=2,
        logging_steps=1,
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    logs = [entry for entry in trainer.state.log_history if "tree/branches" in entry]
    assert [entry["tree/branches"] for entry in logs] == [2.0, 2.0]
    assert all(entry["tree/replay_diverged"] == 0.0 for entry in logs)
