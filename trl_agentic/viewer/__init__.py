"""Trajectory viewer: an episode log as a static folder a browser opens from disk (issues #11, #33).

`trl-agentic inspect <output_dir | episodes.jsonl>` reads the episodes a run logged (`log_episodes=True`:
`output_dir/episodes/episodes-rank*.jsonl`, or `.jsonl.gz` as the demo keeps it; or the JSONL
`Evaluator.evaluate(episodes_path=...)` writes) and writes a
folder, `<output_dir>/viewer/` by default: `index.html` and `steps/<k>.js`, one data file per step. It opens from disk,
with no server and no network, and can be zipped and shared as it is. It shows steps -> groups -> episodes (reward,
advantage, status, forks), and for one episode at a time its messages (tool calls and results, errors) and its
training rows token by token: sampled tokens (`env_mask` 1, trained) apart from the masked context, each with its id,
text and sampling logprob on hover.

Made to open fast on a long run (a 300-step demo-shaped log is 14,400 episodes): `index.html` holds the header, the
alarms and a compact entry per episode (what the step list, the chart and the filters read); a step's episodes,
messages and tokens are loaded when the step is opened (a `<script src>`, which browsers allow from `file://` where
they refuse `fetch()`), and an episode is drawn only when opened. Token ids are decoded with the run's tokenizer when
one is found (`--tokenizer`, or saved in the output directory, a `checkpoint-*` or a sibling `model/`), per step as a
table of the ids that occur; without one the viewer shows ids. In the URL, `#step=<n>` opens a step and
`#episode=<id>` an episode (with `&step=<mode>:<n>`, without searching the steps for it).

Tree rollouts (issue 42): a group's branch episodes are drawn as its tree (each branch under its parent, at the call it
branched at; replayed, sampled and diverged calls told apart; where and why replay diverged; the trainer's segment
advantages when its log has them; `viewer/tree.py`).

Example:

```python
>>> from trl_agentic.viewer import write_viewer
>>> write_viewer("outputs/demo")  # the demo's folder: its run is outputs/demo/grpo, its tokenizer outputs/demo/model
PosixPath('outputs/demo/grpo/viewer/index.html')
```
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from .data import build_viewer_data
from .log import find_episode_files, find_tokenizer, load_records, open_log, sample_steps
from .pages import check_folder, render_index, split_by_step, step_script, write_pages


def _run_alarms(output_dir: Path | None, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's alarms: `alarms.json` when the run wrote one, else recomputed from the episode log (no held-out
    measure there, so no `reward_hacking`)."""
    from ..alarms import check_alarms, history_from_episode_records

    if output_dir is not None and (output_dir / "alarms.json").is_file():
        try:
            return [
                {**alarm, "source": "alarms.json"}
                for alarm in json.loads((output_dir / "alarms.json").read_text())["alarms"]
            ]
        except (json.JSONDecodeError, KeyError, TypeError):
            warnings.warn(f"Unreadable {output_dir / 'alarms.json'}; recomputing alarms from the log.", stacklevel=2)
    found = check_alarms(history_from_episode_records(r for r in records if "sample" not in r))
    return [{"name": a.name, "step": a.step, "message": a.message, "source": "episode log"} for a in found]


def default_output(path: str | Path, output_dir: Path | None) -> Path:
    """Where `write_viewer` writes without `output`: `<output_dir>/viewer` for a folder, `<name>-viewer` beside a
    JSONL file (`x.jsonl` or `x.jsonl.gz`: `x-viewer`)."""
    path = Path(path)
    if path.is_dir():
        return output_dir / "viewer"
    return path.with_name(f"{path.name.removesuffix('.gz').removesuffix('.jsonl')}-viewer")


DEFAULT_MAX_STEPS = 50


def write_viewer(
    path: str | Path,
    output: str | Path | None = None,
    tokenizer: str | None = None,
    decode: bool = True,
    max_steps: int = DEFAULT_MAX_STEPS,
) -> Path:
    """Read the episode log at `path` (an output directory, the demo's folder, an `episodes/` folder or a JSONL file)
    and write the viewer folder.

    Args:
        path: where the episodes are.
        output: the folder to write (`index.html`, `steps/`); default `<output_dir>/viewer`, or `<name>-viewer` beside
            a JSONL file.
        tokenizer: a tokenizer to decode ids with (Hub id, path or `tiny:<family>`); default: found next to the log.
        decode: `False` shows token ids without looking for a tokenizer.
        max_steps: the training steps shown, evenly spaced with the first and the last (`sample_steps`; a warning
            says how many of how many); `0` shows every step. A viewer of every step of a 300-step demo is 37 MB.

    Returns:
        The `index.html` to open.
    """
    folder = check_folder(output) if output is not None else None  # before reading a long log
    files, output_dir = find_episode_files(path)
    records, kept, total = sample_steps(load_records(files), max_steps)
    if kept < total:
        warnings.warn(
            f"The viewer shows {kept} of the log's {total} training steps, evenly spaced (the first and the last "
            "among them); every step: `trl-agentic inspect --max-steps 0` (`write_viewer(..., max_steps=0)`).",
            stacklevel=2,
        )
    records.sort(key=lambda r: (r.get("mode", "train") != "train", r.get("step", 0)))  # stable: rank order kept
    tok = find_tokenizer(output_dir, tokenizer) if decode else None
    if decode and tok is None:
        warnings.warn(
            "No tokenizer found next to the log (pass --tokenizer); the viewer shows token ids.", stacklevel=2
        )
    source = str(files[0] if len(files) == 1 else files[0].parent)
    summary, details = build_viewer_data(records, tok, source=source, alarms=_run_alarms(output_dir, records))
    folder = folder or default_output(path, output_dir)
    return write_pages(summary, details, folder, title=f"episodes · {source}")


__all__ = [
    "build_viewer_data",
    "default_output",
    "find_episode_files",
    "find_tokenizer",
    "load_records",
    "open_log",
    "render_index",
    "sample_steps",
    "split_by_step",
    "step_script",
    "write_pages",
    "write_viewer",
]
