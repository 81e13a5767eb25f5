"""`trl_agentic.envs.from_openenv` with the real `openenv` package: a guess-the-number environment and a repeat-the-word
environment written here with OpenEnv's own server helpers (`Environment`, `Action`, `Observation`, `create_app`),
served by uvicorn in processes of their own on loopback ports, and driven by a scripted engine so that every action,
and so every reward, is known exactly."""

import itertools
import json
import os
import re
import sys
import textwrap
import threading
import time

import httpx
import pytest
import torch
from datasets import Dataset

from conftest import ScriptedEngine
from test_agentic_grpo_trainer import config as grpo_config
from trl_agentic import AgenticGRPOTrainer
from trl_agentic.envs import from_openenv
from trl_agentic.envs.openenv import (
    _environment_error,
    _protocol_from_schema,
    default_observation_to_message,
    openenv_reward,
)
from trl_agentic.imports import import_object
from trl_agentic.rollout.runner import run_episodes, run_rollout
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer
from trl_agentic.trace import Episode


pytest.importorskip("openenv.core.env_server", reason="needs OpenEnv: pip install 'trl-agentic[openenv]'")

ENVS = textwrap.dedent('''
    """Two OpenEnv environments: guess a number (an integer action: tool format), repeat a word (a text action)."""
    import os, random, time
    from uuid import uuid4

    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field


    class GuessAction(Action):
        """Guess the secret number."""
        guess: int = Field(..., description="A number from 1 to 8.")


    class GuessObservation(Observation):
        feedback: str = ""


    class GuessEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self._state = State(episode_id=str(uuid4()), step_count=0)
            self._secret = 0

        def reset(self, seed=None, episode_id=None, secret=None, **kwargs):
            self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
            self._secret = secret if secret is not None else random.Random(seed).randint(1, 8)
            return GuessObservation(feedback="Guess my number from 1 to 8.")

        def step(self, action):
            self._state.step_count += 1
            if action.guess < 0:  # a slow step, for the tests of timeouts and capacity
                time.sleep(-action.guess)
            if action.guess == self._secret:
                return GuessObservation(feedback="Correct!", done=True, reward=1.0)
            hint = "Higher." if action.guess < self._secret else "Lower."
            # -0.25 a wrong guess: sums of these are exact in binary floating point
            return GuessObservation(feedback=hint, done=self._state.step_count >= 4, reward=-0.25)

        @property
        def state(self):
            return self._state


    class RepeatAction(Action):
        message: str


    class RepeatObservation(Observation):
        prompt: str = ""


    class RepeatEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self._state = State(episode_id=str(uuid4()), step_count=0)
            self._word = ""

        def reset(self, seed=None, episode_id=None, word="hello", **kwargs):
            self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
            self._word = word
            return RepeatObservation(prompt=f"Say {word}.")

        def step(self, action):
            self._state.step_count += 1
            right = action.message.strip().strip(".") == self._word
            return RepeatObservation(prompt="Yes." if right else f"No, say {self._word}.", done=right,
                                     reward=1.0 if right else 0.0)

        @property
        def state(self):
            return self._state


    app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=16)
    repeat_app = create_app(RepeatEnvironment, RepeatAction, RepeatObservation, env_name="repeat",
                            max_concurrent_envs=16)
    single_app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=1)


    @app.get("/probe")
    def probe():
        """What the server process can see: its pid and its environment variables' names."""
        return {"pid": os.getpid(), "env": sorted(os.environ)}
''')


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("openenv")
    (path / "toy_envs.py").write_text(ENVS)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


def plan_prompt(*replies) -> list[dict]:
    """A task whose user message holds the replies the scripted model makes, in order: a dict is a `guess` tool call
    with those arguments (or `{"name": ..., "arguments": ...}` for another tool), a string is plain text."""
    return [{"role": "user", "content": "PLAN " + json.dumps(list(replies))}]


def scripted_model(tokenizer):
    def respond(prompt_ids):
        text = tokenizer.decode(prompt_ids)
        plan = json.loads(re.search(r"PLAN (\[.*?\])\n?<\|im_end\|>", text).group(1))
        made = text[text.index("PLAN ") :].count("<|im_start|>assistant") - 1  # the last one is the generation prompt
        reply = plan[made] if made < len(plan) else "I give up."
        if isinstance(reply, str):
            return reply
        call = reply if "name" in reply else {"name": "guess", "arguments": reply}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    return respond


