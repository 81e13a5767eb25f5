"""Files task: a multi-step job whose state lives outside the model, in a temporary workspace directory.

Each episode gets a fresh directory created from the row's initial `files`; the model works through `list_files`,
`read_file` and `write_file`, which are confined to that directory. The agent returns a snapshot of the final
workspace and the checker compares it with the row's `expected` end state, which the model never sees and the tools
cannot reach. Task kinds (knob `kinds`):

- `"sum"`: write the sum of the numbers in `numbers.txt` to `total.txt`;
- `"max"`: write the largest number in `numbers.txt` to `max.txt`;
- `"copy_key"`: copy the value of a key of `config.txt` into `answer.txt`.

Example:

```python
>>> from trl_agentic.tasks import get_task
>>> suite = get_task("files")
>>> suite.build_dataset(split="train", size=1)[0]["prompt"][-1]["content"]
'Copy the value of the key region in config.txt into answer.txt.'
```
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import datasets

from ..endpoint import SERVED_MODEL_NAME
from ..rewards.utils import episode_for, is_scorable
from . import TaskSuite
from .agent_loop import ToolFunction, run_tool_loop
from .splits import sample_split


SYSTEM_PROMPT = (
    "You are an agent working in a directory of text files. Use the tools list_files, read_file and write_file to do "
    "the task; only what is in the files when you finish counts. When you are done, reply briefly."
)

FILES_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "list_files",
            "description": "List the paths of all files in the workspace, one per line.",
            "parameters": {"type": "object", "properties": {}, "required": []},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file of the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "Path relative to the workspace."}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Create or overwrite a text file of the workspace.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Path relative to the workspace."},
                    "content": {"type": "string", "description": "The full new content of the file."},
                },
                "required": ["path", "content"],
            },
        },
    },
]

KINDS = ("sum", "max", "copy_key")
MAX_FILE_CHARS = 100_000  # per write and per read: a runaway model must not fill the disk or the context
MAX_FILES = 100


# ---------------------------------------------------------------------------------------------------------------------
# Workspace and tools


class WorkspaceError(ValueError):
    """A tool call the workspace refuses; the message is shown to the model as the tool result."""


class Workspace:
    """A directory that the file tools are confined to.

    Paths are relative to the root. Absolute paths and `..` are refused outright, and every path is resolved
    (symlinks followed) and must still lie inside the root, so a symlink cannot lead a tool outside.

    Args:
        root: an existing directory.

    Example:

    ```python
    >>> with Workspace.create({"numbers.txt": "1\\n2\\n"}) as workspace:
    ...     workspace.write_file("total.txt", "3")
    ...     workspace.snapshot()
    'Wrote 1 characters to total.txt.'
    {'numbers.txt': '1\\n2\\n', 'total.txt': '3'}
    ```
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()

    @classmethod
    def create(cls, files: Mapping[str, str], parent: str | os.PathLike | None = None) -> Workspace:
        """Make a fresh temporary directory (under `parent`, default the system temp dir) holding `files`."""
        workspace = cls(tempfile.mkdtemp(prefix="trl-agentic-files-", dir=parent))
        try:
            for path, content in files.items():
                workspace.write_file(path, content)  # the same checks as the model's writes: rows can't escape either
        except BaseException:
            workspace.cleanup()
            raise
        return workspace

    def cleanup(self) -> None:
        """Delete the workspace directory (symlinks inside are removed, never followed)."""
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.cleanup()

    def resolve(self, path: str) -> Path:
        """The absolute location of workspace path `path`; raises `WorkspaceError` if it is outside the workspace."""
        if not isinstance(path, str) or not path.strip():
            raise WorkspaceError("the path must be a non-empty string relative to the workspace, e.g. 'notes.txt'")
        if "\x00" in path:
            raise WorkspaceError("the path contains a NUL character")
        if PurePosixPath(path).is_absolute() or PureWindowsPath(path).is_absolute() or path.startswith("\\"):
            raise WorkspaceError(f"absolute paths are not allowed ({path!r}); use a path relative to the workspace")
        if ".." in PurePosixPath(path.replace("\\", "/")).parts:
            raise WorkspaceError(f"'..' is not allowed in paths ({path!r}); stay inside the workspace")
        location = (self.root / path).resolve()
        if location == self.root or not location.is_relative_to(self.root):
            raise WorkspaceError(f"{path!r} leads outside the workspace")
        return location

    def list_files(self) -> str:
        """Tool: the workspace's file paths, one per line."""
        paths = self._file_paths()
        return "\n".join(paths) if paths else "(the workspace is empty)"

    def read_file(self, path: str) -> str:
        """Tool: the content of a text file."""
        location = self.resolve(path)
        if not location.is_file():
            raise WorkspaceError(f"no file {path!r}. Files: {', '.join(self._file_paths()) or 'none'}")
        content = location.read_text(encoding="utf-8", errors="replace")
        if len(content) > MAX_FILE_CHARS:
            content = content[:MAX_FILE_CHARS] + f"\n[truncated after {MAX_FILE_CHARS} characters]"
        return content

    def write_file(self, path: str, content: str) -> str:
        """Tool: create or overwrite a text file (parent directories are created)."""
        if not isinstance(content, str):
            raise WorkspaceError(f'content must be a string, e.g. "42", got {type(content).__name__}')
        if len(content) > MAX_FILE_CHARS:
            raise WorkspaceError(f"content is longer than {MAX_FILE_CHARS} characters")
        location = self.resolve(path)
        if location.is_dir():
            raise WorkspaceError(f"{path!r} is a directory")
        if not location.exists() and len(self._file_paths()) >= MAX_FILES:
            raise WorkspaceError(f"the workspace already holds {MAX_FILES} files")
        location.parent.mkdir(parents=True, exist_ok=True)
        location.write_text(content, encoding="utf-8")
        return f"Wrote {len(content)} characters to {path}."

    def tools(self) -> dict[str, ToolFunction]:
        """Tool name -> function, bound to this workspace (see `FILES_TOOLS` for the schemas)."""
        return {"list_files": self.list_files, "read_file": self.read_file, "write_file": self.write_file}

    def snapshot(self) -> dict[str, str]:
        """The end state: `{relative_path: content}` of every regular file (symlinks are not followed)."""
        return {path: (self.root / path).read_text(encoding="utf-8", errors="replace") for path in self._file_paths()}

    def _file_paths(self) -> list[str]:
        paths = []
        for directory, _, filenames in os.walk(self.root):  # os.walk does not descend into symlinked directories
            for filename in filenames:
                location = Path(directory, filename)
                if location.is_file() and not location.is_symlink():
                    paths.append(location.relative_to(self.root).as_posix())
        return sorted(paths)


