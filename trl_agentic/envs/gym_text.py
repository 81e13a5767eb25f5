"""Gym-style text games as tasks: `reset`/`step`, text observations, a done flag, a reward.

[`gym_text_suite`] turns a game into a [`TaskSuite`] that trains with `trl-agentic demo --task`, `trl-agentic train`
and `AgenticGRPOTrainer`, and evaluates with `trl-agentic eval`: the model plays through one tool, `act(action)`, each
call one `step`; the episode ends on the game's done flag (no extra model reply), and the game's summed reward is the
score. A reference `policy` (observations so far -> next action) gives the warm start its demonstrations, recorded
from its play against the real game through the suite's own agent (`trl_agentic.envs.demonstrations`).

A game is anything with (the Gymnasium API, text in and out):

- `reset(seed=...)` -> the first observation (a str), or `(observation, info)`;
- `step(action: str)` -> `(observation, reward, terminated, truncated, info)`, or the older `(observation, reward,
  done, info)`.

TextArena's games have another API; [`textarena_game`] adapts one (`pip install 'trl-agentic[textarena]'`).

Each task is a game seed: the training and eval splits draw from disjoint seed ranges, so held-out success is
measured on games never trained on (a game with few distinct instances, such as a number from 1 to 15, repeats
instances across seeds: what is held out is then the seed, not the hidden number).

Many games draw from Python's global `random` (TextArena's seed it in `reset`); episodes run concurrently on threads,
so every call into a game runs under one lock with the episode's own random state swapped in (seeded from the game's
seed): each game plays exactly as it would alone.

Example:

```python
>>> TASK = gym_text_suite(lambda: textarena_game("GuessTheNumber-v0", max_number=15), policy=binary_search,
...                       name="guess", max_steps=4)
>>> TASK.build_dataset(split="eval", size=2)["seed"]
[1262410917, 1535848491]
```
"""

from __future__ import annotations

import contextlib
import functools
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .demonstrations import record_demonstrations
from .environment_factory import EnvironmentAgent


# A zero-argument callable returning a new game (an object with `reset(seed=...)` and `step(action)`).
GameFactory = Callable[[], Any]

# `policy(observations) -> action`: the reference solver; `observations[0]` is the first observation.
Policy = Callable[[list[str]], str]

# The seed ranges of the two splits: disjoint, so no eval game is a training game.
SPLIT_SEEDS = {"train": (0, 1_000_000_000), "eval": (1_000_000_000, 2_000_000_000)}

# Every call into a game holds this lock, with the episode's own `random` state swapped in.
_GAME_LOCK = threading.RLock()


class OwnRandom:
    """A game's own state of Python's global `random`, seeded from its seed: [`OwnRandom.active`] swaps it in (under
    one process-wide lock) for each call into the game, so concurrent episodes never draw from each other's stream.

    Example:

    ```python
    >>> own = OwnRandom(3)
    >>> with own.active():
    ...     random.random() == random.Random(3).random()
    True
    ```
    """

    def __init__(self, seed: int | None):
        self.state = random.Random(seed).getstate()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with _GAME_LOCK:
            saved = random.getstate()
            random.setstate(self.state)
            try:
                yield
            finally:
                self.state = random.getstate()
                random.setstate(saved)


def _observation(value: Any) -> str:
    return value if isinstance(value, str) else str(value)


def reset_game(game: Any, seed: int) -> str:
    """`game.reset(seed=seed)`'s first observation, whether it returns it alone or with `info` (Gymnasium)."""
    out = game.reset(seed=seed)
    return _observation(out[0] if isinstance(out, tuple) else out)


REWARD_MODES = ("game", "win")


def step_game(game: Any, action: str) -> tuple[str, float, bool]:
    """`game.step(action)` as `(observation, reward, done)`, from Gymnasium's 5-tuple or gym's 4-tuple."""
    out = game.step(action)
    if not isinstance(out, tuple) or len(out) not in (4, 5):
        raise ValueError(
            f"{type(game).__name__}.step returned {out!r}: expected Gymnasium's (observation, reward, terminated, "
            "truncated, info) or gym's (observation, reward, done, info). Wrap the game (see textarena_game)."
        )
    done = bool(out[2] or out[3]) if len(out) == 5 else bool(out[2])
    return _observation(out[0]), float(out[1] or 0.0), done


