"""The Berkeley Function Calling Leaderboard's multi-turn suite as tasks: `from_bfcl("multi_turn_base")` or
`get_task("bfcl:multi_turn_base")`.

[BFCL](https://gorilla.cs.berkeley.edu/leaderboard.html) (`bfcl-eval` on PyPI) ships multi-turn entries (a user
request per turn), executable stateful backends (`GorillaFileSystem`, `TradingBot`, `TravelAPI`,
`VehicleControlAPI`, `MessageAPI`, `TwitterAPI`, `TicketAPI`, `MathAPI`), their function docs, ground-truth call
sequences and its multi-turn checker. [`from_bfcl`] maps them onto a [`TaskSuite`], calling BFCL's own code for every
part that decides a score:

- the dataset: BFCL's entries (`bfcl_eval.utils.load_dataset_entry`), split train / eval by a hash of the entry id
  (an entry is in one split whatever `size` and `seed`);
- the agent ([`BFCLAgent`]): the package's one tool loop (`rollout/tool_loop.py`), played turn by turn as BFCL's
  function-calling inference plays it (`BaseHandler.inference_multi_turn_FC`): the user turns arrive in order, the
  next one when the model answers without a tool call; each step's tool calls are decoded with BFCL's decoder
  (`convert_to_function_call`) and executed by BFCL's executor (`execute_multi_turn_func_call`) on this episode's own
  backend instances (BFCL's `initial_config` applied); more than BFCL's step limit in a turn force-quits the entry;
- the checker ([`bfcl_multi_turn_accuracy`]): the episode's steps decoded as BFCL's eval runner decodes them, then
  BFCL's `multi_turn_checker` (state and response checks per turn, against the ground truth re-executed); 1.0 when
  it says valid, else 0.0, so mean reward = BFCL's multi-turn accuracy;
- the demonstrations: the ground-truth calls of training entries, replayed against the real backends (their tool
  results are what the backends return).

`bfcl-eval` pins exact versions of unrelated packages (numpy 1.26.4, vllm, faiss, model SDKs), so the `[bfcl]` extra
installs only what its backends and checker import, and BFCL itself goes in without its pins: `pip install
'trl-agentic[bfcl]' && pip install --no-deps bfcl-eval==2026.3.23` (docs/bfcl.md).

Example:

```python
>>> from trl_agentic.envs import from_bfcl
>>> suite = from_bfcl("multi_turn_base", classes=("VehicleControlAPI",))  # or get_task("bfcl:multi_turn_base")
>>> row = suite.build_dataset("eval", size=1)[0]
>>> row["bfcl_id"], row["prompt"][0]["role"]
('multi_turn_base_...', 'user')
```
"""

from __future__ import annotations

import builtins
import copy
import functools
import hashlib
import inspect
import json
import keyword
import os
import random
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import datasets

from ..endpoint import SERVED_MODEL_NAME
from ..rollout.tool_loop import ToolLoop
from ..tasks import TaskSuite


# BFCL keeps its lock files and results under BFCL_PROJECT_ROOT (default: next to the installed package, which may be
# read-only): point it at a cache folder unless the user chose one.
os.environ.setdefault(
    "BFCL_PROJECT_ROOT", str(Path(os.environ.get("TRL_AGENTIC_CACHE", Path.home() / ".cache" / "trl-agentic")) / "bfcl")
)

try:
    from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC, MAXIMUM_STEP_LIMIT
    from bfcl_eval.constants.enums import ModelStyle
    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import (
        execute_multi_turn_func_call,
        is_empty_execute_response,
    )
    from bfcl_eval.model_handler.utils import convert_to_function_call, convert_to_tool
    from bfcl_eval.utils import is_multi_turn, load_dataset_entry, load_ground_truth_entry
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError(
        "trl_agentic.envs.bfcl needs BFCL's package: pip install 'trl-agentic[bfcl]' && pip install --no-deps "
        f"bfcl-eval==2026.3.23 (docs/bfcl.md). ({error})"
    ) from error

BFCL_VERSION = "2026.3.23"
MULTI_TURN_CATEGORIES = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")
CHECKER_NAME = "bfcl_multi_turn_accuracy"
DEMONSTRATION_CLOSING = "Done."
DEFAULT_EVAL_FRACTION = 0.2


# ---------------------------------------------------------------------------------------------------------------------
# Calls: the model's tool calls as BFCL's decoder writes them, refused where BFCL's `eval` would run something else


