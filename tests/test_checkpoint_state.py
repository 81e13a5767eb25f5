"""`checkpoint_state.py` and `episode_log.py` without a trainer: the trainer's own state saved and restored, the
episode log cut back to the checkpoint's length only when it is the log the checkpoint counted."""

import json
from collections import defaultdict

import pytest
import torch

from trl_agentic.checkpoint_state import CheckpointState
from trl_agentic.episode_log import EpisodeLog, keep_episode_rewards, log_episode_metrics
from trl_agentic.rollout.rows import Row, RowsResult
from trl_agentic.trace import Episode


class Part:
    def __init__(self, value=None):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def episodes_and_rows(n: int):
    episodes = [Episode(str(i), status="ok") for i in range(n)]
    rows = [RowsResult([Row([1, 2], [10, 11], [1, 1], [-0.5, -0.5], [0])], [], []) for _ in range(n)]
    return episodes, rows


def test_the_state_round_trips_through_a_checkpoint_folder(tmp_path):
    log = EpisodeLog(tmp_path / "episodes")
    episodes, rows = episodes_and_rows(2)
    log.write(
        episodes,
        rows,
        [1.0, -1.0],
        [{"level": 1}, {"level": 2}],
        step=1,
        mode="train",
        difficulty_column="level",
        targets=(2,),
    )
    metrics = {"train": defaultdict(list, {"loss": [0.5]}), "eval": defaultdict(list)}
    saved = CheckpointState(metrics, log)
    saved.task_sampler, saved.schedule, saved.alarms = Part([3, 4]), Part({"consumed": 2}), None
    saved.seen_tasks, saved.rollouts, saved.step, saved.buffer = {"a", "b"}, 5, 7, [{"x": torch.tensor([1, 2])}]
    saved.save(tmp_path / "checkpoint-1")
    log.write(episodes, rows, [0.0, 0.0], [{}, {}], step=2, mode="train")  # after the checkpoint: cut on resume

    metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    restored = CheckpointState(metrics, EpisodeLog(tmp_path / "episodes"))
    restored.task_sampler, restored.schedule, restored.alarms = Part(), Part(), Part("kept")
    state = restored.load(str(tmp_path / "checkpoint-1"))
    assert state["step"] == 7 and restored.step == 7 and restored.rollouts == 5 and restored.seen_tasks == {"a", "b"}
    assert restored.task_sampler.value == [3, 4] and restored.schedule.value == {"consumed": 2}
    assert restored.alarms.value == "kept"  # the checkpoint had none
    assert metrics["train"]["loss"] == [0.5] and restored.buffer[0]["x"].tolist() == [1, 2]
    records = (tmp_path / "episodes" / "episodes-rank0.jsonl").read_text().splitlines()
    assert len(records) == 2 and '"difficulty": 2, "target": true' in records[1]


def test_another_runs_log_is_left_whole_and_a_state_of_another_process_count_refused(tmp_path, caplog):
    log = EpisodeLog(tmp_path / "episodes")
    episodes, rows = episodes_and_rows(1)
    log.write(episodes, rows, [1.0], [{}], step=1, mode="train")
    state = log.state_dict()
    assert state["episode_log_bytes"] == log.path.stat().st_size and state["episode_log_digest"]
    log.path.write_text("x" * (state["episode_log_bytes"] + 10))  # another run's log, longer
    log.load_state_dict(state, "checkpoint-1")
    assert log.path.stat().st_size == state["episode_log_bytes"] + 10
    assert EpisodeLog(None).state_dict() == {"episode_log_bytes": 0, "episode_log_digest": None}

    (tmp_path / "checkpoint-2").mkdir()
    for rank in range(2):
        (tmp_path / "checkpoint-2" / f"trl_agentic_state_{rank}.json").write_text("{}")
    with pytest.raises(ValueError, match="2 processes.*1 process.*--num_processes 2"):
        CheckpointState({}, log).load(str(tmp_path / "checkpoint-2"))
    (tmp_path / "checkpoint-3").mkdir()
    assert CheckpointState({}, log).load(str(tmp_path / "checkpoint-3")) is None  # saved before: a warning


def test_episode_metrics_of_a_batch():
    episodes, rows = episodes_and_rows(2)
    metrics = defaultdict(list)
    log_episode_metrics(episodes, rows, metrics)
    assert metrics["episodes/rows_mean"] == [1.0] and metrics["episodes/status_ok"] == [1.0]
    assert metrics["episodes/no_model_calls"] == [1.0] and metrics["episodes/unscorable"] == [1.0]


def test_a_checkpoint_keeps_the_generations_rows_only_mid_way_through_its_updates(tmp_path, caplog):
    """`save_step` at TRL's micro-step: the buffered rows go in only when the step falls mid-way through a
    generation's updates; `resume` restores them, and warns when an asynchronous run resumes a synchronous checkpoint."""
    rows = [{"x": torch.tensor([1, 2])}]
    saved = CheckpointState({"train": defaultdict(list), "eval": defaultdict(list)}, EpisodeLog(None))
    saved.save_step(tmp_path / "checkpoint-2", step=4, buffered_inputs=rows, generate_every=4)  # a generation's end
    saved.save_step(tmp_path / "checkpoint-3", step=6, buffered_inputs=rows, generate_every=4)  # mid-way
    assert saved.buffer is None and saved.step == 6
    assert not (tmp_path / "checkpoint-2" / "trl_agentic_buffer_0.pt").exists()

    restored = CheckpointState({"train": defaultdict(list), "eval": defaultdict(list)}, EpisodeLog(None))
    assert restored.resume(str(tmp_path / "checkpoint-2"), global_step=2)
    assert restored.step == 4 and restored.buffer is None

    class Schedule(Part):  # asynchronous rollouts now, not when the checkpoint was saved (its state: `None`)
        def load_state_dict(self, state):
            self.value = state.get("value", "from the start")

    restored.schedule = Schedule()
    with caplog.at_level("WARNING"):
        assert restored.resume(str(tmp_path / "checkpoint-3"), global_step=3)
    assert restored.step == 6 and restored.buffer[0]["x"].tolist() == [1, 2]
    assert "saved without asynchronous rollouts" in caplog.text and restored.schedule.value == "from the start"
    (tmp_path / "checkpoint-4").mkdir()
    assert not restored.resume(str(tmp_path / "checkpoint-4"))  # saved before trl-agentic kept its state


def test_a_raising_reward_function_leaves_the_steps_episodes_in_the_log(tmp_path, caplog):
    log = EpisodeLog(tmp_path / "episodes")
    episodes, rows = episodes_and_rows(2)
    with caplog.at_level("ERROR"):
        log.write_reward_error(ValueError("bad answer"), episodes, rows, [{}, {}], step=3, mode="train")
    records = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert [(r["step"], r["advantage"], r["reward_error"]) for r in records] == [
        (3, None, "ValueError: bad answer")
    ] * 2
    assert f"A reward function raised at step 3; the step's 2 episodes are in {log.path}" in caplog.text
    EpisodeLog(None).write_reward_error(ValueError("x"), episodes, rows, [{}, {}], step=3, mode="train")  # no log


def test_each_episode_keeps_this_process_slice_of_the_gathered_rewards():
    episodes, _ = episodes_and_rows(2)
    gathered = torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, float("nan")], [6.0, 7.0]])  # 2 processes x 2 episodes
    keep_episode_rewards(episodes, gathered, ["correct", "format"], process_index=1)
    assert [ep.metadata["rewards"] for ep in episodes] == [
        {"correct": 4.0, "format": None},  # NaN: unscorable
        {"correct": 6.0, "format": 7.0},
    ]
