"""Versions served side by side (issue 43): a candidate takes a share of new episodes (never a call in the middle of
an episode), is promoted when its online reward holds up against the incumbent's, rolled back when it does not, and
every answer says which version produced it. Real TransformersEngines on tiny models, a real server."""

import threading
import time

import httpx
import openai
import pytest
import torch

from trl_agentic.endpoint.app import EndpointSettings, create_app
from trl_agentic.endpoint.chat import ChatRenderer
from trl_agentic.endpoint.server import EndpointServer
from trl_agentic.endpoint.users import task_fingerprint
from trl_agentic.endpoint.versions import RolloutPolicy, VersionManager
from trl_agentic.generation.transformers_engine import TransformersEngine
from trl_agentic.store import SQLiteEpisodeStore
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


class Engine:
    """A stand-in engine for the pure decision tests (no model call is made)."""

    def __init__(self):
        self.policy_version = 0
        self.stopped = False

    async def start(self):
        pass

    async def stop(self):
        self.stopped = True


def test_the_candidate_takes_its_share_of_new_episodes_deterministically():
    manager = VersionManager(Engine(), RolloutPolicy(candidate_share=0.25, min_episodes=10, margin=0.05), seed=0)
    manager.add_candidate(Engine(), version=1)
    picks = [manager.assign(f"ep-{i}") for i in range(2000)]
    share = picks.count(1) / len(picks)
    assert 0.22 < share < 0.28 and set(picks) == {0, 1}
    again = VersionManager(Engine(), RolloutPolicy(candidate_share=0.25, min_episodes=10, margin=0.05), seed=0)
    again.add_candidate(Engine(), version=1)
    assert [again.assign(f"ep-{i}") for i in range(2000)] == picks  # by the episode id: reproducible


def test_promotion_and_rollback_follow_the_stated_rule():
    policy = RolloutPolicy(candidate_share=0.5, min_episodes=4, margin=0.1, confidence=0.5)  # z = 0: the means alone
    manager = VersionManager(Engine(), policy, seed=0)
    manager.add_candidate(Engine(), version=1)
    for value in (1.0, 0.0, 1.0, 1.0):  # the incumbent over the candidate's window: mean 0.75
        manager.record_reward(0, value)
    for value in (1.0, 1.0, 0.0):  # 3 < min_episodes: no decision yet
        assert manager.record_reward(1, value) is None
    decision = manager.record_reward(1, 0.5)  # mean 0.625 >= 0.75 - 0.1? no: 0.625 < 0.65 -> rolled back
    assert (decision.action, decision.version) == ("rolled_back", 1)
    assert "0.625" in decision.reason and "0.750" in decision.reason and "-0.125" in decision.reason
    assert manager.incumbent == 0 and manager.candidate is None
    manager.add_candidate(Engine(), version=2)
    for value in (1.0, 0.0, 1.0, 1.0):
        manager.record_reward(0, value)
    for value in (1.0, 1.0, 0.0, 1.0):  # 0.75 >= 0.65: promoted
        decision = manager.record_reward(2, value)
    assert (decision.action, decision.version, manager.incumbent) == ("promoted", 2, 2)
    table = {v["version"]: v["state"] for v in manager.describe()}
    assert table == {0: "retired", 1: "rolled_back", 2: "incumbent"}


