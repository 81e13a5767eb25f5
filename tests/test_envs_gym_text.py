"""Gym-style text games through `environment_factory` (`trl_agentic.envs.gym_text`), reference solvers recorded as
demonstrations (`trl_agentic.envs.demonstrations`), and `environment_suite`'s splits (issue 45, item 4)."""

import json
import os
import random
import re
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from datasets import Dataset

from conftest import ScriptedEngine
from trl_agentic.endpoint.launch import launch_endpoint
from trl_agentic.envs.demonstrations import with_solver
from trl_agentic.envs.environment_factory import environment_suite
from trl_agentic.envs.gym_text import OwnRandom, TextGameEnvironment, gym_text_suite, play, split_seeds
from trl_agentic.evaluation import score_episodes
from trl_agentic.pipeline.config import SMOKE_OVERRIDES, PipelineConfig, warm_start_goal, warm_start_key
from trl_agentic.pipeline.stages import example_line
from trl_agentic.rollout.agents import resolve_agent
from trl_agentic.rollout.runner import run_episodes, run_rollout
from trl_agentic.tiny_models import build_tiny_tokenizer


REPO = Path(__file__).resolve().parents[1]


class NumberGame:
    """A gym-style game (Gymnasium's API) that draws its number from Python's global `random` after seeding it, as
    TextArena's games do; `pause` widens the window between the seed and the draw, `barrier` makes every game seed
    before any draws."""

    def __init__(self, pause: float = 0.0, barrier=None):
        self.pause, self.barrier = pause, barrier

    def reset(self, seed=None):
        random.seed(seed)
        time.sleep(self.pause)
        if self.barrier is not None:
            self.barrier.wait()
        self.target, self.guesses = random.randint(1, 15), 0
        return "Guess a number from 1 to 15, e.g. 7.", {}

    def step(self, action):
        self.guesses += 1
        guess = int(re.sub(r"\D", "", action) or 0)
        if guess == self.target:
            return "Correct!", 1.0, True, False, {}
        return ("Higher." if guess < self.target else "Lower."), 0.0, False, self.guesses >= 4, {}


def binary_search(observations):
    """The reference solver: the hints say where the number is; observations alternate with nothing else."""
    low, high = 1, 15
    guess = (low + high) // 2
    for hint in observations[1:]:
        if hint == "Higher.":
            low = guess + 1
        elif hint == "Lower.":
            high = guess - 1
        guess = (low + high) // 2
    return str(guess)


def number_suite(**kwargs):
    return gym_text_suite(NumberGame, name="number", policy=binary_search, max_steps=4, **kwargs)


# --- environment_suite's splits: a held-out split that is really held out ---