def alternating_model(tokenizer, plans):
    """Plays `plans[0]`, `plans[1]`, ... in turn, one plan per episode (each a list of `guess` arguments): an
    episode's first call picks the next plan, its later calls find their plan from the first guess in the prompt."""
    counter = itertools.count()

    def respond(prompt_ids):
        text = tokenizer.decode(prompt_ids)
        text = text[text.index("<|im_start|>assistant") :]  # the calls made, not the system prompt's format example
        made = [json.loads(call)["arguments"] for call in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)]
        plan = plans[next(counter) % len(plans)] if not made else next(p for p in plans if p[0] == made[0])
        if len(made) >= len(plan):
            return "Done."
        return f"<tool_call>\n{json.dumps({'name': 'guess', 'arguments': plan[len(made)]})}\n</tool_call>"

    return respond


@pytest.fixture(scope="module")
def endpoint(start_server, tokenizer):
    return start_server(ScriptedEngine(tokenizer, scripted_model(tokenizer)), tokenizer)


@pytest.fixture(scope="module")
def guess(env_dir):
    """One shared local guess server for the module (each episode has its own session: its own environment)."""
    agent = from_openenv("toy_envs:app", app_dir=env_dir, max_turns=6)
    agent.start()
    yield agent
    agent.close()


@pytest.fixture(scope="module")
def repeat(env_dir):
    agent = from_openenv("toy_envs:repeat_app", app_dir=env_dir, max_turns=3)
    agent.start()
    yield agent
    agent.close()


def wait_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def run(endpoint, agent, tasks, timeout=60.0):
    return run_rollout(run_episodes(endpoint, agent, tasks, timeout=timeout))


def test_tool_format_episode_plays_the_environment_until_done(endpoint, guess):
    tasks = [
        {"prompt": plan_prompt({"guess": 4}, {"guess": 6}, {"guess": 5}), "secret": 5},
        {"prompt": plan_prompt({"guess": 2}), "secret": 2},
    ]
    first, second = run(endpoint, guess, tasks)
    assert first.status == second.status == "ok"
    result = first.result
    assert result["rewards"] == [-0.25, -0.25, 1.0] and result["reward"] == 0.5  # the sum of the step rewards
    assert result["done"] and result["finish"] == "done" and result["steps"] == 3 and result["turns"] == 3
    assert result["actions"] == [{"guess": 4}, {"guess": 6}, {"guess": 5}]
    assert [o["feedback"] for o in result["observations"]] == [
        "Guess my number from 1 to 8.",
        "Higher.",
        "Lower.",
        "Correct!",
    ]
    assert second.result["rewards"] == [1.0] and second.result["turns"] == 1
    # The action's schema (the server's /schema) became the one tool offered to the model.
    (tool,) = first.turns[0].request_tools
    assert tool["function"]["name"] == "guess"
    assert tool["function"]["parameters"] == {
        "type": "object",
        "required": ["guess"],
        "properties": {"guess": {"description": "A number from 1 to 8.", "title": "Guess", "type": "integer"}},
    }
    # The reset observation follows the task's prompt; each observation answers its call as a tool message.
    messages = first.turns[-1].request_messages
    assert messages[0] == tasks[0]["prompt"][0]
    assert messages[1] == {"role": "user", "content": "Guess my number from 1 to 8."}
    tool_messages = [m for m in messages if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages] == ["Higher.", "Lower."]
    assert [m["tool_call_id"] for m in tool_messages] == [
        m["tool_calls"][0]["id"] for m in messages if m["role"] == "assistant"
    ]
    assert openenv_reward([[]] * 2, [[]] * 2, episodes=[first, second]) == [0.5, 1.0]


def test_text_format_episode_sends_the_reply_as_the_actions_string_field(endpoint, repeat):
    tasks = [{"prompt": plan_prompt("Hello.", "world."), "word": "world"}]
    (episode,) = run(endpoint, repeat, tasks)
    assert episode.status == "ok" and not episode.turns[0].request_tools  # no tool in text format
    result = episode.result
    assert result["actions"] == [{"message": "Hello."}, {"message": "world."}]
    assert result["rewards"] == [0.0, 1.0] and result["reward"] == 1.0 and result["finish"] == "done"
    messages = episode.turns[-1].request_messages
    assert [m["content"] for m in messages if m["role"] == "user"][1:] == ["Say world.", "No, say world."]