def _episode_name() -> str:
    # BFCL keys the backend instances of an entry by "model name + entry id" in its executor's globals: a name of
    # each episode's own gives it instances of its own (state isolated), released when it ends.
    return f"trl_agentic_{uuid.uuid4().hex}"


def release_instances(model_name: str) -> None:
    """Drop the backend instances BFCL's executor keeps for `model_name` (its inference and checker runs)."""
    prefix = re.sub(r"[-./:]", "_", f"{model_name}_")
    for key in [key for key in vars(multi_turn_utils) if key.startswith(prefix)]:
        vars(multi_turn_utils).pop(key, None)


def _safe_name(name: Any, methods: set[str]) -> bool:
    # BFCL's executor `eval`s "name(key=repr(value), ...)": a method of the entry's backends runs; any other plain
    # identifier fails there with a NameError, as in BFCL. Builtins and the executor's own globals are refused.
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        return False
    return name in methods or (
        not name.startswith("_") and not hasattr(builtins, name) and name not in vars(multi_turn_utils)
    )


def decode_step(model_responses: Any, methods: set[str]) -> list[str]:
    """One step's model output as BFCL's function-calling decoder writes it (`convert_to_function_call`:
    `[{name: arguments_json}]` -> `["name(key=value, ...)"]`), after checking that every name and argument key is a
    plain identifier BFCL may `eval` (a `ValueError` otherwise: the step does not decode, as a malformed one in BFCL).

    Args:
        model_responses: `[{tool name: arguments JSON}]` (the step's tool calls) or the reply's text.
        methods: the public method names of the entry's backends.
    """
    if not isinstance(model_responses, list):
        raise ValueError("The reply has no tool call.")
    for call in model_responses:
        for name, arguments in call.items():
            decoded = json.loads(arguments) if isinstance(arguments, str) else arguments
            if not _safe_name(name, methods):
                raise ValueError(f"{name!r} is not a function BFCL can call.")
            if not isinstance(decoded, dict) or not all(
                isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key) for key in decoded
            ):
                raise ValueError(f"The arguments of {name!r} are not a JSON object of named arguments.")
    return convert_to_function_call(model_responses)


def _backend_methods(entry: dict[str, Any]) -> set[str]:
    import importlib

    methods = set()
    for class_name in entry["involved_classes"]:
        cls = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name]), class_name)
        methods |= {name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}
    return methods


def _execute(entry: dict[str, Any], calls: list[str], model_name: str) -> list[str]:
    category = entry["id"].rsplit("_", 1)[0]
    results, _ = execute_multi_turn_func_call(
        calls,
        entry.get("initial_config", {}),
        entry["involved_classes"],
        model_name,
        entry["id"],
        long_context=("long_context" in category or "composite" in category),
        is_evaL_run=False,
    )
    return results


# ---------------------------------------------------------------------------------------------------------------------
# Agent


class BFCLTurn(ToolLoop):
    """The tool loop's hooks for one user turn of a BFCL entry: each reply's tool calls are one BFCL step (decoded,
    executed on the episode's backends, answered by one tool message per call); a reply without a tool call, or one
    that does not decode, ends the turn (BFCL: "Proceed to next turn"); more than `step_limit` executed steps
    force-quit the entry, as BFCL's inference does."""

    def __init__(self, entry, tools, model_name, *, model, methods, step_limit, steps):
        self.entry, self.tools, self.model_name, self.model = entry, tools, model_name, model
        self.methods, self.steps, self.max_turns = methods, steps, step_limit + 1

    def request(self) -> dict[str, Any]:
        return {"model": self.model, "tools": self.tools}

    async def env_response(self, message: Any, response: Any) -> list[dict[str, Any]] | None:
        model_responses = [{call.function.name: call.function.arguments} for call in message.tool_calls]
        self.steps.append(model_responses)
        try:
            calls = decode_step(model_responses, self.methods)
        except Exception:  # noqa: BLE001 - BFCL: a reply that does not decode ends the turn
            return None
        if is_empty_execute_response(calls):
            return None
        results = _execute(self.entry, calls, self.model_name)
        return [
            {"role": "tool", "tool_call_id": call.id, "content": result}
            for call, result in zip(message.tool_calls, results)
        ]