def test_a_noisy_trial_goes_on_until_the_difference_is_sure_and_a_harmful_candidate_is_rolled_back():
    """At confidence 0.95 a candidate that scores 0.1 against an incumbent's 0.25 is not promoted on its first episodes
    (at 0.5, the means alone, 8 noisy rewards let it through), and is rolled back within `max_episodes`; a candidate
    as good as the incumbent is promoted once the difference's error is within the margin (~50 episodes here)."""
    harmful = [1.0 if i % 10 == 0 else 0.0 for i in range(200)]  # 0.1, its first 8: 0.125
    incumbent = [1.0 if i % 4 == 0 else 0.0 for i in range(200)]  # 0.25
    loose = VersionManager(Engine(), RolloutPolicy(min_episodes=8, margin=0.15, confidence=0.5), seed=0)
    loose.add_candidate(Engine(), version=1)
    for value in incumbent:
        loose.record_reward(0, value)
    assert [loose.record_reward(1, v) for v in harmful[:8]][-1].action == "promoted"  # the means alone: let through
    policy = RolloutPolicy(candidate_share=0.5, min_episodes=8, margin=0.1, confidence=0.95, max_episodes=200)
    manager = VersionManager(Engine(), policy, seed=0)
    manager.add_candidate(Engine(), version=1)
    for value in incumbent:
        manager.record_reward(0, value)
    decisions = [manager.record_reward(1, value) for value in harmful]
    made = [(i + 1, d.action) for i, d in enumerate(decisions) if d is not None]
    assert len(made) == 1 and made[0][1] == "rolled_back" and 8 < made[0][0] <= 200
    assert manager.incumbent == 0 and manager.candidate is None
    manager.add_candidate(Engine(), version=2)
    for value in incumbent:
        manager.record_reward(0, value)
    decisions = [manager.record_reward(2, value) for value in incumbent]  # as good
    made = [(i + 1, d.action) for i, d in enumerate(decisions) if d is not None]
    assert len(made) == 1 and made[0][1] == "promoted" and 40 <= made[0][0] <= 100 and manager.incumbent == 2
    with pytest.raises(ValueError, match="confidence"):
        RolloutPolicy(confidence=1.0)


def test_the_verdict_pairs_episodes_by_task_so_a_different_task_mix_is_not_read_as_better_or_worse():
    """Two versions equally good on each task, the incumbent served mostly an easy task and the candidate mostly a
    hard one. Unpaired (no task named), the candidate is rolled back on the mix alone; paired by task it is promoted.
    A candidate worse by 0.5 on every task, on the easy task's mix, is rolled back paired (unpaired its mix hid it)."""
    easy = [1.0] * 9 + [0.0]  # 0.9
    hard = [0.0] * 9 + [1.0]  # 0.1
    policy = RolloutPolicy(candidate_share=0.5, min_episodes=20, margin=0.1, confidence=0.9, max_episodes=200)

    def trial(named: bool, incumbent_mix, candidate_mix):
        manager = VersionManager(Engine(), policy, seed=0)
        manager.add_candidate(Engine(), version=1)
        for value, task in incumbent_mix:
            manager.record_reward(0, value, task=task if named else None)
        made = [manager.record_reward(1, value, task=task if named else None) for value, task in candidate_mix]
        return [(i + 1, d.action, d.reason) for i, d in enumerate(made) if d is not None]

    mostly_easy = [(v, "easy") for v in easy * 12] + [(v, "hard") for v in hard * 3]  # 120 easy, 30 hard: 0.74
    mostly_hard = [(v, "hard") for v in hard * 12] + [(v, "easy") for v in easy * 3]  # 120 hard, 30 easy: 0.26
    unpaired = trial(False, mostly_easy, mostly_hard)
    assert [(n, action) for n, action, _ in unpaired] == [(20, "rolled_back")]  # 0.1 vs 0.74 on its first 20
    paired = trial(True, mostly_easy, mostly_hard)
    assert [action for _, action, _ in paired] == ["promoted"]
    # the hard task's 40 episodes (0.1, as the incumbent's 0.1 on it) pair and the error is within the margin
    assert paired[0][0] == 40 and "paired by task over 40 of its 40 episodes (1 task both" in paired[0][2]
    assert "difference +0.000" in paired[0][2] and "unpaired means 0.100 vs the incumbent's 0.740" in paired[0][2]

    worse_easy = [0.0 if i % 5 in (0, 1, 2) else 1.0 for i in range(10)]  # 0.4 on the easy task (the incumbent: 0.9)
    worse_hard = [0.0] * 10  # 0.0 on the hard one (0.1)
    harmful = [(v, "easy") for v in worse_easy * 4] + [(v, "hard") for v in worse_hard]  # mean 0.32
    against = [(v, "easy") for v in easy] + [(v, "hard") for v in hard * 4]  # the incumbent's mean 0.26
    unpaired = trial(False, against, harmful)
    assert [action for _, action, _ in unpaired] == ["promoted"]  # the easy mix hides a worse policy
    paired = trial(True, against, harmful)
    # its first 40 episodes are of the easy task, which the incumbent served 10 times (< min_episodes on its side):
    # judged once its first hard-task episode pairs it against the incumbent's 40 of those
    assert [action for _, action, _ in paired] == ["rolled_back"] and paired[0][0] == 41
    # (40 x (0.4 - 0.9) + 1 x (0.0 - 0.1)) / 41 = -0.490
    assert "difference -0.490" in paired[0][2] and "unpaired means 0.390 vs the incumbent's 0.260" in paired[0][2]


