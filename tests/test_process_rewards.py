"""Per-turn (process) rewards (issue 34): what a reward function may return, the per-turn advantage terms, and the
per-token advantages the trainer hands TRL's unchanged loss, checked against hand computations.

The trainer-level tests record real multi-turn episodes through the endpoint (the agents of test_learning_parity.py),
then check the (B, T) advantage tensor, the loss and the per-token loss gradients d loss / d logp exactly: with TRL's
`dapo` loss at ratio 1, a sampled token with advantage A gets -A / N (N: sampled tokens of the batch).
"""

import math

import pytest
import torch

from test_learning_parity import (
    KNOBS,
    TOOLS,
    dataset,
    loss_and_gradients,
    micro_batches,
    rewriting_agent,
    three_turn_agent,
)
from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.rewards.process import (
    combine_turn_rewards,
    row_token_advantages,
    split_turn_rewards,
    turn_advantage_terms,
    turn_conversation_ids,
)
from trl_agentic.rewards.utils import unscorable_unless_ok
from trl_agentic.rollout.rows import episode_to_rows, row_token_turns
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer
from trl_agentic.trace import Episode, Turn


def turn(index, prompt, completion, parent=None):
    source = "continued" if parent is not None else "rendered"
    return Turn(
        index,
        list(prompt),
        list(completion),
        [-0.1] * len(completion),
        "stop",
        prompt_source=source,
        parent_turn=parent,
    )


def two_turn_episode(status="ok"):
    return Episode("e", status=status, turns=[turn(0, [1, 2], [10, 11]), turn(1, [1, 2, 10, 11, 4, 5], [12], 0)])


# What a reward function may return


def test_lists_and_dicts_split_into_final_and_per_turn_rewards():
    episodes = [two_turn_episode(), two_turn_episode(), two_turn_episode()]
    finals = split_turn_rewards("f", [[0.5, None], {"final": 1.0, "turns": [0, 1]}, 2.0], episodes)
    assert finals == [None, 1.0, 2.0]  # a bare list gives no final reward; a number is TRL's, untouched
    assert [ep.metadata.get("turn_rewards") for ep in episodes] == [{"f": [0.5, None]}, {"f": [0.0, 1.0]}, None]
    assert combine_turn_rewards(episodes[0], {"f": 2.0}) == [1.0, None]
    assert combine_turn_rewards(episodes[2], {"f": 2.0}) is None


def test_the_reward_wrapper_keeps_per_turn_rewards_of_ok_episodes_only():
    """`unscorable_unless_ok` (what the trainer and `trl-agentic eval` apply to every function): a failed episode's
    final and per-turn rewards both go."""
    episodes = [two_turn_episode(), two_turn_episode(status="timeout")]
    func = unscorable_unless_ok(lambda prompts, completions, **kw: [{"final": 1.0, "turns": [1.0, 0.0]}] * 2)
    assert func(["q", "q"], [[], []], episodes=episodes) == [1.0, None]
    assert episodes[0].metadata["turn_rewards"] == {"<lambda>": [1.0, 0.0]}
    assert "turn_rewards" not in episodes[1].metadata


