"""What the trainer holds besides TRL's state, in one object saved in each checkpoint, so that a resumed run is the run
that was never stopped (issue 29, M4): the adaptive sampler, the tasks seen, the alarms, the metrics not logged yet,
TRL's micro-step, the rollouts run, the asynchronous schedule, the episode log's length, and a generation's rows when
a checkpoint falls mid-way through its updates. One file per process (`trl_agentic_state_<i>.json`, and
`trl_agentic_buffer_<i>.pt`), as transformers' RNG states. No trainer: the parts are attached as they exist.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging

from .episode_log import EpisodeLog


logger = logging.get_logger(__name__)


def _state(part) -> Any:
    return part.state_dict() if part is not None else None


class CheckpointState:
    """The trainer's own state. `state_dict()` gathers it from its parts, `load_state_dict` gives it back to them;
    `save(folder)` and `load(checkpoint)` write and read this process's file.

    Args:
        metrics: TRL's `_metrics` (`{"train": {name: [values]}, "eval": ...}`), the values not logged yet.
        episode_log: this process's `EpisodeLog`.
        process_index, num_processes: this process's index and the processes of the run.

    The other parts are attributes set by the trainer: `task_sampler` (the adaptive sampler), `alarms` (the alarms
    callback), `schedule` (the `AsyncSchedule` under asynchronous rollouts), each `None` when absent; `step` (TRL's
    micro-step), `buffer` (the generation's rows, mid-way through its updates) and `rollouts`, `seen_tasks`.
    """

    def __init__(self, metrics: dict, episode_log: EpisodeLog, process_index: int = 0, num_processes: int = 1):
        self.metrics, self.episode_log = metrics, episode_log
        self.process_index, self.num_processes = process_index, num_processes
        self.task_sampler = self.alarms = self.schedule = None
        self.seen_tasks: set[str] = set()  # the tasks drawn so far (their agent and difficulty columns, as JSON)
        self.rollouts = 0  # rollouts run so far (train and eval): each samples from a seed of its own
        self.step = 0
        self.buffer = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "task_sampler": _state(self.task_sampler),
            "seen_tasks": sorted(self.seen_tasks),
            "alarms": _state(self.alarms),
            "metrics": {mode: dict(values) for mode, values in self.metrics.items()},  # not logged yet
            "step": self.step,
            "rollouts": self.rollouts,
            "buffered_inputs": self.buffer is not None,
            # The producer's batches drawn and not trained yet: their episodes are not saved (they run again on
            # resume, from the same tasks and seeds); nothing trained twice, no task skipped.
            "async": _state(self.schedule),
            # The log's length at this step: a resumed run cuts what the stopped run logged after it, once it has
            # checked that the log it finds is this one.
            **self.episode_log.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], checkpoint: str = "the checkpoint") -> None:
        if state["task_sampler"] is not None and self.task_sampler is not None:
            self.task_sampler.load_state_dict(state["task_sampler"])
        self.seen_tasks = set(state["seen_tasks"])
        if state["alarms"] is not None and self.alarms is not None:
            self.alarms.load_state_dict(state["alarms"])
        for mode, values in state["metrics"].items():
            self.metrics[mode].clear()
            self.metrics[mode].update(values)
        self.step, self.rollouts = state["step"], state["rollouts"]
        if self.schedule is not None:
            self.schedule.load_state_dict(state.get("async") or {})
        self.episode_log.load_state_dict(state, checkpoint)

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        state = self.state_dict()
        if self.buffer is not None:  # mid-way through a generation's updates (num_iterations > 1): not regenerated
            torch.save(self.buffer, folder / f"trl_agentic_buffer_{self.process_index}.pt")
        path = folder / f"trl_agentic_state_{self.process_index}.json"
        path.write_text(json.dumps(state, default=str))

    def load(self, checkpoint: str, device=None) -> dict[str, Any] | None:
        """Restore `checkpoint`'s state (and `buffer`, its buffered rows, else `None`); the state read, or `None` when
        the checkpoint has none (saved before trl-agentic kept its state in checkpoints: a warning)."""
        path = Path(checkpoint) / f"trl_agentic_state_{self.process_index}.json"
        saved_by = len(list(Path(checkpoint).glob("trl_agentic_state_*.json")))
        if saved_by and saved_by != self.num_processes:
            # Per process: restoring some processes' state and not others' made them draw different tasks, or one
            # generate while another trained on its buffer (the collectives then hang).
            processes = f"{self.num_processes} process" + "es" * (self.num_processes > 1)
            raise ValueError(
                f"{checkpoint} was saved by {saved_by} process{'es' * (saved_by > 1)} (trl_agentic_state_*.json) and this run has "
                f"{processes}: the trainer's state (adaptive sampler, buffered generation, episode log) is per process. "
                f"Resume with the same number of processes (`accelerate launch --num_processes {saved_by}`), or delete "
                f"the checkpoint's trl_agentic_state_*.json and trl_agentic_buffer_*.pt files to resume with that state "
                f"started afresh."
            )
        if not path.is_file():
            logger.warning(
                f"{checkpoint} has no {path.name} (saved before trl-agentic kept its state in checkpoints): "
                "the adaptive sampler, the tasks seen, the alarms and the episode log start afresh."
            )
            return None
        state = json.loads(path.read_text())
        self.buffer = None
        if state["buffered_inputs"]:
            buffer = Path(checkpoint) / f"trl_agentic_buffer_{self.process_index}.pt"
            self.buffer = torch.load(buffer, map_location=device, weights_only=True)
        self.load_state_dict(state, checkpoint)
        return state

    def save_step(self, folder: Path, step: int, buffered_inputs, generate_every: int) -> None:
        """`save(folder)` at TRL's micro-step `step`; `buffered_inputs` (TRL's `_buffered_inputs`) are saved when the
        checkpoint falls mid-way through a generation's updates (`num_iterations > 1`): its rows are not regenerated.
        `generate_every`: the micro-steps between two generations (`steps_per_generation * num_iterations`)."""
        buffered = buffered_inputs is not None and step % generate_every != 0
        self.step, self.buffer = step, buffered_inputs if buffered else None
        self.save(folder)
        self.buffer = None

    def resume(self, checkpoint: str, device=None, global_step: int = 0) -> bool:
        """`load(checkpoint)` on resume, at the optimizer step `global_step`: whether a state was restored (then `step`
        is TRL's micro-step to resume at, `buffer` the rows to train on, if any). A checkpoint saved without
        asynchronous rollouts, resumed with them past step 0, warns: the producer starts from the first batch."""
        state = self.load(checkpoint, device=device)
        if state is None:
            return False
        if self.schedule is not None and not state.get("async") and global_step:
            logger.warning(
                f"{checkpoint} was saved without asynchronous rollouts: the producer starts from the "
                "dataset's first batch."
            )
        return True
