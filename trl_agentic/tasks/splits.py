"""Train/eval splits by hashing the question, so no eval question can ever be trained on, whatever `size` or `seed`.

Each generated task has a canonical *key* (e.g. the expression `"12 + 7"`); the key's hash alone decides its split.
Builders sample candidates and keep those of the requested split (rejection sampling), so the two splits partition the
question space instead of merely using different seeds.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any


SPLITS = ("train", "eval")

# Share of the question space reserved for evaluation. A module constant on purpose, not a per-call knob: two calls
# with different fractions would no longer partition the space.
EVAL_FRACTION = 0.1


def split_of(key: str) -> str:
    """The split (`"train"` or `"eval"`) a task key belongs to. Stable across processes and Python versions.

    Example:

    ```python
    >>> split_of("12 + 7") in ("train", "eval")
    True
    ```
    """
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "big") / 2**64  # uniform in [0, 1)
    return "eval" if bucket < EVAL_FRACTION else "train"


def sample_split(
    make_task: Callable[[random.Random], tuple[str, dict[str, Any]]], split: str, size: int, seed: int
) -> list[dict[str, Any]]:
    """Draw `size` tasks of `split` from a generator of `(key, row)` candidates.

    Args:
        make_task: draws one candidate task from the given RNG and returns its canonical key and its dataset row.
        split: `"train"` or `"eval"`.
        size: number of rows to return (duplicates are possible when the question space is small).
        seed: RNG seed; the same `(split, size, seed)` always gives the same rows.

    Example:

    ```python
    >>> rows = sample_split(lambda rng: (str(n := rng.randint(0, 999)), {"n": n}), "eval", 3, seed=0)
    >>> all(split_of(str(row["n"])) == "eval" for row in rows)
    True
    ```
    """
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; use one of {SPLITS}.")
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}.")
    rng = random.Random(f"{split}-{seed}")  # str seeds are hashed deterministically (not with PYTHONHASHSEED)
    rows: list[dict[str, Any]] = []
    # ~10 candidates per eval row are expected; the cap only trips when the split is (nearly) empty.
    max_attempts = 1000 * size + 10_000
    for _ in range(max_attempts):
        if len(rows) == size:
            return rows
        key, row = make_task(rng)
        if split_of(key) == split:
            rows.append(row)
    if len(rows) == size:
        return rows
    raise ValueError(
        f"Found only {len(rows)} of {size} {split!r} tasks in {max_attempts} draws: the question space is too small "
        "for this split. Make the task harder (e.g. more operand digits or more operations)."
    )