# ---------------------------------------------------------------------------------------------------------------------
# Dataset

_CONFIG_KEYS = ("host", "port", "user", "mode", "level", "color", "region", "timeout", "language", "theme")
_CONFIG_WORDS = ("alpha", "blue", "debug", "north", "paris", "quiet", "red", "silver", "south", "tokyo", "fast", "dark")


def _make_files_task(rng: random.Random, kinds: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    kind = rng.choice(kinds)
    if kind in ("sum", "max"):
        numbers = [rng.randint(1, 99) for _ in range(rng.randint(3, 6))]
        files = {"numbers.txt": "".join(f"{number}\n" for number in numbers)}
        if kind == "sum":
            instruction = "Read numbers.txt and write the sum of its numbers to total.txt."
            target, value = "total.txt", str(sum(numbers))
        else:
            instruction = "Read numbers.txt and write the largest of its numbers to max.txt."
            target, value = "max.txt", str(max(numbers))
    else:
        keys = rng.sample(_CONFIG_KEYS, rng.randint(3, 5))
        values = {key: rng.choice([rng.choice(_CONFIG_WORDS), str(rng.randint(1, 9999))]) for key in keys}
        files = {"config.txt": "".join(f"{key} = {value}\n" for key, value in values.items())}
        key = rng.choice(keys)
        instruction = f"Copy the value of the key {key} in config.txt into answer.txt."
        target, value = "answer.txt", values[key]
    expected = {**files, target: value}
    row = {
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": instruction}],
        "kind": kind,
        "files": json.dumps(files),
        "expected": json.dumps(expected),
    }
    return f"{instruction}|{row['files']}", row


def build_files_dataset(
    split: str = "train", size: int = 256, seed: int = 0, *, kinds: Sequence[str] = KINDS
) -> datasets.Dataset:
    """File-manipulation tasks with their initial and expected workspaces.

    Args:
        split: `"train"` or `"eval"`; a task (instruction + initial files) belongs to exactly one split.
        size: number of rows.
        seed: sampling seed.
        kinds: task kinds to draw from, a subset of `("sum", "max", "copy_key")`.

    Returns:
        A dataset with columns `prompt` (system + user message), `kind`, `files` (JSON `{path: content}` of the
        initial workspace) and `expected` (JSON `{path: content}` of the correct end state, for the checker only).

    Example:

    ```python
    >>> row = build_files_dataset("eval", size=1, kinds=("copy_key",))[0]
    >>> row["prompt"][-1]["content"]
    'Copy the value of the key region in config.txt into answer.txt.'
    >>> json.loads(row["files"])
    {'config.txt': 'timeout = debug\\nregion = paris\\nlanguage = 995\\ntheme = alpha\\n'}
    ```
    """
    kinds = _validate_kinds(kinds)
    rows = sample_split(lambda rng: _make_files_task(rng, kinds), split, size, seed)
    return datasets.Dataset.from_list(rows, features=_FEATURES)


def _validate_kinds(kinds: Sequence[str]) -> tuple[str, ...]:
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    if not kinds or any(kind not in KINDS for kind in kinds):
        raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {kinds!r}.")
    return kinds


_MESSAGE = {"role": datasets.Value("string"), "content": datasets.Value("string")}
_FEATURES = datasets.Features(
    {
        "prompt": [_MESSAGE],
        "kind": datasets.Value("string"),
        "files": datasets.Value("string"),
        "expected": datasets.Value("string"),
    }
)


# ---------------------------------------------------------------------------------------------------------------------
# Agent


async def files_agent(client: Any, task: dict[str, Any], *, max_rounds: int = 8) -> dict[str, str]:
    """Reference agent: set up a fresh workspace from `task["files"]`, run the tool loop, return the end state.

    The workspace is deleted when the agent returns or fails. `task["expected"]` is never shown to the model.

    Args:
        client: an `openai.AsyncOpenAI` pointed at this episode.
        task: one dataset row (`prompt`, `files`, ...); `task.get("model")` overrides `SERVED_MODEL_NAME`.
        max_rounds: most model calls.

    Returns:
        The final workspace as `{relative_path: content}`.

    Example:

    ```python
    >>> await files_agent(client, dataset[0])
    {'numbers.txt': '12\\n7\\n', 'total.txt': '19'}
    ```
    """
    with Workspace.create(_as_state(task["files"])) as workspace:
        await run_tool_loop(
            client,
            list(task["prompt"]),
            tools=workspace.tools(),
            tool_schemas=FILES_TOOLS,
            model=task.get("model") or SERVED_MODEL_NAME,
            max_rounds=max_rounds,
        )
        return workspace.snapshot()


# ---------------------------------------------------------------------------------------------------------------------
# Checker


def _as_state(value: str | Mapping[str, str]) -> dict[str, str]:
    # Columns hold JSON text (Arrow would turn dicts into structs padded with None); accept a plain dict too.
    return dict(json.loads(value) if isinstance(value, str) else value)


def _normalize(state: Mapping[str, str]) -> dict[str, str]:
    # A trailing newline (or a stray space) is not what the task is about.
    return {path: content.strip() for path, content in state.items()}


def files_correct(
    prompts: list, completions: list, expected: list[str | dict[str, str]], **kwargs: Any
) -> list[float | None]:
    """1.0 if the final workspace equals `expected` (each file's content compared after `strip()`), else 0.0.

    Equal means: the target file holds the right value, the input files are untouched and no other file was
    written. `None` for episodes that did not end `"ok"`, or whose result is not a `{path: content}` snapshot (the
    checker cannot see the workspace otherwise). Needs `episodes` (the [`AgenticGRPOTrainer`] passes them).

    Example:

    ```python
    >>> from trl_agentic.trace import Episode
    >>> expected = ['{"numbers.txt": "1\\\\n2\\\\n", "total.txt": "3"}'] * 2
    >>> episodes = [Episode(id="a", status="ok", result={"numbers.txt": "1\\n2\\n", "total.txt": "3\\n"}),
    ...             Episode(id="b", status="ok", result={"numbers.txt": "1\\n2\\n", "total.txt": "4"})]
    >>> files_correct(prompts=[None] * 2, completions=[[]] * 2, expected=expected, episodes=episodes)
    [1.0, 0.0]
    ```
    """
    if kwargs.get("episodes") is None:
        raise ValueError(
            "files_correct scores the workspace snapshot the agent returns, so it needs `episodes=[Episode, ...]` "
            "(passed by AgenticGRPOTrainer). With plain TRL, score the completions with another reward function."
        )
    rewards: list[float | None] = []
    for index, expected_state in enumerate(expected):
        episode = episode_for(kwargs, index)
        snapshot = episode.result
        if not is_scorable(episode) or not isinstance(snapshot, dict):
            rewards.append(None)
            continue
        correct = all(isinstance(content, str) for content in snapshot.values()) and (
            _normalize(snapshot) == _normalize(_as_state(expected_state))
        )
        rewards.append(1.0 if correct else 0.0)
    return rewards


# ---------------------------------------------------------------------------------------------------------------------
# Demonstrations


def _solution(kind: str, instruction: str, files: Mapping[str, str]) -> tuple[str, str, str]:
    """(file to read, file to write, value to write) that solve a task."""
    if kind in ("sum", "max"):
        numbers = [int(line) for line in files["numbers.txt"].split()]
        return (
            ("numbers.txt", "total.txt", str(sum(numbers)))
            if kind == "sum"
            else ("numbers.txt", "max.txt", str(max(numbers)))
        )
    key = instruction.split("the key ", 1)[1].split(" ", 1)[0]
    values = dict(line.split(" = ", 1) for line in files["config.txt"].splitlines())
    return "config.txt", "answer.txt", values[key]


def files_demonstrations(n: int, seed: int = 0, *, kinds: Sequence[str] = KINDS) -> list[dict[str, Any]]:
    """Successful conversations for an SFT warm start: `read_file` → `write_file` → "Done.".

    Tasks come from the train split only. The tool results are produced by running the real tools in a real
    workspace, and each demonstration is checked against the row's `expected` end state.

    Example:

    ```python
    >>> demo = files_demonstrations(1)[0]
    >>> [m["role"] for m in demo["messages"]]
    ['system', 'user', 'assistant', 'tool', 'assistant', 'tool', 'assistant']
    ```
    """
    demonstrations = []
    for row in build_files_dataset("train", n, seed, kinds=kinds):
        files = json.loads(row["files"])
        source, target, value = _solution(row["kind"], row["prompt"][-1]["content"], files)
        messages = list(row["prompt"])
        with Workspace.create(files) as workspace:
            for call_index, (name, arguments) in enumerate(
                [("read_file", {"path": source}), ("write_file", {"path": target, "content": value})]
            ):
                call_id = f"call_{call_index}"
                # Arguments as a dict: the transformers chat-template convention (templates `tojson` them).
                tool_call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
                messages.append({"role": "assistant", "content": "", "tool_calls": [tool_call]})
                result = workspace.tools()[name](**arguments)
                messages.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": result})
            if _normalize(workspace.snapshot()) != _normalize(json.loads(row["expected"])):
                raise AssertionError(f"files demonstration does not solve its task: {row}")  # a bug in `_solution`
        messages.append({"role": "assistant", "content": f"Done: {target} contains {value}."})
        demonstrations.append({"messages": messages, "tools": FILES_TOOLS})
    return demonstrations


# ---------------------------------------------------------------------------------------------------------------------
# Suite


def make_files_suite(kinds: Sequence[str] = KINDS, max_rounds: int = 8) -> TaskSuite:
    """The files [`TaskSuite`] for a set of task kinds.

    Args:
        kinds: task kinds drawn in the dataset, a subset of `("sum", "max", "copy_key")`.
        max_rounds: most model calls of the reference agent per episode.

    Example:

    ```python
    >>> SUMS_ONLY = make_files_suite(kinds=("sum",))  # get_task("my_module:SUMS_ONLY")
    ```
    """
    kinds = _validate_kinds(kinds)

    # A real coroutine function (not a partial), so sync/async detection and logs see a named async agent.
    async def agent(client: Any, task: dict[str, Any]) -> dict[str, str]:
        return await files_agent(client, task, max_rounds=max_rounds)

    agent.__name__ = agent.__qualname__ = "files_agent"
    return TaskSuite(
        name="files",
        tools=FILES_TOOLS,
        system_prompt=SYSTEM_PROMPT,
        build_dataset=functools.partial(build_files_dataset, kinds=kinds),
        agent=agent,
        reward_funcs=[files_correct],
        demonstrations=functools.partial(files_demonstrations, kinds=kinds),
        agent_columns=("prompt", "files"),  # the initial workspace; `expected` is the checker's
    )


FILES = make_files_suite()
