"""Alarms: each fires on a history built to trigger it and stays silent on a real, healthy one; one real run with a
gameable reward raises `reward_hacking` through the trainer's callback and held-out evaluation."""

import json
import warnings
from pathlib import Path

import pytest
from datasets import Dataset
from transformers import TrainerControl, TrainerState

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.alarms import (
    ALARM_NAMES,
    AlarmsCallback,
    AlarmSettings,
    TrainingAlarm,
    check_alarms,
    history_from_episode_records,
    history_from_log_history,
    reward_hacking,
)
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


# Real per-step metrics of the demo's GRPO phase (79 steps, seed 0; see "source" in the file): reward 0.52 -> 0.65
# (10-step means), split rate ~0.7, 35 sampled tokens and 1.9 turns per episode, malformed calls falling.
HEALTHY = json.loads((Path(__file__).parent / "data" / "demo_run_history.json").read_text())["history"]
# Held-out success the demo measured at steps 0 and 50 (seed 0, README / docs/demo_held_out_success.png).
DEMO_HELD_OUT = [(0, 0.35), (50, 0.66)]


def healthy_history() -> dict[str, list[tuple[int, float]]]:
    return {name: [(int(step), float(value)) for step, value in points] for name, points in HEALTHY.items()}


def with_series(history, name, change):
    """`history` with `name`'s value at each step replaced by `change(step, value)`."""
    return {**history, name: [(step, change(step, value)) for step, value in history[name]]}


def names(history, settings=None):
    return [alarm.name for alarm in check_alarms(history, settings)]


def test_silent_on_every_prefix_of_a_healthy_demo_run():
    history = healthy_history()
    history["held_out/success"] = DEMO_HELD_OUT
    last = history["reward"][-1][0]
    for step in range(last + 1):  # as the callback sees it, log after log
        prefix = {name: [(s, v) for s, v in points if s <= step] for name, points in history.items()}
        assert names(prefix) == [], f"false alarm at step {step}"


def test_reward_hacking_fires_when_reward_rises_and_held_out_stays_flat_or_falls():
    # A gameable checker: the same run, with the reward climbing +0.01 per step while held-out success does not move.
    gamed = with_series(healthy_history(), "reward", lambda step, value: min(1.0, value + 0.01 * step))
    for held_out in ([(0, 0.35), (50, 0.35)], [(0, 0.35), (50, 0.30)]):
        alarms = check_alarms({**gamed, "held_out/success": held_out})
        assert [a.name for a in alarms] == ["reward_hacking"]
        assert alarms[0].step == 50 and alarms[0].evidence["reward_after"] - alarms[0].evidence["reward_before"] > 0.3
    # Held-out success following the reward: silent. Without a held-out measure there is nothing to check against.
    assert names({**gamed, "held_out/success": [(0, 0.35), (50, 0.66)]}) == []
    assert names(gamed) == []


def test_reward_hacking_compares_with_every_earlier_evaluation():
    reward = [(s, 0.3 if s <= 40 else 0.8) for s in range(1, 81)]
    # Held-out rose early (0 -> 40) then stayed flat while the reward jumped (40 -> 80).
    alarm = reward_hacking(reward, [(0, 0.1), (40, 0.5), (80, 0.5)])
    assert alarm is not None and alarm.evidence["from_step"] == 40


def test_reward_hacking_holds_held_out_against_training_success_at_the_target_difficulty():
    # Adaptive sampling moved groups from hard to easy tasks: the mean reward rose 0.45 -> 0.65 while the training
    # success at the target difficulty (what the held-out split measures) and held-out success stayed level.
    history = {
        "reward": [(s, 0.45 if s <= 50 else 0.65) for s in range(1, 101)],
        "sampling/target_success": [(s, 0.6) for s in range(1, 101)],
        "held_out/success": [(0, 0.6), (50, 0.6), (100, 0.6)],
    }
    assert names(history) == []
    # Success at the target rising while held-out success does not: the alarm, naming what it compared.
    history["sampling/target_success"] = [(s, 0.6 if s <= 50 else 0.8) for s in range(1, 101)]
    alarms = check_alarms(history)
    assert [a.name for a in alarms] == ["reward_hacking"]
    assert "training success at the target difficulty rose 0.600 -> 0.800" in alarms[0].message
    # Without the target's success the mean reward is what there is.
    del history["sampling/target_success"]
    assert "training reward rose 0.450 -> 0.650" in check_alarms(history)[0].message