def test_the_turn_limit_ends_an_episode_scored_with_what_the_environment_gave(endpoint, repeat):
    agent = from_openenv(repeat.server_url, max_turns=2, reward="last")  # the running server, by URL
    (episode,) = run(endpoint, agent, [{"prompt": plan_prompt("a", "b", "c"), "word": "z"}])
    assert episode.status == "ok"
    assert episode.result["finish"] == "max_turns" and episode.result["turns"] == 2 and not episode.result["done"]
    assert episode.result["rewards"] == [0.0, 0.0] and episode.result["reward"] == 0.0


def test_bad_actions_are_errors_the_model_reads_and_the_environment_is_not_stepped(endpoint, guess):
    tasks = [
        {
            "prompt": plan_prompt(
                {"guess": "five"}, {"name": "peek", "arguments": {}}, {"guess": 1, "hint": 2}, {"guess": 3}, "Done."
            ),
            "secret": 3,
        }
    ]
    (episode,) = run(endpoint, guess, tasks)
    assert episode.status == "ok"
    result = episode.result
    assert result["turns"] == 4 and result["steps"] == 1 and result["rewards"] == [1.0]
    errors = [m["content"] for m in episode.turns[-1].request_messages if m["role"] == "tool"]
    # No action class here: a wrong type is the server's validation error; the rest is caught before stepping.
    assert errors[0].startswith("Error: the environment rejected the action")
    assert errors[1] == "Error: unknown tool 'peek'; call 'guess'."
    assert errors[2] == "Error: unknown fields ['hint']; the action's fields are ['guess']."


def test_a_reply_without_a_tool_call_ends_a_tool_format_episode(endpoint, guess):
    (episode,) = run(endpoint, guess, [{"prompt": plan_prompt({"guess": 1}, "I am done."), "secret": 8}])
    assert episode.result["finish"] == "answered" and episode.result["turns"] == 2
    assert episode.result["rewards"] == [-0.25] and episode.result["reward"] == -0.25


def test_hooks_decide_the_messages_and_the_actions(endpoint, env_dir, guess):
    sys.path.insert(0, env_dir)
    try:
        from toy_envs import GuessAction
    finally:
        sys.path.remove(env_dir)

    def reply_to_action(message):
        found = re.search(r"GUESS (\d+)", message.get("content") or "")
        if found is None:
            raise ValueError("say GUESS <n>")
        return GuessAction(guess=int(found.group(1)))

    agent = from_openenv(
        guess.server_url,
        action=GuessAction,
        action_format="text",
        reply_to_action=reply_to_action,
        observation_to_message=lambda observation: f"[env] {observation['feedback']}",
    )
    (episode,) = run(endpoint, agent, [{"prompt": plan_prompt("hmm", "GUESS 7", "GUESS 6"), "secret": 6}])
    assert episode.status == "ok" and episode.result["rewards"] == [-0.25, 1.0]
    users = [m["content"] for m in episode.turns[-1].request_messages if m["role"] == "user"][1:]
    assert users == ["[env] Guess my number from 1 to 8.", "Error: say GUESS <n>", "[env] Lower."]


def test_a_hook_that_blocks_times_out_its_own_episode_only(endpoint, env_dir, guess):
    # Hooks run on the episode's event loop: one that blocked (a slow parser, a network call) held every episode of the
    # rollout past every timeout (issue 40). Each episode now has a loop of its own; the blocked one times out alone.
    sys.path.insert(0, env_dir)
    try:
        from toy_envs import GuessAction
    finally:
        sys.path.remove(env_dir)
    release = threading.Event()

    def reply_to_action(message):
        guess_ = int(re.search(r"GUESS (\d+)", message.get("content") or "").group(1))
        if guess_ == 9:
            release.wait(60)
        return GuessAction(guess=guess_)

    agent = from_openenv(guess.server_url, action=GuessAction, action_format="text", reply_to_action=reply_to_action)
    tasks = [{"prompt": plan_prompt("GUESS 9"), "secret": 9}, {"prompt": plan_prompt("GUESS 6"), "secret": 6}]
    out = {}
    thread = threading.Thread(target=lambda: out.update(episodes=run(endpoint, agent, tasks, timeout=4.0)), daemon=True)
    try:
        thread.start()
        thread.join(30)
        assert not thread.is_alive(), "a blocked hook held the rollout past its episode's timeout"
    finally:
        release.set()
    assert [e.status for e in out["episodes"]] == ["timeout", "ok"], [e.error for e in out["episodes"]]
    assert out["episodes"][1].result["rewards"] == [1.0]