def test_a_candidate_whose_episodes_fail_fast_waits_for_the_incumbents_episodes_before_it_is_judged():
    """Reproduces the harmful-update run: the broken candidate's episodes (2 tokens each) were all rewarded 0 before
    the incumbent had 3 rewards in the window, also 0 by chance, and it was promoted. Now both sides need
    `min_episodes`, paired or not."""
    policy = RolloutPolicy(candidate_share=0.5, min_episodes=16, margin=0.1, confidence=0.8, max_episodes=200)
    for named in (True, False):
        manager = VersionManager(Engine(), policy, seed=0)
        manager.add_candidate(Engine(), version=1)
        tasks = [f"task-{i % 4}" if named else None for i in range(64)]
        for i in range(3):
            manager.record_reward(0, 0.0, task=tasks[i])
        assert [manager.record_reward(1, 0.0, task=tasks[i]) for i in range(32)] == [None] * 32
        incumbent = [1.0 if i % 4 == 0 else 0.0 for i in range(64)]  # 0.25
        made = [manager.record_reward(0, value, task=tasks[i]) for i, value in enumerate(incumbent)]
        window = [(i + 4, d.action) for i, d in enumerate(made) if d is not None]  # the incumbent's reward decides,
        assert window == [(16, "rolled_back")], named  # once its window holds min_episodes (3 before + 13)
        assert (
            "mean reward 0.000" in manager.decisions[-1].reason
            or "unpaired means 0.000" in manager.decisions[-1].reason
        )
        assert manager.incumbent == 0 and manager.candidate is None


def test_the_length_guard_rolls_back_a_candidate_whose_episodes_change_length_whatever_its_reward():
    """The harmful-update runs' spikes that the reward let through: answers as often right, every episode at the token
    limit (48 against 31), or cut to a few tokens. With `length_guard=0.5` both are rolled back once each version has
    `min_episodes`; a candidate within 1.5x is judged on its reward as before, and with the guard off nothing
    changes."""
    incumbent_tokens = [30, 32, 31, 31] * 5  # 31 a episode
    rewards = [1.0, 0.0, 0.0, 0.0] * 5  # the same for both versions

    def trial(guard, candidate_tokens):
        policy = RolloutPolicy(candidate_share=0.5, min_episodes=20, margin=0.1, confidence=0.5, length_guard=guard)
        manager = VersionManager(Engine(), policy, seed=0)
        manager.add_candidate(Engine(), version=1)
        for value, tokens in zip(rewards, incumbent_tokens, strict=True):
            manager.record_reward(0, value, tokens=tokens)
        made = [
            manager.record_reward(1, value, tokens=tokens)
            for value, tokens in zip(rewards, candidate_tokens, strict=True)
        ]
        return [(i + 1, d.action, d.reason) for i, d in enumerate(made) if d is not None]

    to_the_limit = trial(0.5, [48] * 20)
    assert [(n, action) for n, action, _ in to_the_limit] == [(20, "rolled_back")]
    assert (
        "length guard: 48.0 sampled tokens per episode over 20 episodes vs the incumbent's 31.0" in to_the_limit[0][2]
    )
    assert "(1.55x, outside 1/1.5-1.5x)" in to_the_limit[0][2]
    cut_short = trial(0.5, [2, 3] * 10)
    assert [(n, action) for n, action, _ in cut_short] == [(20, "rolled_back")] and "(0.08x" in cut_short[0][2]
    within = trial(0.5, [40] * 20)  # 1.29x: judged on the reward, as good: promoted
    assert [(n, action) for n, action, _ in within] == [(20, "promoted")]
    assert [action for _, action, _ in trial(None, [48] * 20)] == ["promoted"]  # off: the reward alone
    with pytest.raises(ValueError, match="length_guard"):
        RolloutPolicy(length_guard=0.0)