def test_reward_hacking_holds_held_out_against_the_reward_metric_it_is_told_to():
    # A trajectory judge beside a format reward (issue 34): the summed reward stays level while the judge's score
    # climbs and held-out success (the objective checker) does not move. Only the judge's series shows the hacking.
    history = {
        "reward": [(s, 0.7) for s in range(1, 101)],
        "rewards/trajectory_judge/mean": [(s, 0.3 if s <= 50 else 0.7) for s in range(1, 101)],
        "sampling/target_success": [(s, 0.6) for s in range(1, 101)],
        "held_out/success": [(0, 0.6), (50, 0.6), (100, 0.6)],
    }
    assert names(history) == []
    alarms = check_alarms(history, AlarmSettings(reward_metric="rewards/trajectory_judge/mean"))
    assert [a.name for a in alarms] == ["reward_hacking"]
    assert "rewards/trajectory_judge/mean rose 0.300 -> 0.700" in alarms[0].message
    # A metric the run never logged is a configuration error, not a silent pass.
    with pytest.raises(ValueError, match="alarm_reward_metric 'rewards/judge/mean' was never logged"):
        check_alarms(history, AlarmSettings(reward_metric="rewards/judge/mean"))
    assert (
        AlarmSettings.from_config(
            AgenticGRPOConfig(output_dir="x", use_cpu=True, bf16=False, alarm_reward_metric="r")
        ).reward_metric
        == "r"
    )


def test_reward_hacking_holds_held_out_against_training_success_on_tasks_not_seen_before():
    # The sampler revisits tasks: success on revisited tasks rose (learned by heart, the demo's seed 0: 0.43 on first
    # visits, 0.56 on revisits at steps 150-200) while success on first visits followed held-out success. Not a gamed
    # checker: no alarm.
    history = {
        "sampling/target_success": [(s, 0.4 if s <= 50 else 0.6) for s in range(1, 101)],
        "sampling/target_success_unseen": [(s, 0.4) for s in range(1, 101, 3)],
        "held_out/success": [(0, 0.4), (50, 0.4), (100, 0.41)],
    }
    assert names(history) == []
    # Success on new tasks rising while held-out success does not: the training checker pays for something the
    # held-out one does not.
    history["sampling/target_success_unseen"] = [(s, 0.4 if s <= 50 else 0.6) for s in range(1, 101, 3)]
    alarms = check_alarms(history)
    assert [a.name for a in alarms] == ["reward_hacking"]
    assert "training success on new tasks at the target difficulty rose 0.400 -> 0.600" in alarms[0].message


def test_reward_hacking_allows_for_the_noise_of_both_measurements():
    # Seed 2 of the demo (issue #11): training success 0.69 -> 0.80 between two held-out evaluations of 200 episodes
    # each, held-out 67.5% -> 65.5%. Per-step training success scatters by +-0.15 around its mean (~30 episodes a
    # step, tasks solved always or never), held-out by ~3.3 points per evaluation: a shortfall of 0.13 is within
    # twice the noise of the comparison (~0.17), let alone three times.
    noisy = [(s, (0.69 if s <= 100 else 0.80) + (0.15 if s % 2 else -0.15)) for s in range(1, 151)]
    held_out = [(0, 0.345), (100, 0.675), (150, 0.655)]
    small = [(0, 200), (100, 200), (150, 200)]
    assert reward_hacking(noisy, held_out, held_out_episodes=small) is None
    # Steady training success and evaluations 25 times larger: the same shortfall is not noise any more.
    steady = [(s, 0.69 if s <= 100 else 0.80) for s in range(1, 151)]
    alarm = reward_hacking(steady, held_out, held_out_episodes=[(0, 5000), (100, 5000), (150, 5000)])
    assert alarm is not None and alarm.evidence["from_step"] == 100
    assert alarm.evidence["noise"] == pytest.approx(3 * (0.675 * 0.325 / 5000 + 0.655 * 0.345 / 5000) ** 0.5)
    # A reward gamed far beyond the noise fires however small the evaluation; without episode counts only the
    # training side's noise is known.
    gamed = [(s, (0.2 if s <= 100 else 0.9) + (0.15 if s % 2 else -0.15)) for s in range(1, 151)]
    assert reward_hacking(gamed, held_out, held_out_episodes=small) is not None
    assert reward_hacking(steady, held_out) is not None
    # Through the callback's history: `held_out/episodes` is what it records with each evaluation.
    history = {
        "sampling/target_success": noisy,
        "held_out/success": held_out,
        "held_out/episodes": [(s, float(n)) for s, n in small],
    }
    assert names(history) == []
    assert names(
        {**history, "sampling/target_success": steady, "held_out/episodes": [(s, 5000.0) for s, _ in small]}
    ) == ["reward_hacking"]


