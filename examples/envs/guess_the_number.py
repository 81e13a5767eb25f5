"""TextArena's Guess The Number as a task: `trl-agentic demo --task examples/envs/guess_the_number.py:TASK`."""

import re

from trl_agentic.envs import gym_text_suite, textarena_game


def new_game():
    return textarena_game("GuessTheNumber-v0", min_number=1, max_number=15, max_turns=4)


def binary_search(observations: list[str]) -> str:
    """The reference solver: halve the range the hints leave."""
    low, high = 1, 15
    for guess, hint in re.findall(r"\[(\d+)\]\s*\[GAME\] The target number is (higher|lower)", "\n".join(observations)):
        if hint == "higher":
            low = int(guess) + 1
        else:
            high = int(guess) - 1
    return f"[{(low + high) // 2}]"


def random_guess(observations, rng) -> str:
    return f"[{rng.randint(1, 15)}]"


# reward="win": train on won games (1) alone; the game's own reward pays as much for ending it with invalid moves.
TASK = gym_text_suite(
    new_game, name="guess_the_number", policy=binary_search, max_steps=4, chance_policy=random_guess, reward="win"
)