class TextGameEnvironment:
    """One game as a TRL `environment_factory` environment: `reset(seed=...)` starts the row's game, the one tool
    `act` plays a move, `done` ends the episode without another model reply, `get_reward()` is the game's summed
    reward (`reward="game"`) or whether the game was won (`"win"`).

    Args:
        make_game: a zero-argument callable returning a new game.
        max_steps: most moves per game (`None`: the game's own limit); the move that reaches it ends the game
            (`truncated`).
        reward: what `get_reward()` returns: `"game"`, the game's summed reward (`total_reward`); `"win"`, 1.0 when
            it reaches `success_reward`, else 0.0.
        success_reward: the summed reward that counts as a win.
    """

    def __init__(
        self, make_game: GameFactory, max_steps: int | None = None, reward: str = "game", success_reward: float = 1.0
    ):
        if reward not in REWARD_MODES:
            raise ValueError(
                f"reward={reward!r}: expected 'game' (the game's summed reward) or 'win' (1 for a won game, else 0)."
            )
        self.make_game, self.max_steps, self.reward, self.success_reward = make_game, max_steps, reward, success_reward
        self.game, self.own_random = None, None
        self.observations: list[str] = []
        self.actions: list[str] = []
        self.total_reward = 0.0
        self.done = False  # read by `EnvironmentAgent`: the episode ends without another model call
        self.truncated = False

    def reset(self, seed: int, **row: Any) -> None:
        """Start the row's game (`seed`); its first observation is the prompt already, nothing is appended."""
        self.own_random = OwnRandom(seed)
        with self.own_random.active():
            self.game = self.make_game()
            self.observations = [reset_game(self.game, seed)]
        self.actions, self.total_reward, self.done, self.truncated = [], 0.0, False, False

    def act(self, action: str) -> str:
        """Make your move in the game.

        Args:
            action: Your move, written as the game's instructions ask.

        Returns:
            What the game answers.
        """
        if self.done:
            raise ValueError("The game is over.")
        with self.own_random.active():
            observation, reward, done = step_game(self.game, str(action))
        self.actions.append(str(action))
        self.observations.append(observation)
        self.total_reward += reward
        self.truncated = not done and self.max_steps is not None and len(self.actions) >= self.max_steps
        self.done = done or self.truncated
        return observation

    def get_reward(self) -> float:
        if self.reward == "win":
            return float(self.total_reward >= self.success_reward)
        return self.total_reward


def play(make_game: GameFactory, policy: Callable[[list[str]], str], seed: int, max_steps: int | None = None):
    """Play one game with `policy` directly (no model, no endpoint); return its [`TextGameEnvironment`] (its
    `actions`, `observations`, `total_reward`). A loop without `max_steps` stops after 1,000 moves."""
    environment = TextGameEnvironment(make_game, max_steps)
    environment.reset(seed=seed)
    while not environment.done and len(environment.actions) < (max_steps or 1000):
        environment.act(policy(list(environment.observations)))
    return environment


def measure_success(
    make_game: GameFactory,
    policy: Callable[[list[str]], str],
    games: int = 200,
    max_steps: int | None = None,
    success_reward: float = 1.0,
    seed: int = 0,
) -> float:
    """The share of `games` training-split games `policy` wins (summed reward >= `success_reward`): a random policy's
    is the game's chance level, what [`gym_text_suite`]'s `chance_policy` measures."""
    seeds = split_seeds("train", games, seed)
    wins = sum(play(make_game, policy, s, max_steps).total_reward >= success_reward for s in seeds)
    return wins / games