def test_length_drift_fires_on_growing_episodes_without_reward():
    history = healthy_history()
    longer = with_series(
        history, "episodes/sampled_tokens_mean", lambda step, value: value * (1 + max(0, step - 40) / 20)
    )  # 35 -> ~100 tokens by step 78
    assert names(longer) == ["length_drift"]
    more_turns = with_series(history, "episodes/turns_mean", lambda step, value: value + max(0, step - 50) / 10)
    alarms = check_alarms(more_turns)
    assert [a.name for a in alarms] == ["length_drift"] and "turns per episode" in alarms[0].message
    # The same growth while the reward climbs is not drift.
    paid = with_series(longer, "reward", lambda step, value: value + 0.01 * step)
    assert names(paid) == []


def test_malformed_tool_call_and_unscorable_spikes():
    history = healthy_history()
    last = history["reward"][-1][0]
    malformed = with_series(
        history, "episodes/malformed_tool_calls_mean", lambda step, value: 0.8 if step > last - 5 else value
    )  # 0.8 of ~1.9 calls
    assert names(malformed) == ["malformed_tool_calls"]
    failing = with_series(history, "episodes/unscorable", lambda step, value: 0.3 if step > last - 5 else value)
    assert names(failing) == ["unscorable_episodes"]
    # Without `episodes/unscorable`, episodes that did not end ok count (they are unscorable by default).
    no_unscorable = {k: v for k, v in history.items() if k != "episodes/unscorable"}
    timeouts = with_series(no_unscorable, "episodes/status_ok", lambda step, value: 0.6 if step > last - 5 else 1.0)
    assert names(timeouts) == ["unscorable_episodes"]
    # One bad step is noise, not a spike.
    blip = with_series(history, "episodes/unscorable", lambda step, value: 0.3 if step == last else value)
    assert names(blip) == []


def by_level_history(steps: int, rates, shares) -> dict:
    """Per-level malformed-call metrics as the trainer logs them (`sampling/model_calls/<level>`, model calls at that
    level in the step, `sampling/malformed_rate/<level>` and `sampling/groups/<level>`) and the overall ones they add
    up to: 8 groups of 8 episodes of 2 calls a step. `rates(step)`/`shares(step)`: {level: malformed calls per call},
    {level: share of the groups}."""
    history: dict[str, list] = {"reward": [], "episodes/turns_mean": [], "episodes/malformed_tool_calls_mean": []}
    for step in range(1, steps + 1):
        groups = {level: 8 * share for level, share in shares(step).items() if share}
        malformed = sum(16 * groups[level] * rates(step)[level] for level in groups)
        history["reward"].append((step, 0.5))
        history["episodes/turns_mean"].append((step, 2.0))
        history["episodes/malformed_tool_calls_mean"].append((step, malformed / 64))
        for level, count in groups.items():
            history.setdefault(f"sampling/model_calls/{level}", []).append((step, 16 * count))
            history.setdefault(f"sampling/malformed_rate/{level}", []).append((step, rates(step)[level]))
            history.setdefault(f"sampling/groups/{level}", []).append((step, count))
    return history