def test_an_action_class_validates_locally_with_errors_the_model_reads(endpoint, env_dir, guess):
    sys.path.insert(0, env_dir)
    try:
        from toy_envs import GuessAction
    finally:
        sys.path.remove(env_dir)
    agent = from_openenv(guess.server_url, action=GuessAction)  # the running shared server, by URL
    (episode,) = run(endpoint, agent, [{"prompt": plan_prompt({"guess": "five"}, {"guess": 5}), "secret": 5}])
    assert episode.result["rewards"] == [1.0] and episode.result["server"] == guess.server_url
    (error,) = [m["content"] for m in episode.turns[-1].request_messages if m["role"] == "tool"]
    assert error.startswith("Error: invalid action (guess: Input should be a valid integer")


@pytest.mark.slow
def test_per_episode_servers_are_fresh_and_gone_after_the_episode(endpoint, env_dir):
    agent = from_openenv("toy_envs:app", app_dir=env_dir, per_episode=True)
    episodes = run(endpoint, agent, [{"prompt": plan_prompt({"guess": 1}), "secret": 1}] * 2)
    assert [e.status for e in episodes] == ["ok", "ok"] and [e.result["reward"] for e in episodes] == [1.0, 1.0]
    urls = {e.result["server"] for e in episodes}
    assert len(urls) == 2 and agent.server_url is None
    for url in urls:
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2.0, trust_env=False)


@pytest.mark.slow
def test_a_shared_local_server_serves_every_episode_with_a_minimal_environment_and_stops_on_close(
    endpoint, env_dir, monkeypatch
):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws_secret")
    agent = from_openenv("toy_envs:app", app_dir=env_dir, env={"GUESS_LABEL": "x"}, inherit_env=["HF_TOKEN"])
    try:
        episodes = run(endpoint, agent, [{"prompt": plan_prompt({"guess": 2}), "secret": 2}] * 2)
        url = agent.server_url
        probe = httpx.get(f"{url}/probe", trust_env=False).json()
        episodes += run(endpoint, agent, [{"prompt": plan_prompt({"guess": 2}), "secret": 2}])  # a later rollout
        assert httpx.get(f"{agent.server_url}/probe", trust_env=False).json()["pid"] == probe["pid"]
    finally:
        agent.close()
    assert [e.result["reward"] for e in episodes] == [1.0] * 3
    assert {e.result["server"] for e in episodes} == {url} and agent.server_url is None
    assert wait_gone(probe["pid"])
    names = set(probe["env"])
    assert {"PATH", "GUESS_LABEL", "HF_TOKEN"} <= names
    assert "AWS_SECRET_ACCESS_KEY" not in names
    assert not {n for n in names if "OPENAI" in n or "TRL_AGENTIC" in n}  # nor the episode's key


@pytest.mark.slow
def test_a_session_refused_for_capacity_fails_its_episode_saying_how_to_serve_more(endpoint, env_dir):
    agent = from_openenv("toy_envs:single_app", app_dir=env_dir)  # one session at a time
    try:
        agent.start()
        # The first episode to connect holds the only session for 2 s (its slow guess); the other is refused.
        episodes = run(endpoint, agent, [{"prompt": plan_prompt({"guess": -2}, {"guess": 1}), "secret": 1}] * 2)
    finally:
        agent.close()
    assert sorted(e.status for e in episodes) == ["agent_error", "ok"]
    (refused,) = [e for e in episodes if e.status == "agent_error"]
    # OpenEnv's error frame says CAPACITY_REACHED; openenv-core 0.3.0's client often sees only the socket closing.
    assert "CAPACITY_REACHED" in refused.error or "ConnectionClosed" in refused.error
    assert "max_concurrent_envs=N" in refused.error and "per_episode=True" in refused.error