@dataclass
class BFCLAgent:
    """Plays BFCL multi-turn entries over the episode's endpoint, as BFCL's function-calling inference does.

    The task row names its entry (`bfcl_id`); the agent holds the entries' questions, initial states and tools (never
    their ground truth). Each episode gets backend instances of its own. The result (`episode.result`) is
    `{"bfcl_id", "turns": [[step, ...] per turn], "force_quit"}`, each step the model's `[{name: arguments}]` (or its
    text), what BFCL's checker decodes.

    Args:
        entries: BFCL entry id -> entry (`load_dataset_entry`'s, with `function` and `missed_function`).
        tools: entry id -> the OpenAI tool schemas offered at its first turn.
        model: the model name sent.
        step_limit: most executed steps per turn before the entry is force-quit (BFCL's `MAXIMUM_STEP_LIMIT`).
        compact_schemas: the tool schemas [`compact_tool`] leaves (what `from_bfcl(schemas="compact")` sends).
    """

    entries: dict[str, dict[str, Any]]
    tools: dict[str, list[dict[str, Any]]]
    model: str = SERVED_MODEL_NAME
    step_limit: int = MAXIMUM_STEP_LIMIT
    compact_schemas: bool = False

    def __post_init__(self):
        self.__name__ = "bfcl"

    async def __call__(self, client: Any, task: dict[str, Any]) -> dict[str, Any]:
        entry_id = task.get("bfcl_id")
        if entry_id not in self.entries:
            raise ValueError(
                f"The task names no BFCL entry of this suite (bfcl_id={entry_id!r}): give the agent the 'bfcl_id' "
                "column, AgenticGRPOConfig(agent_columns=list(suite.agent_columns))."
            )
        entry = self.entries[entry_id]
        model_name, methods = _episode_name(), _backend_methods(entry)
        tools = list(self.tools[entry_id])
        messages = [dict(m) for m in task["prompt"]]
        turns: list[list[Any]] = []
        force_quit = False
        try:
            _execute(entry, [], model_name)  # the backends, with BFCL's initial_config, before the first call
            for turn_index, turn in enumerate(entry["question"]):
                added = entry.get("missed_function", {}).get(str(turn_index))
                if added:  # miss_func: the held-out functions arrive with BFCL's prompt for them
                    tools += _tool_schemas(added, self.compact_schemas)
                    turn = [{"role": "user", "content": DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC}]
                if turn_index > 0:
                    messages.extend(dict(m) for m in turn)
                steps: list[Any] = []
                hooks = BFCLTurn(
                    entry, tools, model_name, model=self.model, methods=methods, step_limit=self.step_limit, steps=steps
                )
                end = await hooks.run(client, messages)
                if end.finish == "answered":
                    steps.append(end.text)
                turns.append(steps)
                if end.finish == "max_turns":
                    force_quit = True  # BFCL: "Model has been forced to quit": the entry fails
                    break
        finally:
            release_instances(model_name)
        return {"bfcl_id": entry_id, "turns": turns, "force_quit": force_quit}


# ---------------------------------------------------------------------------------------------------------------------
# Checker


def check_entry(entry: dict[str, Any], ground_truth: list[list[str]], turns: Any) -> dict[str, Any]:
    """BFCL's verdict on one episode: its steps decoded as BFCL's eval runner decodes them
    (`_evaluate_single_multi_turn_entry`: undecodable or empty steps left out), then BFCL's `multi_turn_checker`.

    Returns:
        BFCL's result dict: `{"valid": True}` or `{"valid": False, "error_type": ..., "error_message": ...}`.
    """
    if not isinstance(turns, list):
        return {"valid": False, "error_type": "multi_turn:inference_error"}
    if len(turns) != len(ground_truth):
        return {"valid": False, "error_type": "multi_turn:force_terminated"}
    methods = _backend_methods(entry)
    decoded: list[list[list[str]]] = []
    for steps in turns:
        turn_decoded = []
        for step in steps:
            try:
                calls = decode_step(step, methods)
            except Exception:  # noqa: BLE001 - BFCL: "Ignore any failed decoding and continue to the next message"
                continue
            if not is_empty_execute_response(calls):
                turn_decoded.append(calls)
        decoded.append(turn_decoded)
    model_name = _episode_name()
    category = entry["id"].rsplit("_", 1)[0]
    try:
        return multi_turn_checker(decoded, ground_truth, entry, category, model_name)
    finally:
        release_instances(model_name)


