"""Tree rollouts in the trainer (`rollout_tree=True`, `docs/tree_rollouts.md`): a GRPO group of G episodes becomes a
tree: R root episodes, then `branches` branch episodes (`rollout/replay.py`: the agent run again, the endpoint
replaying its parent's first calls) from chosen calls of chosen episodes, level after level.

- Level 0: the R = G - `branches` roots, run together (as a flat group's episodes).
- Level 1 .. `depth`: the branches, split evenly over the levels (earlier levels get the remainder). A branch of level
  l starts once the episodes of level l - 1 have closed, from one of them (round robin over those that can be
  branched; else from any earlier episode that can; else it runs as a fresh root), at a call chosen by `branch_points`.

Which calls a parent can be branched at: `k` in `[b + 1, n - 1]`, where `n` is its number of calls (cancelled ones not
counted) and `b` its own branch point (0 for a root): call `k` is sampled again, the calls before it replayed, so a
branch shares the parent's first `k` calls and at least one call of it is its own; a point at or before the parent's
own branch point would make a sibling of the parent, not a child. The rules (`TREE_BRANCH_POINTS`):

- `"uniform"`: uniform over those calls (a random stream per episode slot, from the rollout's seed);
- `"entropy"`: the call whose sampled tokens had the highest mean `-logprob` (an entropy proxy: the sampled tokens'
  surprisal), the next highest for the parent's next branch;
- `"tool_error"`: the call whose reply led to the first tool error of the parent (a malformed tool call, or a tool
  result starting with `"Error"`, as `ToolAgent` and the tool loop answer a broken call): that decision sampled again
  (`k` may then be the parent's own first sampled call). Without a tool error: `"uniform"`.
- `"first"`: the earliest of those calls (`b + 1`: a root is branched after its first call), then the next ones in
  order: siblings share the parent's first call, so the leaves under it estimate that call's value (a task whose
  first call is the decision, `trl_agentic/tasks/precedence.py`).
- `"call:K"` (an integer `K >= 1`): call `K` and no other, every branch of the parent: siblings replay calls
  `0 .. K-1` and differ from call `K` on (a task whose decision is call `K`, after `K` deterministic calls:
  `trl_agentic/tasks/precedence_lookup.py`, `"call:3"`). A parent with `K` calls or fewer, or branched at `K` or
  later itself, cannot be branched.

The slots of a group: roots first, then the branches level by level; a branch's `group_index` is its slot in the group
and its `task_index` its parent's (`rollout/replay.py`). Each episode's `metadata["tree"]` says where it sits:
`{"root": id, "parent": id | None, "branch_point": k | None}`; `rollout/tree.py` (`group_tree`) turns a group into
segments and advantages.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass
from typing import Any

from ..generation.engine import derive_seed
from ..trace import Episode
from .agents import EpisodeAgent
from .replay import run_branch
from .rows import RowsResult, row_token_turns
from .runner import EpisodeServer, run_episode
from .tree import GroupTree, group_tree


NAMED_BRANCH_POINTS = ("uniform", "entropy", "tool_error", "first")
FIXED_CALL = "call:"  # "call:K": branch at call K (an integer >= 1)
TREE_BRANCH_POINTS = (*NAMED_BRANCH_POINTS, f"{FIXED_CALL}K")


def fixed_branch_call(rule: str) -> int | None:
    """`K` of a `"call:K"` rule (`None` for the other rules); a `ValueError` that says how to write it if `K` is not
    an integer >= 1.

    Example:

    ```python
    >>> fixed_branch_call("call:3"), fixed_branch_call("first")
    (3, None)
    ```
    """
    if not isinstance(rule, str) or not rule.startswith(FIXED_CALL):
        return None
    raw = rule[len(FIXED_CALL) :].strip()
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(
            f"tree_branch_points {rule!r}: write 'call:K' with K an integer >= 1, the 0-based index of the call the "
            "branches sample again (e.g. 'call:3': calls 0-2 replayed); call 0 cannot be branched (a branch there "
            "is a fresh root: lower num_generations - tree_branches instead)."
        )
    return int(raw)


TREE_KEY = "tree"  # episode.metadata[TREE_KEY] = {"root", "parent", "branch_point"} (+ "segments" once trained)


@dataclass(frozen=True)
class TreeSpec:
    """How a group becomes a tree: `branches` branch episodes per group over `depth` levels, branched at calls chosen
    by `branch_points` (one of `TREE_BRANCH_POINTS`)."""

    branches: int
    branch_points: str = "uniform"
    depth: int = 1

    def __post_init__(self):
        if fixed_branch_call(self.branch_points) is None and self.branch_points not in NAMED_BRANCH_POINTS:
            raise ValueError(f"tree_branch_points must be one of {TREE_BRANCH_POINTS}, got {self.branch_points!r}.")
        if self.branches < 1 or not 1 <= self.depth <= self.branches:
            raise ValueError(
                f"tree_branches must be >= 1 and tree_depth in [1, tree_branches]; got {self.branches} and "
                f"{self.depth}."
            )

    def roots(self, group_size: int) -> int:
        """Root episodes of a group of `group_size`: what the branches leave (at least one)."""
        roots = group_size - self.branches
        if roots < 1:
            raise ValueError(
                f"A group of {group_size} episodes cannot hold {self.branches} branches and a root: set tree_branches "
                f"<= num_generations - 1 (= {group_size - 1}), or raise num_generations."
            )
        return roots

    def level_sizes(self) -> list[int]:
        """Branches per level, level 1 first."""
        base, extra = divmod(self.branches, self.depth)
        return [base + (level < extra) for level in range(self.depth)]


def _calls(episode: Episode) -> list:
    return [turn for turn in episode.turns if turn.finish_reason != "cancelled"]


def _own_branch_point(episode: Episode) -> int:
    tree = episode.metadata.get(TREE_KEY) or {}
    return tree.get("branch_point") or 0


def surprisal(turn) -> float:
    """Mean `-logprob` of a call's sampled tokens (the entropy proxy of `"entropy"`); `-inf` without logprobs."""
    values = [-lp for lp in turn.logprobs if lp is not None and math.isfinite(lp)]
    return sum(values) / len(values) if values else -math.inf