def test_the_malformed_guard_rolls_back_a_candidate_that_broke_the_tool_call_format_whatever_its_reward():
    """The harmful-update run after the version-sync fix: the spike's candidate made 1 model call an episode, 66% of
    them malformed, against the incumbent's 23%, at as good a reward (feedback on a weak incumbent and on a broken
    candidate differed by less than its noise) and as long episodes. With `malformed_guard=0.15` it is rolled back once
    each version has `min_episodes`; a rise within the guard (or not shown beyond it at the confidence) is judged on
    the reward; off, nothing changes."""
    rewards = [1.0, 0.0, 0.0, 0.0] * 5  # the same for both versions
    incumbent = [(2, m) for m in [0, 1, 0, 0, 1] * 4]  # (calls, malformed): 0.2 malformed per call on average

    def trial(guard, candidate, confidence=0.5):
        policy = RolloutPolicy(
            candidate_share=0.5, min_episodes=20, margin=0.1, confidence=confidence, malformed_guard=guard
        )
        manager = VersionManager(Engine(), policy, seed=0)
        manager.add_candidate(Engine(), version=1)
        for value, (calls, malformed) in zip(rewards, incumbent, strict=True):
            manager.record_reward(0, value, tokens=30, calls=calls, malformed=malformed)
        made = [
            manager.record_reward(1, value, tokens=30, calls=calls, malformed=malformed)
            for value, (calls, malformed) in zip(rewards, candidate, strict=True)
        ]
        return [(i + 1, d.action, d.reason) for i, d in enumerate(made) if d is not None]

    broken = [(1, m) for m in [1, 1, 1, 0] * 5]  # 0.75
    made = trial(0.15, broken)
    assert [(n, action) for n, action, _ in made] == [(20, "rolled_back")]
    assert made[0][2] == (
        "malformed guard: 75.0% of model calls with a malformed tool call over 20 episodes vs the incumbent's 20.0% "
        "over 20: difference +0.550 +- 0.000 (confidence 0.5), guard 0.15"
    )
    assert [action for _, action, _ in trial(0.15, broken, confidence=0.8)] == ["rolled_back"]
    within = [(2, m) for m in [1, 0, 0, 1, 1] * 4]  # 0.3: +0.1, within the guard: judged on the reward
    assert [action for _, action, _ in trial(0.15, within)] == ["promoted"]
    beyond = [(2, m) for m in [1, 1, 0, 1, 1] * 4]  # 0.4: +0.2 +- 0.061 at 0.8, not shown beyond 0.15 there
    assert [action for _, action, _ in trial(0.15, beyond)] == ["rolled_back"]
    # at 0.8 the guard does not fire; the reward rule then needs more episodes at 0.8 than these 20 (the trial goes on)
    assert trial(0.15, beyond, confidence=0.8) == trial(None, beyond, confidence=0.8) == []
    assert [action for _, action, _ in trial(None, broken)] == ["promoted"]  # off: the reward alone
    with pytest.raises(ValueError, match="malformed_guard"):
        RolloutPolicy(malformed_guard=1.5)


def test_a_candidate_whose_tasks_the_incumbent_did_not_serve_waits_then_is_judged_unpaired():
    policy = RolloutPolicy(candidate_share=0.5, min_episodes=4, margin=0.1, confidence=0.5, max_episodes=8)
    manager = VersionManager(Engine(), policy, seed=0)
    manager.add_candidate(Engine(), version=1)
    for value in (1.0, 0.0, 1.0, 1.0):
        manager.record_reward(0, value, task="a")
    made = [manager.record_reward(1, 1.0, task=f"new-{i}") for i in range(8)]  # no task in common: no pair
    assert made[:7] == [None] * 7
    assert made[7].action == "promoted" and "too few episodes paired by task" in made[7].reason


def test_a_newer_candidate_supersedes_one_still_on_trial():
    manager = VersionManager(Engine(), RolloutPolicy(candidate_share=0.5, min_episodes=4, margin=0.1), seed=0)
    first = Engine()
    manager.add_candidate(first, version=1)
    manager.add_candidate(Engine(), version=2)
    assert manager.candidate == 2
    assert {v["version"]: v["state"] for v in manager.describe()}[1] == "superseded"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