def make_checker(entries: dict[str, dict[str, Any]], ground_truth: dict[str, list[list[str]]]):
    """The suite's reward function: 1.0 when BFCL's checker says the episode's entry is solved, else 0.0; `None`
    for an episode that did not end `"ok"` (crashed, timed out, hit a limit: not scorable)."""

    def bfcl_multi_turn_accuracy(
        prompts: list, completions: list, episodes: list | None = None, bfcl_id: list | None = None, **kwargs: Any
    ) -> list[float | None]:
        if episodes is None or bfcl_id is None:
            raise ValueError(
                "bfcl_multi_turn_accuracy scores BFCL episodes and needs `episodes=` and the dataset's 'bfcl_id' "
                "column (AgenticGRPOTrainer and Evaluator pass them)."
            )
        rewards: list[float | None] = []
        for episode, entry_id in zip(episodes, bfcl_id, strict=True):
            if episode.status != "ok":
                rewards.append(None)
                continue
            result = episode.result if isinstance(episode.result, dict) else {}
            if result.get("bfcl_id") != entry_id:
                raise ValueError(
                    f"The episode of BFCL entry {entry_id!r} was not played by the suite's BFCLAgent (its result is "
                    f"{type(episode.result).__name__}); use suite.agent with this checker."
                )
            verdict = check_entry(entries[entry_id], ground_truth[entry_id], result.get("turns"))
            rewards.append(1.0 if verdict.get("valid") else 0.0)
        return rewards

    return bfcl_multi_turn_accuracy


# ---------------------------------------------------------------------------------------------------------------------
# Demonstrations: the ground truth replayed against the real backends


def _parse_call(call: str, entry: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    import ast
    import importlib

    node = ast.parse(call, mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"Cannot read the ground-truth call {call!r}.")
    name = node.func.id
    arguments = {keyword_.arg: ast.literal_eval(keyword_.value) for keyword_ in node.keywords}
    if node.args:  # positional in the ground truth (`sort('final_report.pdf')`): named after the backend's method
        for class_name in entry["involved_classes"]:
            cls = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name]), class_name)
            if hasattr(cls, name):
                parameters = [p for p in inspect.signature(getattr(cls, name)).parameters if p != "self"]
                break
        else:
            raise ValueError(f"No backend of {entry['id']} has the ground-truth function {name!r}.")
        for parameter, value in zip(parameters, node.args):
            arguments[parameter] = ast.literal_eval(value)
    return name, arguments


def replay_ground_truth(
    entry: dict[str, Any], ground_truth: list[list[str]], tools: list[dict[str, Any]]
) -> dict[str, Any]:
    """One demonstration: the entry's conversation with its ground-truth calls made one per assistant message,
    answered by what BFCL's executor returns for them on fresh backends, each turn closed by "Done."."""
    model_name, messages = _episode_name(), []
    try:
        _execute(entry, [], model_name)
        for turn_index, (turn, calls) in enumerate(zip(entry["question"], ground_truth, strict=True)):
            messages.extend(dict(m) for m in turn)
            for step, call in enumerate(calls):
                name, arguments = _parse_call(call, entry)
                (result,) = _execute(entry, convert_to_function_call([{name: arguments}]), model_name)
                call_id = f"call_{turn_index}_{step}"
                function = {"name": name, "arguments": arguments}
                messages.append({"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function", "function": function}]})  # fmt: skip
                messages.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": result})
            messages.append({"role": "assistant", "content": DEMONSTRATION_CLOSING})
    finally:
        release_instances(model_name)
    return {"messages": messages, "tools": tools}


# ---------------------------------------------------------------------------------------------------------------------
# Suite