def test_an_episode_timeout_stops_its_own_server_even_while_it_starts(endpoint, tmp_path):
    (tmp_path / "toy_envs.py").write_text(ENVS)  # a directory of its own: no other test's server serves from it
    env_dir = str(tmp_path)
    agent = from_openenv("toy_envs:app", app_dir=env_dir, per_episode=True)
    (episode,) = run(endpoint, agent, [{"prompt": plan_prompt({"guess": 1}), "secret": 1}], timeout=1.0)
    assert episode.status == "timeout"
    # No server of this test's directory is left: the one starting for the episode was killed with it.
    deadline = time.monotonic() + 10
    while servers_of(env_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not servers_of(env_dir)


def servers_of(app_dir: str) -> list[int]:
    """The pids of the uvicorn processes serving from `app_dir` (not zombies)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                args = cmdline.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as stat:
                state = stat.read().split(")")[-1].split()[0]
        except (OSError, ValueError):
            continue
        if b"uvicorn" in args and app_dir.encode() in args and state != "Z":
            pids.append(int(entry))
    return pids


def test_environment_failures_fail_their_episode_with_the_reason(endpoint, env_dir, tmp_path):
    (unreachable,) = run(
        endpoint,
        from_openenv(
            "http://127.0.0.1:9", action_format="text", reply_to_action=lambda m: {"message": m.get("content")}
        ),
        [{"prompt": plan_prompt("hi")}],
    )
    assert unreachable.status == "agent_error" and "failed on reset" in unreachable.error
    (tmp_path / "broken_env.py").write_text("raise SystemExit('cannot load the word list')\n")
    broken = from_openenv("broken_env:app", app_dir=str(tmp_path))
    (episode,) = run(endpoint, broken, [{"prompt": plan_prompt("hi")}])
    assert episode.status == "agent_error" and "before answering /health" in episode.error
    assert "cannot load the word list" in episode.metadata["stderr_tail"]
    strict = from_openenv("toy_envs:app", app_dir=env_dir, reset_columns=["secret"])
    (episode,) = run(endpoint, strict, [{"prompt": plan_prompt("hi")}])
    assert episode.status == "agent_error" and "add them to AgenticGRPOConfig.agent_columns" in episode.error


def test_default_messages_and_protocol_from_the_action_schema():
    assert default_observation_to_message({"prompt": "Say hi.", "done": False, "reward": None}) == "Say hi."
    assert default_observation_to_message({"a": 1, "b": "x"}) == '{"a": 1, "b": "x"}'
    text = _protocol_from_schema(
        {
            "title": "EchoAction",
            "required": ["message"],
            "properties": {"message": {"type": "string"}, "metadata": {"type": "object"}},
        },
        None,
        None,
    )
    assert (text.format, text.text_field, text.tools) == ("text", "message", None)
    tool = _protocol_from_schema(
        {
            "title": "MoveAction",
            "required": ["row", "col"],
            "properties": {"row": {"type": "integer"}, "col": {"type": "integer"}},
        },
        None,
        None,
    )
    assert tool.format == "tool" and tool.tools[0]["function"]["name"] == "move"
    capacity = _environment_error("reset", "http://x", RuntimeError("Server error: full (code: CAPACITY_REACHED)"))
    assert "max_concurrent_envs=N" in str(capacity) and "per_episode=True" in str(capacity)
    with pytest.raises(ValueError, match="exactly one required string field"):
        _protocol_from_schema({"required": ["row"], "properties": {"row": {"type": "integer"}}}, "text", None)


def test_config_errors_say_how_to_fix():
    with pytest.raises(ValueError, match="a URL of a running one"):
        from_openenv("http://127.0.0.1:8000", per_episode=True)
    with pytest.raises(ValueError, match="needs '\\{port\\}'"):
        from_openenv(["python", "serve.py"])
    with pytest.raises(ValueError, match="max_turns=0"):
        from_openenv("http://127.0.0.1:8000", max_turns=0)
    with pytest.raises(ValueError, match="action_format='json'"):
        from_openenv("http://127.0.0.1:8000", action_format="json")
    with pytest.raises(ValueError, match="reward='mean'"):
        from_openenv("http://127.0.0.1:8000", reward="mean")
    custom = [lambda prompts, completions, **kwargs: [0.0] * len(prompts)]
    assert from_openenv("http://127.0.0.1:8000", reward_funcs=custom).reward_funcs == custom
    assert from_openenv("http://127.0.0.1:8000").reward_funcs == [openenv_reward]
    assert openenv_reward([[]], [[]], episodes=[Episode(id="x", status="timeout")]) == [None]


# --- training and evaluation ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_training_steps_on_the_environments_reward_and_exactly_the_sampled_tokens(tmp_path, tokenizer, guess):
    model = build_tiny_model(tokenizer)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = grpo_config(
        tmp_path, max_completion_length=64, episode_timeout=60, agent_columns=["prompt", "secret"]
    )  # 2 episodes a step, room for a scripted tool call; reset reads `secret`
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "Guess."}], "secret": 4}] * 4)
    # A group's two episodes play different plans, so their rewards (and advantages) differ: 1.0 and -0.25 + 1.0
    engine = ScriptedEngine(tokenizer, alternating_model(tokenizer, [[{"guess": 4}], [{"guess": 3}, {"guess": 4}]]))
    trainer = AgenticGRPOTrainer(
        model,
        agent=guess,
        reward_funcs=guess.reward_funcs,
        args=config,
        train_dataset=dataset,
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
        assert episode["status"] == "ok" and episode["result"]["rewards"] in ([1.0], [-0.25, 1.0])
        turns = episode["turns"]
        assert [t["prompt_source"] for t in turns] == ["rendered", "continued"][: len(turns)]
        (row,) = record["rows"]  # one linear conversation: one row
        sampled = [(tok, lp) for t in turns for tok, lp in zip(t["completion_ids"], t["logprobs"])]
        assert [
            (tok, lp) for tok, m, lp in zip(row["completion_ids"], row["env_mask"], row["logprobs"]) if m
        ] == sampled
        # Everything else in the row (the observations) is the endpoint's rendering, masked, with logprob 0.
        assert all(lp == 0.0 for m, lp in zip(row["env_mask"], row["logprobs"]) if not m)
        assert row["prompt_ids"] + row["completion_ids"] == turns[-1]["prompt_ids"] + turns[-1]["completion_ids"]
        assert row["prompt_ids"] == turns[0]["prompt_ids"]
    for step in range(2):
        group = sorted(r["episode"]["result"]["reward"] for r in records if r["step"] == step)
        assert group == [0.75, 1.0]
        advantages = {r["episode"]["result"]["reward"]: r["advantage"] for r in records if r["step"] == step}
        assert advantages[1.0] > 0 and advantages[0.75] == pytest.approx(-advantages[1.0])
    metrics = trainer.state.log_history[0]
    assert metrics["reward"] == 0.875 and metrics["rewards/openenv_reward/mean"] == 0.875


EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "envs", "openenv_env.py")


@pytest.mark.slow
def test_the_example_trains_two_steps_on_a_tiny_model(tmp_path):
    main = import_object(f"{EXAMPLE}:main")
    main(
        [
            "--model",
            "tiny:qwen2_5",
            "--steps",
            "2",
            "--num-generations",
            "2",
            "--max-tokens",
            "8",
            "--output-dir",
            str(tmp_path),
        ]
    )
    records = [json.loads(line) for line in (tmp_path / "episodes" / "episodes-rank0.jsonl").open()]
    assert [r["step"] for r in records] == [0, 0, 1, 1]
    for record in records:
        result = record["episode"]["result"]
        assert record["episode"]["status"] == "ok" and result["done"] and result["steps"] == len(result["rewards"])
        assert result["observations"][0]["feedback"] == "I have a number from 1 to 20. Your guess?"


@pytest.mark.slow
def test_the_example_suite_evaluates_with_trl_agentic_eval(tmp_path):
    from trl_agentic.scripts.eval import main

    output = tmp_path / "eval.json"
    example = EXAMPLE
    try:
        code = main(
            [
                "--task",
                f"{example}:SUITE",
                "--model",
                "tiny:qwen2_5:64x2",
                "--size",
                "2",
                "--num-samples",
                "2",
                "--max-tokens",
                "8",
                "--max-turns",
                "5",  # the example's 5 guesses
                "--output",
                str(output),
                "--no-progress",
            ]
        )
    finally:
        import_object(f"{example}:SUITE").agent.close()  # the example's shared server (else stopped at exit)
    assert code == 0
    written = json.loads(output.read_text())
    assert written["episodes"] == 4 and written["status"]["ok"] == 4
    assert set(written["scored_reward_funcs"]) == {"openenv_reward"} and written["scored_episodes"] == 4