def first_tool_error(episode: Episode) -> int | None:
    """The index (among the non-cancelled calls) of the call whose reply led to the episode's first tool error: a
    malformed tool call, or a tool message answering it whose text starts with `"Error"`; `None` without one."""
    calls = _calls(episode)
    for j, turn in enumerate(calls):
        if turn.malformed_tool_call:
            return j
        if j + 1 < len(calls):
            after = calls[j + 1].request_messages[len(turn.request_messages) + 1 :]
            for message in after:
                content = message.get("content")
                text = content if isinstance(content, str) else ""
                if isinstance(content, list):  # content parts
                    text = " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
                if message.get("role") == "tool" and text.lstrip().startswith("Error"):
                    return j
    return None


def branch_candidates(episode: Episode, rule: str, rng: random.Random) -> list[int]:
    """The calls `episode` can be branched at, in the order `rule` prefers them (the first for its first branch, the
    next for its second, ...); empty when it cannot be branched (see the module's docstring)."""
    calls = _calls(episode)
    low = _own_branch_point(episode) + 1
    candidates = list(range(low, len(calls)))
    fixed = fixed_branch_call(rule)
    if fixed is not None:
        return [fixed] if fixed in candidates else []
    if rule == "tool_error":
        error = first_tool_error(episode)
        if error is not None and error >= low - 1 and error < len(calls):
            rest = [k for k in candidates if k != error]
            rng.shuffle(rest)
            return [error] + rest
    if not candidates or rule == "first":
        return candidates
    if rule == "entropy" and any(math.isfinite(surprisal(calls[k])) for k in candidates):
        return sorted(candidates, key=lambda k: (-surprisal(calls[k]), k))
    rng.shuffle(candidates)
    return candidates


@dataclass
class _Slot:
    episode: Episode | None = None
    level: int = 0