@pytest.mark.parametrize(
    "output, message",
    [
        ([[1.0]], "returned 1 per-turn rewards for episode 0, which has 2 turns"),
        ([[1.0, "good"]], "returned 'good' for turn 1 of episode 0"),
        ([[1.0, math.inf]], "returned inf for turn 1 of episode 0"),
        ([{"final": 1.0, "turn": [1.0, 0.0]}], "keys ['turn']"),
    ],
)
def test_malformed_per_turn_rewards_are_refused_by_name(output, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        split_turn_rewards("well_formed_calls", output, [two_turn_episode()])


def test_per_turn_rewards_need_episodes():
    with pytest.raises(ValueError, match="need the episodes' turns"):
        split_turn_rewards("f", [[1.0]], None)


# Per-turn advantage terms, by hand


def test_turn_advantage_terms_by_hand():
    # One group of two 3-turn episodes: rewards [1, -, 0] and [0, 0.5, 1]. Rewarded turns 1, 0, 0, 0.5, 1: mean 0.5,
    # sample std 0.5, so they normalise to z, -z, -z, 0, z with z = 0.5 / (0.5 + 1e-4); an unrewarded turn is left out
    # of the mean. Each term is the discounted mean of the rewards from its turn on (issue 40: a sum grew with the
    # turns left), scaled only when the group's largest exceeds 1.
    rewards = [[1.0, None, 0.0], [0.0, 0.5, 1.0]]
    z = 0.5 / 0.5001
    # gamma 0.5: t2 = n2 / 1, t1 = (n1? + 0.5 n2) / (1? + 0.5), t0 = (n0 + 0.5 n1? + 0.25 n2) / (1 + 0.5 (1?) + 0.25)
    expected = [[(z - 0.25 * z) / 1.25, -z, -z], [(-z + 0.25 * z) / 1.75, 0.5 * z / 1.5, z]]
    got = turn_advantage_terms(rewards, group_size=2, discount=0.5, normalization="group", weight=1.0)
    for row, want in zip(got, expected, strict=True):
        assert row == pytest.approx(want, abs=1e-12)
    # "mean": r - 0.5, gamma 1 (reward-to-go), weight 2: means [0, -0.5, -0.5] and [0, 0.25, 0.5]
    got = turn_advantage_terms(rewards, group_size=2, discount=1.0, normalization="mean", weight=2.0)
    assert got == [pytest.approx([0.0, -1.0, -1.0]), pytest.approx([0.0, 0.5, 1.0])]
    # "none", gamma 0: each turn's own raw reward, scaled by the group's largest (3, then 2) to at most `weight`;
    # episodes without per-turn rewards get None; groups are separate
    got = turn_advantage_terms(
        [[3.0, None], None, [1.0], [2.0]], group_size=2, discount=0.0, normalization="none", weight=1.0
    )
    assert got == [[1.0, 0.0], None, [0.5], [1.0]]
    # a group whose rewarded turns all agree normalises to 0 (no spread: nothing to prefer)
    assert turn_advantage_terms([[1.0, 1.0], [1.0]], group_size=2) == [[0.0, 0.0], [0.0]]


def test_row_token_turns_and_token_advantages_on_int_lists():
    # Labelled (as lineage labels an episode when it closes), so that which conversation is the main line (the first
    # row) is given here, not decided by lineage's rules
    t0 = labelled_turn(0, 0, "main", [1, 2, 3], [10, 11])
    t1 = labelled_turn(1, 0, "main", [1, 2, 3, 10, 11, 4, 5], [12, 13], parent=0)  # 4, 5: tool output + template glue
    t2 = labelled_turn(2, 2, "side_call", [9], [20])  # another conversation: a row of its own
    t3 = labelled_turn(3, 2, "side_call", [9, 20, 6], [21], parent=2)
    rows = episode_to_rows([t0, t1, t2, t3]).rows
    assert [row.completion_ids for row in rows] == [[10, 11, 4, 5, 12, 13], [20, 6, 21]]
    assert [row_token_turns(row, [t0, t1, t2, t3]) for row in rows] == [[0, 0, -1, -1, 1, 1], [2, -1, 3]]
    # A = 1, terms per turn 0.5, -0.5, 2, 3; row scales 1 and 0.5 (e.g. `grpo`'s share)
    assert row_token_advantages(rows, [t0, t1, t2, t3], 1.0, [0.5, -0.5, 2.0, 3.0], [1.0, 0.5]) == [
        [1.5, 1.5, 1.0, 1.0, 0.5, 0.5],
        [1.5, 0.5, 2.0],
    ]


# The trainer: per-token advantages into TRL's loss


def staged_reward(prompts, completions, episodes, **kwargs):
    """Final 1 for the first episode of a group, 0 for the second; per-turn rewards [1, -, 0] and [0, 0.5, 1]."""
    table = {0: [1.0, None, 0.0], 1: [0.0, 0.5, 1.0]}
    return [{"final": float(ep.group_index == 0), "turns": table[ep.group_index]} for ep in episodes]


def fork_turn_reward(prompts, completions, episodes, a, **kwargs):
    """Per-turn rewards for task 0's episodes (they fork: two rows), a final reward alone for task 1's."""
    return [
        {"final": float(ep.group_index), "turns": [1.0, 0.0] if ep.group_index == 0 else [0.0, 0.0]}
        if task == 0
        else float(sum(sum(t.completion_ids) for t in ep.turns) % 7)
        for ep, task in zip(episodes, a, strict=True)
    ]


def trl_group_advantages(finals):
    """TRL's rule: (r - group mean) / (group std + 1e-4), groups of 2."""
    rewards = torch.tensor(finals).view(-1, 2)
    return ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten().tolist()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


def test_per_turn_rewards_give_the_hand_computed_token_advantages_loss_and_gradients(tmp_path, tokenizer):
    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=three_turn_agent,
        reward_funcs=staged_reward,
        processing_class=tokenizer,
        train_dataset=dataset(),
        args=AgenticGRPOConfig(
            output_dir=str(tmp_path),
            loss_type="dapo",
            steps_per_generation=1,
            gradient_accumulation_steps=1,
            turn_reward_discount=0.5,
            log_episodes=True,
            **dict(KNOBS, per_device_train_batch_size=4),
        ),
    )
    train = dataset()
    inputs = [dict(train[i]) for i in (0, 0, 1, 1)]
    try:
        trainer.model.train()
        output = trainer._generate_and_score_completions(inputs)
    finally:
        trainer.close()
    episodes = [x["episodes"] for x in inputs]
    assert [len(ep.turns) for ep in episodes] == [3, 3, 3, 3] and output["prompt_ids"].size(0) == 4  # one row each

    # By hand: the final advantages (TRL's rule), the per-turn terms (see test_turn_advantage_terms_by_hand, gamma
    # 0.5, the default weight 0.5), and each token's turn from the turns' lengths: c0, context, c1, context, c2.
    final = trl_group_advantages([1.0, 0.0, 1.0, 0.0])
    z = 0.5 / 0.5001
    terms = [[0.5 * 0.6 * z, -0.5 * z, -0.5 * z], [-0.5 * 3 / 7 * z, 0.5 * z / 3, 0.5 * z]] * 2  # w = 0.5
    expected = torch.zeros(4, output["completion_ids"].size(1))
    for e, ep in enumerate(episodes):
        t0, t1, t2 = ep.turns
        spans = [
            (t0, 0, None),
            (t1, len(t1.prompt_ids) - len(t0.prompt_ids) - len(t0.completion_ids), 1),
            (t2, len(t2.prompt_ids) - len(t1.prompt_ids) - len(t1.completion_ids), 2),
        ]
        values = [final[e] + terms[e][0]] * len(t0.completion_ids)
        for current, context, k in spans[1:]:
            values += [final[e]] * context + [final[e] + terms[e][k]] * len(current.completion_ids)
        expected[e, : len(values)] = torch.tensor(values)
        assert output["tool_mask"][e, : len(values)].tolist() == [int(v != final[e]) for v in values], (
            "context tokens are exactly those left at the final advantage"
        )
    torch.testing.assert_close(output["advantages"], expected, rtol=0, atol=1e-6)
    assert episodes[0].metadata["turn_advantages"] == pytest.approx(terms[0])

    # TRL's loss, untouched: the loss and every sampled token's gradient are the hand computation's.
    output["row_id"] = torch.arange(4)
    (chunk,) = micro_batches(trainer, output, inputs, 1)
    loss, token_grads, grads = loss_and_gradients(trainer, chunk, 1)
    mask = (output["completion_mask"] * output["tool_mask"]).bool()
    n = int(mask.sum())
    assert int(output["num_items_in_batch"]) == n
    torch.testing.assert_close(loss, -(expected[mask]).sum() / n)
    order = chunk["row_id"].tolist()  # the micro-batch is shuffled
    torch.testing.assert_close(token_grads, torch.where(mask, -expected / n, 0.0)[order], rtol=1e-5, atol=1e-7)
    assert grads and all(g.abs().sum() > 0 for g in grads.values() if g.dim() > 1)


