"""`trl_agentic.envs.MCPAgent` with the real `mcp` SDK: a key-value MCP server written here with the SDK's `MCPServer`
(what `FastMCP` is called in mcp 2.x), run over stdio (a subprocess) and streamable HTTP (uvicorn on loopback), driven
by a scripted engine so every tool call, and so every tool result, is known exactly."""

import itertools
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from datasets import Dataset

from conftest import ScriptedEngine
from test_agentic_grpo_trainer import config as grpo_config
from trl_agentic import AgenticGRPOTrainer
from trl_agentic.envs import MCPAgent
from trl_agentic.envs.mcp import openai_tool_names
from trl_agentic.rollout.runner import run_episodes, run_rollout
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


pytest.importorskip("mcp.server.mcpserver", reason="needs the mcp SDK 2.x: pip install 'trl-agentic[mcp]'")

KV_SERVER = textwrap.dedent('''
    """A stateful key-value MCP server: stdio by default, streamable HTTP with `--http PORT`."""
    import os, sys, time
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    server = MCPServer("kv")
    store = {}

    @server.tool()
    def put(key: str, value: str) -> str:
        """Store a value under a key."""
        store[key] = value
        return f"stored {key}"

    @server.tool()
    def get(key: str) -> str:
        """Read the value stored under a key."""
        if key not in store:
            raise ToolError(f"no key {key!r}")
        return store[key]

    @server.tool()
    def count() -> int:
        """How many keys are stored."""
        return len(store)

    @server.tool()
    def pid() -> int:
        """This server's process id."""
        return os.getpid()

    @server.tool()
    def env_names() -> str:
        """The names of this server's environment variables."""
        return " ".join(sorted(os.environ))

    @server.tool()
    def sleep(seconds: float) -> str:
        """Sleep."""
        time.sleep(seconds)
        return "slept"

    @server.tool()
    def crash() -> str:
        """Exit at once, as a server that dies does."""
        print("the server died", file=sys.stderr, flush=True)
        os._exit(1)

    if __name__ == "__main__":
        if sys.argv[1:2] == ["--http"]:
            server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
        else:
            server.run("stdio")
''')


@pytest.fixture(scope="module")
def kv_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("mcp") / "kv_server.py"
    path.write_text(KV_SERVER)
    return [sys.executable, str(path)]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


def plan_prompt(*steps) -> list[dict]:
    """A task whose user message holds the plan the scripted model follows: each step a list of `[tool, arguments]`
    calls made in one assistant message, then a final answer."""
    return [{"role": "user", "content": "PLAN " + json.dumps(list(steps))}]


def scripted_model(tokenizer, endings=("",)):
    """Follows the plan in the prompt: the next step's tool calls (Qwen 2.5's `<tool_call>` format), or, once every
    step has its tool results, an answer quoting the last tool result, followed by the next of `endings` in turn."""
    endings = itertools.cycle(endings)

    def respond(prompt_ids):
        text = tokenizer.decode(prompt_ids)
        plan = json.loads(re.search(r"PLAN (\[.*\])", text).group(1))
        after = text[text.index("PLAN ") :]
        done = after.count("<|im_start|>assistant") - 1  # the assistant messages before the one being generated
        if done < len(plan):
            return "\n".join(
                f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
                for name, args in plan[done]
            )
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", after, re.S)
        return f"Done: {results[-1] if results else 'nothing'}.{next(endings)}"

    return respond


@pytest.fixture(scope="module")
def endpoint(start_server, tokenizer):
    return start_server(ScriptedEngine(tokenizer, scripted_model(tokenizer)), tokenizer)


def run(endpoint, agent, prompts, timeout=60.0):
    return run_rollout(run_episodes(endpoint, agent, [{"prompt": p} for p in prompts], timeout=timeout))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) is not a running server.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