def test_malformed_tool_calls_compares_like_with_like_across_difficulties():
    # An adaptive sampler moves the mix: at 3 digits the policy writes a broken call one time in two, at 2 digits one
    # in twenty, and neither rate moves. Over the last 5 steps the sampler draws 3-digit tasks 3 groups in 8 instead
    # of 1 in 8: the pooled rate rises 0.11 -> 0.22, but at every difficulty the policy writes calls as well as before.
    steady = {2: 0.05, 3: 0.5}
    moved = by_level_history(
        30, lambda step: steady, lambda step: {2: 5 / 8, 3: 3 / 8} if step > 25 else {2: 7 / 8, 3: 1 / 8}
    )
    without_levels = {k: v for k, v in moved.items() if not k.startswith("sampling/")}
    assert names(without_levels) == ["malformed_tool_calls"]  # pooled: the mix looks like a breakage
    assert names(moved) == []
    # The policy breaks at one difficulty (2-digit calls 0.05 -> 0.25 of calls) at an unchanged mix: it fires, and the
    # evidence compares the rate seen with the one expected from each difficulty's earlier rate.
    broken = by_level_history(
        30, lambda step: {2: 0.25 if step > 25 else 0.05, 3: 0.5}, lambda step: {2: 7 / 8, 3: 1 / 8}
    )
    alarms = check_alarms(broken)
    assert [a.name for a in alarms] == ["malformed_tool_calls"]
    after, before = 7 / 8 * 0.25 + 1 / 8 * 0.5, 7 / 8 * 0.05 + 1 / 8 * 0.5
    assert alarms[0].evidence["after"] == pytest.approx(after)
    assert alarms[0].evidence["before"] == pytest.approx(before)
    assert "at each difficulty" in alarms[0].message
    # A difficulty first drawn in the last steps has no earlier rate to compare with: its calls are left out.
    new_level = by_level_history(
        30, lambda step: {2: 0.05, 3: 0.9}, lambda step: {2: 5 / 8, 3: 3 / 8} if step > 25 else {2: 1.0, 3: 0.0}
    )
    assert names(new_level) == []


def test_malformed_tool_calls_needs_more_than_a_few_groups_can_produce_by_chance():
    # A task's episodes tend to fail alike (the demo, seed 2, step 100: all 8 episodes of "What is 4 * 1?" ended their
    # call with "4 * 1."), so the alarm counts groups, not calls: one 1-digit group a step, broken five steps running
    # (the 1-digit rate 0.1 -> 1.0), moves the whole rate by 0.11 but is within 3 standard errors of what five groups
    # of a 0.1 rate can give.
    few = by_level_history(30, lambda step: {1: 1.0 if step > 25 else 0.1, 2: 0.05}, lambda step: {1: 1 / 8, 2: 7 / 8})
    assert names(few) == []
    assert names(few, AlarmSettings(noise_z=2.0)) == ["malformed_tool_calls"]
    # Logged without group counts (before they were logged), the calls count as independent.
    calls_only = {k: v for k, v in few.items() if not k.startswith("sampling/groups/")}
    assert names(calls_only) == ["malformed_tool_calls"]


def test_entropy_collapse():
    history = healthy_history()
    collapsed = with_series(history, "entropy", lambda step, value: value * 0.05 if step > 60 else value)
    assert names(collapsed) == ["entropy_collapse"]
    # The healthy run's entropy halves (0.116 -> 0.061 nats): sharpening, not collapse.
    assert names(history) == []


def test_low_split_rate():
    # `trl-agentic demo --seed 3` (issue #11): zero-std groups 1.00 step after step.
    dead = with_series(healthy_history(), "frac_reward_zero_std", lambda step, value: 1.0)
    alarms = check_alarms(dead)
    assert [a.name for a in alarms] == ["low_split_rate"] and alarms[0].evidence["split_rate"] == 0.0
    assert names(with_series(healthy_history(), "frac_reward_zero_std", lambda step, value: 0.7)) == []  # 30% split
    assert names(dead, AlarmSettings(min_split_rate=0.0)) == []


def test_history_from_log_history_skips_eval_and_non_numbers():
    log_history = [
        {"reward": 0.5, "step": 1, "eval_reward": 0.1, "note": "x"},
        {"reward": None, "step": 2},
        {"train_runtime": 3.0, "step": 2},
    ]
    assert history_from_log_history(log_history) == {"reward": [(1, 0.5)], "train_runtime": [(2, 3.0)]}


