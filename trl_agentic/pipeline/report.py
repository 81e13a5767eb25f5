"""The pipeline's results: the trained model saved with the commands that use it, the before/after table and the
split-rate line."""

from __future__ import annotations

import gzip
import math
import shlex
import shutil
from pathlib import Path
from typing import Any

from .config import PipelineConfig


def task_file_source(spec: str) -> str:
    """The text of a `task.py` that loads the task `spec` (`"pkg.module:attr"`, `"path/to/file.py:attr"`, a bundled
    name), so that `trl-agentic eval --task <output_dir>/task.py:TASK` finds it from any folder."""
    module, sep, attr = spec.partition(":")
    if sep and module.endswith(".py"):
        spec = f"{Path(module).resolve()}:{attr}"
    return (
        '"""The task of this pipeline run, for `trl-agentic eval --task <this file>:TASK`."""\n\n'
        f"from trl_agentic.tasks import get_task\n\nTASK = get_task({spec!r})\n"
    )


def save_trained_model(
    model, tokenizer, config: PipelineConfig, output_dir: Path, task_source: str | None, eval_seed: int | None = None
) -> dict[str, str]:
    """Save the trained policy (model + tokenizer) to `<output_dir>/model` and the task to `<output_dir>/task.py`
    (`task_source`, the file's text); return the `trl-agentic eval` and `trl-agentic serve` commands that use them
    (without `task_source`, no task file and no eval command).

    The eval command repeats the "after" evaluation: the same eval-split tasks (`--split`, `--size`,
    `--dataset-seed`), one episode each, the same sampling, turn limit and sampling seed. `eval_seed` is that seed:
    the alarms evaluate step `s` with `seed + s`, so the "after" figure of an `N`-step run was sampled with
    `config.seed + N` (default `config.seed`). Issue 40: the command carried `config.seed` and gave another figure.
    """
    model_dir = output_dir / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    sampling = [
        "--temperature",
        str(config.temperature),
        "--max-tokens",
        str(config.max_completion_length),
        "--max-turns",
        str(config.max_turns),
    ]
    serve = ["trl-agentic", "serve", "--model", str(model_dir), *sampling]
    if task_source is None:
        return {"serve": shlex.join(serve)}
    task_file = output_dir / "task.py"
    task_file.write_text(task_source)
    evaluate = [
        "trl-agentic",
        "eval",
        "--task",
        f"{task_file}:TASK",
        "--model",
        str(model_dir),
        "--split",
        "eval",
        "--size",
        str(config.eval_size),
        "--dataset-seed",
        str(config.seed),
        "--num-samples",
        "1",
        *sampling,
        "--seed",
        str(config.seed if eval_seed is None else eval_seed),
        "--concurrency",
        str(config.eval_size),  # every task at once, as the held-out evaluation runs them
    ]
    return {"eval": shlex.join(evaluate), "serve": shlex.join(serve)}


def keep_episode_log(path: Path, episode_log: str) -> Path:
    """The episode log as `episode_log` (`PipelineConfig`) keeps it: `"gzip"` compresses the trainer's JSONL at `path`
    into `<path>.gz` and removes it (every record kept; a 300-step calculator run wrote 145 MB of it, issue 40),
    `"jsonl"` leaves it. Returns the file kept."""
    if episode_log == "jsonl" or not path.is_file():
        return path
    packed = path.with_name(path.name + ".gz")
    with path.open("rb") as source, gzip.open(packed, "wb", compresslevel=6) as target:
        shutil.copyfileobj(source, target)
    path.unlink()
    return packed


def describe_episode_log(path: Path, output_dir: Path) -> str:
    """The results' line on the episode log: where, how big, how to browse it and how to keep it uncompressed."""
    if not path.is_file():
        return ""
    size = path.stat().st_size
    size = (f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size / 1e3:.1f} kB") + (
        ", gzip: --set episode_log=jsonl keeps it uncompressed" if path.suffix == ".gz" else ""
    )
    return f"  episodes: {path} ({size}); browse them: trl-agentic inspect {output_dir}\n"


def format_table(before: dict, after: dict) -> str:
    """The before/after table of two held-out evaluations."""
    statuses = [s for s in before["status"] if before["status"][s] or after["status"].get(s)]
    rows = [
        ("held-out success", f"{before['success']:.1%}", f"{after['success']:.1%}"),
        ("mean model calls (turns)", f"{before['mean_turns']:.2f}", f"{after['mean_turns']:.2f}"),
        ("mean tool calls", f"{before['mean_tool_calls']:.2f}", f"{after['mean_tool_calls']:.2f}"),
        (
            "malformed tool-call rate",
            f"{before['malformed_tool_call_rate']:.1%}",
            f"{after['malformed_tool_call_rate']:.1%}",
        ),
        ("mean sampled tokens", f"{before['mean_sampled_tokens']:.1f}", f"{after['mean_sampled_tokens']:.1f}"),
    ]
    rows += [(f"episodes {s}", str(before["status"].get(s, 0)), str(after["status"].get(s, 0))) for s in statuses]
    width = max(len(r[0]) for r in rows)
    lines = [f"  {'':<{width}}  {'before':>10}  {'after':>10}", f"  {'-' * (width + 24)}"]
    lines += [f"  {name:<{width}}  {b:>10}  {a:>10}" for name, b, a in rows]
    return "\n".join(lines)


def split_rate_summary(log_history: list[dict], after_step: int = 20, window: int = 10) -> dict[str, Any]:
    """The split rate (`sampling/split_rate`) after `after_step`: its mean and its lowest `window`-step mean."""
    values = [
        entry["sampling/split_rate"]
        for entry in log_history
        if entry.get("step", 0) > after_step and isinstance(entry.get("sampling/split_rate"), int | float)
    ]
    means = [sum(values[i : i + window]) / window for i in range(0, len(values) - window + 1)]
    return {
        "after_step": after_step,
        "window": window,
        "steps": len(values),
        "mean": sum(values) / len(values) if values else None,
        "lowest_window_mean": min(means) if means else None,
    }


def format_split_rate(signal: dict[str, Any]) -> str | None:
    """The results line of `split_rate_summary(...)`; `None` when no step came after `after_step`."""
    if not signal["steps"]:
        return None
    line = f"split rate (groups whose rewards differ) after step {signal['after_step']}: mean {signal['mean']:.0%}"
    if signal["lowest_window_mean"] is not None:  # a run shorter than after_step + window has no window
        line += f", lowest {signal['window']}-step mean {signal['lowest_window_mean']:.0%}"
    return line


def json_default(value):
    """`json.dumps(default=...)` for a summary: NaN and infinities as `null`, tensors and numpy scalars as numbers."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if hasattr(value, "item"):
        return value.item()
    return str(value)