class CountEnv:
    def reset(self, **row):
        self.count = 0

    def add(self, step: int) -> int:
        """Add to the count.

        Args:
            step: How much to add.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count == 3)


def rows(targets):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Reach {t}."}] for t in targets], "t": targets})


def test_environment_suite_never_serves_its_eval_rows_as_the_training_split():
    # The bug: `build_dataset` returned `dataset` whatever the split, so the demo's "held-out" success was measured on
    # the tasks it trained on. One dataset is the eval split; asking for a training split is refused.
    suite = environment_suite(CountEnv, rows([1, 2, 3]), name="count")
    assert suite.build_dataset(split="eval")["t"] == [1, 2, 3]
    with pytest.raises(ValueError, match="has no training split.*train_dataset="):
        suite.build_dataset(split="train", size=2)
    with pytest.raises(ValueError, match="split='test'"):
        suite.build_dataset(split="test")
    # a row in both splits is refused, naming it
    with pytest.raises(ValueError, match="1 rows of train_dataset are also in dataset.*row 1"):
        environment_suite(CountEnv, rows([1, 2, 3]), train_dataset=rows([4, 3, 5]))
    suite = environment_suite(CountEnv, rows([1, 2, 3]), train_dataset=rows([4, 5, 6, 7]))
    assert suite.build_dataset(split="train")["t"] == [4, 5, 6, 7]
    train = suite.build_dataset(split="train", size=2, seed=0)["t"]
    assert len(train) == 2 and set(train) <= {4, 5, 6, 7}
    assert set(suite.build_dataset(split="eval", size=2, seed=1)["t"]) <= {1, 2, 3}


def test_gym_suite_splits_draw_disjoint_game_seeds():
    suite = number_suite()
    train = suite.build_dataset(split="train", size=300, seed=0)
    held_out = suite.build_dataset(split="eval", size=300, seed=0)
    assert not set(train["seed"]) & set(held_out["seed"])
    assert len(set(train["seed"])) == 300 and split_seeds("train", 300, seed=0) == train["seed"]
    assert suite.build_dataset(split="eval", size=3, seed=0)["seed"] == held_out["seed"][:3]  # deterministic
    assert train[0]["prompt"] == [{"role": "user", "content": "Guess a number from 1 to 15, e.g. 7."}]
    with pytest.raises(ValueError, match="split='validation'.*\\['eval', 'train'\\]"):
        suite.build_dataset(split="validation", size=2)


def test_the_demo_plan_holds_out_its_eval_games():
    from trl_agentic.pipeline.plan import make_plan

    plan = make_plan(number_suite(), PipelineConfig(**SMOKE_OVERRIDES), use_cache=False)
    eval_seeds = set(plan.eval_tasks["seed"])
    trained = set(plan.grpo_tasks["seed"]) | {task["seed"] for task in plan.validation_tasks}
    assert eval_seeds and trained and not eval_seeds & trained
    assert all(seed >= 1_000_000_000 for seed in eval_seeds) and all(seed < 1_000_000_000 for seed in trained)


# --- Python's global `random`, shared by concurrent episodes ---


def test_concurrent_games_each_draw_from_their_own_random_state():
    seeds = list(range(16))
    alone = [play(NumberGame, binary_search, seed, 4).game.target for seed in seeds]
    assert alone == [random.Random(seed).randint(1, 15) for seed in seeds]

    barrier = threading.Barrier(len(seeds), timeout=60)

    def raw(seed):
        game = NumberGame(barrier=barrier)
        game.reset(seed=seed)
        return game.target

    with ThreadPoolExecutor(
        16
    ) as pool:  # the hazard: games on threads draw from each other's seeding (all seed, then draw)
        assert list(pool.map(raw, seeds)) != alone

    def wrapped(seed):
        environment = TextGameEnvironment(lambda: NumberGame(pause=0.02), max_steps=4)
        environment.reset(seed=seed)
        return environment.game.target

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(wrapped, seeds)) == alone
    # and the caller's own stream is left as it was
    random.seed(123)
    expected = random.Random(123).random()
    with OwnRandom(5).active():
        random.random()
    assert random.random() == expected


# --- The done flag, over the real endpoint ---


def test_won_games_end_on_the_done_flag_without_another_model_call():
    tokenizer = build_tiny_tokenizer("qwen2_5")
    suite = number_suite()

    def respond(prompt_ids):  # the policy behind the endpoint: binary search, read from the rendered prompt
        text = tokenizer.decode(prompt_ids)
        hints = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)
        action = binary_search(["start", *hints])
        return "<tool_call>\n" + json.dumps({"name": "act", "arguments": {"action": action}}) + "\n</tool_call>"

    tasks = [dict(row) for row in suite.build_dataset(split="eval", size=6, seed=0)]
    moves = [len(play(NumberGame, binary_search, task["seed"], 4).actions) for task in tasks]
    assert max(moves) == 4 and min(moves) < 4
    # max_turns = the longest game's moves: a won game must not need one more reply (it was `limit_exceeded`)
    server = launch_endpoint(ScriptedEngine(tokenizer, respond), tokenizer, max_tokens=64, max_turns=max(moves))
    try:
        episodes = run_rollout(
            run_episodes(
                server, resolve_agent(suite.agent), [{"prompt": t["prompt"], "seed": t["seed"]} for t in tasks]
            )
        )
    finally:
        server.stop()
    assert [e.status for e in episodes] == ["ok"] * 6, episodes[0].error
    assert [len(e.turns) for e in episodes] == moves  # one model call per move, none after the winning move
    assert [e.result["ended_on_done"] for e in episodes] == [True] * 6
    rewards, _, _ = score_episodes(suite.reward_funcs, tasks, episodes, suite.reward_weights)
    assert rewards == [1.0] * 6


# --- Reference solvers: recorded against the real environment ---


def test_demonstrations_are_the_solvers_winning_plays_on_training_games():
    suite = number_suite()
    demonstrations = suite.demonstrations(8, seed=0)
    assert len(demonstrations) == 8
    train_targets = {}
    for row in suite.build_dataset(split="train", size=32, seed=0):
        train_targets[row["seed"]] = play(NumberGame, binary_search, row["seed"], 4)
    played = list(train_targets.values())[:8]  # the solver wins every game: the first 8 rows
    for demonstration, game in zip(demonstrations, played):
        messages = demonstration["messages"]
        assert messages[0] == {"role": "user", "content": "Guess a number from 1 to 15, e.g. 7."}
        calls = [m["tool_calls"][0]["function"] for m in messages if m["role"] == "assistant"]
        assert calls == [{"name": "act", "arguments": {"action": a}} for a in game.actions]
        # the game's answers between the moves; the winning move is the last message (the episode ended on `done`)
        assert [m["content"] for m in messages if m["role"] == "tool"] == game.observations[1:-1]
        assert messages[-1]["role"] == "assistant"
        assert [t["function"]["name"] for t in demonstration["tools"]] == ["act"]


def test_any_suite_takes_a_scripted_solver():
    # environment_suite (and with_solver for any adapter's suite): solver(messages, tools) -> the next reply
    def solver(messages, tools):
        assert [t["function"]["name"] for t in tools] == ["add"]
        done = sum(1 for m in messages if m["role"] == "tool")
        return {"name": "add", "arguments": {"step": 1}} if done < 3 else "Reached 3."

    suite = environment_suite(CountEnv, rows([1]), train_dataset=rows([3, 4, 5]), solver=solver, name="count")
    (demonstration,) = suite.demonstrations(1)
    roles = [m["role"] for m in demonstration["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant", "tool", "assistant"]
    assert [m["content"] for m in demonstration["messages"] if m["role"] == "tool"] == ["1", "2", "3"]
    assert demonstration["messages"][-1] == {"role": "assistant", "content": "Reached 3."}

    def loser(messages, tools):
        return "No."

    with pytest.raises(ValueError, match="succeeded on 0 of 3 training-split tasks of 'count'"):
        with_solver(suite, loser).demonstrations(2)


# --- The warm start's stop rule and the printed examples ---


def test_the_warm_start_stops_above_the_tasks_chance_level():
    config = PipelineConfig()
    assert warm_start_goal(config, number_suite()) == 0.25  # chance unknown: taken as 0
    guess = number_suite(chance_success=0.27)
    assert warm_start_goal(config, guess) == pytest.approx(0.27 + 0.25 * 0.73)
    measured = number_suite(chance_policy=lambda observations, rng: str(rng.randint(1, 15)))
    assert 0.15 < measured.chance_success < 0.4  # 4 random guesses of 15 (repeats allowed)
    assert warm_start_key(config, guess, [], []) != warm_start_key(config, number_suite(), [], [])
    with pytest.raises(ValueError, match="chance_success=1.0"):
        warm_start_goal(config, number_suite(chance_success=1.0))


def test_printed_examples_show_the_reward():
    line = example_line({"question": "Guess " + "x" * 200, "tool_calls": ['{"action": "8"}'], "answer": None,
                         "expected": None, "reward": 1.0})  # fmt: skip
    assert (
        line.endswith("""-> calls ['{"action": "8"}'], reward 1""") and "(expected" not in line and "None" not in line
    )
    assert len(line) < 160
    line = example_line(
        {"question": "What is 2 + 3?", "tool_calls": [], "answer": "5", "expected": 5, "reward": None,
         "status": "limit_exceeded"}
    )  # fmt: skip
    assert line == "e.g. 'What is 2 + 3?' -> calls [] -> '5' (expected 5), unscored (limit_exceeded)"


# --- TextArena, a popular library of text games ---


def test_textarena_games_play_through_the_gym_api():
    pytest.importorskip("textarena")
    from trl_agentic.envs.gym_text import textarena_game

    game = textarena_game("GuessTheNumber-v0", min_number=1, max_number=15, max_turns=4)
    observation, info = game.reset(seed=1)
    assert observation.startswith("[GAME] You are Player 0. You are playing Guess The Number.") and info == {}
    target = game.env.game_number
    guess = 8 if target != 8 else 4
    text, reward, terminated, truncated, _ = game.step(f"[{guess}]")
    hint = "higher" if guess < target else "lower"
    assert (text, reward, terminated, truncated) == (f"[Player] [{guess}]\n[GAME] The target number is {hint}.", 0.0,
                                                     False, False)  # fmt: skip
    text, reward, terminated, truncated, _ = game.step(f"[{target}]")
    assert (reward, terminated, truncated) == (1.0, True, False) and "Congratulations!" in text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_gym_page_trains_through_the_demo_and_evaluates(tmp_path):
    # docs/environments_gym.md's code, as written: `trl-agentic demo --task ... --smoke` (2 GRPO steps) and the
    # printed `trl-agentic eval` command.
    pytest.importorskip("textarena")
    page = (REPO / "docs" / "environments_gym.md").read_text()
    blocks = re.findall(r"```(\w*)\n(.*?)```", page, re.S)
    (module,) = [body for language, body in blocks if language == "python" and "TASK = gym_text_suite(" in body]
    assert len(module.strip().splitlines()) <= 40
    assert module == (REPO / "examples" / "envs" / "guess_the_number.py").read_text()
    (tmp_path / "guess.py").write_text(module)
    lines = [line.split("  #")[0] for _, body in blocks for line in body.splitlines()]
    (command,) = [
        line for line in lines if line.startswith("trl-agentic demo --task guess.py:TASK") and "--smoke" in line
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    run = dict(cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
    done = subprocess.run(
        [sys.executable, "-m", "trl_agentic.cli", *shlex.split(command)[1:], "--cache-dir", str(tmp_path / "cache")],
        **run,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[5/5] Results" in done.stdout and "phase 2 stops at" in done.stdout and "(expected None)" not in done.stdout
    assert re.search(r"e\.g\. .* -> calls .*, (reward [\d.]+|unscored)", done.stdout)
    (summary_path,) = tmp_path.glob("outputs/*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["settings"]["steps"] == 2 and summary["smoke"] is True
    evaluated = subprocess.run([sys.executable, "-m", "trl_agentic.cli", *shlex.split(summary["commands"]["eval"])[1:],
                                "--no-progress", "--output", str(tmp_path / "eval.json")], **run)  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    metrics = json.loads((tmp_path / "eval.json").read_text())
    assert metrics["split"] == "eval" and metrics["episodes"] == summary["after"]["episodes"]
    assert metrics["success"] == summary["after"]["success"]


def test_reward_win_trains_on_what_held_out_success_counts():
    """TextArena's Guess The Number pays a game ended by invalid moves the same partial credit as a close loss (1 -
    distance / range of the last valid guess): `[8]` then `[8]` twice ends the game at once with 0.5-0.93. A real run on
    the game's reward learned exactly that (docs/environments_gym.md). `reward="win"` scores 1 for a won game, 0
    otherwise: what held-out success counts."""
    pytest.importorskip("textarena")
    from trl_agentic.envs.gym_text import textarena_game

    def new_game():
        return textarena_game("GuessTheNumber-v0", min_number=1, max_number=15, max_turns=4)

    seed = split_seeds("train", 1)[0]
    target = TextGameEnvironment(new_game, 4)
    target.reset(seed=seed)
    hidden = target.game.env.game_number
    guess = 8 if hidden != 8 else 4
    for mode, expected in (("game", 1 - abs(guess - hidden) / 14), ("win", 0.0)):
        environment = TextGameEnvironment(new_game, 4, reward=mode)
        environment.reset(seed=seed)
        texts = [environment.act(f"[{guess}]") for _ in range(3)]  # a guess, then the same guess twice: invalid
        assert environment.done and not environment.truncated and "already guessed" in texts[1]
        assert (
            environment.total_reward == pytest.approx(1 - abs(guess - hidden) / 14) and environment.total_reward > 0.4
        )
        assert environment.get_reward() == pytest.approx(expected)
    for mode in ("game", "win"):  # a won game scores 1 either way
        environment = TextGameEnvironment(new_game, 4, reward=mode)
        environment.reset(seed=seed)
        environment.act(f"[{hidden}]")
        assert environment.done and environment.get_reward() == 1.0
    suite = gym_text_suite(new_game, name="g", max_steps=4, reward="win", chance_success=0.24)
    assert suite.reward_weights == [1.0]
    with pytest.raises(ValueError, match="reward='won'.*'game' .*'win'"):
        gym_text_suite(new_game, name="g", max_steps=4, reward="won")