def test_history_from_episode_records_recomputes_the_trainer_metrics():
    def record(step, task, sample, reward, status="ok"):
        turn = {"completion_ids": [1, 2], "logprobs": [-0.5, -1.5], "malformed_tool_call": sample == 0}
        return {
            "step": step,
            "mode": "train",
            "episode": {
                "task_index": task,
                "group_index": sample,
                "turns": [turn],
                "status": status,
                "metadata": {"rewards": {"f": reward}},
            },
        }

    records = [record(1, 0, 0, 1.0), record(1, 1, 1, 0.0), record(1, 2, 0, None, "timeout"), record(1, 3, 1, None)]
    history = history_from_episode_records(records)
    assert history["reward"] == [(2, 0.5)]  # over the scorable episodes, logged when step 1's update completes
    assert history["frac_reward_zero_std"] == [(2, 0.5)]  # group 0 split (1.0, 0.0); group 1 had nothing scored
    assert history["episodes/unscorable"] == [(2, 0.5)] and history["episodes/status_ok"] == [(2, 0.75)]
    assert history["episodes/malformed_tool_calls_mean"] == [(2, 0.5)] and history["entropy"] == [(2, 1.0)]


def test_episode_records_with_difficulties_hold_each_level_to_its_own_rates_like_the_run():
    """The viewer recomputes the alarms from the episode log. A curriculum that moves groups to a level whose calls
    break, or whose episodes time out, more often raises the pooled rates with no change in the policy: with each
    record's difficulty the recomputed alarms compare like with like, as the run's do; without it, they would report
    spikes. A real rise at the target, at an unchanged mix, still fires."""

    def records(step, levels, target_timeouts=0):
        out = []
        for group, level in enumerate(levels):
            broken = 1 if level == 2 else 6  # 1 of 8 calls at the target, 6 of 8 at the harder level
            timeouts = target_timeouts if level == 2 else 4  # ... and 4 of 8 harder episodes time out
            for sample in range(8):
                turn = {"completion_ids": [1, 2], "logprobs": [-0.5, -0.5], "malformed_tool_call": sample < broken}
                unscorable = sample >= 8 - timeouts
                out.append(
                    {
                        "step": step,
                        "mode": "train",
                        "difficulty": level,
                        "target": level == 2,
                        "episode": {
                            "task_index": group * 8 + sample,
                            "group_index": sample,
                            "turns": [turn],
                            "status": "timeout" if unscorable else "ok",
                            "metadata": {"rewards": {"f": None if unscorable else float(sample % 2)}},
                        },
                    }
                )
        return out

    def alarms(log):
        return [alarm.name for alarm in check_alarms(history_from_episode_records(log))]

    log = [r for step in range(15) for r in records(step, [2, 2, 2, 3])]
    moved = log + [r for step in range(15, 20) for r in records(step, [2, 3, 3, 3])]  # the mix moves, rates do not
    history = history_from_episode_records(moved)
    assert history["sampling/malformed_rate/3"][-1] == (20, 0.75) and history["sampling/groups/3"][-1] == (20, 3.0)
    assert history["sampling/unscorable/3"][-1] == (20, 0.5) and history["sampling/episodes/3"][-1] == (20, 24.0)
    assert history["episodes/malformed_tool_calls_mean"][-1][1] == pytest.approx(19 / 32)  # 9 / 32 before
    assert history["episodes/unscorable"][-1][1] == pytest.approx(12 / 32)  # 4 / 32 before
    assert not {"malformed_tool_calls", "unscorable_episodes"} & set(alarms(moved))
    pooled = [{k: v for k, v in r.items() if k not in ("difficulty", "target")} for r in moved]
    assert {"malformed_tool_calls", "unscorable_episodes"} <= set(alarms(pooled))
    broken = log + [r for step in range(15, 20) for r in records(step, [2, 2, 2, 3], target_timeouts=4)]
    assert "unscorable_episodes" in alarms(broken) and "malformed_tool_calls" not in alarms(broken)


