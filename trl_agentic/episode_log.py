"""The episode log (`log_episodes=True`): one JSON record per episode in `output_dir/episodes/episodes-rank<i>.jsonl`,
and the `episodes/*` metrics of a batch. No trainer: what a record holds is passed in.

A checkpoint keeps the log's length (`state_dict`); a resumed run cuts what the stopped run logged after it, once it
has checked that the log it finds is the one its checkpoint counted (`load_state_dict`).
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.utils import logging

from .rewards.process import TURN_REWARDS_KEY
from .rollout.rows import RowsResult
from .rollout.tree_groups import TREE_KEY
from .trace import EPISODE_STATUSES, Episode, json_text


logger = logging.get_logger(__name__)


def _log_digest(path: Path, size: int, window: int = 1 << 16) -> str | None:
    """A fingerprint of the first `size` bytes of an episode log (its first and last 64 KiB of them): a resumed run
    cuts the log only when it is the one its checkpoint counted."""
    if not path.exists():
        return None
    with path.open("rb") as f:
        head = f.read(min(size, window))
        f.seek(max(size - window, 0))
        tail = f.read(size - max(size - window, 0))
    return hashlib.sha256(head + b"|" + tail).hexdigest()


class EpisodeLog:
    """This process's episode log: `folder` (`None`: no log, `log_episodes=False`) and the process's index."""

    def __init__(self, folder: Path | None, process_index: int = 0):
        self.folder = folder
        self.process_index = process_index

    @property
    def path(self) -> Path:
        return self.folder / f"episodes-rank{self.process_index}.jsonl"

    def write(
        self,
        episodes: list[Episode],
        rows_results: list[RowsResult],
        advantages: list[float | None],
        inputs: list[dict],
        *,
        step: int,
        mode: str,
        difficulty_column: str | None = None,
        targets: tuple = (),
        error: str | None = None,
    ) -> None:
        """Append one record per episode; `error`: why the episodes have no rewards (a reward function raised)."""
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        column = difficulty_column
        with self.path.open("a") as f:
            for i, (ep, result, example) in enumerate(zip(episodes, rows_results, inputs, strict=True)):
                record = {
                    "step": step,
                    "mode": mode,
                    "advantage": advantages[i],
                    "episode": ep.to_dict(),
                    "rows": [row.to_dict() for row in result.rows],
                    "skipped_turns": result.skipped_turns,
                    "capped_turns": result.capped_turns,
                }
                if TREE_KEY in ep.metadata:  # tree rollouts: where it sits, its segments and their advantages
                    record["tree"] = ep.metadata[TREE_KEY]
                if error is not None:
                    record["reward_error"] = error
                if column and column in example:  # the task's difficulty: the per-level metrics, recomputable
                    record["difficulty"] = example[column]
                    record["target"] = example[column] in targets
                f.write(json_text(record) + "\n")  # whatever the agent returned: valid JSON, never a crash

    def write_reward_error(
        self, error: Exception, episodes: list[Episode], rows_results: list[RowsResult], inputs: list[dict], **fields
    ) -> None:
        """A reward function raised (the run stops, as in TRL): the step's episodes are logged first, with no
        advantage and the error as `reward_error` (issue 29, N4), and an error says where to read them. `fields`:
        [`write`]'s keyword arguments."""
        self.write(
            episodes, rows_results, [None] * len(episodes), inputs, error=f"{type(error).__name__}: {error}", **fields
        )
        if self.folder is not None:
            logger.error(
                f"A reward function raised at step {fields['step']}; the step's {len(episodes)} episodes are in "
                f"{self.path} (`reward_error`)."
            )

    def state_dict(self) -> dict:
        """The log's length now, and a fingerprint of it (`None` without a log)."""
        log = self.path if self.folder is not None else None
        size = log.stat().st_size if log is not None and log.exists() else 0
        return {"episode_log_bytes": size, "episode_log_digest": _log_digest(log, size) if log is not None else None}

    def load_state_dict(self, state: dict, checkpoint: str = "the checkpoint") -> None:
        """Cut what a stopped run logged after `checkpoint` (the resumed run logs those steps again), unless the log
        is shorter than it was, or not the one the checkpoint counted: then it is left whole, with a warning."""
        if self.folder is None or not self.path.exists():
            return
        log = self.path
        size = state["episode_log_bytes"]
        if log.stat().st_size < size:
            logger.warning(
                f"{log} is shorter than when {checkpoint} was saved: it was edited or replaced, and "
                "the resumed run appends to it as it is."
            )
        elif "episode_log_digest" in state and _log_digest(log, size) != state["episode_log_digest"]:
            # (None: the run that saved the checkpoint logged no episodes.)
            logger.warning(
                f"{log} is not the log {checkpoint} counted (another run's, or edited): the resumed "
                "run appends to it as it is, without cutting it."
            )
        else:  # drop what the stopped run logged after the checkpoint: the resumed run logs those steps again
            os.truncate(log, state["episode_log_bytes"])


