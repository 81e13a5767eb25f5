"""GRPO on an OpenEnv environment: guess the number, with hints, served the OpenEnv way and played through the endpoint.

The environment is written with OpenEnv's own server helpers (`Environment`, `Action`, `Observation`, `create_app`);
this file is also its server module: `from_openenv("openenv_env:app", ...)` serves `app` with uvicorn in a process of
its own on a free loopback port (in production: a Docker image or a Space; pass its URL instead). Each episode opens
a session on it, resets it with the row's `seed`, and asks the model for a guess until it is right or runs out of
turns; the environment's reward (1 for the right number) is the episode's reward.

```bash
python examples/envs/openenv_env.py --model Qwen/Qwen2.5-0.5B-Instruct --steps 50              # one GPU
python examples/envs/openenv_env.py --model tiny:qwen2_5 --steps 2 --max-tokens 16              # CPU smoke run
trl-agentic eval --task examples/envs/openenv_env.py:SUITE --model tiny:qwen2_5:64x2 --size 4   # evaluation
```
"""

from __future__ import annotations

import argparse
import os
import random
import re
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


HIGHEST = 20  # the secret is from 1 to HIGHEST
MAX_GUESSES = 5
SYSTEM_PROMPT = f"You are playing a game: find my secret number from 1 to {HIGHEST}. Reply with one number per turn."


# --- the environment (runs in the server process) ----------------------------------------------------------------


class GuessAction(Action):
    """A guess, as text: the first number in it counts."""

    message: str


class GuessObservation(Observation):
    feedback: str = ""


class GuessNumberEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # an instance per session, nothing shared: one server serves every episode

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._secret = 1

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._secret = random.Random(seed).randint(1, HIGHEST)
        return GuessObservation(feedback=f"I have a number from 1 to {HIGHEST}. Your guess?")

    def step(self, action: GuessAction) -> GuessObservation:
        self._state.step_count += 1
        out_of_guesses = self._state.step_count >= MAX_GUESSES
        number = re.search(r"-?\d+", action.message)
        if number is None:
            return GuessObservation(feedback="That is not a number. Your guess?", done=out_of_guesses, reward=0.0)
        guess = int(number.group())
        if guess == self._secret:
            return GuessObservation(feedback="Correct!", done=True, reward=1.0)
        hint = "higher" if guess < self._secret else "lower"
        return GuessObservation(feedback=f"No, {hint}. Your guess?", done=out_of_guesses, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    GuessNumberEnvironment, GuessAction, GuessObservation, env_name="guess_number", max_concurrent_envs=256
)


# --- the task: dataset, agent and reward (the trainer's side) ----------------------------------------------------


def build_dataset(split: str = "train", size: int = 256, seed: int = 0):
    """Rows with the instructions (`prompt`) and the environment's `seed`: even seeds train, odd seeds evaluate."""
    import datasets

    rng = random.Random(seed)
    seeds = [2 * rng.randrange(10**6) + (split == "eval") for _ in range(size)]
    prompt = [{"role": "system", "content": SYSTEM_PROMPT}]
    return datasets.Dataset.from_dict({"prompt": [prompt] * size, "seed": seeds})


def make_env(max_turns: int = MAX_GUESSES):
    from trl_agentic.envs import from_openenv

    # The agent: a session on the environment served from this file; the model's reply text is the action's `message`
    return from_openenv("openenv_env:app", app_dir=os.path.dirname(os.path.abspath(__file__)), max_turns=max_turns)


def make_suite():
    from trl_agentic.tasks import TaskSuite

    env = make_env()
    return TaskSuite(
        name="openenv_guess_number",
        tools=[],
        system_prompt=SYSTEM_PROMPT,
        build_dataset=build_dataset,
        agent=env,
        reward_funcs=env.reward_funcs,
        demonstrations=lambda n, seed=0: [],
        agent_columns=("prompt", "seed"),
    )


def __getattr__(name: str):
    # `SUITE` for `trl-agentic eval --task examples/envs/openenv_env.py:SUITE`, built on first use so that the server
    # process, which imports this file for `app`, never imports the trainer.
    if name == "SUITE":
        globals()["SUITE"] = suite = make_suite()
        return suite
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None):
    import torch

    from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
    from trl_agentic.tiny_models import load_model_and_tokenizer

    parser = argparse.ArgumentParser(description="GRPO on an OpenEnv guess-the-number environment.")
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct", help="Hub id, path, or tiny:<family>.")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--num-generations", type=int, default=8, help="Episodes per task (one task per step).")
    parser.add_argument("--max-tokens", type=int, default=64, help="Tokens per model call.")
    parser.add_argument("--output-dir", default="outputs/openenv_guess_number")
    args = parser.parse_args(argv)
    model, tokenizer = load_model_and_tokenizer(args.model)
    gpu = torch.cuda.is_available()
    config = AgenticGRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.num_generations,
        max_completion_length=args.max_tokens,
        max_turns=MAX_GUESSES,
        episode_timeout=300,
        learning_rate=1e-6,
        log_episodes=True,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=gpu,
        use_cpu=not gpu,
        agent_columns=["prompt", "seed"],  # the seed reaches the environment's reset: a group plays one secret
    )
    env = make_env()
    trainer = AgenticGRPOTrainer(
        model,
        agent=env,
        reward_funcs=env.reward_funcs,
        args=config,
        train_dataset=build_dataset("train"),
        processing_class=tokenizer,
    )
    try:
        trainer.train()
    finally:
        trainer.close()
        env.close()
    return trainer


if __name__ == "__main__":
    main()