async def run_tree_group(
    server: EpisodeServer,
    agent: EpisodeAgent,
    task: dict[str, Any],
    group_size: int,
    tree: TreeSpec,
    *,
    first_index: int,
    semaphore: asyncio.Semaphore,
    timeout: float = 300.0,
    model: str | None = None,
    seed: int | None = None,
) -> list[Episode]:
    """One group of `task` as a tree (see the module's docstring): its episodes in slot order, roots first. Slot `s`
    has index `first_index + s` in the batch (its task index as a root, its seed `derive_seed(seed, index)` as
    `run_episodes` gives it)."""
    roots = tree.roots(group_size)

    def episode_seed(slot: int) -> int | None:
        return None if seed is None else derive_seed(seed, first_index + slot)

    async def root(slot: int) -> Episode:
        async with semaphore:
            episode = await run_episode(
                server, agent, task, first_index + slot, slot, timeout, model, seed=episode_seed(slot)
            )
        episode.metadata[TREE_KEY] = {"root": episode.id, "parent": None, "branch_point": None}
        return episode

    slots = [_Slot(episode, 0) for episode in await asyncio.gather(*[root(s) for s in range(roots)])]
    # Each episode's candidates, drawn once (a stream per slot), and how many branches it has had
    # (without a seed, as under vLLM, fresh draws: a fixed stream would branch every step's groups alike)
    rngs = [random.Random(f"tree:{seed}:{first_index}:{s}" if seed is not None else None) for s in range(group_size)]
    candidates: dict[int, list[int]] = {}
    taken: dict[int, int] = {}

    def candidates_of(slot: int) -> list[int]:
        if slot not in candidates:
            candidates[slot] = branch_candidates(slots[slot].episode, tree.branch_points, rngs[slot])
        return candidates[slot]

    for level, size in enumerate(tree.level_sizes(), start=1):
        previous = [s for s, slot in enumerate(slots) if slot.level == level - 1 and candidates_of(s)]
        earlier = [s for s, slot in enumerate(slots) if slot.level < level - 1 and candidates_of(s)]
        plan = []  # (slot, parent slot or None, branch point)
        for i in range(size):
            pool = previous or earlier
            slot = len(slots) + i
            if not pool:
                plan.append((slot, None, None))
                continue
            parent = pool[i % len(pool)]
            options = candidates_of(parent)
            point = options[taken.get(parent, 0) % len(options)]
            taken[parent] = taken.get(parent, 0) + 1
            plan.append((slot, parent, point))

        async def branch(slot: int, parent: int | None, point: int | None) -> Episode:
            if parent is None:  # nothing to branch from (one-call episodes): a fresh episode, a root of the tree
                return await root(slot)
            parent_episode = slots[parent].episode
            async with semaphore:
                episode = await run_branch(
                    server,
                    agent,
                    task,
                    parent_episode,
                    point,
                    timeout=timeout,
                    seed=episode_seed(slot),
                    group_index=slot,
                    model=model,
                )
            episode.metadata[TREE_KEY] = {
                "root": parent_episode.metadata[TREE_KEY]["root"],
                "parent": parent_episode.id,
                "branch_point": point,
            }
            return episode

        episodes = await asyncio.gather(*[branch(*entry) for entry in plan])
        slots += [_Slot(episode, level) for episode in episodes]
    return [slot.episode for slot in slots]


async def run_tree_groups(
    server: EpisodeServer,
    agent: EpisodeAgent,
    tasks: list[dict[str, Any]],
    group_size: int,
    tree: TreeSpec,
    *,
    max_concurrent: int = 64,
    timeout: float = 300.0,
    model: str | None = None,
    seed: int | None = None,
    first_index: int = 0,
) -> list[Episode]:
    """`run_episodes` for tree groups: `tasks` holds whole groups (each task `group_size` times in a row, TRL's
    `RepeatSampler` order); every group runs as a tree (`run_tree_group`), the groups concurrently, at most
    `max_concurrent` episodes at once. Returns the episodes in the order of `tasks`."""
    if group_size < 1 or len(tasks) % group_size:
        raise ValueError(
            f"Tree rollouts need whole groups on each process: {len(tasks)} episodes are not groups of {group_size}. "
            "Make the per-process generation batch (per_device_train_batch_size * steps_per_generation) a multiple "
            "of num_generations."
        )
    semaphore = asyncio.Semaphore(max_concurrent)
    groups = await asyncio.gather(
        *[
            run_tree_group(
                server,
                agent,
                tasks[start],
                group_size,
                tree,
                first_index=first_index + start,
                semaphore=semaphore,
                timeout=timeout,
                model=model,
                seed=seed,
            )
            for start in range(0, len(tasks), group_size)
        ]
    )
    return [episode for group in groups for episode in group]


def _replayed_tokens(episode: Episode, result: RowsResult) -> int | None:
    """How many of a branch's main-row completion tokens come from its replayed calls (`group_tree`'s `replayed`)."""
    if not result.rows:
        return 0
    row = result.rows[0]
    calls = _calls(episode)
    first = next((j for j, turn in enumerate(calls) if not turn.replayed), len(calls))
    if first == len(calls) or calls[first].index not in row.turns:
        return len(row.completion_ids) if first else 0
    return max(0, len(calls[first].prompt_ids) - len(row.prompt_ids))


