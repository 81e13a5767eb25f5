"""Adaptive task sampling: spend the rollouts on tasks whose groups split.

GRPO learns only from groups whose episodes disagree: a group that all succeed or all fail has zero advantage and
costs its G episodes for nothing. [`AdaptiveTaskSampler`] replaces TRL's `RepeatSampler` (same index layout: each
task `num_generations` times, each batch `repeat_count` times) and chooses every group's task from what the run has
seen so far:

- it keeps a running success estimate per difficulty bucket (a dataset column, e.g. the calculator's operand
  `digits`) and per task, and a running split rate per bucket (the share of its recent groups that split), updated
  from every scored group (`observe`);
- a group of G episodes with success probability p splits with probability `1 - p^G - (1 - p)^G`, highest at
  p = 0.5. That is only a bucket's split rate *before* its groups are seen: a bucket's tasks are not alike (on the
  demo, late in training, one-digit products are each solved by nearly every episode or by nearly none, so their
  groups split half the time at a mean success of 0.6, where the formula says 0.98). So a bucket's split rate is
  the share of its recent groups that split, shrunk towards the formula's value at its success estimate;
- buckets are drawn in proportion to their split rate, times an affinity per bucket between it and the target:
  `target_affinity` while the target's groups split, rising towards 1 as they stop splitting (`1 -` the target's
  split rate, when larger). So the sampler stays on the target while its groups split, moves to easier buckets
  while the target is out of reach (and to harder or easier ones once it is solved, whichever still split), and
  comes back as the model improves;
- within a bucket, a few candidate tasks are drawn and one is kept in proportion to its own split probability,
  squared (tasks never seen inherit their bucket's estimate);
- a bucket's estimate overrates a new task's chance to split for the same reason, so some of the groups go back
  to a task whose last group split (the bucket's recently split tasks, newest `revisit_pool` of them); a task leaves
  that pool once a group of it does not split. A `revisit` share of the bucket's groups to begin with, then tilted
  by what split: the revisits' share moves with how often revisits split against how often new tasks split
  (squared, as for candidates);
- the target difficulty is never starved (`target_min_share` of the groups at least), and every bucket keeps a small
  exploration share so that its estimate follows the model.

Every process of a multi-process run holds the same sampler (same seed) and observes the same gathered results,
so all ranks draw the same indices, as TRL's sampler does.

In the trainer, the dataloader yields only the layout of the batches ([`TaskSlots`]); a generation batch's tasks are
drawn (`draw_batch`) when the trainer consumes it, after every earlier batch's results were observed. Drawn while
iterating, as the dataloader fetches, the draws lagged a step: accelerate's dataloader and the Trainer fetch the next
batch before the current one is trained on (issue 29, L2). A checkpoint holds the sampler's whole state
(`state_dict`), so a resumed run draws what the uninterrupted run would have.

Example:

```python
>>> sampler = AdaptiveTaskSampler(dataset, num_generations=8, tasks_per_batch=4, difficulty_column="difficulty",
...                               target_difficulty=2)
>>> sampler.observe([{"difficulty": 1, "prompt": ...}] * 8, [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
>>> sampler.estimates()
{1: 0.69..., 2: 0.5, ...}
```
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Sampler

from .trace import json_text, weighted_reward


# How many groups' worth of weight the formula's split probability has in a bucket's split rate (and a bucket's rate
# in a way of drawing's): a handful of observed groups outweigh it.
SPLIT_PRIOR_GROUPS = 4.0


def split_probability(success: float, group_size: int) -> float:
    """Probability that a group of `group_size` episodes, each succeeding with probability `success`, has both a
    success and a failure (non-zero reward std).

    Example:

    ```python
    >>> round(split_probability(0.5, 8), 3), split_probability(0.0, 8), split_probability(1.0, 8)
    (0.992, 0.0, 0.0)
    ```
    """
    p = min(max(success, 0.0), 1.0)
    return max(0.0, 1.0 - p**group_size - (1.0 - p) ** group_size)


def task_key(row: dict[str, Any], columns: Sequence[str]) -> str:
    """A stable key of one task: a hash of `columns` of its dataset row (what the agent sees, plus its bucket)."""
    payload = json.dumps({c: row.get(c) for c in columns}, sort_keys=True, default=str)
    return hashlib.sha1(payload.encode()).hexdigest()


def group_split_rate(rewards: Sequence[float | None], group_size: int) -> float:
    """Share of the groups (consecutive runs of `group_size` rewards) whose scored rewards differ; `None` (unscorable)
    is left out of its group. `nan` when there is no group."""
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]
    if not groups:
        return math.nan
    split = 0
    for group in groups:
        scored = {float(r) for r in group if r is not None and not math.isnan(r)}
        split += len(scored) > 1
    return split / len(groups)


@dataclass
class _Estimate:
    """Decayed success counts: `successes / episodes` over recent observations, shrunk towards a prior."""

    successes: float = 0.0
    episodes: float = 0.0

    def update(self, outcomes: Sequence[float], decay: float) -> None:
        self.successes = self.successes * decay + sum(outcomes)
        self.episodes = self.episodes * decay + len(outcomes)

    def mean(self, prior: float, strength: float) -> float:
        return (self.successes + prior * strength) / (self.episodes + strength)


class AdaptiveTaskSampler(Sampler[int]):
    """Chooses each group's task where its episodes are likely to disagree (see the module docstring).

    Args:
        dataset: the training dataset (anything with `__len__` and `__getitem__` returning dict rows).
        num_generations: episodes per task (G); each chosen index is yielded G times in a row.
        tasks_per_batch: tasks per generation batch (TRL: `generation_batch_size // num_generations`).
        repeat_count: how many times each batch of tasks is yielded (TRL: `num_iterations * steps_per_generation`).
        difficulty_column: the column holding each task's difficulty bucket (numbers, larger = harder); `None` or a
            column the dataset lacks: one bucket.
        target_difficulty: the bucket(s) the run is for, which get at least `target_min_share` of the groups;
            `None`: the hardest bucket.
        target_min_share: least share of groups drawn from the target bucket(s).
        target_affinity: a bucket's weight is multiplied by this for each bucket between it and the nearest target
            while the target's groups split (1.0: split probability alone; 0.5: a bucket next to the target needs
            twice its split probability to be drawn as often); as the target's split probability p falls (solved
            or out of reach), the factor rises to `1 - p` when that is larger.
        explore: share of groups spread evenly over all buckets whatever their estimate, so that an estimate
            follows the model (a bucket out of reach today is tried again).
        memory: how many recent groups of a bucket its estimate mostly reflects (older ones decay by
            `1 - 1/memory` per group).
        prior_success: the estimate of a bucket before any observation.
        success_threshold: an episode succeeds when its reward is at least this.
        candidates: tasks drawn from the chosen bucket, of which one is kept in proportion to its split probability.
        key_columns: the columns that identify a task (`task_key`), e.g. the agent's columns and the difficulty
            column; default: every column of the dataset.
        revisit: share of a bucket's groups that go back to a task whose last group split (when the bucket has
            one), the others to new candidates, before any revisit is seen; then tilted by the split rates seen:
            `revisit * r^2 / (revisit * r^2 + (1 - revisit) * f^2)`, with `r` and `f` the bucket's recent split
            rates of revisits and of new tasks. 0 draws every group from the whole bucket, 1 revisits whenever it can.
        revisit_pool: how many of a bucket's recently split tasks are kept for revisits (the newest).
        seed: the sampler's RNG seed (the same on every process).
    """

    def __init__(
        self,
        dataset,
        num_generations: int,
        tasks_per_batch: int,
        repeat_count: int = 1,
        difficulty_column: str | None = "difficulty",
        target_difficulty: Any = None,
        target_min_share: float = 0.25,
        target_affinity: float = 0.5,
        explore: float = 0.1,
        memory: int = 16,
        prior_success: float = 0.5,
        success_threshold: float = 1.0,
        candidates: int = 8,
        key_columns: Sequence[str] | None = None,
        revisit: float = 0.5,
        revisit_pool: int = 256,
        seed: int = 0,
    ):
        if num_generations < 2:
            raise ValueError(f"num_generations must be >= 2 (a group of one never splits), got {num_generations}.")
        if tasks_per_batch < 1 or repeat_count < 1 or candidates < 1 or memory < 1 or revisit_pool < 1:
            raise ValueError(
                "tasks_per_batch, repeat_count, candidates, memory and revisit_pool must be >= 1; got "
                f"{tasks_per_batch}, {repeat_count}, {candidates}, {memory} and {revisit_pool}."
            )
        for name, value in (
            ("target_min_share", target_min_share),
            ("explore", explore),
            ("prior_success", prior_success),
            ("target_affinity", target_affinity),
            ("revisit", revisit),
        ):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}.")
        if len(dataset) == 0:
            raise ValueError("The training dataset is empty.")
        self.dataset = dataset
        self.num_generations = num_generations
        self.tasks_per_batch = tasks_per_batch
        self.repeat_count = repeat_count
        self.target_min_share = target_min_share
        self.target_affinity = target_affinity
        self.explore = explore
        self.decay = 1.0 - 1.0 / memory
        self.prior_success = prior_success
        self.success_threshold = success_threshold
        self.candidates = candidates
        self.revisit = revisit
        self.revisit_pool = revisit_pool
        self.seed = seed
        self._rng = random.Random(seed)

        columns = list(getattr(dataset, "column_names", None) or dataset[0].keys())
        self.difficulty_column = difficulty_column if difficulty_column in columns else None
        self.key_columns = list(key_columns) if key_columns is not None else columns
        levels = list(dataset[self.difficulty_column]) if self.difficulty_column else [0] * len(dataset)
        bad = [v for v in set(levels) if not isinstance(v, int | float) or isinstance(v, bool)]
        if bad:
            raise ValueError(
                f"Column {difficulty_column!r} must hold numbers (larger = harder), found {sorted(map(repr, bad))[:5]}; "
                "map your difficulty names to numbers, or set difficulty_column=None."
            )
        self.buckets: dict[Any, list[int]] = {}
        for index, level in enumerate(levels):
            self.buckets.setdefault(level, []).append(index)
        self.buckets = dict(sorted(self.buckets.items()))
        if target_difficulty is None:
            targets = [max(self.buckets)]
        else:
            targets = (
                list(target_difficulty) if isinstance(target_difficulty, list | tuple | set) else [target_difficulty]
            )
        missing = [t for t in targets if t not in self.buckets]
        if missing:
            raise ValueError(
                f"target_difficulty {missing} is not among the dataset's {self.difficulty_column!r} values "
                f"{list(self.buckets)}."
            )
        self.targets = targets
        ranks = {level: rank for rank, level in enumerate(self.buckets)}
        self._distance = {level: min(abs(ranks[level] - ranks[t]) for t in targets) for level in self.buckets}
        self._bucket_estimates = {level: _Estimate() for level in self.buckets}
        # Per bucket, the share of its recent groups that split, overall and by how the task was drawn (revisit or
        # new); and how each task's groups not yet observed were drawn (its key -> [revisited, ...], oldest first).
        self._bucket_splits = {level: _Estimate() for level in self.buckets}
        self._kind_splits = {level: {True: _Estimate(), False: _Estimate()} for level in self.buckets}
        self._drawn_as: dict[str, list[bool]] = {}
        self._task_estimates: dict[str, _Estimate] = {}
        self.groups_drawn = {level: 0 for level in self.buckets}
        self.groups_revisited = {level: 0 for level in self.buckets}
        # Per bucket, the tasks whose last group split (index -> None, oldest first), and the index of every task
        # drawn so far by its key (observe gets rows, revisits need indices).
        self._split_tasks: dict[Any, dict[int, None]] = {level: {} for level in self.buckets}
        self._index_of: dict[str, int] = {}

    # Estimates

    def estimates(self) -> dict[Any, float]:
        """Each bucket's running success estimate."""
        return {level: est.mean(self.prior_success, 1.0) for level, est in self._bucket_estimates.items()}

    def split_rates(self) -> dict[Any, float]:
        """Each bucket's running split rate: the share of its recent groups that split, shrunk (by
        `SPLIT_PRIOR_GROUPS` groups) towards `split_probability` of its success estimate, what a bucket of alike
        tasks would give."""
        estimates = self.estimates()
        return {
            level: splits.mean(split_probability(estimates[level], self.num_generations), SPLIT_PRIOR_GROUPS)
            for level, splits in self._bucket_splits.items()
        }

    def revisit_share(self, level) -> float:
        """The probability that a group of bucket `level` goes back to a task whose last group split (when the bucket
        has one): `revisit`, tilted by how often the bucket's recent revisits and new tasks split."""
        if self.revisit in (0.0, 1.0):
            return self.revisit
        bucket = self.split_rates()[level]
        # Squared, as the candidates' weights: a way of drawing seen to split more is clearly preferred.
        revisits = self.revisit * self._kind_splits[level][True].mean(bucket, SPLIT_PRIOR_GROUPS) ** 2
        new = (1.0 - self.revisit) * self._kind_splits[level][False].mean(bucket, SPLIT_PRIOR_GROUPS) ** 2
        return revisits / (revisits + new) if revisits + new > 0 else self.revisit

    def bucket_probabilities(self) -> dict[Any, float]:
        """The probability that the next group is drawn from each bucket."""
        levels = list(self.buckets)
        splits = self.split_rates()
        # Away from the target, a bucket's weight is cut by `target_affinity` per bucket between them while the
        # target's groups split, and by less as they stop splitting (solved or out of reach): 1 - its split rate.
        affinity = max(self.target_affinity, 1.0 - max(splits[t] for t in self.targets))
        weights = {level: splits[level] * affinity ** self._distance[level] for level in levels}
        total = sum(weights.values())
        if total <= 0:  # nothing is expected to split: spread evenly and let the estimates move
            weights, total = {level: 1.0 for level in levels}, float(len(levels))
        probs = {level: (1 - self.explore) * w / total + self.explore / len(levels) for level, w in weights.items()}
        target_share = sum(probs[t] for t in self.targets)
        if target_share < self.target_min_share:
            others = 1.0 - target_share
            for level in levels:
                if level in self.targets:
                    probs[level] = self.target_min_share * (
                        probs[level] / target_share if target_share else 1.0 / len(self.targets)
                    )
                else:
                    probs[level] *= (1.0 - self.target_min_share) / others if others else 0.0
        return probs

    def _task_success(self, index: int, level) -> float:
        bucket = self._bucket_estimates[level].mean(self.prior_success, 1.0)
        estimate = self._task_estimates.get(self._key(self.dataset[index]))
        return bucket if estimate is None else estimate.mean(bucket, 2.0)  # two episodes of prior: one group speaks

    def _key(self, row: dict[str, Any]) -> str:
        return task_key(row, [c for c in self.key_columns if c in row])

    def observe(self, rows: Sequence[dict[str, Any]], rewards: Sequence[float | None]) -> None:
        """Update the estimates with scored episodes: `rows[i]` is the dataset row of episode `i` (at least its key
        and difficulty columns), `rewards[i]` its total reward (`None` or NaN: unscorable, left out). Groups are
        consecutive runs of `num_generations` episodes, as the sampler lays them out and the trainer gathers them: a
        task drawn twice in a batch is two groups, each split or not (issue 29, L1)."""
        if len(rows) != len(rewards):
            raise ValueError(f"observe got {len(rows)} rows and {len(rewards)} rewards.")
        for start in range(0, len(rows), self.num_generations):
            end = start + self.num_generations
            self._observe_group(rows[start:end], rewards[start:end])

    def _observe_group(self, rows: Sequence[dict[str, Any]], rewards: Sequence[float | None]) -> None:
        by_task: dict[str, tuple[Any, list[float]]] = {}  # one task, unless the caller's layout mixes them
        drawn_as: dict[str, bool | None] = {}  # how each task of the group was drawn, scored or not
        for row, reward in zip(rows, rewards, strict=True):
            level = row.get(self.difficulty_column) if self.difficulty_column else 0
            if level not in self._bucket_estimates:
                continue  # a row from another dataset
            key = self._key(row)
            if key not in drawn_as:  # the group's draw is settled even when none of it is scored (agent errors)
                pending = self._drawn_as.get(key)
                drawn_as[key] = pending.pop(0) if pending else None
                if pending is not None and not pending:
                    del self._drawn_as[key]
            if reward is None or (isinstance(reward, float) and math.isnan(reward)):
                continue
            by_task.setdefault(key, (level, []))[1].append(float(reward >= self.success_threshold))
        for key, (level, outcomes) in by_task.items():
            # Decay per group: a bucket's estimate follows its last `memory` groups.
            self._bucket_estimates[level].update(outcomes, self.decay)
            self._task_estimates.setdefault(key, _Estimate()).update(outcomes, 1.0)
            revisited = drawn_as[key]
            if len(outcomes) > 1:  # a group of one scored episode cannot split: it says nothing of split rates
                split = [float(len(set(outcomes)) > 1)]
                self._bucket_splits[level].update(split, self.decay)
                if revisited is not None:
                    self._kind_splits[level][revisited].update(split, self.decay)
            index = self._index_of.get(key)
            if index is None:
                continue  # not drawn by this sampler (e.g. a row of another dataset at the same level)
            pool = self._split_tasks[level]
            pool.pop(index, None)
            if len(set(outcomes)) > 1:  # it split: to the end of the pool (the newest)
                pool[index] = None
                if len(pool) > self.revisit_pool:
                    del pool[next(iter(pool))]

    def revisit_pools(self) -> dict[Any, int]:
        """How many tasks of each bucket can be revisited (their last group split)."""
        return {level: len(pool) for level, pool in self._split_tasks.items()}

    # Sampling

    def draw_task(self) -> int:
        """The dataset index of the next group's task."""
        probs = self.bucket_probabilities()
        levels = list(probs)
        level = self._rng.choices(levels, weights=[probs[lv] for lv in levels])[0]
        self.groups_drawn[level] += 1
        split = self._split_tasks[level]
        revisited = bool(split) and self.revisit > 0 and self._rng.random() < self.revisit_share(level)
        if revisited:
            self.groups_revisited[level] += 1
            pool = list(split)
        else:
            pool = self.buckets[level]
        candidates = [pool[self._rng.randrange(len(pool))] for _ in range(min(self.candidates, len(pool)))]
        if len(candidates) == 1:
            index = candidates[0]
        else:
            # Squared: a task seen to split is clearly preferred over one seen to be always solved (or never).
            weights = [
                split_probability(self._task_success(i, level), self.num_generations) ** 2 + 1e-3 for i in candidates
            ]
            index = self._rng.choices(candidates, weights=weights)[0]
        key = self._key(self.dataset[index])
        self._index_of[key] = index
        self._drawn_as.setdefault(key, []).append(revisited)
        return index

    def draw_batch(self) -> list[int]:
        """The dataset indices of one generation batch: `tasks_per_batch` tasks drawn now, each `num_generations`
        times in a row."""
        return [
            index
            for index in (self.draw_task() for _ in range(self.tasks_per_batch))
            for _ in range(self.num_generations)
        ]

    def __iter__(self) -> Iterator[int]:
        for _ in range(len(self.dataset) // self.tasks_per_batch or 1):
            batch = self.draw_batch()
            for _ in range(self.repeat_count):
                yield from batch

    def __len__(self) -> int:
        return (
            (len(self.dataset) // self.tasks_per_batch or 1)
            * self.tasks_per_batch
            * self.num_generations
            * (self.repeat_count)
        )

    # Checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Everything the sampler learned and its RNG, as JSON-serialisable values (levels become list entries: JSON
        object keys are strings)."""
        version, internal, gauss = self._rng.getstate()
        return {
            "rng": [version, list(internal), gauss],
            "bucket_estimates": [[lv, [e.successes, e.episodes]] for lv, e in self._bucket_estimates.items()],
            "bucket_splits": [[lv, [e.successes, e.episodes]] for lv, e in self._bucket_splits.items()],
            "kind_splits": [
                [lv, [[k[True].successes, k[True].episodes], [k[False].successes, k[False].episodes]]]
                for lv, k in self._kind_splits.items()
            ],
            "drawn_as": self._drawn_as,
            "task_estimates": {key: [e.successes, e.episodes] for key, e in self._task_estimates.items()},
            "groups_drawn": list(self.groups_drawn.items()),
            "groups_revisited": list(self.groups_revisited.items()),
            "split_tasks": [[lv, list(pool)] for lv, pool in self._split_tasks.items()],
            "index_of": self._index_of,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (the same dataset and difficulty levels)."""
        levels = [lv for lv, _ in state["bucket_estimates"]]
        if levels != list(self.buckets):
            raise ValueError(
                f"The sampler state is for difficulty levels {levels}, this dataset has "
                f"{list(self.buckets)}: resume with the dataset the run was started with."
            )
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self._bucket_estimates = {lv: _Estimate(*e) for lv, e in state["bucket_estimates"]}
        self._bucket_splits = {lv: _Estimate(*e) for lv, e in state["bucket_splits"]}
        self._kind_splits = {lv: {True: _Estimate(*r), False: _Estimate(*n)} for lv, (r, n) in state["kind_splits"]}
        self._drawn_as = {key: list(kinds) for key, kinds in state["drawn_as"].items()}
        self._task_estimates = {key: _Estimate(*e) for key, e in state["task_estimates"].items()}
        self.groups_drawn = dict((lv, n) for lv, n in state["groups_drawn"])
        self.groups_revisited = dict((lv, n) for lv, n in state["groups_revisited"])
        self._split_tasks = {lv: dict.fromkeys(pool) for lv, pool in state["split_tasks"]}
        self._index_of = dict(state["index_of"])


class TaskSlots(Sampler[int]):
    """The dataloader's sampler under adaptive sampling: the layout of `sampler`'s batches (as many slots, batch by
    batch), each slot index 0, with no task drawn. The trainer draws a batch's tasks with `sampler.draw_batch()` when
    it consumes the batch, so the dataloader's prefetching never draws ahead of the results (issue 29, L2), and
    skipping batches on resume draws nothing."""

    def __init__(self, sampler: AdaptiveTaskSampler):
        self.sampler = sampler

    def __iter__(self) -> Iterator[int]:
        return itertools.repeat(0, len(self.sampler))

    def __len__(self) -> int:
        return len(self.sampler)


def draw_generation_batch(sampler: AdaptiveTaskSampler, dataset, process_index: int, num_slots: int) -> list[dict]:
    """This process's rows of a generation batch drawn now by `sampler` (every process draws the same batch, and takes
    its slice as accelerate's batch sampler would have: process i the i-th of the batch's consecutive slices of
    `num_slots`)."""
    indices = sampler.draw_batch()
    start = process_index * num_slots
    return [dataset[i] for i in indices[start : start + num_slots]]


def target_levels(sampler: AdaptiveTaskSampler | None, target_difficulty=None) -> tuple:
    """The target difficulty: the sampler's, else `target_difficulty`, else none (a mix without a target)."""
    if sampler is not None:
        return tuple(sampler.targets)
    return () if target_difficulty is None else (target_difficulty,)


def observe_tasks(
    inputs: list[dict],
    episodes: list,
    *,
    mode: str,
    weights: dict[str, float],
    agent_columns: Sequence[str],
    difficulty_column: str | None,
    group_size: int,
    seen: set[str],
    targets: tuple,
    metrics: dict[str, list],
    sampler: AdaptiveTaskSampler | None = None,
    gather: Callable[[list], list] = lambda local: local,
) -> None:
    """Log the `sampling/*` metrics of a batch (`metrics`, TRL's `_metrics[mode]`) and feed the adaptive `sampler`
    (every rank sees every result through `gather`, so every rank's sampler draws the same next tasks). `seen`: the
    tasks drawn so far in the run (as JSON), which a training batch adds to; `targets`: the target difficulties."""
    column = difficulty_column
    local = []
    for example, episode in zip(inputs, episodes, strict=True):
        keep = {c: example.get(c) for c in (*agent_columns, column) if c and c in example}
        reward = weighted_reward(episode, weights)
        local.append((keep, reward, len(episode.turns), episode.num_malformed_tool_calls))
    gathered = gather(local)
    rows, rewards = [g[0] for g in gathered], [g[1] for g in gathered]
    keys = [json_text(row) for row in rows]
    # Tasks not drawn before in this run: to the policy what held-out tasks are (a revisited task may have been
    # learned by heart; on the demo, late in training, 0.56 success on revisits against 0.43 on first visits).
    seen_before = seen if mode == "train" else set()
    unseen = [key not in seen_before for key in keys]
    metrics["sampling/split_rate"].append(group_split_rate(rewards, group_size))
    if mode == "train" and unseen:  # share of groups whose task this run had drawn before
        firsts = unseen[::group_size]
        metrics["sampling/revisit_share"].append(1.0 - sum(firsts) / len(firsts))
    if column and rows and column in rows[0]:
        levels = [row[column] for row in rows]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in levels):
            metrics["sampling/difficulty_mean"].append(sum(levels) / len(levels))
            threshold = sampler.success_threshold if sampler is not None else 1.0
            for level in sorted(set(levels)):
                outcomes = [
                    float(r >= threshold)
                    for lv, r in zip(levels, rewards, strict=True)
                    if lv == level and r is not None
                ]
                metrics[f"sampling/share/{level:g}"].append(levels.count(level) / len(levels))
                # What `malformed_tool_calls` compares at the same mix of difficulties: model calls at this level
                # in the step (a count), its groups, and the share of the calls with a malformed tool call.
                calls = sum(g[2] for lv, g in zip(levels, gathered, strict=True) if lv == level)
                metrics[f"sampling/model_calls/{level:g}"].append(float(calls))
                metrics[f"sampling/groups/{level:g}"].append(levels.count(level) / group_size)
                # ... and what `unscorable_episodes` compares: the level's episodes and the share left unscored.
                metrics[f"sampling/episodes/{level:g}"].append(float(levels.count(level)))
                metrics[f"sampling/unscorable/{level:g}"].append(
                    sum(r is None for lv, r in zip(levels, rewards, strict=True) if lv == level) / levels.count(level)
                )
                if calls:
                    malformed = sum(g[3] for lv, g in zip(levels, gathered, strict=True) if lv == level)
                    metrics[f"sampling/malformed_rate/{level:g}"].append(malformed / calls)
                if outcomes:
                    metrics[f"sampling/success/{level:g}"].append(sum(outcomes) / len(outcomes))
                    if level in targets:  # what the reward_hacking alarm holds to held-out
                        metrics["sampling/target_success"].append(sum(outcomes) / len(outcomes))
                        fresh = [
                            float(r >= threshold)
                            for lv, r, new in zip(levels, rewards, unseen, strict=True)
                            if lv == level and r is not None and new
                        ]
                        if fresh:
                            metrics["sampling/target_success_unseen"].append(sum(fresh) / len(fresh))
    if mode == "train":
        seen.update(keys)
    if sampler is not None and mode == "train":
        sampler.observe(rows, rewards)
        for level, value in sampler.estimates().items():
            metrics[f"sampling/estimate/{level:g}"].append(value)
        for level, value in sampler.split_rates().items():
            metrics[f"sampling/split_estimate/{level:g}"].append(value)


def adaptive_sampler(dataset, args, num_generations: int, num_iterations: int) -> AdaptiveTaskSampler:
    """The `AdaptiveTaskSampler` of a run (`AgenticGRPOConfig(task_sampling="adaptive")`): keyed by the agent's and the
    difficulty columns, one batch per generation, repeated as TRL's `RepeatSampler` repeats its slots."""
    columns = list(args.agent_columns)
    if args.difficulty_column and args.difficulty_column not in columns:
        columns.append(args.difficulty_column)
    return AdaptiveTaskSampler(
        dataset,
        num_generations=num_generations,
        tasks_per_batch=args.generation_batch_size // num_generations,
        repeat_count=num_iterations * args.steps_per_generation,
        difficulty_column=args.difficulty_column,
        target_difficulty=args.target_difficulty,
        target_min_share=args.target_min_share,
        target_affinity=args.target_affinity,
        explore=args.sampling_explore,
        memory=args.sampling_memory,
        revisit=args.sampling_revisit,
        key_columns=columns,
        seed=args.seed,
    )
