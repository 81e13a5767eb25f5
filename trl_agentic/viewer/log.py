"""Reading a run's episode log: where the JSONL files are, their records, and the tokenizer to decode token ids with."""

from __future__ import annotations

import gzip
import json
import warnings
from pathlib import Path
from typing import Any


def find_episode_files(path: str | Path) -> tuple[list[Path], Path | None]:
    """The JSONL files to read and the run's output directory (where a tokenizer and `alarms.json` may be).

    `path` is a JSONL file, an `episodes/` folder, an output directory holding `episodes/`, or a folder with one such
    output directory (`trl-agentic demo`'s `outputs/demo`, whose run is `outputs/demo/grpo`). A log may be gzipped
    (`*.jsonl.gz`: the demo compresses its own, issue 40).
    """
    path = Path(path)
    if path.is_file():
        output_dir = path.parent.parent if path.parent.name == "episodes" else path.parent
        return [path], output_dir
    if not path.is_dir():
        raise FileNotFoundError(f"No episode log at {path}: pass an output directory or an episodes .jsonl file.")
    runs = sorted(p.parent for p in path.glob("*/episodes") if p.is_dir())
    if not (path / "episodes").is_dir() and not _logs_in(path) and len(runs) == 1:
        path = runs[0]  # the run inside, e.g. outputs/demo/grpo
    folder = path / "episodes" if (path / "episodes").is_dir() else path
    files = _logs_in(folder)
    if not files:
        raise FileNotFoundError(
            f"No *.jsonl or *.jsonl.gz in {folder}. Train with log_episodes=True (episodes go to "
            "<output_dir>/episodes/) or pass the JSONL file itself."
        )
    return files, (folder.parent if folder.name == "episodes" else folder)


def _logs_in(folder: Path) -> list[Path]:
    return sorted([*folder.glob("*.jsonl"), *folder.glob("*.jsonl.gz")])


def open_log(file: Path):
    """A log file opened as text, gzipped (`.gz`) or not."""
    if file.suffix == ".gz":
        return gzip.open(file, "rt", encoding="utf-8")
    return file.open(encoding="utf-8")


def sample_steps(records: list[dict[str, Any]], max_steps: int) -> tuple[list[dict[str, Any]], int, int]:
    """`(records, kept, total)`: the records of at most `max_steps` training steps, evenly spaced, the first and the
    last always among them (every step when `max_steps` is 0 or the log has no more). Evaluation records (`mode`
    other than `"train"`) are all kept. A 300-step demo log made a 37 MB viewer (issue 40); 50 steps make a sixth."""
    steps = sorted({r.get("step", 0) for r in records if r.get("mode", "train") == "train"})
    if max_steps <= 0 or len(steps) <= max_steps:
        return records, len(steps), len(steps)
    if max_steps == 1:
        kept = {steps[-1]}
    else:
        kept = {steps[round(i * (len(steps) - 1) / (max_steps - 1))] for i in range(max_steps)}
    sampled = [r for r in records if r.get("mode", "train") != "train" or r.get("step", 0) in kept]
    return sampled, len(kept), len(steps)


def load_records(files: list[Path]) -> list[dict[str, Any]]:
    """Every record of `files`, each tagged with `rank` (the file's position); unreadable lines are skipped with a
    warning (a run killed mid-write leaves a torn last line)."""
    records = []
    for rank, file in enumerate(files):
        with open_log(file) as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    warnings.warn(f"{file}:{number}: skipped an unreadable line ({error.msg}).", stacklevel=2)
                    continue
                if isinstance(record, dict) and isinstance(record.get("episode"), dict):
                    records.append({**record, "rank": rank})
    if not records:
        raise ValueError(f"No episode records in {', '.join(map(str, files))}.")
    return records


def find_tokenizer(output_dir: Path | None, name: str | None = None):
    """The tokenizer to decode ids with: `name` (a Hub id, a path, or `tiny:<family>`) if given, else the first of
    `output_dir`, its newest `checkpoint-*`, a sibling `model/` (the demo's layout) that loads; `None` if none does."""
    from transformers import AutoTokenizer

    if name is not None:
        if name.startswith("tiny:"):
            from ..tiny_models import build_tiny_tokenizer

            return build_tiny_tokenizer(name.split(":")[1] or "qwen2_5")
        return AutoTokenizer.from_pretrained(name)
    if output_dir is None:
        return None
    checkpoints = sorted(
        output_dir.glob("checkpoint-*"),
        key=lambda p: int(p.name.split("-")[-1]) if p.name.split("-")[-1].isdigit() else -1,
        reverse=True,
    )
    for candidate in [output_dir, *checkpoints, output_dir.parent / "model"]:
        if (candidate / "tokenizer_config.json").is_file() or (candidate / "tokenizer.json").is_file():
            try:
                return AutoTokenizer.from_pretrained(candidate)
            except Exception as error:  # noqa: BLE001 - a broken tokenizer folder only costs the decoding
                warnings.warn(
                    f"Could not load the tokenizer in {candidate} ({error}); showing token ids.", stacklevel=2
                )
    return None