@dataclass
class BatchTree:
    """The tree advantages of a batch of tree groups (`batch_tree`).

    Attributes:
        token_advantages (`list[list[list[float]]]`): per episode, per row, one advantage per completion token: the
            main row's from its segments (`tree_advantages`: 0 on the tokens it does not own), the other rows (forks,
            side calls) its leaf's advantage on every token (0 when unscorable).
        owned (`list[list[int]]`): per episode, per completion token of its main row, 1 where the row carries it in the
            loss (its own segments, scorable), 0 elsewhere (a shared segment's copies, unscorable segments).
        branches (`int`): branch episodes that share tokens with their parent.
        groups (`int`): groups.
        flat_tokens, tree_tokens (`int`): the main rows' tokens (prompt + completion) as rows, and as a prefix tree
            (each distinct prefix once): what prefix-tree training forwards when a tree's rows are scored together.
    """

    token_advantages: list[list[list[float]]]
    owned: list[list[int]]
    branches: int
    groups: int
    flat_tokens: int
    tree_tokens: int


def trie_tokens(sequences: list[list[int]]) -> int:
    """Distinct prefixes of `sequences` (the nodes of their trie): the tokens a prefix tree runs once each."""
    ordered = sorted(sequences)
    total, previous = 0, []
    for sequence in ordered:
        common = 0
        for a, b in zip(sequence, previous):
            if a != b:
                break
            common += 1
        total += len(sequence) - common
        previous = sequence
    return total


def batch_tree(
    episodes: list[Episode],
    rows_results: list[RowsResult],
    rewards: list[float | None],
    group_size: int,
    *,
    local_weight: float = 1.0,
    scale: bool = True,
) -> BatchTree:
    """Tree advantages of a batch of tree groups (`group_size` consecutive episodes each, `run_tree_groups`'s order):
    each group's tree (`rollout.tree.group_tree` over the main rows) and `rewards` (each episode's, `None` unscorable)
    through `tree_advantages`. Writes each episode's segments into `metadata["tree"]["segments"]`:
    `[{"turns": [first, last], "advantage": a | None, "owned": bool}]` along its path, root first (segments that hold
    no sampled token left out)."""
    if len(episodes) % group_size:
        raise ValueError(f"{len(episodes)} episodes are not whole groups of {group_size}.")
    token_advantages, owned = [], []
    branches = flat = tree_tokens = 0
    for start in range(0, len(episodes), group_size):
        group = episodes[start : start + group_size]
        results = rows_results[start : start + group_size]
        ids = {episode.id: i for i, episode in enumerate(group)}
        parents = [ids.get((episode.metadata.get(TREE_KEY) or {}).get("parent")) for episode in group]
        rows = [result.rows[0] if result.rows else None for result in results]
        tree: GroupTree = group_tree(
            parents,
            [row.prompt_ids if row else [] for row in rows],
            [row.completion_ids if row else [] for row in rows],
            [None if parent is None else _replayed_tokens(ep, res) for ep, res, parent in zip(group, results, parents)],
        )
        advantages = tree.advantages(rewards[start : start + group_size], local_weight=local_weight, scale=scale)
        branches += sum(parent is not None for parent in tree.parents)
        sequences = [row.prompt_ids + row.completion_ids for row in rows if row is not None]
        flat += sum(map(len, sequences))
        tree_tokens += trie_tokens(sequences)
        for e, (episode, result, row) in enumerate(zip(group, results, rows)):
            leaf = advantages.segments[tree.spans[e][-1][0]]
            main = advantages.rows[e] if row is not None else [0.0]
            extra = [[leaf or 0.0] * len(other.completion_ids) for other in result.rows[1:]]
            token_advantages.append([main, *extra])
            owned.append([int(x) for x in advantages.owned[e]] if row is not None else [0])
            turns = row_token_turns(row, episode.turns) if row is not None else []
            segments = []
            mine = {span[0] for span in tree.spans[e]} - (
                set() if tree.parents[e] is None else {span[0] for span in tree.spans[tree.parents[e]]}
            )
            for segment, first, end in tree.spans[e]:
                sampled = [t for t in turns[first:end] if t >= 0]
                if sampled:
                    segments.append(
                        {
                            "turns": [sampled[0], sampled[-1]],
                            "advantage": advantages.segments[segment],
                            "owned": segment in mine,
                        }
                    )
            info = episode.metadata.setdefault(TREE_KEY, {"root": episode.id, "parent": None, "branch_point": None})
            info["segments"] = segments
    return BatchTree(token_advantages, owned, branches, len(episodes) // group_size, flat, tree_tokens)


__all__ = [
    "BatchTree",
    "batch_tree",
    "trie_tokens",
    "TREE_BRANCH_POINTS",
    "TREE_KEY",
    "TreeSpec",
    "branch_candidates",
    "first_tool_error",
    "run_tree_group",
    "run_tree_groups",
    "surprisal",
]