def compact_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool schema with the first sentence of its description and its parameters' names, types, enums and
    `required` (no parameter descriptions, no response schema): BFCL's function docs take 6-17k characters per
    backend, more than a tiny model's context (the CPU demo's `schemas=compact`)."""
    function = tool["function"]
    description = re.split(r"(?<=\.)\s", function.get("description", ""), maxsplit=1)[0]
    parameters = copy.deepcopy(function.get("parameters", {}))

    def strip(schema: Any) -> Any:
        if isinstance(schema, dict):
            return {k: strip(v) for k, v in schema.items() if k not in ("description", "default")}
        return schema

    properties = {name: strip(schema) for name, schema in parameters.get("properties", {}).items()}
    compact = {"type": "object", "properties": properties, "required": parameters.get("required", [])}
    return {"type": "function", "function": {"name": function["name"], "description": description, "parameters": compact}}  # fmt: skip


def _tool_schemas(functions: list[dict[str, Any]], compact: bool) -> list[dict[str, Any]]:
    # BFCL's OpenAI function-calling conversion (what its OpenAI handlers send as `tools`).
    tools = convert_to_tool(functions, GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS)
    return [compact_tool(tool) for tool in tools] if compact else tools


def split_of_entry(entry_id: str, eval_fraction: float) -> str:
    """`"eval"` or `"train"`, by a hash of the entry id alone (stable across processes and versions)."""
    digest = hashlib.sha256(f"bfcl-split:{entry_id}".encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction else "train"


@functools.lru_cache(maxsize=None)
def _load_category(category: str) -> tuple[dict[str, dict[str, Any]], dict[str, list[list[str]]]]:
    # BFCL's entries (with their function docs) and ground truth, read once per process; nothing here mutates them.
    entries = {entry["id"]: entry for entry in load_dataset_entry(category)}
    ground_truth = {answer["id"]: answer["ground_truth"] for answer in load_ground_truth_entry(category)}
    return entries, ground_truth


@dataclass
class BFCLSuite(TaskSuite):
    """A [`TaskSuite`] of BFCL multi-turn entries (made by [`from_bfcl`]), with the entries by id (`entries`) and
    the ids of each split (`split_ids`)."""

    entries: dict[str, dict[str, Any]] | None = None
    split_ids: dict[str, list[str]] | None = None
    category: str = ""
    comparable: bool = False

    def leaderboard_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """BFCL's multi-turn accuracy for `trl-agentic eval`'s summary: entries BFCL's checker says solved over entries
        evaluated (an episode that crashed or hit a limit counts as wrong, as in BFCL), i.e. `success`; the
        leaderboard's figure for the category when every entry ran once (`--split all --size 200 --num-samples 1`),
        with BFCL's tool schemas (`comparable`)."""
        return {
            "bfcl": {
                "category": self.category,
                "accuracy": metrics["success"],
                "episodes": metrics.get("episodes"),
                "comparable_with_leaderboard": self.comparable,
            }
        }