def test_callback_logs_warns_once_clears_and_writes_the_summary(tmp_path):
    args = AgenticGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    callback, state, control = AlarmsCallback(AlarmSettings(window=3)), TrainerState(), TrainerControl()
    logged = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, zero_std in enumerate([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0], start=1):
            state.global_step = step
            logs = {"reward": 0.5, "frac_reward_zero_std": zero_std}
            state.log_history.append({**logs, "step": step})
            callback.on_log(args, state, control, logs=logs)
            logged.append(logs["alarms/low_split_rate"])
            assert set(ALARM_NAMES) <= {k.removeprefix("alarms/") for k in state.log_history[-1]}
    assert logged == [0, 0, 1, 1, 0, 0, 0, 0, 0, 1]  # 3-step means: fires at 3, clears at 5, fires again at 10
    assert len([w for w in caught if issubclass(w.category, TrainingAlarm)]) == 2
    assert [(a["name"], a["step"], a["last_step"]) for a in callback.alarms] == [
        ("low_split_rate", 3, 4),
        ("low_split_rate", 10, 10),
    ]
    summary = json.loads((tmp_path / "alarms.json").read_text())
    assert summary["alarms"] == callback.alarms and summary["checks"] == list(ALARM_NAMES)


# ---------------------------------------------------------------------------------------------------------------------
# A real run


async def one_call_agent(client, task):
    response = await client.chat.completions.create(model="policy", messages=task["prompt"], max_tokens=8)
    return response.choices[0].message.content or ""


def answer_looks_like_a_number(prompts, completions, episodes, **kwargs):
    """Gameable on purpose: pays for the answer's format (the share of its characters that are digits), not for its
    value. A policy learns to print digits long before it learns to multiply."""
    return [sum(c.isdigit() for c in ep.result) / max(len(ep.result), 1) for ep in episodes]


def correct_answer(prompts, completions, episodes, answer, **kwargs):
    return [float(ep.result.strip() == expected) for ep, expected in zip(episodes, answer, strict=True)]


def test_reward_hacking_stays_silent_on_a_healthy_runs_swings():
    # Issue #11, the demo's seed 1 (default settings, decay over the last 50 steps): its success on new 2-digit
    # tasks, logged step by step (step 91 drew none), swung from a 10-step mean of 0.54 at step 50 to 0.78 at step
    # 100 and back to 0.56 over steps 101-125, while held-out success read 51.5% and 53.0% (200 episodes each) and
    # then rose to 72.0% by step 200. With 2 standard errors `reward_hacking` fired at step 100 (noise 0.170 against
    # a shortfall of 0.219): a run compares each evaluation with every earlier one (10 comparisons over 5
    # evaluations), and a policy's state carries from step to step, so 10-step windows scatter more than their
    # per-step values say. The default is 3.
    steps = [s for s in range(1, 101) if s != 91]
    values = [
        0.3125,
        0.0938,
        0.25,
        0.25,
        0.4583,
        0.1875,
        0.5,
        0.3125,
        0.2812,
        0.3125,
        0.5417,
        0.2917,
        0.3333,
        0.5312,
        0.4375,
        0.375,
        0.5,
        0.1667,
        0.6667,
        0.2917,
        0.4375,
        0.5,
        0.3333,
        0.5,
        0.5625,
        0.4583,
        0.4583,
        0.7083,
        0.5,
        0.4688,
        0.2917,
        0.5,
        0.5625,
        0.75,
        0.4375,
        0.625,
        0.75,
        0.6875,
        0.4583,
        0.5938,
        0.4167,
        0.7917,
        0.2917,
        0.5417,
        0.3438,
        0.7083,
        0.5,
        0.4583,
        0.5417,
        0.8125,
        0.5938,
        0.7083,
        0.625,
        0.0,
        0.375,
        0.5625,
        0.5833,
        0.0,
        0.4583,
        0.5625,
        0.25,
        0.5312,
        0.625,
        0.5,
        0.0625,
        0.5,
        0.4688,
        0.6875,
        0.625,
        0.625,
        0.125,
        0.625,
        0.5625,
        0.4583,
        0.375,
        0.5625,
        0.6667,
        0.4583,
        0.25,
        0.75,
        0.625,
        0.3125,
        0.6562,
        0.75,
        0.7083,
        0.6875,
        0.5,
        0.6667,
        0.75,
        0.75,
        1.0,
        0.8125,
        0.625,
        0.625,
        0.875,
        0.6875,
        0.875,
        0.8125,
        0.6875,
    ]
    success = list(zip(steps, values))
    held_out, episodes = [(0, 0.235), (50, 0.515), (100, 0.53)], [(0, 200), (50, 200), (100, 200)]
    assert reward_hacking(success, held_out, held_out_episodes=episodes, noise_z=2.0) is not None  # the false alarm
    assert reward_hacking(success, held_out, held_out_episodes=episodes) is None
    assert (
        names(
            {
                "sampling/target_success_unseen": success,
                "held_out/success": held_out,
                "held_out/episodes": [(s, float(n)) for s, n in episodes],
            }
        )
        == []
    )


