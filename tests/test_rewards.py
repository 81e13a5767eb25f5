"""Reward functions: the unscorable rule holds for every form TRL accepts, reward models included (issue #9)."""

import torch
from transformers import AutoModelForSequenceClassification

from trl_agentic.rewards.utils import RewardModelFunc, unscorable_unless_ok
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer
from trl_agentic.trace import Episode, Turn


def tiny_reward_model(path):
    """A one-label sequence classifier saved with its tokenizer, as a reward model on the Hub would be."""
    tokenizer = build_tiny_tokenizer("qwen2_5")
    config = build_tiny_model(tokenizer).config
    config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


def test_reward_model_given_as_id_or_module_leaves_failed_episodes_unscored(tmp_path):
    model, tokenizer = tiny_reward_model(tmp_path / "rm")
    prompts = [[{"role": "user", "content": "What is 2 + 3?"}]] * 3
    completions = [
        [{"role": "assistant", "content": "The answer is 5."}],
        [{"role": "assistant", "content": "6"}],
        [{"role": "assistant", "content": "The answer is 5."}],
    ]
    episodes = [Episode(id="a", status="ok"), Episode(id="b", status="ok"), Episode(id="c", status="timeout")]

    # What TRL's GRPOTrainer computes for an nn.Module reward (chat template, right padding, first logit).
    texts = [tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
    inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.inference_mode():
        expected = model.eval()(**inputs).logits[:, 0].tolist()

    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")  # a module, as TRL accepts it
    for given in (str(tmp_path / "rm"), loaded):
        reward = unscorable_unless_ok(given)
        assert callable(reward) and reward.__name__ == "rm"  # the name TRL logs it under
        scores = reward(prompts, completions, episodes=episodes)
        assert scores[2] is None  # the timed-out episode is not scored
        assert torch.allclose(torch.tensor(scores[:2]), torch.tensor(expected[:2]), atol=1e-5)
    assert isinstance(RewardModelFunc(model, tokenizer=tokenizer), RewardModelFunc)  # a module without a path


def test_cut_off_penalty_scores_ok_episodes_and_agents_that_raised_on_a_cut_off_answer():
    """The last call decides; an agent that raised right after a cut-off call (the Agents SDK's `ModelBehaviorError`
    on an `incomplete` response) is scored -1, not left unscorable; other failed episodes stay unscored."""
    import pytest

    from trl_agentic.rewards import cut_off_penalty
    from trl_agentic.trace import Turn

    cut, done = Turn(0, [1], [2, 3], [-0.1, -0.2], "length"), Turn(0, [1], [2, 0], [-0.1, -0.2], "tool_calls")
    episodes = [
        Episode(id="a", status="ok", turns=[cut, done]),
        Episode(id="b", status="ok", turns=[done, cut]),
        Episode(id="c", status="ok"),
        Episode(id="d", status="timeout", turns=[cut]),
        Episode(id="e", status="agent_error", turns=[cut]),
        Episode(id="f", status="agent_error", turns=[cut, done]),
    ]
    # an earlier cut call that the agent went on from is not the answer
    expected = [0.0, -1.0, 0.0, None, -1.0, None]
    assert cut_off_penalty([None] * 6, [[]] * 6, episodes=episodes) == expected
    assert unscorable_unless_ok(cut_off_penalty)([None] * 6, [[]] * 6, episodes=episodes) == expected  # not masked
    with pytest.raises(ValueError, match="episodes"):
        cut_off_penalty([None], [[{"role": "assistant", "content": "4"}]])


def test_cut_off_penalty_reads_the_main_lines_last_call():
    """The main line's last call decides, not the episode's: a title request cut at its token limit after the main
    line answered is no cut-off answer, and a main line cut off stays cut off whatever side call comes after it."""
    from trl_agentic.rewards import cut_off_penalty
    from trl_agentic.trace import Turn

    def call(index, finish_reason, conversation, role):
        return Turn(index, [1], [2, 3], [-0.1, -0.2], finish_reason, conversation=conversation, role=role)

    answered_then_cut_title = [
        call(0, "tool_calls", 0, "main"),
        call(1, "stop", 0, "main"),
        call(2, "length", 2, "side_call"),
    ]
    cut_then_title = [call(0, "tool_calls", 0, "main"), call(1, "length", 0, "main"), call(2, "stop", 2, "side_call")]
    cut_sub_agent = [call(0, "tool_calls", 0, "main"), call(1, "length", 1, "sub_agent"), call(2, "stop", 0, "main")]
    episodes = [
        Episode(id="a", status="ok", turns=answered_then_cut_title),
        Episode(id="b", status="ok", turns=cut_then_title),
        Episode(id="c", status="agent_error", turns=cut_then_title),
        Episode(id="d", status="ok", turns=cut_sub_agent),
    ]
    assert cut_off_penalty([None] * 4, [[]] * 4, episodes=episodes) == [0.0, -1.0, -1.0, 0.0]


def test_reward_functions_returning_the_wrong_count_or_non_float32_values_are_named():
    """A wrong count used to fail in a bare `zip()`; 1e39 or inf became inf in TRL's float32 rewards and silently
    zeroed the group's advantage (issue 29, N4/N5). NaN stays TRL's "unscorable", as `None`."""
    import math
    import re

    import pytest

    episodes = [Episode(id="a", status="ok"), Episode(id="b", status="timeout")]

    def short(prompts, completions, **kwargs):
        return [1.0]

    def scores_failures(prompts, completions, **kwargs):
        return [1.0, 0.0, 1.0]

    scores_failures.scores_failed_episodes = True
    for func in (short, scores_failures):
        with pytest.raises(ValueError, match=rf"{func.__name__!r} returned {len(func(None, None))} rewards for 2 "):
            unscorable_unless_ok(func)([None] * 2, [[]] * 2, episodes=episodes)

    for bad in (1e39, -1e39, math.inf, -math.inf, "1.0"):

        def huge(prompts, completions, bad=bad, **kwargs):
            return [0.5, bad]

        huge.scores_failed_episodes = True
        with pytest.raises(ValueError, match=rf"'huge' returned {re.escape(repr(bad))} for episode 1.*float32"):
            unscorable_unless_ok(huge)([None] * 2, [[]] * 2, episodes=episodes)

    def unscorable(prompts, completions, **kwargs):
        return [math.nan, None]

    values = unscorable_unless_ok(unscorable)([None] * 2, [[]] * 2, episodes=episodes)
    assert math.isnan(values[0]) and values[1] is None
    assert unscorable_unless_ok(lambda prompts, completions, **kw: [3e38, -3e38])([None] * 2, [[]] * 2) == [3e38, -3e38]


def test_weighted_rewards_whose_group_statistics_overflow_float32_are_refused():
    """Each within float32, but TRL's float32 group mean (3e38 + 3e38) or std overflows: NaN advantages, refused."""
    import pytest
    import torch

    from trl_agentic.rewards.utils import check_weighted_rewards

    nan = float("nan")
    check_weighted_rewards(torch.tensor([[1.0, nan], [0.0, 2.0], [nan, nan], [5.0, nan]]), torch.ones(2), "fg", 2)
    with pytest.raises(ValueError, match=r"group 0 .* too far apart for float32"):
        check_weighted_rewards(torch.tensor([[3e38], [3e38], [-3e38]]), torch.ones(1), ["f"], 3)
    with pytest.raises(ValueError, match=r"group 1 .* too far apart for float32"):
        check_weighted_rewards(torch.tensor([[0.0], [1.0], [3e38], [-3e38]]), torch.ones(1), ["f"], 2)
    with pytest.raises(ValueError, match=r"episode 1 \(\{'f': 2e\+38, 'g': None\}\) weighted by reward_weights"):
        check_weighted_rewards(torch.tensor([[0.0, 0.0], [2e38, nan]]), torch.tensor([1.0, 1.0]) * 2, "fg", 2)


def test_async_callable_classes_are_awaited_and_masked():
    """An instance whose `__call__` is `async def`: the wrapper was synchronous, so TRL never awaited it and `finish`
    got a coroutine (TypeError). TRL's `is_async_callable` is what decides, as in TRL."""
    import asyncio

    from trl.trainer.utils import is_async_callable

    class AsyncScorer:
        async def __call__(self, prompts, completions, **kwargs):
            return [{"final": 1.0, "turns": [0.5]}] * len(prompts)

    episodes = [
        Episode(id="a", status="ok", turns=[Turn(0, [1], [2], [-0.1], "stop")]),
        Episode(id="b", status="timeout"),
    ]
    wrapped = unscorable_unless_ok(AsyncScorer())
    assert is_async_callable(wrapped)
    assert asyncio.run(wrapped([None] * 2, [[]] * 2, episodes=episodes)) == [1.0, None]
    assert episodes[0].metadata["turn_rewards"] == {"AsyncScorer": [0.5]}


def test_reward_callables_without_a_name_keep_their_weight_for_per_turn_rewards():
    """A functools.partial or a callable instance has no `__name__`: TRL named the wrapper "wrapped" (its
    `reward_weights` key) while the per-turn rewards were filed under "partial", so the weight was lost (1.0)."""
    import functools

    from trl.trainer.utils import get_callable_name

    from trl_agentic.rewards.process import combine_turn_rewards

    def per_turn(prompts, completions, episodes, bonus, **kwargs):
        return [[bonus] for _ in episodes]

    class PerTurn:
        def __call__(self, prompts, completions, episodes, **kwargs):
            return [[1.0] for _ in episodes]

    for func, name in ((functools.partial(per_turn, bonus=2.0), "per_turn"), (PerTurn(), "PerTurn")):
        episode = Episode(id="a", status="ok", turns=[Turn(0, [1], [2], [-0.1], "stop")])
        wrapped = unscorable_unless_ok(func)
        wrapped([None], [[]], episodes=[episode])
        assert get_callable_name(wrapped) == name  # what TRL names it: reward_func_names, rewards/<name>/mean
        assert combine_turn_rewards(episode, {get_callable_name(wrapped): 3.0}) == [
            3.0 * (2.0 if name == "per_turn" else 1.0)
        ]