def log_episode_metrics(
    episodes: list[Episode],
    rows_results: list[RowsResult],
    metrics: dict[str, list],
    gather: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    device=None,
) -> None:
    """Append a batch's `episodes/*` metrics to `metrics` (TRL's `_metrics[mode]`), over every process (`gather`)."""
    per_episode = {
        "turns": [len(ep.turns) for ep in episodes],
        "tool_calls": [ep.num_tool_calls for ep in episodes],
        "malformed_tool_calls": [ep.num_malformed_tool_calls for ep in episodes],
        "rows": [len(r.rows) for r in rows_results],
        "forks": [ep.num_forks for ep in episodes],
        "main_line_forks": [ep.num_main_line_forks for ep in episodes],  # rewrites of the task's conversation
        "drift": [ep.total_drift for ep in episodes],
        "wall_time": [ep.wall_time for ep in episodes],
        "sampled_tokens": [ep.num_sampled_tokens for ep in episodes],
        "untrained_turns": [len(r.skipped_turns) + len(r.capped_turns) for r in rows_results],
    }
    for name, values in per_episode.items():
        gathered = gather(torch.tensor(values, dtype=torch.float32, device=device))
        metrics[f"episodes/{name}_mean"].append(gathered.mean().item())
        if name in ("turns", "sampled_tokens"):
            metrics[f"episodes/{name}_max"].append(gathered.max().item())
    status_ids = torch.tensor([EPISODE_STATUSES.index(ep.status) for ep in episodes], device=device, dtype=torch.long)
    all_status = Counter(gather(status_ids).tolist())
    total = sum(all_status.values())
    for index, status in enumerate(EPISODE_STATUSES):
        if status != "running":
            metrics[f"episodes/status_{status}"].append(all_status.get(index, 0) / total)
    # Episodes whose agent never called the model: whatever they scored, it says nothing about the policy.
    no_calls = torch.tensor([float(not ep.turns) for ep in episodes], device=device)
    metrics["episodes/no_model_calls"].append(gather(no_calls).mean().item())
    # Timed-out agents left behind (blocked in a call, or ignoring their cancellation): each holds a thread until
    # what blocks it returns (issue 40); a share that stays up is a leak worth a look.
    abandoned = torch.tensor([float(bool(ep.metadata.get("abandoned"))) for ep in episodes], device=device)
    metrics["episodes/abandoned"].append(gather(abandoned).mean().item())
    # Episodes no reward function could score (failed, or every checker returned None): no advantage, no signal.
    unscorable = torch.tensor(
        [
            float(
                all(v is None for v in (ep.metadata.get("rewards") or {None: None}).values())
                and not ep.metadata.get(TURN_REWARDS_KEY)  # per-turn rewards alone are a signal
            )
            for ep in episodes
        ],
        device=device,
    )
    metrics["episodes/unscorable"].append(gather(unscorable).mean().item())
    # Branch episodes (issue 42, `rollout/replay.py`): one fixed-size gather on every process whatever its episodes
    # (processes may hold different mixes), logged only when some process ran a branch: without tree rollouts the
    # logs are as they were.
    totals = gather(torch.tensor(replay_counts(episodes), dtype=torch.float32, device=device)).reshape(-1, 5).sum(0)
    branches, replayed, diverged, flat, branched = totals.tolist()
    if branches:
        metrics["tree/replayed_calls"].append(replayed / branches)
        metrics["tree/replay_diverged"].append(diverged / branches)
        metrics["tree/sampled_flat_tasks"].append(flat / branched if branched else 0.0)


def keep_episode_rewards(
    episodes: list[Episode], rewards_per_func: torch.Tensor, names: list[str], process_index: int = 0
) -> None:
    """Keep each of this process's episodes' rewards in `episode.metadata["rewards"]` (`{name: value}`, `None` for
    unscorable) for the episode log and the `episodes/*` metrics: `rewards_per_func` is TRL's, gathered over the
    processes (rows of process `i` at `i * len(episodes)`), NaN where a reward function returned `None`."""
    start = process_index * len(episodes)
    local = rewards_per_func[start : start + len(episodes)]
    for episode, values in zip(episodes, local.tolist(), strict=True):
        episode.metadata["rewards"] = {
            name: None if value != value else value  # NaN = unscorable
            for name, value in zip(names, values, strict=True)
        }


def replay_counts(episodes: list[Episode]) -> list[float]:
    """`[branches, replayed calls, diverged branches, tasks sampled flat, tasks branched]` of a batch's branch episodes
    (`Episode.replay`). A task is sampled flat when it was branched past call 0 and none of its branches replayed a
    single call of its parent: its agent's requests change from run to run (a clock, a random id), so every branch
    costs a whole episode's sampling."""
    branches = [episode for episode in episodes if episode.replay is not None]
    by_task: dict[int, list[int]] = {}
    for episode in branches:
        if episode.replay["branch_point"] > 0:
            by_task.setdefault(episode.task_index, []).append(episode.replay["replayed_calls"])
    return [
        float(len(branches)),
        float(sum(episode.replay["replayed_calls"] for episode in branches)),
        float(sum(bool(episode.replay["diverged"]) for episode in branches)),
        float(sum(not any(replayed) for replayed in by_task.values())),
        float(len(by_task)),
    ]