def test_every_answer_names_its_version_and_an_episode_never_changes_version(tokenizer, tmp_path):
    torch.manual_seed(0)
    incumbent = TransformersEngine(build_tiny_model(tokenizer, seed=1), pad_token_id=tokenizer.pad_token_id)
    candidate = TransformersEngine(build_tiny_model(tokenizer, seed=2), pad_token_id=tokenizer.pad_token_id)
    manager = VersionManager(incumbent, RolloutPolicy(candidate_share=0.5, min_episodes=1000, margin=0.0), seed=0)
    store = SQLiteEpisodeStore(tmp_path / "store.db")
    settings = EndpointSettings(user_episode_idle_timeout=60.0, default_max_tokens=4)
    app = create_app(incumbent, ChatRenderer(tokenizer), settings, store=store, versions=manager)
    with EndpointServer(app) as server:
        admin = {"Authorization": f"Bearer {server.admin_token}"}
        key = httpx.post(f"{server.url}/admin/users", json={"name": "alice"}, headers=admin).json()["key"]
        client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        first = client.chat.completions.with_raw_response.create(model="policy", messages=messages, max_tokens=4)
        assert first.headers["x-trl-agentic-version"] == "0"
        server.call(manager.add_candidate_async(candidate, version=1))  # a new version arrives mid-episode
        second = client.chat.completions.with_raw_response.create(model="policy", messages=messages, max_tokens=4)
        assert second.headers["x-trl-agentic-version"] == "0"  # the open episode stays on its version
        seen = set()
        for _ in range(12):  # new episodes: both versions serve
            httpx.post(f"{server.base_url}/episodes/end", headers={"Authorization": f"Bearer {key}"})
            raw = client.chat.completions.with_raw_response.create(model="policy", messages=messages, max_tokens=4)
            seen.add(raw.headers["x-trl-agentic-version"])
            assert raw.parse().system_fingerprint == f"policy-v{raw.headers['x-trl-agentic-version']}"
        assert seen == {"0", "1"}
        versions = httpx.get(f"{server.url}/admin/versions", headers=admin).json()["versions"]
        assert [(v["version"], v["state"], v["share"]) for v in versions] == [
            (0, "incumbent", 0.5),
            (1, "candidate", 0.5),
        ]
        auth = {"Authorization": f"Bearer {key}"}
        ended = httpx.post(f"{server.base_url}/episodes/end", json={"task": "What is 6 * 7?"}, headers=auth).json()
        for episode_id in store.episodes_of("alice"):
            episode = store.get_episode(episode_id)[0]
            assert len({turn.policy_version for turn in episode.turns}) == 1
        # feedback on an episode whose client named its task reaches the rule with the task: verdicts pair by it
        named = store.get_episode(ended["episode_id"])[0]
        assert named.metadata["fingerprint"] == task_fingerprint("What is 6 * 7?")
        feedback = httpx.post(
            f"{server.base_url}/feedback", json={"episode_id": ended["episode_id"], "value": 1.0}, headers=auth
        )
        assert feedback.status_code == 200
        version = named.turns[0].policy_version
        recorded = manager._versions[version].rewards[-1]
        assert recorded.task == task_fingerprint("What is 6 * 7?")
        assert recorded.tokens == named.num_sampled_tokens > 0  # for the length guard


def test_a_swap_neither_fails_nor_stalls_a_request_in_flight(tokenizer):
    """Promotion while a long call decodes on the old incumbent: the call completes on it, then it is stopped."""
    torch.manual_seed(0)
    old = TransformersEngine(build_tiny_model(tokenizer, seed=1), pad_token_id=tokenizer.pad_token_id)
    new = TransformersEngine(build_tiny_model(tokenizer, seed=2), pad_token_id=tokenizer.pad_token_id)
    manager = VersionManager(old, RolloutPolicy(candidate_share=1.0, min_episodes=1, margin=1.0), seed=0)
    app = create_app(old, ChatRenderer(tokenizer), EndpointSettings(), versions=manager)
    with EndpointServer(app) as server:
        session = server.open_episode()
        assert session.engine is old
        client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0)
        result = {}

        def long_call():
            result["answer"] = client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "go"}], max_tokens=200, temperature=1.0
            )

        thread = threading.Thread(target=long_call)
        thread.start()
        time.sleep(0.3)
        server.call(manager.add_candidate_async(new, version=1))
        manager.record_reward(0, 0.0)
        decision = manager.record_reward(1, 1.0)
        assert decision.action == "promoted"
        thread.join(timeout=60)
        assert result["answer"].choices[0].finish_reason in ("stop", "length")
        assert result["answer"].system_fingerprint == "policy-v0"
        server.close_episode(session.episode.id)
        assert server.open_episode().engine is new
        deadline = time.monotonic() + 10
        while manager.engine_of(0) is not None and time.monotonic() < deadline:  # retired once drained
            time.sleep(0.05)
        assert manager.engine_of(0) is None