def from_bfcl(
    category: str = "multi_turn_base",
    *,
    classes: tuple[str, ...] | None = None,
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
    schemas: str = "bfcl",
    model: str = SERVED_MODEL_NAME,
    step_limit: int = MAXIMUM_STEP_LIMIT,
) -> BFCLSuite:
    """BFCL's entries of a multi-turn category as a [`TaskSuite`] (see the module's docstring).

    Args:
        category: `"multi_turn_base"`, `"multi_turn_miss_func"`, `"multi_turn_miss_param"` or
            `"multi_turn_long_context"`.
        classes: keep only entries whose backends are all among these (e.g. `("VehicleControlAPI",)`); default all.
        eval_fraction: share of the entries held out (`split="eval"`), chosen by a hash of the entry id.
        schemas: `"bfcl"` (BFCL's function docs as its OpenAI handler sends them) or `"compact"` ([`compact_tool`]:
            for tiny models whose context cannot hold them; not BFCL's prompt, so not comparable with the leaderboard).
        model: the model name the agent sends.
        step_limit: most executed steps per turn (BFCL's `MAXIMUM_STEP_LIMIT`, 20).

    Returns:
        A [`BFCLSuite`]: `build_dataset(split, size, seed)` returns `size` rows of the split's entries (`"all"`: every
        entry, for a leaderboard-comparable evaluation), shuffled with `seed` (each entry once per pass; more passes
        when `size` exceeds them), columns `prompt` (the first turn),
        `bfcl_id`, `bfcl_category`; `agent_columns` = `("prompt", "bfcl_id")`; one reward function,
        `bfcl_multi_turn_accuracy`; `demonstrations(n, seed)` replays the ground truth of training entries.
    """
    if category not in MULTI_TURN_CATEGORIES or not is_multi_turn(category):
        raise ValueError(
            f"BFCL category {category!r} is not a multi-turn category; use one of {MULTI_TURN_CATEGORIES}."
        )
    if schemas not in ("bfcl", "compact"):
        raise ValueError(f"schemas must be 'bfcl' or 'compact', got {schemas!r}.")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}.")
    entries, ground_truth = (dict(loaded) for loaded in _load_category(category))
    if classes:
        unknown = sorted(set(classes) - set(CLASS_FILE_PATH_MAPPING))
        if unknown:
            raise ValueError(f"Unknown BFCL backends {unknown}; known: {sorted(CLASS_FILE_PATH_MAPPING)}.")
        entries = {i: e for i, e in entries.items() if set(e["involved_classes"]) <= set(classes)}
        if not entries:
            raise ValueError(f"No {category} entry uses only the backends {list(classes)}.")
    compact = schemas == "compact"
    tools = {entry_id: _tool_schemas(entry["function"], compact) for entry_id, entry in entries.items()}
    split_ids: dict[str, list[str]] = {"train": [], "eval": []}
    for entry_id in entries:
        split_ids[split_of_entry(entry_id, eval_fraction)].append(entry_id)
    for split, ids in split_ids.items():
        if not ids:
            raise ValueError(
                f"The {split!r} split of {category} ({len(entries)} entries) is empty; use more entries (classes) or "
                f"another eval_fraction (now {eval_fraction})."
            )

    def ids_for(split: str, size: int, seed: int) -> list[str]:
        if split not in (*split_ids, "all"):
            raise ValueError(f"split must be 'train', 'eval' or 'all' (every entry: evaluation only), got {split!r}.")
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}.")
        ids = list(entries) if split == "all" else split_ids[split]
        rng, chosen = random.Random(f"bfcl-{split}-{seed}"), []
        while len(chosen) < size:
            batch = sorted(ids)
            rng.shuffle(batch)
            chosen += batch[: size - len(chosen)]
        return chosen

    def build_dataset(split: str = "train", size: int = 256, seed: int = 0) -> datasets.Dataset:
        rows = [
            {"prompt": [dict(m) for m in entries[i]["question"][0]], "bfcl_id": i, "bfcl_category": category}
            for i in ids_for(split, size, seed)
        ]
        features = datasets.Features(
            {
                "prompt": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
                "bfcl_id": datasets.Value("string"),
                "bfcl_category": datasets.Value("string"),
            }
        )
        return datasets.Dataset.from_list(rows, features=features)

    def demonstrations(n: int, seed: int = 0) -> list[dict[str, Any]]:
        if category == "multi_turn_miss_func":
            raise ValueError(
                "multi_turn_miss_func adds tools mid-conversation, which one demonstration's tool list cannot show; "
                "warm-start on 'bfcl:multi_turn_base' (its entries are the same tasks) or train without a warm start."
            )
        return [replay_ground_truth(entries[i], ground_truth[i], tools[i]) for i in ids_for("train", n, seed)]

    agent = BFCLAgent(entries, tools, model=model, step_limit=step_limit, compact_schemas=compact)
    name = category if not classes else f"{category}-{'-'.join(sorted(classes))}"
    return BFCLSuite(
        name=f"bfcl-{name}",
        tools=[],  # per entry: its backends' functions (`suite.agent.tools[bfcl_id]`)
        system_prompt="",  # BFCL's function-calling mode sends none
        build_dataset=build_dataset,
        agent=agent,
        reward_funcs=[make_checker(entries, ground_truth)],
        demonstrations=demonstrations,
        agent_columns=("prompt", "bfcl_id"),
        entries=entries,
        split_ids=split_ids,
        category=category,
        comparable=not classes and not compact and step_limit == MAXIMUM_STEP_LIMIT,
    )


def load_bfcl_suite(spec: str) -> BFCLSuite:
    """What `get_task("bfcl:<category>[?classes=A,B&schemas=compact&eval_fraction=0.2]")` returns.

    Example:

    ```python
    >>> load_bfcl_suite("multi_turn_base?classes=VehicleControlAPI&schemas=compact").name
    'bfcl-multi_turn_base-VehicleControlAPI'
    ```
    """
    category, _, query = spec.partition("?")
    options = {key: values[-1] for key, values in parse_qs(query, strict_parsing=bool(query)).items()}
    unknown = sorted(set(options) - {"classes", "schemas", "eval_fraction"})
    if unknown:
        raise ValueError(f"Unknown option(s) {unknown} in 'bfcl:{spec}'; known: classes, schemas, eval_fraction.")
    kwargs: dict[str, Any] = {}
    if "classes" in options:
        kwargs["classes"] = tuple(c for c in options["classes"].split(",") if c)
    if "schemas" in options:
        kwargs["schemas"] = options["schemas"]
    if "eval_fraction" in options:
        kwargs["eval_fraction"] = float(options["eval_fraction"])
    return from_bfcl(category or "multi_turn_base", **kwargs)


__all__ = [
    "BFCLAgent",
    "BFCLSuite",
    "BFCLTurn",
    "check_entry",
    "compact_tool",
    "decode_step",
    "from_bfcl",
    "load_bfcl_suite",
    "make_checker",
    "release_instances",
    "replay_ground_truth",
    "split_of_entry",
]
