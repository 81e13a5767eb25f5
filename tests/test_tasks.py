"""Tests of the bundled task suites (`trl_agentic/tasks/`) and the reward-function registry (`trl_agentic/rewards/`).

The agents run against a scripted stand-in for `openai.AsyncOpenAI` that returns real `ChatCompletion` objects, so
the loop logic is tested without an endpoint; the endpoint's own tests cover the HTTP side.
"""

import asyncio
import copy
import dataclasses
import json
import os
import time

import pytest
from openai.types.chat import ChatCompletion

from trl_agentic.recipes import get_reward_func
from trl_agentic.tasks import BUNDLED_TASKS, TaskSuite, get_task, register_task_source
from trl_agentic.tasks.agent_loop import call_tool
from trl_agentic.tasks.calculator import (
    build_calculator_dataset,
    calculator,
    calculator_agent,
    calculator_correct,
    evaluate_expression,
    last_number,
    make_calculator_suite,
)
from trl_agentic.tasks.files import Workspace, WorkspaceError, build_files_dataset, files_agent, files_correct
from trl_agentic.tasks.latency import build_latency_dataset, make_latency_suite
from trl_agentic.tasks.splits import sample_split, split_of
from trl_agentic.tiny_models import build_tiny_tokenizer
from trl_agentic.trace import Episode, Turn


# ---------------------------------------------------------------------------------------------------------------------
# A scripted OpenAI-compatible client


def tool_call_reply(*calls):
    """A scripted assistant reply making tool calls: `(name, arguments_json_text)` pairs."""
    return {"tool_calls": list(calls)}