def tasks(start, n):
    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": f"What is {i} * {i + 3}?"}], "answer": str(i * (i + 3))}
            for i in range(start, start + n)
        ]
    )


@pytest.mark.slow
def test_gameable_reward_raises_reward_hacking_against_held_out_success(tmp_path):
    tokenizer = build_tiny_tokenizer("qwen2_5")
    args = AgenticGRPOConfig(
        # A big lr: the tiny model games it in ~8-15 steps. With 12 steps, 3 of 12 seeds had not yet gamed it (one CI
        # run failed so); with 20, the alarm fired on 12 of 12 seeds.
        output_dir=str(tmp_path),
        max_steps=20,
        learning_rate=5e-2,
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=8,  # 2 tasks x 4 episodes per step
        held_out_eval_steps=5,
        alarm_window=3,  # held-out at steps 0, 5, 10, 15, 20; 3-step means
        use_cpu=True,
        bf16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=one_call_agent,
        reward_funcs=answer_looks_like_a_number,
        args=args,
        train_dataset=tasks(10, 8),
        processing_class=tokenizer,
        eval_dataset=tasks(50, 4),  # held out: never trained on
    )
    # The held-out evaluation uses the trainer's agent with a strict checker (a custom AlarmsCallback could pass any).
    trainer.alarms_callback.held_out.reward_funcs = [correct_answer]
    try:
        with pytest.warns(TrainingAlarm, match="reward_hacking"):
            trainer.train()
    finally:
        trainer.close()

    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    # The TRL metric names the detectors read (a rename in TRL would silence them).
    assert {
        "reward",
        "frac_reward_zero_std",
        "entropy",
        "episodes/sampled_tokens_mean",
        "episodes/turns_mean",
        "episodes/malformed_tool_calls_mean",
        "episodes/status_ok",
    } <= logs[0].keys()
    assert max(entry["reward"] for entry in logs) - logs[0]["reward"] > 0.5  # the training reward was gamed...
    held_out = {step: value for step, value in trainer.alarms_callback.history["held_out/success"]}
    assert dict(trainer.alarms_callback.history["held_out/episodes"]) == {0: 4.0, 5: 4.0, 10: 4.0, 15: 4.0, 20: 4.0}
    assert sorted(held_out) == [0, 5, 10, 15, 20] and set(held_out.values()) == {0.0}  # ...held-out success was not
    # Logged with the step's metrics (the evaluation before training arrives with the first log).
    assert {entry["step"]: entry["held_out/success"] for entry in logs if "held_out/success" in entry} == {
        1: 0.0,
        5: 0.0,
        10: 0.0,
        15: 0.0,
        20: 0.0,
    }
    fired = {alarm["name"]: alarm for alarm in trainer.alarms}
    assert "reward_hacking" in fired and fired["reward_hacking"]["step"] in (5, 10, 15, 20)
    assert logs[-1]["alarms/reward_hacking"] == 1.0 and logs[0]["alarms/reward_hacking"] == 0.0
    summary = json.loads((tmp_path / "alarms.json").read_text())
    assert [a["name"] for a in summary["alarms"]] == [a["name"] for a in trainer.alarms]
    assert summary["held_out_success"][0] == [0, 0.0]
