"""Trajectory viewer: an episode log as one self-contained HTML file (issue #11).

`trl-agentic inspect <output_dir | episodes.jsonl>` reads the episodes a run logged (`log_episodes=True`:
`output_dir/episodes/episodes-rank*.jsonl`; or the JSONL `Evaluator.evaluate(episodes_path=...)` writes) and writes
one HTML file that opens from disk, with no server and no network: the data is embedded as JSON, the script and
styles inline. It shows steps -> groups -> episodes (reward, advantage, status, forks), and for one episode at a time
its messages (tool calls and results, errors) and its training rows token by token: sampled tokens (`env_mask` 1,
trained) apart from the masked context, each with its id, text and sampling logprob on hover.

Made to stay usable on a long run (a 200-step demo log is ~6,400 episodes): each episode's detail is a JSON block of
its own, parsed and rendered only when the episode is opened; the list renders one step's groups when the step is
opened, and filters by step, mode, status, reward, advantage and text. Token ids are decoded with the run's tokenizer
when one is found (`--tokenizer`, or saved in the output directory, a `checkpoint-*` or a sibling `model/`), as a
table of the ids that occur; without one the viewer shows ids. `#episode=<id>` in the URL opens an episode.

Example:

```python
>>> from trl_agentic.viewer import write_viewer
>>> write_viewer("outputs/demo/grpo", "episodes.html")
PosixPath('episodes.html')
```
"""

from __future__ import annotations

import json
import warnings
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

from ..lineage import turn_conversations
from ..rollout.rows import episode_to_rows
from ..trace import Turn


# ---------------------------------------------------------------------------------------------------------------------
# Reading a log