def test_forked_episodes_and_final_only_episodes_in_one_batch(tmp_path, tokenizer):
    """Task 0's episodes fork (two rows, per-turn rewards): the extra row carries its turn's term. Task 1's have a
    final reward only: every sampled token gets -A / N, as without per-turn rewards."""
    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=rewriting_agent,
        reward_funcs=fork_turn_reward,
        processing_class=tokenizer,
        train_dataset=dataset(),
        args=AgenticGRPOConfig(
            output_dir=str(tmp_path),
            loss_type="dapo",
            steps_per_generation=1,
            gradient_accumulation_steps=1,
            turn_reward_normalization="none",
            turn_reward_discount=0.0,
            turn_reward_weight=1.0,  # the largest raw reward is 1: the terms are the raw rewards
            agent_columns=["prompt", "a"],  # the agent reads `a`
            **dict(KNOBS, per_device_train_batch_size=4),
        ),
    )
    train = dataset()
    inputs = [dict(train[i]) for i in (0, 0, 1, 1)]
    try:
        trainer.model.train()
        output = trainer._generate_and_score_completions(inputs)
    finally:
        trainer.close()
    episodes = [x["episodes"] for x in inputs]
    rows_per_episode = [episode_to_rows(ep.turns).rows for ep in episodes]
    assert [len(rows) for rows in rows_per_episode] == [2, 2, 1, 1]
    finals = [0.0, 1.0] + [float(sum(sum(t.completion_ids) for t in ep.turns) % 7) for ep in episodes[2:]]
    final = trl_group_advantages(finals)
    assert final[2] != 0, "task 1's group did not split; the final-only comparison would be vacuous"
    terms = [[1.0, 0.0], [0.0, 0.0], None, None]  # raw, gamma 0: each turn's own reward

    owner = list(range(4)) + [e for e, rows in enumerate(rows_per_episode) for _ in rows[1:]]
    row_of = [rows_per_episode[e][0] for e in range(4)] + [r for rows in rows_per_episode for r in rows[1:]]
    assert output["advantages"].shape == output["completion_ids"].shape == (6, output["completion_ids"].size(1))
    output["row_id"] = torch.arange(6)
    (chunk,) = micro_batches(trainer, output, inputs, 1)
    _, token_grads, _ = loss_and_gradients(trainer, chunk, 1)
    n = int((output["completion_mask"] * output["tool_mask"]).sum())
    for position, row_id in enumerate(chunk["row_id"].tolist()):
        e, row = owner[row_id], row_of[row_id]
        if terms[e] is None:  # one row of two turns, context between: -A / N on every sampled token, as before
            expected = [-final[e] / n if m else 0.0 for m in row.env_mask]
        else:  # task 0: one row per turn (the second is the fork), no context
            (k,) = row.turns
            expected = [-(final[e] + terms[e][k]) / n] * len(row.env_mask)
        grads = token_grads[position, : len(row.env_mask)]
        torch.testing.assert_close(grads, torch.tensor(expected), rtol=1e-5, atol=1e-7)
        assert (token_grads[position, len(row.env_mask) :] == 0).all()