class ScriptedClient:
    """Stands in for `openai.AsyncOpenAI`: `chat.completions.create` returns the next scripted reply.

    A reply is a string (final text), `tool_call_reply(...)` or an exception to raise. Requests are recorded (deep
    copies) in `requests`; `probe()`, if given, is called at each request and its results are kept in `probes`.
    """

    def __init__(self, replies, probe=None):
        self.replies = list(replies)
        self.requests = []
        self.probe = probe
        self.probes = []
        self.chat = self  # client.chat.completions.create
        self.completions = self

    async def create(self, **request):
        self.requests.append(copy.deepcopy(request))
        if self.probe is not None:
            self.probes.append(self.probe())
        reply = self.replies.pop(0) if self.replies else "I give up."
        if isinstance(reply, Exception):
            raise reply
        if isinstance(reply, str):
            message = {"role": "assistant", "content": reply}
            finish_reason = "stop"
        else:
            tool_calls = [
                {"id": f"call_{len(self.requests)}_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(reply["tool_calls"])
            ]
            message = {"role": "assistant", "content": None, "tool_calls": tool_calls}
            finish_reason = "tool_calls"
        # Validated like the openai client validates an HTTP response.
        return ChatCompletion.model_validate(
            {
                "id": f"chatcmpl-{len(self.requests)}",
                "object": "chat.completion",
                "created": 0,
                "model": request["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            }
        )


def demo_replies(demo):
    """The assistant messages of a demonstration, as scripted replies (arguments re-encoded as JSON text)."""
    replies = []
    for message in demo["messages"]:
        if message["role"] != "assistant":
            continue
        if message.get("tool_calls"):
            calls = [(c["function"]["name"], json.dumps(c["function"]["arguments"])) for c in message["tool_calls"]]
            replies.append(tool_call_reply(*calls))
        else:
            replies.append(message["content"])
    return replies


# ---------------------------------------------------------------------------------------------------------------------
# Registry


def test_get_task_bundled_and_import_path():
    for name in ("calculator", "files", "latency"):
        suite = get_task(name)
        assert isinstance(suite, TaskSuite) and suite.name == name
    assert get_task("trl_agentic.tasks.calculator:CALCULATOR") is get_task("calculator")


def test_get_task_unknown_name_lists_bundled_names():
    with pytest.raises(ValueError, match="calculator") as info:
        get_task("calculater")
    assert all(name in str(info.value) for name in BUNDLED_TASKS)
    with pytest.raises(ValueError, match="Cannot load"):
        get_task("trl_agentic.tasks.calculator:NOPE")
    with pytest.raises(ValueError, match="not a TaskSuite"):
        get_task("trl_agentic.tasks.calculator:calculator")  # a function, not a suite


def make_named_calculator(task_id: str) -> TaskSuite:  # a task source's loader: `get_task("test-source:<id>")`
    return dataclasses.replace(get_task("calculator"), name=task_id)


def test_get_task_resolves_a_registered_task_source(monkeypatch):
    # Environment adapters register their prefix (issue 41): tasks/ finds "verifiers:<env-id>" without importing envs/.
    from trl_agentic.imports import TASK_SOURCES

    assert TASK_SOURCES["verifiers"] == "trl_agentic.envs.verifiers:load_verifiers_suite"  # what envs/ registered
    monkeypatch.setitem(TASK_SOURCES, "test-source", f"{__name__}:make_named_calculator")
    assert get_task("test-source:my-calculator").name == "my-calculator"
    with pytest.raises(ValueError, match="plain name"):
        register_task_source("pkg.module", "pkg.module:load")


def test_get_task_from_a_python_file(tmp_path):
    # What `trl-agentic demo` writes next to its model, for `trl-agentic eval --task <output_dir>/task.py:TASK`.
    (tmp_path / "task.py").write_text(
        "from trl_agentic.tasks.calculator import make_calculator_suite\n"
        "TASK = make_calculator_suite(digits=3, ops=('+',))\n"
    )
    suite = get_task(f"{tmp_path}/task.py:TASK")
    assert suite.name == "calculator" and suite is get_task(f"{tmp_path}/task.py:TASK")  # loaded once
    assert " + " in suite.build_dataset(split="eval", size=1, seed=0)[0]["expression"]
    with pytest.raises(ValueError, match="no file"):
        get_task(f"{tmp_path}/missing.py:TASK")
    with pytest.raises(ValueError, match="has no attribute 'NOPE'"):
        get_task(f"{tmp_path}/task.py:NOPE")


def test_a_task_file_imports_the_modules_beside_it(tmp_path):
    # As when the file runs as a script: `--task tasks/my_task.py:TASK` with `tasks/my_levels.py` next to it.
    (tmp_path / "my_levels.py").write_text("DIGITS = 3\n")
    (tmp_path / "my_task.py").write_text(
        "from my_levels import DIGITS\n"
        "from trl_agentic.tasks.calculator import make_calculator_suite\n"
        "TASK = make_calculator_suite(digits=DIGITS)\n"
    )
    assert get_task(f"{tmp_path}/my_task.py:TASK").target_difficulty == 3


def test_get_reward_func():
    assert get_reward_func("calculator_correct") is calculator_correct
    assert get_reward_func("trl_agentic.tasks.files:files_correct") is files_correct
    with pytest.raises(ValueError, match="calculator_correct"):
        get_reward_func("accuracy")


# ---------------------------------------------------------------------------------------------------------------------
# Calculator tool


@pytest.mark.parametrize(
    "expression, value",
    [("12 * (3 + 4)", 84), ("7 // 2", 3), ("-7 % 3", 2), ("7 / 2", 3.5), ("-(2 - 5)", 3), (" 1+2 ", 3)],
)
def test_evaluate_expression(expression, value):
    assert evaluate_expression(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os')",
        "__import__('os').system('echo pwned')",
        "os.getcwd()",
        "x + 1",
        "2 ** 100000",  # no power: unbounded integers
        "(1).real",
        "'a' * 3",
        "True + 1",
        "[1, 2]",
        "lambda: 1",
        "1 if 1 else 2",
        "1 +",
        "9" * 201,  # too long
    ],
)
def test_evaluate_expression_rejects_anything_but_arithmetic(expression):
    with pytest.raises(ValueError):
        evaluate_expression(expression)


def test_calculator_tool_output_and_errors_as_text():
    assert calculator("6 / 3") == "2"  # integral float shown as an integer
    assert calculator("7 / 2") == "3.5"
    tools = {"calculator": calculator}
    assert call_tool(tools, "calculator", '{"expression": "2 * 21"}') == "42"
    assert call_tool(tools, "calculator", {"expression": "2 * 21"}) == "42"  # already decoded arguments
    for arguments, error in [
        ('{"expression": "1 / 0"}', "division by zero"),
        ('{"expression": "__import__(\'os\')"}', "function call"),
        ('{"expression": ', "not valid JSON"),
        ('["1 + 1"]', "must be a JSON object"),
        ('{"expr": "1 + 1"}', "Expected arguments: (expression)"),
        ("", "missing a required argument"),
        ('{"expression": 5}', "must be a string"),
    ]:
        result = call_tool(tools, "calculator", arguments)
        assert result.startswith("Error:") and error in result, result
    assert "Available tools: calculator" in call_tool(tools, "python", "{}")


# ---------------------------------------------------------------------------------------------------------------------
# Datasets


def test_calculator_dataset_rows():
    dataset = build_calculator_dataset("train", size=16, seed=0, digits=3, ops=("+", "-", "*", "//", "%"))
    assert dataset.column_names == ["prompt", "expression", "answer"]
    for row in dataset:
        system, user = row["prompt"]
        assert system["role"] == "system" and user == {"role": "user", "content": f"What is {row['expression']}?"}
        assert int(row["answer"]) == evaluate_expression(row["expression"])
        assert all(len(operand) <= 3 for operand in row["expression"].split()[::2])
    # Deterministic for a seed, different across seeds.
    assert (
        dataset["expression"]
        == build_calculator_dataset("train", 16, 0, digits=3, ops=("+", "-", "*", "//", "%"))["expression"]
    )
    assert (
        dataset["expression"]
        != build_calculator_dataset("train", 16, 1, digits=3, ops=("+", "-", "*", "//", "%"))["expression"]
    )


def test_calculator_suite_knobs_reach_dataset():
    suite = make_calculator_suite(digits=1, ops=("*",), num_operands=3)
    expression = suite.build_dataset("eval", size=1)[0]["expression"]
    assert len(expression.split()) == 5 and expression.split()[1] == "*"
    with pytest.raises(ValueError, match="subset"):
        make_calculator_suite(ops=("**",))
    with pytest.raises(ValueError, match="fewer operands"):
        make_calculator_suite(digits=18, num_operands=12)
    with pytest.raises(ValueError, match="split"):
        build_calculator_dataset("test")


def test_splits_are_disjoint_whatever_size_and_seed():
    # A small question space (100 sums of two digits) so that overlap would show if the partition were by seed.
    train = {
        e for seed in range(3) for e in build_calculator_dataset("train", 300, seed, digits=1, ops=("+",))["expression"]
    }
    evals = {
        e for seed in range(3) for e in build_calculator_dataset("eval", 30, seed, digits=1, ops=("+",))["expression"]
    }
    assert train and evals and not train & evals
    assert all(split_of(e) == "eval" for e in evals)

    def files_keys(split, seed, size):
        dataset = build_files_dataset(split, size, seed)
        return {(row["prompt"][-1]["content"], row["files"]) for row in dataset}

    train = files_keys("train", 0, 400) | files_keys("train", 1, 400)
    evals = files_keys("eval", 0, 100) | files_keys("eval", 1, 100)
    assert not train & evals


def test_split_without_tasks_raises_with_a_fix():
    key = next(k for k in map(str, range(100)) if split_of(k) == "train")
    with pytest.raises(ValueError, match="question space is too small"):
        sample_split(lambda rng: (key, {}), "eval", size=1, seed=0)  # every candidate belongs to train


def test_files_dataset_rows():
    dataset = build_files_dataset("train", size=30, seed=0)
    assert dataset.column_names == ["prompt", "kind", "files", "expected"]
    assert set(dataset["kind"]) == {"sum", "max", "copy_key"}
    for row in dataset:
        files, expected = json.loads(row["files"]), json.loads(row["expected"])
        assert set(expected) - set(files) and all(expected[path] == files[path] for path in files)
        assert row["expected"] not in json.dumps(row["prompt"])
    assert set(build_files_dataset("eval", 5, kinds=("sum",))["kind"]) == {"sum"}


# ---------------------------------------------------------------------------------------------------------------------
# Checkers


def test_calculator_correct():
    completions = [
        [{"role": "assistant", "content": "The answer is 3,008."}],
        [{"role": "assistant", "content": "The answer is 3007."}],
        [{"role": "assistant", "content": "I don't know."}],
        [{"role": "assistant", "content": [{"type": "text", "text": "-12"}]}],
    ]
    answer = ["3008", "3008", "3008", "-12"]
    assert calculator_correct(prompts=[None] * 4, completions=completions, answer=answer) == [1.0, 0.0, 0.0, 1.0]


def test_calculator_correct_with_episodes():
    completions = [[{"role": "assistant", "content": "The answer is 42."}]] * 4
    episodes = [
        Episode(id="ok-right", status="ok", result="So 6 * 7 = 42."),
        Episode(id="ok-wrong", status="ok", result="The answer is 41."),  # result wins over the transcript
        Episode(id="crashed", status="agent_error", result=None),
        Episode(id="timeout", status="timeout", result="The answer is 42."),
    ]
    rewards = calculator_correct(prompts=[None] * 4, completions=completions, answer=[42] * 4, episodes=episodes)
    assert rewards == [1.0, 0.0, None, None]


def test_calculator_correct_pays_nothing_for_a_broken_tool_call():
    """A reply that tried to call the calculator and broke is no answer, even when it ends with the right number: seed 1
    of the demo learned to end broken calls on 1-digit tasks with the product (`"0 * 1 * 1 * 8.` for "What is 8 *
    1?"), which the last-number reading paid for."""
    broken = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "0 * 1 * 1 * 8.'

    def turn(malformed):
        return Turn(
            index=0,
            prompt_ids=[1],
            completion_ids=[2],
            logprobs=[-0.1],
            finish_reason="stop",
            malformed_tool_call=malformed,
        )

    episodes = [
        Episode(id="broken", status="ok", result=broken, turns=[turn(False), turn(True)]),
        Episode(id="answered", status="ok", result="The answer is 8.", turns=[turn(True), turn(False)]),
        Episode(id="no-calls", status="ok", result="8"),
    ]
    completions = [[{"role": "assistant", "content": episode.result}] for episode in episodes]
    rewards = calculator_correct(prompts=[None] * 3, completions=completions, answer=[8] * 3, episodes=episodes)
    assert rewards == [0.0, 1.0, 1.0]  # an earlier broken call the agent recovered from costs nothing


def test_last_number():
    assert last_number("3.5 then -7.") == -7
    assert last_number("nothing") is None


def _files_episodes(*results, status="ok"):
    return [Episode(id=str(i), status=status, result=result) for i, result in enumerate(results)]


def test_files_correct():
    initial = {"numbers.txt": "1\n2\n"}
    expected = [json.dumps({**initial, "total.txt": "3"})] * 6
    episodes = _files_episodes(
        {**initial, "total.txt": "3\n"},  # right (trailing newline ignored)
        {**initial, "total.txt": "4"},  # wrong value
        dict(initial),  # target never written
        {"numbers.txt": "3\n", "total.txt": "3"},  # input clobbered
        {**initial, "total.txt": "3", "scratch.txt": "1+2"},  # extra file
        None,  # an "ok" episode without a snapshot cannot be scored
    )
    rewards = files_correct(prompts=[None] * 6, completions=[[]] * 6, expected=expected, episodes=episodes)
    assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0, None]
    crashed = _files_episodes({**initial, "total.txt": "3"}, status="agent_error")
    assert files_correct(prompts=[None], completions=[[]], expected=expected[:1], episodes=crashed) == [None]
    with pytest.raises(ValueError, match="episodes"):
        files_correct(prompts=[None], completions=[[]], expected=expected[:1])


# ---------------------------------------------------------------------------------------------------------------------
# Workspace confinement


def test_workspace_refuses_paths_outside(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("s3cret")
    with Workspace.create({"a.txt": "A"}, parent=tmp_path) as workspace:
        os.symlink(outside, workspace.root / "link_dir")
        os.symlink(outside / "secret.txt", workspace.root / "link_file.txt")
        escapes = [
            str(outside / "secret.txt"),  # absolute
            "/etc/passwd",
            "../outside/secret.txt",
            "sub/../../outside/secret.txt",
            "link_dir/secret.txt",  # through a symlinked directory
            "link_file.txt",  # a symlink to a file outside
            ".",
            "",
        ]
        tools = workspace.tools()
        for path in escapes:
            with pytest.raises(WorkspaceError):
                workspace.read_file(path)
            assert call_tool(tools, "read_file", json.dumps({"path": path})).startswith("Error:")
            result = call_tool(tools, "write_file", json.dumps({"path": path, "content": "pwned"}))
            assert result.startswith("Error:"), (path, result)
        assert (outside / "secret.txt").read_text() == "s3cret"
        assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
        assert not (tmp_path / "pwned").exists()

        # Inside the workspace everything works, including new sub-directories; symlinks are not listed.
        assert (
            call_tool(tools, "write_file", '{"path": "sub/b.txt", "content": "B"}')
            == "Wrote 1 characters to sub/b.txt."
        )
        assert call_tool(tools, "read_file", '{"path": "sub/b.txt"}') == "B"
        assert call_tool(tools, "list_files", "{}") == "a.txt\nsub/b.txt"
        assert workspace.snapshot() == {"a.txt": "A", "sub/b.txt": "B"}
        assert "Files: a.txt, sub/b.txt" in call_tool(tools, "read_file", '{"path": "missing.txt"}')
    assert not workspace.root.exists()
    assert (outside / "secret.txt").read_text() == "s3cret"  # cleanup removed the links, not their targets


def test_workspace_refuses_escaping_initial_files(tmp_path):
    with pytest.raises(WorkspaceError):
        Workspace.create({"../evil.txt": "x"}, parent=tmp_path)
    assert list(tmp_path.iterdir()) == []  # the half-made workspace is removed


# ---------------------------------------------------------------------------------------------------------------------
# Agents


def test_calculator_agent_runs_tools_and_stops():
    task = build_calculator_dataset("train", size=1)[0]
    client = ScriptedClient(
        [tool_call_reply(("calculator", json.dumps({"expression": task["expression"]}))), "The answer is X."]
    )
    result = asyncio.run(calculator_agent(client, task))
    assert result == "The answer is X."
    assert len(client.requests) == 2
    first, second = client.requests
    assert (
        first["model"] == "policy"
        and first["messages"] == task["prompt"]
        and first["tools"] == get_task("calculator").tools
    )
    assistant, tool = second["messages"][-2:]
    assert assistant["role"] == "assistant" and assistant["tool_calls"][0]["function"]["name"] == "calculator"
    assert tool == {"role": "tool", "tool_call_id": assistant["tool_calls"][0]["id"], "content": task["answer"]}
    assert len(task["prompt"]) == 2  # the dataset row was not mutated


def test_calculator_agent_survives_malformed_calls_and_obeys_max_rounds():
    client = ScriptedClient(
        [
            tool_call_reply(("calculator", "{not json"), ("python", "{}")),  # two broken calls in one message
            tool_call_reply(("calculator", '{"expression": "os.system(1)"}')),
            "The answer is 5.",
        ]
    )
    result = asyncio.run(calculator_agent(client, {**build_calculator_dataset("train", 1)[0], "model": "my-model"}))
    assert result == "The answer is 5."
    assert {request["model"] for request in client.requests} == {"my-model"}
    tool_messages = [m for m in client.requests[-1]["messages"] if m["role"] == "tool"]
    assert len(tool_messages) == 3 and all(m["content"].startswith("Error:") for m in tool_messages)

    looping = ScriptedClient([tool_call_reply(("calculator", '{"expression": "1 + 1"}'))] * 10)
    assert asyncio.run(get_task("calculator").agent(looping, build_calculator_dataset("train", 1)[0])) == ""
    assert len(looping.requests) == 6  # max_rounds


def test_files_agent_works_in_a_temporary_workspace(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where the agent's workspaces are created
    task = build_files_dataset("train", size=1, kinds=("sum",))[0]
    numbers = json.loads(task["files"])["numbers.txt"]
    total = str(sum(int(n) for n in numbers.split()))
    client = ScriptedClient(
        [
            tool_call_reply(("list_files", "{}")),
            tool_call_reply(("read_file", '{"path": "numbers.txt"}')),
            tool_call_reply(("write_file", json.dumps({"path": "../escape.txt", "content": total}))),
            tool_call_reply(("write_file", json.dumps({"path": "total.txt", "content": total}))),
            "Done.",
        ],
        probe=lambda: [p.name for p in tmp_path.iterdir()],
    )
    snapshot = asyncio.run(files_agent(client, task))
    assert len(client.probes[0]) == 1 and client.probes[0][0].startswith("trl-agentic-files-")  # one live workspace
    assert snapshot == {"numbers.txt": numbers, "total.txt": total}
    tool_results = [m["content"] for m in client.requests[-1]["messages"] if m["role"] == "tool"]
    assert tool_results[:2] == ["numbers.txt", numbers]
    assert tool_results[2].startswith("Error:") and tool_results[3].startswith("Wrote")
    # The model sees the prompt, the tool schemas and tool results, never the checker's `expected` column.
    assert client.requests[0]["messages"] == task["prompt"] and client.requests[0]["tools"] == get_task("files").tools
    assert list(tmp_path.iterdir()) == []  # workspace deleted, nothing escaped into its parent

    episode = Episode(id="e", status="ok", result=snapshot)
    assert files_correct(
        prompts=[task["prompt"]], completions=[[]], expected=[task["expected"]], episodes=[episode]
    ) == [1.0]


def test_files_agent_cleans_up_when_the_client_fails(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    client = ScriptedClient([RuntimeError("endpoint closed the episode")])
    with pytest.raises(RuntimeError):
        asyncio.run(files_agent(client, build_files_dataset("train", size=1)[0]))
    assert list(tmp_path.iterdir()) == []


def test_latency_agent_waits_on_its_tool_after_every_model_call():
    suite = make_latency_suite(tool_latency=0.05)
    task = {"prompt": build_latency_dataset("train", 1)[0]["prompt"], "readings": [4, 0, 7]}
    client = ScriptedClient(
        [
            tool_call_reply(("probe", "{}")),
            "I will wait.",
            tool_call_reply(("probe", "{}"), ("probe", "{}")),
            "The sum is 11.",
        ],
        probe=time.monotonic,
    )
    assert asyncio.run(suite.agent(client, task)) == "The sum is 11."
    # One model call per reading and one for the answer, the tool's latency between each two
    assert len(client.requests) == 4
    assert all(later - earlier >= 0.05 for earlier, later in zip(client.probes, client.probes[1:]))
    assert all(request["tools"] == suite.tools for request in client.requests)
    after_prompt = client.requests[-1]["messages"][len(task["prompt"]) :]
    calls = [m["tool_calls"] for m in after_prompt if m["role"] == "assistant" and m.get("tool_calls")]
    assert [(m["role"], m.get("content")) for m in after_prompt if m["role"] != "assistant"] == [
        ("tool", "4"),
        ("user", "The probe ran: reading 0."),
        ("tool", "7"),
        ("tool", "Error: the probe runs once per turn."),
    ]
    assert [m["tool_call_id"] for m in after_prompt if m["role"] == "tool"] == [
        calls[0][0]["id"],
        calls[1][0]["id"],
        calls[1][1]["id"],
    ]
    episode = Episode(id="e", status="ok", result="The sum is 11.")
    assert suite.reward_funcs[0](prompts=[None], completions=[[]], answer=["11"], episodes=[episode]) == [1.0]
    assert not {"answer"} & set(suite.agent_columns)
    with pytest.raises(ValueError, match="min_calls"):
        make_latency_suite(min_calls=3, max_calls=2)
    with pytest.raises(ValueError, match="tool_latency"):
        make_latency_suite(tool_latency=-1)


def test_latency_dataset_draws_two_to_four_readings_and_their_sum():
    rows = build_latency_dataset("train", size=64, seed=1)
    assert {len(r) for r in rows["readings"]} == {2, 3, 4}
    assert all(row["answer"] == str(sum(row["readings"])) for row in rows)
    assert all(f"{len(row['readings'])} times" in row["prompt"][-1]["content"] for row in rows)
    train = {tuple(r) for r in build_latency_dataset("train", size=200, seed=0)["readings"]}
    assert not train & {tuple(r) for r in build_latency_dataset("eval", size=50, seed=0)["readings"]}


# ---------------------------------------------------------------------------------------------------------------------
# Demonstrations


@pytest.mark.parametrize("task_name", ["calculator", "files", "latency"])
def test_demonstrations_replayed_by_the_agent_score_full_marks(task_name, tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    suite = get_task(task_name) if task_name != "latency" else make_latency_suite(tool_latency=0.0)
    # The agent works from the columns its suite declares, none of the checker's (issue #9: `answer` leaked).
    assert not {"answer", "expected", "expression"} & set(suite.agent_columns)
    rows = suite.build_dataset("train", size=6, seed=3)
    demos = suite.demonstrations(6, seed=3)
    episodes, completions = [], []
    for row, demo in zip(rows, demos, strict=True):
        assert demo["messages"][: len(row["prompt"])] == row["prompt"]
        client = ScriptedClient(demo_replies(demo))
        result = asyncio.run(suite.agent(client, {column: row[column] for column in suite.agent_columns}))
        assert client.replies == []  # the agent consumed the whole demonstration
        completion = client.requests[-1]["messages"][len(row["prompt"]) :]
        # The agent's transcript matches the demonstration (up to ids and the dict/JSON form of the arguments).
        assert [m["role"] for m in completion] == [m["role"] for m in demo["messages"][len(row["prompt"]) : -1]]
        episodes.append(Episode(id=str(len(episodes)), status="ok", result=result))
        completions.append(completion)
    columns = {name: rows[name] for name in rows.column_names if name != "prompt"}
    for reward_func in suite.reward_funcs:
        rewards = reward_func(prompts=rows["prompt"], completions=completions, episodes=episodes, **columns)
        assert rewards == [1.0] * len(rows)


@pytest.mark.parametrize("family", ["qwen2_5", "llama3_2"])
@pytest.mark.parametrize("task_name", ["calculator", "files", "latency"])
def test_demonstrations_render_through_chat_templates(family, task_name):
    tokenizer = build_tiny_tokenizer(family)
    suite = get_task(task_name)
    properties = {t["function"]["name"]: set(t["function"]["parameters"]["properties"]) for t in suite.tools}
    for demo in suite.demonstrations(4, seed=0):
        assert demo["tools"] == suite.tools
        for message in demo["messages"]:
            for tool_call in message.get("tool_calls", []):
                function = tool_call["function"]
                assert isinstance(function["arguments"], dict)
                assert set(function["arguments"]) <= properties[function["name"]]  # no keys outside the schema
        text = tokenizer.apply_chat_template(demo["messages"], tools=demo["tools"], tokenize=False)
        assert demo["messages"][-1]["content"] in text
        for message in demo["messages"]:
            for tool_call in message.get("tool_calls", []):
                assert tool_call["function"]["name"] in text
