"""`checkpoint_state.py` and `episode_log.py` without a trainer: the trainer's own state saved and restored, the
episode log cut back to the checkpoint's length only when it is the log the checkpoint counted."""

from collections import defaultdict

import pytest
import torch

from trl_agentic.checkpoint_state import CheckpointState
from trl_agentic.episode_log import EpisodeLog, log_episode_metrics
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