# Credit along conversations, bounded (issue 40, item 2)


def labelled_turn(index, conversation, role, prompt, completion, parent=None):
    t = turn(index, prompt, completion, parent)
    t.conversation, t.role = conversation, role
    return t


def test_reward_to_go_runs_along_each_conversation_not_call_order():
    """A title call (turn 0) and a sub-agent's turn (2) come between and before main-line turns 1 and 3: a turn's
    term averages the rewards of its own conversation's later turns only ("none", gamma 1, weight 1, by hand)."""
    episode = Episode(
        "e",
        turns=[
            labelled_turn(0, 0, "side_call", [7], [8]),
            labelled_turn(1, 1, "main", [1, 2], [10]),
            labelled_turn(2, 2, "sub_agent", [5], [6]),
            labelled_turn(3, 1, "main", [1, 2, 10, 4], [11], parent=1),
        ],
    )
    conversations = turn_conversation_ids(episode)
    assert conversations == [0, 1, 2, 1]
    terms = turn_advantage_terms(
        [[1.0, 0.0, -1.0, 0.5]], group_size=1, normalization="none", weight=1.0, conversations=[conversations]
    )
    # main: turn 1 -> mean(0, 0.5), turn 3 -> 0.5; the title and the sub-agent keep their own reward
    assert terms == [[1.0, 0.25, -1.0, 0.5]]


def test_the_per_turn_term_does_not_grow_with_the_turns_left_and_cannot_outweigh_the_outcome():
    """The issue's case: 40 turns, defaults (gamma 1, group normalization). The reward-to-go summed 40 normalised
    rewards (+5.96 at turn 0), so more calls meant more advantage; now each term is a mean of the rewards to come,
    scaled so that the group's largest is at most `w` (default 0.5): two episodes' terms differ by at most 1, less
    than the smallest gap TRL's group normalization puts between a passed and a failed episode, 2 sqrt((G-1)/G)."""
    good, bad = [1.0] * 40, [0.0] * 40
    short = [1.0] * 4
    terms = turn_advantage_terms([good, bad, short, [0.0] * 4], group_size=4)
    weight = AgenticGRPOConfig.__dataclass_fields__["turn_reward_weight"].default
    assert weight == 0.5
    assert all(abs(x) <= weight + 1e-12 for term in terms for x in term)
    # As many good calls, in 40 turns or 4: the same term (a mean), whatever the number of turns left
    assert terms[0][0] == pytest.approx(terms[2][0]) and terms[0][0] == pytest.approx(terms[0][39])
    z = 0.5 / (math.sqrt(0.25 * 88 / 87) + 1e-4)  # 44 ones and 44 zeros, normalised; the sum gave 40 z at turn 0
    assert terms[0][0] == pytest.approx(weight * z) and terms[1][0] == pytest.approx(-weight * z)
    assert 2 * weight < 2 * math.sqrt(1 / 2)  # G = 2, the smallest gap


