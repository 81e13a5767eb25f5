"""`rollout/schedule.py` without a trainer: the asynchronous schedule over a fake producer, and its checkpoint."""

from types import SimpleNamespace

import pytest

from trl_agentic.rollout.rows import Row, RowsResult
from trl_agentic.rollout.schedule import (
    AsyncSchedule,
    behaviour_correction,
    check_staleness,
    rollout_seed,
    task_batches,
)
from trl_agentic.trace import Episode


class FakeProducer:
    def __init__(self, version):
        self.version, self.submitted, self.running, self.closed = version, {}, 0, False

    def submit(self, index, tasks, group_indices, consume_version, unit_size, seed):
        self.submitted[index] = (tasks, consume_version, seed)

    def set_version(self, version):
        self.version = version

    def result(self, index):
        return [Episode(f"{index}-{i}") for i in range(len(self.submitted[index][0]))], 0.0

    def take_idle_seconds(self):
        return 0.0

    def close(self):
        self.closed = True


def schedule(max_staleness=1, draw=None) -> AsyncSchedule:
    args = SimpleNamespace(
        steps_per_generation=1, gradient_accumulation_steps=1, max_staleness=max_staleness, agent_columns=["task"]
    )
    synced = []
    made = schedule.made = []

    def make_producer(version):
        made.append(FakeProducer(version))
        return made[-1]

    s = AsyncSchedule(
        args,
        num_iterations=1,
        num_generations=2,
        dataset=[{"task": i, "answer": -i} for i in range(8)],
        process_index=0,
        make_producer=make_producer,
        sync_weights=synced.append,
        stream=lambda: iter([[0, 1], [2, 3], [4, 5], [6, 7]] * 10),
        draw=draw,
        seed_for=lambda index: 100 + index,
    )
    s.synced = synced
    return s


def test_batches_start_within_the_staleness_bound_and_a_checkpoint_resubmits_the_untrained():
    s = schedule(max_staleness=1)
    metrics = {"async/trainer_wait_s": [], "async/producer_wait_s": [], "async/in_flight_episodes": []}
    inputs, episodes = s.take(2, 0, metrics)
    assert inputs == [{"task": 0, "answer": 0}, {"task": 1, "answer": -1}] and len(episodes) == 2
    producer = s.producer
    # At version 0 batches 0 and 1 may start (batch 1 is consumed at step 1: one version of staleness)
    assert {i: (t, v, seed) for i, (t, v, seed) in producer.submitted.items()} == {
        0: ([{"task": 0}, {"task": 1}], 0, 100),  # the agent sees only its columns
        1: ([{"task": 2}, {"task": 3}], 1, 101),
    }
    s.sync(1)
    assert s.synced == [0, 1] and producer.version == 1
    s.sync(1)  # once per version
    assert s.synced == [0, 1]
    assert s.state_dict() == {"consumed": 1, "drawn": 2, "offset": 0, "pending": {"1": [2, 3]}}
    s.stop()
    assert producer.closed and s.producer is None
    resumed = schedule(max_staleness=1)
    resumed.load_state_dict(s.state_dict())
    inputs, _ = resumed.take(2, 1, metrics)  # batch 1 again, then batch 2 at version 1
    assert inputs == [{"task": 2, "answer": -2}, {"task": 3, "answer": -3}]
    assert sorted(resumed.producer.submitted) == [1, 2] and resumed.producer.submitted[2][0] == [
        {"task": 4},
        {"task": 5},
    ]
    assert len(metrics["async/trainer_wait_s"]) == 2


def test_adaptive_batches_are_drawn_one_by_one():
    drawn = []
    s = schedule(max_staleness=0, draw=lambda: drawn.append(1) or [6, 7])
    inputs, _ = s.take(2, 0, {"async/trainer_wait_s": [], "async/producer_wait_s": [], "async/in_flight_episodes": []})
    assert inputs == [{"task": 6, "answer": -6}, {"task": 7, "answer": -7}] and drawn == [1]


def test_task_batches_and_seeds():
    class Sampler:
        repeat_count = 2

        def __iter__(self):
            return iter([0, 0, 1, 1, 2, 2, 3, 3])  # each slot twice (repeat_count): batches of 2, yielded once

    batches = task_batches(Sampler(), 2)
    assert [next(batches) for _ in range(3)] == [[0, 0], [2, 2], [0, 0]]
    with pytest.raises(ValueError, match="no whole generation batch"):
        next(task_batches(Sampler(), 9))
    assert rollout_seed(0, 0, 1) == rollout_seed(0, 0, 1) != rollout_seed(0, 1, 1)


def test_a_group_with_a_token_beyond_the_bound_is_dropped():
    def result(version):
        return RowsResult([Row([1], [10, 11], [1, 1], [0.0, 0.0], [0], versions=[version, version])], [], [])

    episodes = [Episode(str(i)) for i in range(4)]
    rows = [result(3), result(2), result(1), result(3)]  # group 2 holds a token 3 versions old
    metrics = {"async/dropped_groups": [], "async/staleness_mean": [], "async/staleness_max": []}
    check_staleness(episodes, rows, 2, step=4, max_staleness=2, metrics=metrics, gather=lambda t: t)
    assert [ep.metadata["staleness"] for ep in episodes] == [1, 2, 3, 1]
    assert [ep.metadata.get("dropped") for ep in episodes] == [None, None, True, True]
    assert rows[2].rows[0].env_mask == [0, 0] and rows[0].rows[0].env_mask == [1, 1]
    assert metrics == {"async/dropped_groups": [1.0], "async/staleness_mean": [1.75], "async/staleness_max": [3.0]}


def test_behaviour_correction_under_asynchronous_rollouts_with_the_embedded_engine(caplog):
    def args(async_rollouts=True, use_vllm=False, correction=True):
        return SimpleNamespace(
            async_rollouts=async_rollouts, use_vllm=use_vllm, vllm_importance_sampling_correction=correction
        )

    assert behaviour_correction(args())
    assert not behaviour_correction(args(async_rollouts=False))  # the tokens are the current policy's
    assert not behaviour_correction(args(use_vllm=True))  # TRL corrects vLLM's tokens itself
    assert "without the importance-sampling correction" not in caplog.text
    with caplog.at_level("WARNING"):
        assert behaviour_correction(args(correction=False))  # on, and TRL's flag turns the correction off: said
    assert "trained without the importance-sampling correction" in caplog.text
