"""The asynchronous schedule (`async_rollouts=True`, issue 30): which generation batch the producer runs when, the
policy version each is consumed at, the bound on staleness, and what a checkpoint keeps of it. No trainer: the
producer, the engine's weight sync and the batches' tasks come in as callables.

Batch `b` (counted from the producer's first start) is consumed at step `offset + b * generate_every / grad_accum`;
the producer may start it once the policy is at most `max_staleness` versions older than that step. A checkpoint keeps
the batches drawn and not trained yet (their episodes run again on resume, from the same tasks and seeds): nothing
trained twice, no task skipped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.utils import logging

from ..trace import Episode
from .rows import RowsResult


logger = logging.get_logger(__name__)


def rollout_seed(seed: int, process_index: int, rollout: int) -> int:
    """The seed of one process's `rollout`-th rollout: distinct per process and rollout, the same in every run."""
    digest = hashlib.sha256(f"{seed}/{process_index}/{rollout}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def task_batches(sampler, size: int) -> Iterator[list[int]]:
    """The global generation batches of dataset indices in the order the dataloader would yield them (each once, not
    `num_iterations * steps_per_generation` times): TRL's `RepeatSampler` (`sampler`), epoch after epoch."""
    repeats = sampler.repeat_count
    while True:
        indices = list(iter(sampler))
        if len(indices) < size:
            raise ValueError(
                f"The training dataset makes no whole generation batch of {size} episodes "
                f"({len(indices)} slots per epoch)."
            )
        for start in range(0, len(indices) - size + 1, size * repeats):
            yield indices[start : start + size]


def behaviour_correction(args) -> bool:
    """Whether TRL's importance-sampling correction (the one it applies when vLLM samples) must run for the embedded
    engine: under `async_rollouts`, a batch's episodes were sampled by up to `max_staleness` earlier policy versions
    (behaviour -> the policy at the consuming step). Warns when `vllm_importance_sampling_correction=False` turns it
    off."""
    if not args.async_rollouts or args.use_vllm:
        return False
    if not args.vllm_importance_sampling_correction:
        logger.warning(
            "async_rollouts=True with vllm_importance_sampling_correction=False: tokens sampled by "
            "earlier policy versions are trained without the importance-sampling correction."
        )
    return True


def check_staleness(
    episodes: list[Episode],
    rows_results: list[RowsResult],
    group_size: int,
    *,
    step: int,
    max_staleness: int,
    metrics: dict[str, list],
    gather: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    device=None,
) -> None:
    """The bound, checked on what is trained: an episode's staleness is the version gap between this step and its
    oldest trained token. A group holding a token beyond `max_staleness` (none under the producer's pacing; a
    resumed run with a lower bound could) is dropped: its rows train nothing, and it is counted."""
    consume = step
    staleness, dropped = [], 0
    for start in range(0, len(episodes), group_size):
        group = range(start, min(start + group_size, len(episodes)))
        gaps = []
        for i in group:
            versions = [row.oldest_version for row in rows_results[i].rows if row.oldest_version is not None]
            gap = consume - min(versions) if versions else None
            episodes[i].metadata["staleness"] = gap
            if gap is not None:
                gaps.append(gap)
        if gaps and max(gaps) > max_staleness:
            dropped += 1
            for i in group:
                episodes[i].metadata["dropped"] = True
                for row in rows_results[i].rows:
                    row.env_mask = [0] * len(row.env_mask)
        staleness += gaps
    if dropped:
        logger.warning(
            f"Step {consume}: {dropped} group(s) held tokens sampled more than max_staleness="
            f"{max_staleness} versions ago and were dropped (not trained; in the episode log "
            "with `dropped`)."
        )
    local = torch.tensor(
        [float(dropped), float(len(staleness)), float(sum(staleness)), float(max(staleness, default=0))], device=device
    )
    gathered = gather(local.unsqueeze(0))
    metrics["async/dropped_groups"].append(gathered[:, 0].sum().item())
    count = gathered[:, 1].sum().item()
    metrics["async/staleness_mean"].append(gathered[:, 2].sum().item() / count if count else 0.0)
    metrics["async/staleness_max"].append(gathered[:, 3].max().item())


class AsyncSchedule:
    """The producer's schedule for one training run.

    Args:
        args: the config (`steps_per_generation`, `gradient_accumulation_steps`, `max_staleness`, `agent_columns`).
        num_iterations, num_generations: TRL's.
        dataset: the training dataset (rows by index).
        process_index: this process's (it runs its slice of each global batch).
        make_producer: `make_producer(version)`, a started `RolloutProducer` (or the rollout process's).
        sync_weights: `sync_weights(version)`, the engine takes the policy's weights after an optimizer step.
        stream: a fresh iterator of global batches of dataset indices (the dataloader's order), or `None` ...
        draw: ... when the batches are drawn one by one (the adaptive sampler's `draw_batch`).
        seed_for: the sampling seed of batch `index` (`None`: unseeded).
    """

    def __init__(
        self,
        args,
        *,
        num_iterations: int,
        num_generations: int,
        dataset,
        process_index: int,
        make_producer: Callable[[int], Any],
        sync_weights: Callable[[int], None],
        stream: Callable[[], Iterator[list[int]]] | None = None,
        draw: Callable[[], list[int]] | None = None,
        seed_for: Callable[[int], int | None] = lambda index: None,
    ):
        self.args, self.num_iterations, self.num_generations = args, num_iterations, num_generations
        self.dataset, self.process_index = dataset, process_index
        self.make_producer, self.sync_weights, self.seed_for = make_producer, sync_weights, seed_for
        self.stream, self.draw = stream, draw
        self.producer = None
        self._async: dict[str, Any] | None = None  # the running schedule (set by `start`)
        self._saved: dict[str, Any] | None = None  # from a checkpoint, applied when the producer starts

    def consume_version(self, batch: int) -> int:
        """The global step at which generation batch `batch` (counted from the producer's first start) is consumed."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self._async["offset"] + batch * generate_every // self.args.gradient_accumulation_steps

    def _draw(self) -> list[int]:
        """The next global generation batch's dataset indices (every process draws the same)."""
        self._async["drawn"] += 1
        if self.draw is not None:
            return self.draw()
        return next(self._async["stream"])

    def start(self, num_slots: int, version: int) -> None:
        """Start the producer (first training batch, or after a resume): resubmit a checkpoint's pending batches."""
        saved = self._saved or {}
        # `offset`: the step of batch 0 (a run resumed from a checkpoint saved without asynchronous rollouts)
        self._async = {
            "consumed": saved.get("consumed", 0),
            "drawn": saved.get("drawn", 0),
            "pending": {},
            "offset": saved.get("offset", version),
            "num_slots": num_slots,
            "version": None,
        }
        self._saved = None
        if self.draw is None:
            self._async["stream"] = self.stream()
            for _ in range(self._async["drawn"]):  # where the stopped run's stream was
                next(self._async["stream"])
        self.producer = self.make_producer(version)
        self.sync(version)
        # The batches the stopped run had drawn but not trained: their episodes were lost with it; run them again.
        for index, indices in sorted((int(k), v) for k, v in saved.get("pending", {}).items()):
            self.submit(index, indices)

    def submit(self, index: int, indices: list[int]) -> None:
        num_slots = self._async["num_slots"]
        start = self.process_index * num_slots
        inputs = [self.dataset[i] for i in indices[start : start + num_slots]]
        self._async["pending"][index] = (indices, inputs)
        tasks = [{c: example[c] for c in self.args.agent_columns} for example in inputs]
        missing = [c for c in self.args.agent_columns if c not in inputs[0]]
        if missing:
            raise ValueError(
                f"agent_columns names {missing}, which the dataset does not have; its columns are "
                f"{sorted(inputs[0])}. Fix `agent_columns`."
            )
        # Seeds by batch index, not by rollout count: a resumed run samples its batches as the stopped one did.
        self.producer.submit(
            index,
            tasks,
            [i % self.num_generations for i in range(len(tasks))],
            consume_version=self.consume_version(index),
            unit_size=self.num_generations,
            seed=self.seed_for(index),
        )

    def fill(self, version: int) -> None:
        """Submit every batch the producer may start at the current version (pacing: `max_staleness`)."""
        while self.consume_version(self._async["drawn"]) - self.args.max_staleness <= version:
            index = self._async["drawn"]
            self.submit(index, self._draw())

    def sync(self, version: int) -> None:
        """After an optimizer step: the engine takes the new weights (`sync_weights`) and the producer learns the
        version. Episodes in flight go on with the new weights."""
        if self.producer is None or self._async["version"] == version:
            return
        self.sync_weights(version)
        self._async["version"] = version
        self.producer.set_version(version)

    def take(self, num_slots: int, version: int, metrics: dict[str, list]) -> tuple[list[dict], list[Episode]]:
        """This process's rows of the next generation batch and their episodes, run by the producer (waited for)."""
        if self.producer is None:
            self.start(num_slots, version)
        self.fill(version)
        index = self._async["consumed"]
        if index not in self._async["pending"]:  # every batch up to this step's is submitted by `fill`
            raise RuntimeError(f"Generation batch {index} was never submitted to the producer.")
        episodes, waited = self.producer.result(index)
        _, inputs = self._async["pending"].pop(index)
        self._async["consumed"] += 1
        metrics["async/trainer_wait_s"].append(waited)
        metrics["async/producer_wait_s"].append(self.producer.take_idle_seconds())
        metrics["async/in_flight_episodes"].append(float(self.producer.running))
        return inputs, episodes

    def stop(self) -> None:
        """End the producer (after `train`): episodes of batches no step will train are cancelled. A later `train`
        starts it again from the batches it had not trained."""
        if self.producer is None:
            return
        self.producer.close()
        self.producer = None
        self._saved = self.state_dict()
        self._async = None

    def state_dict(self) -> dict[str, Any]:
        state = self._async
        if state is None:
            return self._saved or {}
        return {
            "consumed": state["consumed"],
            "drawn": state["drawn"],
            "offset": state["offset"],
            "pending": {str(k): v[0] for k, v in state["pending"].items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's schedule, applied when the producer starts."""
        self._saved = state


class AsyncWeightSync(TrainerCallback):
    """Under asynchronous rollouts: the engine takes the new weights right after each optimizer step (episodes in
    flight go on with them), not only when the next step asks for its batch."""

    def __init__(self, schedule: AsyncSchedule):
        self.schedule = schedule

    def on_step_end(self, args, state, control, **kwargs):
        self.schedule.sync(state.global_step)