def test_per_turn_rewards_that_sum_past_float32_give_bounded_terms():
    """Two functions' per-turn rewards, each within float32, summed past it (6e38): the terms stay within
    [-w, w] whatever the normalization (they became inf in the (B, T) float32 advantages: NaN parameters)."""
    episode = two_turn_episode()
    split_turn_rewards("f", [[3e38, -3e38]], [episode])
    split_turn_rewards("g", [[3e38, -3e38]], [episode])
    combined = combine_turn_rewards(episode, {"f": 1.0, "g": 1.0})
    for normalization in ("group", "mean", "none"):
        terms = turn_advantage_terms([combined, [0.0, 0.0]], group_size=2, normalization=normalization, weight=2.0)
        values = torch.tensor([x for term in terms for x in term], dtype=torch.float32)
        assert torch.isfinite(values).all() and values.abs().max() <= 2.0, (normalization, terms)


async def title_between_agent(client, task):
    """A main-line call, a title request sharing nothing with it (a side call), then the main line again."""
    messages = list(task["prompt"])
    response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=5)
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "Write a title for this chat."}], max_tokens=3
    )
    message = response.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if message.tool_calls:
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "42"} for c in message.tool_calls]
    else:
        messages.append({"role": "user", "content": "Use the add tool."})
    await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=5)
    return None


def title_reward(prompts, completions, episodes, **kwargs):
    """The title call (turn 1) of each group's first episode is rewarded 1; every main-line turn 0."""
    return [{"final": float(ep.group_index == 0), "turns": [0.0, float(ep.group_index == 0), 0.0]} for ep in episodes]


def test_the_trainer_keeps_a_side_calls_reward_out_of_the_main_lines_earlier_turns(tmp_path, tokenizer):
    """In call order the title's reward flowed into the main line's first turn (reward-to-go over turns 0..2); along
    conversations (lineage) the main line's turns get the main line's rewards only."""
    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=title_between_agent,
        reward_funcs=title_reward,
        processing_class=tokenizer,
        train_dataset=dataset(),
        args=AgenticGRPOConfig(
            output_dir=str(tmp_path),
            turn_reward_normalization="none",  # raw rewards: 1 at most, so the terms are the means themselves
            turn_reward_weight=1.0,
            **KNOBS,
        ),
    )
    inputs = [dict(dataset()[0]) for _ in range(2)]
    try:
        trainer.model.train()
        trainer._generate_and_score_completions(inputs)
    finally:
        trainer.close()
    episodes = [x["episodes"] for x in inputs]
    assert [turn_conversation_ids(ep) for ep in episodes] == [[0, 1, 0], [0, 1, 0]]
    assert [[t.role for t in ep.turns] for ep in episodes] == [["main", "side_call", "main"]] * 2
    assert [ep.metadata["turn_advantages"] for ep in episodes] == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]


def huge_finals(prompts, completions, **kwargs):
    return [3e38] * len(prompts)


def test_final_rewards_whose_weighted_sum_overflows_float32_stop_with_the_fix(tmp_path, tokenizer):
    """Two functions' finals, each within float32 (3e38), weighted and summed by TRL past it: the group's advantages
    were NaN (NaN parameters, loss logged 0, no error). Now an error names the episode, the values and the fix."""
    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=three_turn_agent,
        reward_funcs=[huge_finals, staged_reward],
        processing_class=tokenizer,
        train_dataset=dataset(),
        args=AgenticGRPOConfig(output_dir=str(tmp_path), reward_weights=[1.0, 1e38], **KNOBS),
    )
    inputs = [dict(dataset()[0]) for _ in range(2)]
    try:
        trainer.model.train()
        with pytest.raises(ValueError, match=r"episode 0 .* sum to 4e\+38, beyond float32.*Rescale the reward"):
            trainer._generate_and_score_completions(inputs)
    finally:
        trainer.close()