def wait_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def http_kv_url(tmp_path_factory):
    """The same server's streamable HTTP app in this process, under uvicorn on a loopback port (a server the user
    runs: its state lives as long as it does)."""
    import importlib.util

    import uvicorn

    path = tmp_path_factory.mktemp("mcp_http") / "kv_http.py"
    path.write_text(KV_SERVER)
    spec = importlib.util.spec_from_file_location("kv_http", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(module.server.streamable_http_app(), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the MCP HTTP server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/mcp"
    server.should_exit = True
    thread.join(10)


def test_tools_are_offered_called_and_their_results_and_errors_read_by_the_model(endpoint, kv_server):
    agent = MCPAgent(servers={"kv": kv_server}, system_prompt="Use the tools.")
    prompt = plan_prompt(
        [["put", {"key": "a", "value": "1"}], ["put", {"key": "b", "value": "2"}]],  # two calls in one message
        [["get", {"key": "a"}]],
        [["get", {"key": "zz"}]],  # the tool raises: an error the model reads
        [["get", {"kee": "a"}]],  # bad arguments: the server's validation error
        [["drop", {}]],  # no such tool
        [["count", {}]],
    )
    (episode,) = run(endpoint, agent, [prompt])
    assert episode.status == "ok", episode.error
    result = episode.result
    assert result["finish"] == "answered" and result["turns"] == 7 and result["text"] == "Done: 2."
    calls = [(c["tool"], c["server"], c["arguments"], c["content"], c["is_error"]) for c in result["tool_calls"]]
    assert calls[:4] == [
        ("put", "kv", {"key": "a", "value": "1"}, "stored a", False),
        ("put", "kv", {"key": "b", "value": "2"}, "stored b", False),
        ("get", "kv", {"key": "a"}, "1", False),
        ("get", "kv", {"key": "zz"}, "Error executing tool get: no key 'zz'", True),
    ]
    assert calls[4][:2] == ("get", "kv") and calls[4][4] and "Field required" in calls[4][3]
    assert calls[5] == (
        "drop",
        None,
        "{}",
        "Error: unknown tool 'drop'. Available tools: count, crash, env_names, get, pid, put, sleep.",
        True,
    )
    assert calls[6] == ("count", "kv", {}, "2", False) and result["tool_calls"][6]["structured_content"] == {
        "result": 2
    }

    # What the model was offered: the server's tools as OpenAI functions, their MCP input schemas as parameters.
    tools = {t["function"]["name"]: t["function"] for t in episode.turns[0].request_tools}
    assert list(tools) == ["put", "get", "count", "pid", "env_names", "sleep", "crash"]
    assert tools["get"]["description"] == "Read the value stored under a key."
    assert tools["get"]["parameters"]["properties"] == {"key": {"title": "Key", "type": "string"}}
    assert tools["get"]["parameters"]["required"] == ["key"]
    # What it read: each result as a tool message answering its call, in the conversation the endpoint recorded.
    tool_messages = [m for m in episode.turns[-1].request_messages if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages] == [c[3] for c in calls]
    assert episode.turns[0].request_messages[0] == {"role": "system", "content": "Use the tools."}
    # One linear conversation: every call continues the previous one token for token.
    assert [t.prompt_source for t in episode.turns] == ["rendered"] + ["continued"] * 6


@pytest.mark.slow
def test_fresh_servers_per_episode_share_no_state_and_are_gone_when_it_ends(endpoint, kv_server):
    agent = MCPAgent(servers={"kv": kv_server})
    # Four episodes at once: each stores its key, then counts and reads its server's pid.
    prompts = [plan_prompt([["put", {"key": f"k{i}", "value": "v"}]], [["count", {}]], [["pid", {}]]) for i in range(4)]
    episodes = run(endpoint, agent, prompts)
    assert [e.status for e in episodes] == ["ok"] * 4
    assert [e.result["tool_calls"][1]["content"] for e in episodes] == ["1"] * 4  # nobody else's key
    pids = [int(e.result["tool_calls"][2]["content"]) for e in episodes]
    assert len(set(pids)) == 4 and not any(alive(pid) for pid in pids)  # closed before the episode ended
    # And a later rollout (a new event loop) starts from scratch again.
    (again,) = run(endpoint, agent, [plan_prompt([["count", {}]])])
    assert again.result["tool_calls"][0]["content"] == "0"


def test_shared_servers_keep_their_state_across_episodes_and_rollouts_until_closed(endpoint, kv_server):
    agent = MCPAgent(servers={"kv": kv_server}, shared=True)
    try:
        first = run(endpoint, agent, [plan_prompt([["put", {"key": "a", "value": "1"}]], [["pid", {}]])])
        # A second rollout runs on another event loop: the shared server outlives the first one.
        second = run(
            endpoint, agent, [plan_prompt([["put", {"key": "b", "value": "2"}]], [["count", {}]], [["pid", {}]])]
        )
        assert first[0].status == second[0].status == "ok"
        assert second[0].result["tool_calls"][1]["content"] == "2"  # the first episode's key is still there
        pid = int(first[0].result["tool_calls"][1]["content"])
        assert int(second[0].result["tool_calls"][2]["content"]) == pid and alive(pid)
    finally:
        agent.close()
    assert wait_gone(pid)
    # Closed servers start again for the next episode, empty.
    try:
        (third,) = run(endpoint, agent, [plan_prompt([["count", {}]])])
        assert third.result["tool_calls"][0]["content"] == "0"
    finally:
        agent.close()


def test_streamable_http_server_by_url_and_colliding_tool_names(endpoint, kv_server, http_kv_url):
    # Two servers with the same tools: each name is prefixed with its server's.
    agent = MCPAgent(servers={"local": kv_server, "remote": http_kv_url})
    prompt = plan_prompt(
        [["remote__put", {"key": "a", "value": "web"}]], [["local__count", {}]], [["remote__get", {"key": "a"}]]
    )
    episodes = run(endpoint, agent, [prompt, prompt])
    assert [e.status for e in episodes] == ["ok", "ok"], episodes[0].error
    names = [t["function"]["name"] for t in episodes[0].turns[0].request_tools]
    assert names == [
        f"{server}__{tool}"
        for server in ("local", "remote")
        for tool in ("put", "get", "count", "pid", "env_names", "sleep", "crash")
    ]
    for episode in episodes:
        log = episode.result["tool_calls"]
        assert [(c["server"], c["mcp_tool"], c["content"]) for c in log] == [
            ("remote", "put", "stored a"),
            ("local", "count", "0"),
            ("remote", "get", "web"),
        ]
    # The URL's server is the user's: the connection is new each episode, the state is the server's own.
    (episode,) = run(endpoint, MCPAgent(servers={"remote": http_kv_url}), [plan_prompt([["count", {}]])])
    assert episode.result["tool_calls"][0]["content"] == "1"


def test_http_server_started_per_episode_on_a_port_of_its_own(endpoint, kv_server):
    agent = MCPAgent(
        servers={
            "kv": {
                "command": kv_server[0],
                "args": [*kv_server[1:], "--http", "{port}"],
                "url": "http://127.0.0.1:{port}/mcp",
            }
        }
    )
    prompt = plan_prompt([["put", {"key": "a", "value": "1"}]], [["count", {}]], [["pid", {}]])
    episodes = run(endpoint, agent, [prompt, prompt])
    assert [e.status for e in episodes] == ["ok", "ok"], episodes[0].error
    assert [e.result["tool_calls"][1]["content"] for e in episodes] == ["1", "1"]
    pids = [int(e.result["tool_calls"][2]["content"]) for e in episodes]
    assert pids[0] != pids[1] and all(wait_gone(pid) for pid in pids)


def test_servers_get_a_minimal_environment_not_the_trainers_secrets(endpoint, kv_server, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws_secret")
    prompt = plan_prompt([["env_names", {}]])
    (episode,) = run(endpoint, MCPAgent(servers={"kv": {"command": kv_server, "env": {"KV_LABEL": "x"}}}), [prompt])
    names = set(episode.result["tool_calls"][0]["content"].split())
    assert "PATH" in names and "KV_LABEL" in names
    assert "HF_TOKEN" not in names and "AWS_SECRET_ACCESS_KEY" not in names
    assert not {n for n in names if "OPENAI" in n or "TRL_AGENTIC" in n}  # nor the episode's key
    (episode,) = run(endpoint, MCPAgent(servers={"kv": kv_server}, inherit_env=["HF_TOKEN"]), [prompt])
    names = set(episode.result["tool_calls"][0]["content"].split())
    assert "HF_TOKEN" in names and "AWS_SECRET_ACCESS_KEY" not in names


def test_a_tool_call_past_its_timeout_is_an_error_the_model_reads(endpoint, kv_server):
    agent = MCPAgent(servers={"kv": kv_server}, tool_timeout=0.5)
    (episode,) = run(endpoint, agent, [plan_prompt([["sleep", {"seconds": 5}]], [["count", {}]])])
    assert episode.status == "ok"
    log = episode.result["tool_calls"]
    assert log[0]["is_error"] and "timed out" in log[0]["content"] and log[1]["content"] == "0"


@pytest.mark.slow
def test_an_episode_timeout_kills_its_stdio_server(endpoint, kv_server):
    agent = MCPAgent(servers={"kv": kv_server})
    started = time.monotonic()
    # 6 s: time for the server to start and answer `pid` on a busy machine, then the sleep outlives the episode.
    (episode,) = run(endpoint, agent, [plan_prompt([["pid", {}]], [["sleep", {"seconds": 60}]])], timeout=6.0)
    assert episode.status == "timeout" and time.monotonic() - started < 20
    # The pid it reported is in the last call's conversation (the agent never returned).
    messages = episode.turns[-1].request_messages
    pid = int(next(m["content"] for m in messages if m["role"] == "tool"))
    assert wait_gone(pid)


def test_a_server_that_dies_during_a_call_fails_its_episode_and_a_shared_one_starts_again(endpoint, kv_server):
    agent = MCPAgent(servers={"kv": kv_server}, shared=True)
    try:
        (died,) = run(endpoint, agent, [plan_prompt([["put", {"key": "a", "value": "1"}]], [["crash", {}]])])
        assert died.status == "agent_error" and "MCP server 'kv'" in died.error and "'crash'" in died.error
        assert "the server died" in died.metadata["stderr_tail"]
        (after,) = run(endpoint, agent, [plan_prompt([["count", {}]])])  # a new server, empty
        assert after.status == "ok" and after.result["tool_calls"][0]["content"] == "0"
    finally:
        agent.close()


def test_a_server_that_cannot_start_fails_its_episode_only_with_its_stderr(endpoint, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import sys\nprint('cannot open the database', file=sys.stderr)\nsys.exit(3)\n")
    episodes = run(endpoint, MCPAgent(servers={"db": [sys.executable, str(broken)]}), [plan_prompt()] * 2)
    assert [e.status for e in episodes] == ["agent_error"] * 2
    assert "MCP server 'db' could not start" in episodes[0].error
    assert "cannot open the database" in episodes[0].metadata["stderr_tail"]


def test_a_server_that_never_answers_is_stopped_at_its_startup_timeout(endpoint, tmp_path):
    hung = tmp_path / "hung.py"
    hung.write_text("import os, sys, time\nprint(os.getpid(), file=sys.stderr, flush=True)\ntime.sleep(120)\n")
    agent = MCPAgent(servers={"hung": [sys.executable, str(hung)]}, startup_timeout=1.0)
    (episode,) = run(endpoint, agent, [plan_prompt()])
    assert episode.status == "agent_error" and "did not start and list its tools within 1s" in episode.error
    assert wait_gone(int(episode.metadata["stderr_tail"].split()[0]))


def test_server_specs_in_every_form_name_the_same_server(kv_server):
    from mcp import StdioServerParameters

    forms = [
        " ".join(kv_server),
        kv_server,
        {"command": kv_server[0], "args": kv_server[1:]},
        {"command": " ".join(kv_server), "type": "stdio"},
        StdioServerParameters(command=kv_server[0], args=kv_server[1:]),
    ]
    for form in forms:
        (config,) = MCPAgent(servers={"kv": form})._configs
        assert (config.transport, config.command) == ("stdio", tuple(kv_server)), form
    (config,) = MCPAgent(servers={"web": {"url": "https://h/mcp", "headers": {"X": "1"}}})._configs
    assert (config.transport, config.url, dict(config.headers)) == ("http", "https://h/mcp", {"X": "1"})


def test_tool_names_are_valid_openai_function_names_and_unique():
    assert openai_tool_names([("kv", ["get", "put"]), ("files", ["get", "read.text"])]) == [
        ["kv__get", "put"],
        ["files__get", "read_text"],
    ]
    long = "x" * 70
    assert openai_tool_names([("a", [long, "x" * 64])]) == [["x" * 64, "x" * 62 + "_2"]]


def test_config_errors_say_how_to_fix(kv_server):
    with pytest.raises(ValueError, match="at least one server"):
        MCPAgent(servers={})
    with pytest.raises(ValueError, match="legacy SSE transport is not supported"):
        MCPAgent(servers={"a": {"url": "http://x/sse", "type": "sse"}})
    with pytest.raises(ValueError, match=r"unknown keys \['argz'\]"):
        MCPAgent(servers={"a": {"command": "python", "argz": []}})
    with pytest.raises(ValueError, match="needs '\\{port\\}' in the URL"):
        MCPAgent(servers={"a": {"command": "serve", "url": "http://127.0.0.1:8000/mcp"}})
    with pytest.raises(ValueError, match=r"\['b'\] are not servers"):
        MCPAgent(servers={"a": kv_server}, shared=["b"])
    with pytest.raises(ValueError, match="a list of server names"):
        MCPAgent(servers={"a": kv_server}, shared="a")
    with pytest.raises(ValueError, match="max_turns=0"):
        MCPAgent(servers={"a": kv_server}, max_turns=0)


# --- training and evaluation ------------------------------------------------------------------------------------


def counter_dataset(n: int) -> Dataset:
    return Dataset.from_list(
        [
            {"prompt": plan_prompt([["put", {"key": f"k{i}", "value": str(i)}]], [["count", {}]]), "expected": "1"}
            for i in range(n)
        ]
    )


def count_reward(prompts, completions, expected, episodes, **kwargs):
    """1.0 when the episode's server held only its own key: `episode.result` is the agent's return value."""
    return [float(e.result["tool_calls"][-1]["content"] == x) for e, x in zip(episodes, expected)]


def brevity_reward(prompts, completions, episodes, **kwargs):
    """Shorter answers score higher: differs within a group, so the step has a gradient."""
    return [1.0 / len(e.result["text"]) for e in episodes]


@pytest.mark.slow
def test_two_training_steps_on_exactly_the_sampled_tokens(tmp_path, tokenizer, kv_server):
    model = build_tiny_model(tokenizer)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = grpo_config(
        tmp_path, max_completion_length=64, episode_timeout=60
    )  # 2 episodes a step, room for a scripted tool call
    # The scripted model ends its answers in turn with "" and " Counted.": the two episodes of a group differ.
    engine = ScriptedEngine(tokenizer, scripted_model(tokenizer, endings=("", " Counted.")))
    trainer = AgenticGRPOTrainer(
        model,
        agent=MCPAgent(servers={"kv": kv_server}),
        reward_funcs=[count_reward, brevity_reward],
        args=config,
        train_dataset=counter_dataset(4),
        processing_class=tokenizer,
        engine=engine,
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters()), "parameters did not change"
    records = [json.loads(line) for line in (tmp_path / "episodes" / "episodes-rank0.jsonl").open()]
    assert len(records) == 4
    for record in records:
        episode = record["episode"]
        assert episode["status"] == "ok" and episode["result"]["tool_calls"][-1]["content"] == "1"
        turns = episode["turns"]
        assert [t["prompt_source"] for t in turns] == ["rendered", "continued", "continued"]
        (row,) = record["rows"]  # one linear conversation: one row
        sampled = [(tok, lp) for t in turns for tok, lp in zip(t["completion_ids"], t["logprobs"])]
        assert [
            (tok, lp) for tok, m, lp in zip(row["completion_ids"], row["env_mask"], row["logprobs"]) if m
        ] == sampled
        # Everything else in the row (the tool results) is the endpoint's rendering, masked, with logprob 0.
        assert all(lp == 0.0 for m, lp in zip(row["env_mask"], row["logprobs"]) if not m)
        assert row["prompt_ids"] + row["completion_ids"] == turns[-1]["prompt_ids"] + turns[-1]["completion_ids"]
        assert row["prompt_ids"] == turns[0]["prompt_ids"]
    # Fresh servers: every episode counted its own key only.
    assert trainer.state.log_history[0]["rewards/count_reward/mean"] == 1.0


EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "envs", "mcp_agent.py")


@pytest.mark.slow
def test_the_example_suite_evaluates_with_trl_agentic_eval(tmp_path):
    from trl_agentic.scripts.eval import main

    output = tmp_path / "eval.json"
    code = main(
        [
            "--task",
            f"{EXAMPLE}:SUITE",
            "--model",
            "tiny:qwen2_5:64x2",
            "--size",
            "2",
            "--num-samples",
            "2",
            "--max-tokens",
            "8",
            "--max-turns",
            "2",
            "--output",
            str(output),
            "--no-progress",
        ]
    )
    assert code == 0
    written = json.loads(output.read_text())
    assert written["episodes"] == 4 and written["status"]["ok"] == 4
    assert set(written["scored_reward_funcs"]) == {"counter_correct"}


def test_the_example_suite_runs_in_the_evaluator_with_its_servers_tools(tokenizer):
    from trl_agentic.evaluation import Evaluator
    from trl_agentic.imports import import_object

    suite = import_object(f"{EXAMPLE}:SUITE")
    evaluator = Evaluator(
        build_tiny_model(tokenizer),
        tokenizer,
        suite,
        suite.build_dataset("eval", size=2),
        num_samples=2,
        max_tokens=8,
        max_turns=2,
    )
    try:
        episodes = evaluator.run(seed=0)
        rewards, _, _ = evaluator.score(episodes)
    finally:
        evaluator.close()
    assert [e.status for e in episodes] == ["ok"] * 4
    for episode in episodes:
        assert [t["function"]["name"] for t in episode.turns[0].request_tools] == ["increment", "read"]
        assert set(episode.result) == {"text", "tool_calls", "turns", "finish"}
    assert all(r in (0.0, 1.0) for r in rewards)  # a random tiny model: scored, whatever it said


@pytest.mark.slow
def test_the_example_trains_two_steps_on_a_tiny_model(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            EXAMPLE,
            "--model",
            "tiny:qwen2_5",
            "--steps",
            "2",
            "--num-generations",
            "2",
            "--max-tokens",
            "16",
            "--output-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "episodes" / "episodes-rank0.jsonl").open()]
    assert len(records) == 4 and all(r["episode"]["status"] == "ok" for r in records)
    assert all(r["episode"]["turns"][0]["request_tools"][0]["function"]["name"] == "increment" for r in records)