def find_episode_files(path: str | Path) -> tuple[list[Path], Path | None]:
    """The JSONL files to read and the run's output directory (where a tokenizer and `alarms.json` may be).

    `path` is a JSONL file, an `episodes/` folder, an output directory holding `episodes/`, or a folder with one such
    output directory (`trl-agentic demo`'s `outputs/demo`, whose run is `outputs/demo/grpo`).
    """
    path = Path(path)
    if path.is_file():
        output_dir = path.parent.parent if path.parent.name == "episodes" else path.parent
        return [path], output_dir
    if not path.is_dir():
        raise FileNotFoundError(f"No episode log at {path}: pass an output directory or an episodes .jsonl file.")
    runs = sorted(p.parent for p in path.glob("*/episodes") if p.is_dir())
    if not (path / "episodes").is_dir() and not list(path.glob("*.jsonl")) and len(runs) == 1:
        path = runs[0]  # the run inside, e.g. outputs/demo/grpo
    folder = path / "episodes" if (path / "episodes").is_dir() else path
    files = sorted(folder.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(
            f"No *.jsonl in {folder}. Train with log_episodes=True (episodes go to <output_dir>/episodes/) or pass the "
            "JSONL file itself."
        )
    return files, (folder.parent if folder.name == "episodes" else folder)


def load_records(files: list[Path]) -> list[dict[str, Any]]:
    """Every record of `files`, each tagged with `rank` (the file's position); unreadable lines are skipped with a
    warning (a run killed mid-write leaves a torn last line)."""
    records = []
    for rank, file in enumerate(files):
        with file.open(encoding="utf-8") as f:
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


# ---------------------------------------------------------------------------------------------------------------------
# Viewer data


def _round(value: Any, digits: int = 4) -> Any:
    return round(value, digits) if isinstance(value, float) else value


def _episode_reward(record: dict[str, Any]) -> float | None:
    if "reward" in record:  # Evaluator.write_episodes: the weighted reward
        return record["reward"]
    scores = [v for v in (record["episode"].get("metadata") or {}).get("rewards", {}).values() if v is not None]
    return sum(scores) if scores else None


def _rows_of(record: dict[str, Any]) -> tuple[list[dict], list[int], list[int]]:
    """The record's rows (recomputed from its turns when the log has none, e.g. an evaluation log)."""
    if "rows" in record:
        return record["rows"], record.get("skipped_turns", []), record.get("capped_turns", [])
    result = episode_to_rows([Turn.from_dict(turn) for turn in record["episode"].get("turns", [])])
    return [row.to_dict() for row in result.rows], result.skipped_turns, result.capped_turns


def _row_label(kind: str, role: str | None) -> str:
    """`main`, `side_call`, `sub_agent`; a fork or branch says whose (`fork of sub_agent`)."""
    return f"{kind} of {role}" if kind in ("fork", "branch") and role else kind


def _short(value: Any, limit: int = 300) -> str | None:
    if value is None:
        return None
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "…"


def build_viewer_data(
    records: list[dict[str, Any]], tokenizer=None, source: str = "", alarms: list[dict[str, Any]] | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The viewer's data: `(summary, details)`. `summary` holds one small entry per episode (what the list shows and
    filters on), the interned prompts and the decoded vocabulary; `details[i]` is episode `i`'s messages, turns and
    rows.

    Each row and turn carries its conversation's role (`main`, `side_call`, `sub_agent`: `trl_agentic.lineage`).
    Rows keep their token ids; `mask` is the row's `env_mask` as a string of `0`/`1`, `lp` the logprobs of its sampled
    tokens only (rounded to 4 digits). A row's prompt is stored once per distinct prompt (`prompts`): the episodes of a
    group share it. `conversations` holds, per row, the messages of its last model call and the reply.
    """
    prompts: dict[tuple[int, ...], int] = {}
    used_ids: set[int] = set()
    episodes, details = [], []
    # Trainer logs: task_index is the episode's slot in the batch, G consecutive slots per group (one task).
    group_size: dict[tuple, int] = {}
    for record in records:
        key = (record["rank"], record.get("mode", "train"), record.get("step", 0))
        group_size[key] = max(group_size.get(key, 1), record["episode"].get("group_index", 0) + 1)

    for index, record in enumerate(records):
        episode = record["episode"]
        turns = episode.get("turns", [])
        step, mode = record.get("step", 0), record.get("mode", "train" if "sample" not in record else "eval")
        if "sample" in record:  # Evaluator.write_episodes: one task per task_index
            group, sample = record.get("task_index", episode.get("task_index", 0)), record["sample"]
        else:
            size = group_size[(record["rank"], record.get("mode", "train"), step)]
            group, sample = episode.get("task_index", 0) // size, episode.get("group_index", 0)
        rows, skipped, capped = _rows_of(record)
        messages = episode.get("messages") or (turns[-1]["request_messages"] if turns else [])
        # Each turn's conversation and its role (labelled when the episode closed; decided now for an older log).
        roles = turn_conversations([Turn.from_dict(turn) for turn in turns])
        main = next((t for t in turns if roles.get(t["index"], (None, None))[1] == "main"), turns[0] if turns else None)
        # The task: the last user message of the main line's first call (later calls may have rewritten the history;
        # the episode's first call may be a title request).
        first_request = (main.get("request_messages") or messages) if main else messages
        prompt_text = next(
            (
                m.get("content")
                for m in reversed(first_request)
                if m.get("role") == "user" and isinstance(m.get("content"), str)
            ),
            None,
        )
        reward = _episode_reward(record)
        episodes.append(
            {
                "i": index,
                "id": episode.get("id", str(index)),
                "step": step,
                "mode": mode,
                "rank": record["rank"],
                "group": group,
                "sample": sample,
                "status": episode.get("status", "?"),
                "reward": _round(reward),
                "rewards": {
                    k: _round(v)
                    for k, v in (
                        (record.get("rewards") or (episode.get("metadata") or {}).get("rewards") or {}).items()
                    )
                },
                "advantage": _round(record.get("advantage")),
                "turns": len(turns),
                "tool_calls": sum(len((t.get("response_message") or {}).get("tool_calls") or []) for t in turns),
                "malformed": sum(bool(t.get("malformed_tool_call")) for t in turns),
                "forks": sum(1 for t in turns[1:] if t.get("prompt_source") != "continued"),
                "conversations": {
                    role: sum(1 for c, r in set(roles.values()) if r == role)
                    for role in ("main", "sub_agent", "side_call")
                },
                "tokens": sum(len(t.get("completion_ids", [])) for t in turns),
                "rows": len(rows),
                "wall": _round(episode.get("wall_time"), 2),
                "error": _short(episode.get("error")),
                "result": _short(episode.get("result"), 120),
                "task": _short(prompt_text, 160),
            }
        )
        metadata = episode.get("metadata") or {}
        if "staleness" in metadata:  # asynchronous rollouts: the version it started on, its oldest trained token's gap
            episodes[-1].update(
                start_version=metadata.get("start_version"),
                staleness=metadata["staleness"],
                dropped=bool(metadata.get("dropped")),
            )
        if "difficulty" in record:  # a run with a difficulty column (a curriculum): the task's level
            episodes[-1].update(difficulty=record["difficulty"], target=bool(record.get("target")))

        detail_rows = []
        for row in rows:
            prompt_key = tuple(row["prompt_ids"])
            if prompt_key not in prompts:
                prompts[prompt_key] = len(prompts)
                used_ids.update(prompt_key)
            used_ids.update(row["completion_ids"])
            mask = row["env_mask"]
            detail_rows.append(
                {
                    "kind": row.get("kind", "main"),
                    "turns": row.get("turns", []),
                    "prompt": prompts[prompt_key],
                    "role": row.get("role") or roles.get((row.get("turns") or [None])[0], (None, None))[1],
                    "ids": row["completion_ids"],
                    "mask": "".join("1" if m else "0" for m in mask),
                    "lp": [
                        None if lp is None else round(lp, 4) for lp, m in zip(row["logprobs"], mask, strict=True) if m
                    ],
                }
            )
        # What the model saw and said, per row: the request of the row's last turn and its reply (a fork's main line
        # and its rewritten history differ; the episode's final messages hold only the last).
        by_index = {turn["index"]: turn for turn in turns}

        def conversation(turn: dict) -> list[dict]:
            return [
                *(turn.get("request_messages") or []),
                *([turn["response_message"]] if turn.get("response_message") else []),
            ]

        conversations = [
            {
                "label": f"row {r} · {_row_label(row.get('kind', 'main'), detail_rows[r]['role'])}",
                "messages": conversation(by_index[row["turns"][-1]]),
            }
            for r, row in enumerate(rows)
            if row.get("turns") and row["turns"][-1] in by_index
        ]
        in_rows = {t for row in rows for t in row.get("turns", [])}
        untrained = []
        for turn in turns:
            if turn["index"] not in in_rows:  # skipped or capped: not in any row, still worth seeing
                used_ids.update(turn["completion_ids"])
                untrained.append(
                    {
                        "turn": turn["index"],
                        "ids": turn["completion_ids"],
                        "lp": [None if lp is None else round(lp, 4) for lp in turn["logprobs"]],
                        "why": "capped" if turn["index"] in capped else "skipped",
                    }
                )
                role = roles.get(turn["index"], (None, None))[1]
                conversations.append(
                    {
                        "label": f"turn {turn['index']}{' · ' + role if role else ''} (not trained)",
                        "messages": conversation(turn),
                    }
                )
        if not conversations:
            conversations = [{"label": "messages", "messages": messages}]
        details.append(
            {
                "conversations": conversations,
                "tools": [(tool.get("function") or {}).get("name") for tool in (main.get("request_tools") or [])]
                if main
                else [],
                "turns": [
                    {
                        "index": t["index"],
                        "source": t.get("prompt_source"),
                        "parent": t.get("parent_turn"),
                        "conversation": roles.get(t["index"], (None, None))[0],
                        "role": roles.get(t["index"], (None, None))[1],
                        "spawned_by": t.get("spawned_by"),
                        "forked_from": t.get("forked_from"),
                        "fork_reason": t.get("fork_reason"),
                        "drift": t.get("drift", 0),
                        "finish": t.get("finish_reason"),
                        "malformed": bool(t.get("malformed_tool_call")),
                        "forced": t.get("forced_tokens", 0),
                        "prompt_tokens": len(t.get("prompt_ids", [])),
                        "sampled_tokens": len(t.get("completion_ids", [])),
                        # A call that decoded across a weight update (asynchronous rollouts): the versions it spans
                        "version": t.get("policy_version")
                        if not t.get("token_versions")
                        else f"{min(t['token_versions'])}-{max(t['token_versions'])}",
                        "wall": _round(t.get("wall_time"), 3),
                        "requested": t.get("requested_sampling") or {},
                    }
                    for t in turns
                ],
                "rows": detail_rows,
                "untrained": untrained,
                "skipped_turns": skipped,
                "capped_turns": capped,
                "result": episode.get("result"),
                "error": episode.get("error"),
                "metadata": episode.get("metadata") or {},
            }
        )

    vocab = None
    if tokenizer is not None:
        vocab = {
            str(i): tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            for i in sorted(used_ids)
        }
    summary = {
        "source": source,
        "generated": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "tokenizer": tokenizer.name_or_path if tokenizer is not None else None,
        "episodes": episodes,
        "prompts": [list(p) for p in prompts],
        "vocab": vocab,
        "alarms": alarms or [],
    }
    return summary, details


# ---------------------------------------------------------------------------------------------------------------------
# HTML


def _script_json(value: Any) -> str:
    # `<` only occurs inside JSON strings, where \u003c is the same character: no `</script>` can end the block early.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str).replace("<", "\\u003c")


def render_html(summary: dict[str, Any], details: list[dict[str, Any]], title: str = "trl-agentic episodes") -> str:
    """The self-contained page: the template with the summary and one `<script type="application/json">` block per
    episode (parsed when the episode is opened)."""
    template = resources.files(__package__).joinpath("template.html").read_text(encoding="utf-8")
    blocks = "\n".join(
        f'<script type="application/json" id="episode-data-{i}">{_script_json(detail)}</script>'
        for i, detail in enumerate(details)
    )
    return (
        template.replace("__TITLE__", title.replace("&", "&amp;").replace("<", "&lt;"))
        .replace("/*__SUMMARY__*/null", _script_json(summary))
        .replace("<!--__DETAILS__-->", blocks)
    )


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


def write_viewer(
    path: str | Path, output: str | Path | None = None, tokenizer: str | None = None, decode: bool = True
) -> Path:
    """Read the episode log at `path` (an output directory, an `episodes/` folder or a JSONL file) and write the viewer.

    Args:
        path: where the episodes are.
        output: the HTML file to write; default `<output_dir>/episodes.html` (next to the JSONL for a file).
        tokenizer: a tokenizer to decode ids with (Hub id, path or `tiny:<family>`); default: found next to the log.
        decode: `False` shows token ids without looking for a tokenizer.

    Returns:
        The path written.
    """
    files, output_dir = find_episode_files(path)
    records = load_records(files)
    records.sort(key=lambda r: (r.get("mode", "train") != "train", r.get("step", 0)))  # stable: rank order kept
    tok = find_tokenizer(output_dir, tokenizer) if decode else None
    if decode and tok is None:
        warnings.warn(
            "No tokenizer found next to the log (pass --tokenizer); the viewer shows token ids.", stacklevel=2
        )
    source = str(files[0] if len(files) == 1 else files[0].parent)
    summary, details = build_viewer_data(records, tok, source=source, alarms=_run_alarms(output_dir, records))
    if output is None:
        output = (output_dir / "episodes.html") if Path(path).is_dir() else Path(path).with_suffix(".html")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(render_html(summary, details, title=f"episodes · {source}"), encoding="utf-8")
    return output


__all__ = ["build_viewer_data", "find_episode_files", "find_tokenizer", "load_records", "render_html", "write_viewer"]
