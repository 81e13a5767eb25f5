"""The viewer's files: `index.html` with a small index of every episode, and one data file per step, loaded when the
step is opened.

Browsers refuse `fetch()` of `file://` URLs, but not `<script src>`: a step's file is a script that hands its data to
the page (`trlViewerStep(k, {...})`), so the folder works opened from disk, with no server and no network.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any


STEPS_DIR = "steps"
STEP_CALLBACK = "trlViewerStep"  # the page's function each step file calls


def _script_json(value: Any) -> str:
    # `<` only occurs inside JSON strings, where \u003c is the same character: no `</script>` can end the block early.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str).replace("<", "\\u003c")


def _sign(value: float | None) -> int:
    return 0 if not value else (1 if value > 0 else -1)


def split_by_step(
    summary: dict[str, Any], details: list[dict[str, Any]]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`(index, steps)`: the page's index and each step's data, from `build_viewer_data`'s `(summary, details)`.

    `index` keeps the run's header (`source`, `generated`, `tokenizer`, `alarms`), the episode `statuses`, and per step
    (in log order: training steps, then evaluation) its `mode`, `step`, data `file` and one compact entry per episode,
    `[rank, group, status index, reward, sign of the advantage, has forks]`: what the step list, the chart and every
    filter but the text search read, without opening a step. `steps[k]` holds step `k`'s full `episodes` entries and
    `details`, the `prompts` its rows start from (indices renumbered per step) and the `vocab` its token ids use.
    """
    statuses = sorted({episode["status"] for episode in summary["episodes"]})
    order: dict[tuple[str, Any], int] = {}
    for i, episode in enumerate(summary["episodes"]):
        order.setdefault((episode["mode"], episode["step"]), len(order))
    members: list[list[int]] = [[] for _ in order]
    for i, episode in enumerate(summary["episodes"]):
        members[order[(episode["mode"], episode["step"])]].append(i)
    vocab = summary["vocab"]

    entries, steps = [], []
    for k, ((mode, step), indices) in enumerate(zip(order, members, strict=True)):
        prompts: dict[int, int] = {}  # the run's prompt index -> this step's
        step_details, used = [], set()
        for i in indices:
            detail = details[i]
            rows = []
            for row in detail["rows"]:
                if row["prompt"] not in prompts:
                    prompts[row["prompt"]] = len(prompts)
                    used.update(summary["prompts"][row["prompt"]])
                used.update(row["ids"])
                rows.append({**row, "prompt": prompts[row["prompt"]]})
            for untrained in detail["untrained"]:
                used.update(untrained["ids"])
            step_details.append({**detail, "rows": rows})
        episodes = [summary["episodes"][i] for i in indices]
        steps.append(
            {
                "episodes": episodes,
                "details": step_details,
                "prompts": [summary["prompts"][p] for p in prompts],
                "vocab": None if vocab is None else {str(t): vocab[str(t)] for t in sorted(used) if str(t) in vocab},
            }
        )
        entries.append(
            {
                "mode": mode,
                "step": step,
                "file": f"{STEPS_DIR}/{k}.js",
                # Branch episodes of tree rollouts (the step list says how many, before the step is opened)
                "branches": sum(1 for e in episodes if (e.get("tree") or {}).get("parent") is not None),
                "episodes": [
                    [
                        e["rank"],
                        e["group"],
                        statuses.index(e["status"]),
                        e["reward"],
                        _sign(e["advantage"]),
                        int(bool(e["forks"])),
                    ]
                    for e in episodes
                ],
            }
        )
    index = {key: summary[key] for key in ("source", "generated", "tokenizer", "alarms") if key in summary} | {
        "statuses": statuses,
        "episodes": len(summary["episodes"]),
        "steps": entries,
    }
    return index, steps


def step_script(k: int, data: dict[str, Any]) -> str:
    """Step `k`'s data file: a script that hands `data` to the page (JSON is a JavaScript expression)."""
    return f"{STEP_CALLBACK}({k},{_script_json(data)});\n"


def render_index(index: dict[str, Any], title: str = "trl-agentic episodes") -> str:
    """The page: the template with the index inlined."""
    template = resources.files(__package__).joinpath("template.html").read_text(encoding="utf-8")
    return template.replace("__TITLE__", title.replace("&", "&amp;").replace("<", "&lt;")).replace(
        "/*__INDEX__*/null", _script_json(index)
    )


def check_folder(folder: str | Path) -> Path:
    """`folder` as a `Path`; a ValueError for a `.html` name (the viewer was one HTML file before issue #33)."""
    folder = Path(folder)
    if folder.suffix.lower() in (".html", ".htm"):
        raise ValueError(
            f"The viewer is a folder (index.html and one data file per step), not one HTML file: got {folder}. Pass a "
            f"folder, e.g. -o {folder.with_suffix('')}"
        )
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file; the viewer needs a folder to write index.html and steps/ into.")
    return folder


def write_pages(
    summary: dict[str, Any], details: list[dict[str, Any]], folder: str | Path, title: str = "trl-agentic episodes"
) -> Path:
    """Write the viewer of `build_viewer_data`'s `(summary, details)` into `folder`: `index.html` and
    `steps/<k>.js`; returns the `index.html` path. Step files a previous write left in `folder/steps/` are removed."""
    folder = check_folder(folder)
    steps_dir = folder / STEPS_DIR
    steps_dir.mkdir(parents=True, exist_ok=True)
    for old in steps_dir.glob("*.js"):
        if re.fullmatch(r"\d+\.js", old.name):
            old.unlink()
    index, steps = split_by_step(summary, details)
    for k, data in enumerate(steps):
        (steps_dir / f"{k}.js").write_text(step_script(k, data), encoding="utf-8")
    page = folder / "index.html"
    page.write_text(render_index(index, title), encoding="utf-8")
    return page