def split_seeds(split: str, size: int, seed: int = 0) -> list[int]:
    """`size` distinct game seeds of `split` (`"train"` or `"eval"`: disjoint ranges), drawn with `seed`."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"split={split!r}: a gym text suite has the splits {sorted(SPLIT_SEEDS)}.")
    low, high = SPLIT_SEEDS[split]
    return random.Random(f"{split}:{seed}").sample(range(low, high), size)


def gym_text_suite(
    make_game: GameFactory,
    *,
    name: str,
    policy: Policy | None = None,
    max_steps: int | None = None,
    system_prompt: str = "",
    success_reward: float = 1.0,
    chance_policy: Callable[[list[str], random.Random], str] | None = None,
    chance_success: float | None = None,
    default_size: int = 256,
    reward: str = "game",
):
    """A [`TaskSuite`] playing a gym-style text game through the endpoint: each row is a game seed, its prompt the
    game's first observation; the model plays with the tool `act(action)`; the score is the game's summed reward.

    Args:
        make_game: a zero-argument callable returning a new game (`reset(seed=...)`, `step(action)`, the module's
            docstring).
        name: the task's name (logs, cache keys).
        policy: the reference solver, `policy(observations) -> action` (`observations[0]` the first observation, then
            what each move returned): its winning plays, recorded through the suite's agent against the real game,
            are the warm start's demonstrations. Without it the suite evaluates and trains but cannot warm-start.
        max_steps: most moves per game (`None`: the game's limit). Keep the endpoint's `max_turns` at least as large,
            or a game still running is cut as `limit_exceeded`.
        system_prompt: a system message before the first observation (`""`: none).
        success_reward: the summed reward that counts as a win (the evaluator's success threshold is 1.0: a game whose
            win pays more is still a success; one whose win pays less needs its reward rescaled).
        chance_policy: a random player, `chance_policy(observations, rng) -> action`: its measured win rate over 200
            training games becomes `chance_success`, which the demo pipeline's warm start sets its stop rule above.
        chance_success: the game's chance level, when known (overrides `chance_policy`).
        default_size: rows `build_dataset` makes when no `size` is given.
        reward: what GRPO trains on: `"game"`, the game's summed reward; `"win"`, 1 for a won game (summed reward at
            least `success_reward`), else 0: what held-out success counts. Take `"win"` when the game's own reward
            pays partial credit that a policy can collect without playing: TextArena's Guess The Number pays a game
            ended by invalid moves (the same guess three times) as much as a close loss, and GRPO on it learned to
            do just that (docs/environments_gym.md).

    Example:

    ```python
    >>> TASK = gym_text_suite(make_game, name="guess", policy=binary_search, max_steps=4,
    ...                       chance_policy=lambda observations, rng: str(rng.randint(1, 15)))
    ```
    """
    from datasets import Dataset

    from ..tasks import TaskSuite

    if reward not in REWARD_MODES:
        raise ValueError(
            f"reward={reward!r}: expected 'game' (the game's summed reward) or 'win' (1 for a won game, else 0)."
        )
    factory = functools.partial(TextGameEnvironment, make_game, max_steps, reward=reward, success_reward=success_reward)
    agent = EnvironmentAgent(factory, max_tool_calling_iterations=max_steps)

    def build_dataset(split: str = "train", size: int | None = None, seed: int = 0, **knobs: Any):
        if knobs:
            raise ValueError(f"Task {name!r} has no difficulty knobs; got {sorted(knobs)}.")
        seeds = split_seeds(split, default_size if size is None else size, seed)
        prompts = []
        for game_seed in seeds:
            environment = TextGameEnvironment(make_game, max_steps)
            environment.reset(seed=game_seed)
            system = [{"role": "system", "content": system_prompt}] if system_prompt else []
            prompts.append([*system, {"role": "user", "content": environment.observations[0]}])
        return Dataset.from_dict({"prompt": prompts, "seed": seeds})

    def solver(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        first = next(i for i, m in enumerate(messages) if m["role"] == "user")
        observations = [str(messages[first]["content"])] + [
            str(m["content"]) for m in messages[first + 1 :] if m["role"] == "tool"
        ]
        return {"name": "act", "arguments": {"action": str(policy(observations))}}

    def demonstrations(n: int, seed: int = 0, **knobs: Any) -> list[dict[str, Any]]:
        if policy is None:
            raise ValueError(
                f"Task {name!r} has no reference solver: give gym_text_suite a policy=fn(observations) -> action, "
                "whose winning plays become the warm start's demonstrations."
            )
        threshold = success_reward if reward == "game" else 1.0
        return record_demonstrations(suite, solver, n, seed, success_threshold=threshold, **knobs)

    if chance_success is None and chance_policy is not None:
        rng = random.Random(0)
        chance_success = measure_success(
            make_game, lambda observations: chance_policy(observations, rng), 200, max_steps, success_reward
        )
    suite = TaskSuite(
        name=name,
        tools=agent.tool_schemas[None],
        system_prompt=system_prompt,
        build_dataset=build_dataset,
        agent=agent,
        reward_funcs=agent.reward_funcs(),
        demonstrations=demonstrations,
        agent_columns=("prompt", "seed"),
        reward_weights=[1.0 / success_reward if reward == "game" else 1.0],
        chance_success=chance_success,
    )
    return suite


class TextArenaGame:
    """A TextArena single-player game with the Gymnasium API: `reset(seed=...)` returns the first observation,
    `step(action)` returns `(new text, reward, terminated, truncated, info)`; the reward (TextArena's, given when the
    game ends) and the closing reason arrive with the last move. Built by [`textarena_game`]."""

    def __init__(self, env: Any):
        self.env = env
        self.seen = 0  # characters of TextArena's (cumulative) observation already returned

    def _new_text(self) -> str:
        _, observation = self.env.get_observation()
        text = observation if isinstance(observation, str) else str(observation)
        new, self.seen = text[self.seen :], len(text)
        return new.strip()

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        self.env.reset(num_players=1, seed=seed)
        self.seen = 0
        return self._new_text(), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        done, info = self.env.step(action)
        if not done:
            return self._new_text(), 0.0, False, False, dict(info or {})
        rewards, game_info = self.env.close()
        reward = float((rewards or {}).get(0, 0.0))
        reason = str((game_info or {}).get(0, {}).get("reason", ""))
        return "\n".join(part for part in (self._new_text(), reason) if part), reward, True, False, dict(info or {})


def textarena_game(env_id: str, **kwargs: Any) -> TextArenaGame:
    """A TextArena game (`textarena.make(env_id, **kwargs)`, single-player) with the Gymnasium text API.

    Example:

    ```python
    >>> game = textarena_game("GuessTheNumber-v0", max_number=15)
    >>> game.reset(seed=0)[0][:40]
    '[GAME] You are Player 0. You are playing'
    ```
    """
    try:
        import textarena
    except ImportError as error:
        raise ImportError("textarena_game needs TextArena: pip install 'trl-agentic[textarena]'") from error
    return TextArenaGame(textarena.make(env_id, **kwargs))


__all__ = [
    "OwnRandom",
    "TextArenaGame",
    "TextGameEnvironment",
    "gym_text_suite",
    "measure_success",
    "play",
    "split_seeds",
    "textarena_game",
]
