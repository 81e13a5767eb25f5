"""verifiers 0.3 environments as task suites: `from_verifiers(env)` or `get_task("verifiers:<env-id>")`.

A [verifiers](https://github.com/PrimeIntellect-ai/verifiers) `Environment` (the Environments Hub behind prime-rl)
brings three things, and [`from_verifiers`] maps each onto ours:

1. its dataset (`env.get_dataset()` / `env.get_eval_dataset()`: a `prompt` column of chat messages, `example_id`,
   `answer`, `info`, ...) becomes `suite.build_dataset(split, size, seed)`;
2. its own rollout loop (`env.rollout(input, client, model, sampling_args)`: `SingleTurnEnv`, `ToolEnv`,
   `MultiTurnEnv`, ...) becomes the agent: each episode runs it unchanged, handing it this episode's
   `openai.AsyncOpenAI` client (wrapped in verifiers' own `OpenAIChatCompletionsClient`) and the model name
   `"policy"`, so every model call it makes goes through the endpoint and is recorded token by token;
3. its rubric (weighted reward functions, `vf.Rubric` or a `vf.RubricGroup` of them, including the metrics that
   `MultiTurnEnv`/`ToolEnv` add with weight 0) becomes one TRL-signature reward function per rubric function, named
   like it (TRL logs each as `rewards/<name>/mean`), with the rubric's weights in `suite.reward_weights`. Each is
   scored by its own rubric, as `Rubric.score_rollout` scores it (same arguments: `prompt`, `completion`, `answer`,
   `state`, `info`, `parser`, ...; an exception scores 0.0 and is logged, as in verifiers), on the rollout's live
   `State`. Group functions (plural arguments: `states`, `completions`, ...) score the episodes of one `example_id`
   together.

The verifiers 0.3.x half of `trl_agentic.envs.verifiers` (which imports it when verifiers 0.3.1 to 0.3.x is
installed; verifiers 0.4's `verifiers.v1` is `verifiers_v1.py`). Verified against verifiers 0.3.1 (its classic
`vf.Environment` API, `verifiers.legacy`): `pip install 'trl-agentic[verifiers-legacy]'` (it pins `mcp<2`: install it
in an environment without the `[mcp]` extra). Which environment types run, and what an environment can see:
docs/envs_verifiers.md.

Example:

```python
>>> import verifiers as vf
>>> from trl_agentic.envs import from_verifiers
>>> suite = from_verifiers(vf.load_environment("my-env"))  # or get_task("verifiers:my-env")
>>> config = AgenticGRPOConfig(..., reward_weights=suite.reward_weights, agent_columns=list(suite.agent_columns))
>>> trainer = AgenticGRPOTrainer(model, agent=suite.agent, reward_funcs=suite.reward_funcs, args=config,
...                              train_dataset=suite.build_dataset("train", size=256))
```
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import datasets

from ..endpoint import SERVED_MODEL_NAME
from ..tasks import TaskSuite


try:
    import verifiers as vf
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError(
        "trl_agentic.envs.verifiers needs the `verifiers` package: pip install 'trl-agentic[verifiers]'."
    ) from error
if not hasattr(vf, "Environment"):  # pragma: no cover - imported through verifiers.py, which checks the version
    raise ImportError("trl_agentic.envs.verifiers_legacy runs verifiers 0.3.x; import trl_agentic.envs.verifiers.")
from verifiers.legacy.clients import OpenAIChatCompletionsClient
from verifiers.legacy.utils.error_utils import ErrorChain


# verifiers errors that are the policy's doing (an empty reply, a tool call the environment could not parse or run):
# the rollout is scored, as verifiers scores it. Any other error left in `state["error"]` (the endpoint refused the
# call, a sandbox failed) says nothing about the policy: the episode fails (`agent_error`) and is not scored.
POLICY_ERRORS = (vf.InvalidModelResponseError, vf.ToolError)


class VerifiersResult(dict):
    """What a [`VerifiersAgent`] episode returns (`episode.result`): a summary of the rollout for the episode log
    (`completion`, `num_turns`, `stop_condition`, `is_truncated`, `error`), with verifiers' live `State` as the
    attribute `state` (never written to the log)."""

    state: Any = None


def verifiers_state(episode: Any) -> Any:
    """The live verifiers `State` of an episode a [`VerifiersAgent`] ran, or `None` (the episode failed before the
    agent returned, or another agent ran it)."""
    result = getattr(episode, "result", None)
    return result.state if isinstance(result, VerifiersResult) else None


@dataclass
class VerifiersAgent:
    """An agent that runs a verifiers environment's own rollout loop over the episode's endpoint.

    Args:
        env: a `vf.Environment` (its `rollout` is called once per episode, with the episode's task row).
        model: the model name the rollout sends (`"policy"`, the endpoint's name).
        sampling_args: what the rollout passes with each call (default: the environment's `sampling_args`, as
            `env.generate` does). The endpoint applies the trainer's sampling settings whatever the request says.
        columns: the dataset columns the rollout needs in its task (`from_verifiers` sets all of the dataset's): an
            episode whose task lacks one fails with how to fix it, rather than being scored without its `answer`.

    Example:

    ```python
    >>> agent = VerifiersAgent(vf.load_environment("my-env"))
    >>> result = await agent(openai.AsyncOpenAI(base_url=..., api_key=...), dataset[0])
    >>> result["stop_condition"], result.state["completion"][-1].content
    ('no_tools_called', 'The answer is 5.')
    ```
    """

    env: Any
    model: str = SERVED_MODEL_NAME
    sampling_args: dict[str, Any] | None = None
    columns: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.env, vf.Environment):
            raise ValueError(
                f"VerifiersAgent needs a verifiers Environment (vf.SingleTurnEnv, vf.ToolEnv, ...), got a "
                f"{type(self.env).__name__}. Load one with vf.load_environment('<env-id>')."
            )
        self.__name__ = f"verifiers:{self.env.env_id or type(self.env).__name__}"  # named in logs like a function

    async def __call__(self, client: Any, task: dict[str, Any]) -> VerifiersResult:
        missing = [column for column in self.columns if column not in task]
        if missing:
            # The rubric scores what the rollout saw: without `answer` every reward would be a silent 0.
            raise ValueError(
                f"The verifiers environment reads the whole dataset row, but the episode's task lacks {missing}: give "
                "the agent every column, AgenticGRPOConfig(agent_columns=list(suite.agent_columns))."
            )
        sampling_args = dict(self.env.sampling_args if self.sampling_args is None else self.sampling_args)
        state = await self.env.rollout(dict(task), OpenAIChatCompletionsClient(client), self.model, sampling_args)
        error = state.get("error")
        if error is not None and not isinstance(error, POLICY_ERRORS):
            raise RuntimeError(f"The verifiers rollout failed: {ErrorChain(error)!r}") from error
        result = VerifiersResult(
            completion=[message.model_dump(exclude_none=True) for message in state.get("completion") or []],
            num_turns=len(state["trajectory"]),
            stop_condition=state.get("stop_condition"),
            is_truncated=bool(state.get("is_truncated")),
            error=None if error is None else f"{type(error).__name__}: {error}",
        )
        result.state = state
        return result


# ---------------------------------------------------------------------------------------------------------------------
# Rubric -> reward functions


def _leaf_rubrics(rubric: Any) -> Iterator[Any]:
    # A RubricGroup scores with its members only (its own `funcs` are never called), members may be groups too.
    if isinstance(rubric, vf.RubricGroup):
        for member in rubric.rubrics:
            yield from _leaf_rubrics(member)
    else:
        yield rubric


def rubric_reward_funcs(rubric: Any) -> tuple[list[Callable], list[float]]:
    """One TRL-signature reward function per function of a verifiers rubric, and their weights.

    Each function is named like the rubric's (a second function of the same name gets `_2`, ...) and returns, for
    every episode, what `Rubric.score_rollout` would record in `state["metrics"]` for it (unweighted): it calls the
    rubric's own scorer on the episode's live `State`. Episodes without one (failed, or run by another agent) get
    `None`. Group functions score the episodes of each `example_id` (a dataset column verifiers adds) together.

    Args:
        rubric: a `vf.Rubric` or `vf.RubricGroup` (`env.rubric`).

    Returns:
        `(reward_funcs, reward_weights)`, in the rubric's order (a group's members in order).

    Example:

    ```python
    >>> funcs, weights = rubric_reward_funcs(vf.Rubric(funcs=[correct_answer, short], weights=[1.0, 0.2]))
    >>> [f.__name__ for f in funcs], weights
    (['correct_answer', 'short'], [1.0, 0.2])
    ```
    """
    funcs, weights, names = [], [], set()
    for member in _leaf_rubrics(rubric):
        for func, weight in zip(member.funcs, member.weights, strict=True):
            base = getattr(func, "__name__", type(func).__name__)
            name, suffix = base, 1
            while name in names:
                suffix += 1
                name = f"{base}_{suffix}"
            names.add(name)
            funcs.append(_reward_func(member, func, name))
            weights.append(float(weight))
    return funcs, weights


def _reward_func(rubric: Any, func: Callable, name: str) -> Callable:
    is_group = rubric._is_group_func(func)

    async def reward(
        prompts: list, completions: list, episodes: list | None = None, example_id: list | None = None, **kwargs: Any
    ) -> list[float | None]:
        if episodes is None:
            raise ValueError(
                f"The reward function {name!r} scores verifiers rollouts and needs `episodes=` (AgenticGRPOTrainer and "
                "Evaluator pass them); it cannot score plain TRL completions."
            )
        states = [verifiers_state(episode) for episode in episodes]
        for episode, state in zip(episodes, states, strict=True):
            if state is None and episode.status == "ok":
                raise ValueError(
                    f"The reward function {name!r} of a verifiers rubric got an episode that no VerifiersAgent ran "
                    f"(its result is a {type(episode.result).__name__}); use the suite's agent (suite.agent) with its "
                    "reward functions."
                )
        rewards: list[float | None] = [None] * len(states)
        scored = [i for i, state in enumerate(states) if state is not None]
        if not is_group:
            # The rubric's own scorer: the same arguments (parser, class objects, task fields), and an exception
            # scores 0.0 with an error logged, as in `Rubric.score_rollout`.
            values = await asyncio.gather(*(rubric._call_individual_reward_func(func, states[i]) for i in scored))
            for i, value in zip(scored, values, strict=True):
                rewards[i] = float(value)
            return rewards
        if example_id is None:
            raise ValueError(
                f"The group reward function {name!r} scores the rollouts of one example together and needs the "
                "dataset's `example_id` column (verifiers adds it); keep it in the dataset."
            )
        groups: dict[Any, list[int]] = defaultdict(list)
        for i in scored:
            groups[example_id[i]].append(i)
        for members in groups.values():
            values = await rubric._call_group_reward_func(func, [states[i] for i in members])
            for i, value in zip(members, values, strict=True):
                rewards[i] = float(value)
        return rewards

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = f"The verifiers rubric function {name!r}, scored on the episode's rollout state."
    return reward


# ---------------------------------------------------------------------------------------------------------------------
# Suite


@dataclass
class VerifiersSuite(TaskSuite):
    """A [`TaskSuite`] made from a verifiers environment by [`from_verifiers`], with the environment as `env`.

    Its `reward_weights` are the rubric's (one per `reward_funcs`): `trl-agentic train`/`eval` use them, and a trainer
    built in code takes them as `AgenticGRPOConfig(reward_weights=suite.reward_weights)` (an `Evaluator` as
    `reward_weights=suite.reward_weights`).
    """

    env: Any = None


def _tool_schema(tool: Any) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    if tool.strict is not None:
        function["strict"] = tool.strict
    return {"type": "function", "function": function}


def _no_demonstrations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    raise ValueError(
        "A verifiers environment brings no demonstrations for an SFT warm start; warm-start from your own "
        "conversations or train without one."
    )


def from_verifiers(
    env: Any, *, name: str | None = None, model: str = SERVED_MODEL_NAME, sampling_args: dict[str, Any] | None = None
) -> VerifiersSuite:
    """Dataset, agent and reward functions of a verifiers environment, as a [`TaskSuite`].

    Args:
        env: a `vf.Environment`, e.g. `vf.load_environment("<env-id>")` or a `vf.SingleTurnEnv(...)` built in code.
        name: the suite's name (default: the environment's `env_id`, else its class name).
        model: the model name its rollouts send (the endpoint's, `"policy"`).
        sampling_args: what its rollouts pass with each call (default: the environment's).

    Returns:
        A [`VerifiersSuite`]: `build_dataset(split="train" | "eval", size, seed)` returns `size` rows of
        `env.get_dataset` / `env.get_eval_dataset` shuffled with `seed` (an environment without an eval dataset
        evaluates on its train dataset, as verifiers does, with a warning); `agent` is a [`VerifiersAgent`];
        `reward_funcs` and `reward_weights` come from `env.rubric` ([`rubric_reward_funcs`]); `agent_columns` are
        all the dataset's columns, since the environment's rollout reads the row as verifiers gives it (`answer`,
        `info`, ...).

    Example:

    ```python
    >>> env = vf.SingleTurnEnv(dataset=Dataset.from_list([{"question": "2 + 3?", "answer": "5"}]),
    ...                        rubric=vf.Rubric(funcs=[exact], weights=[1.0]))
    >>> suite = from_verifiers(env)
    >>> [f.__name__ for f in suite.reward_funcs], suite.reward_weights, suite.agent_columns
    (['exact', 'num_turns'], [1.0, 0.0], ('question', 'answer', 'example_id', 'prompt'))
    ```
    """
    if not isinstance(env, vf.Environment):
        raise ValueError(
            f"from_verifiers needs a verifiers Environment (vf.SingleTurnEnv, vf.ToolEnv, ...), got a "
            f"{type(env).__name__}. Load one with vf.load_environment('<env-id>')."
        )
    label = name or env.env_id or type(env).__name__
    if env.rubric.has_advantages:
        raise ValueError(
            f"The rubric of the verifiers environment {label!r} computes its own advantages (rubric.has_advantages); "
            "GRPO computes advantages from rewards, so it cannot train this environment."
        )
    reward_funcs, reward_weights = rubric_reward_funcs(env.rubric)
    if not any(reward_weights):
        raise ValueError(
            f"The rubric of the verifiers environment {label!r} has no reward function with a non-zero weight (only "
            f"metrics: {[f.__name__ for f in reward_funcs]}), so every reward would be 0. Give it one: "
            "vf.Rubric(funcs=[...], weights=[...])."
        )

    # The agent gets the train dataset's columns (the eval dataset's when it has none); each episode must bring those
    # that every dataset of the environment has.
    built = [dataset for dataset in (env.build_dataset(), env.build_eval_dataset()) if dataset is not None]
    columns = tuple(built[0].column_names)
    required = tuple(column for column in columns if all(column in dataset.column_names for dataset in built))
    agent = VerifiersAgent(env, model=model, sampling_args=sampling_args, columns=required)

    def build_dataset(split: str = "train", size: int = 256, seed: int = 0) -> datasets.Dataset:
        if split == "train":
            return env.get_dataset(n=size, seed=seed)
        if split == "eval":
            return env.get_eval_dataset(n=size, seed=seed)
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")

    return VerifiersSuite(
        name=label,
        tools=[_tool_schema(tool) for tool in env.tool_defs or []],
        system_prompt=env.system_prompt or "",
        build_dataset=build_dataset,
        agent=agent,
        reward_funcs=reward_funcs,
        demonstrations=_no_demonstrations,
        agent_columns=columns,
        env=env,
        reward_weights=reward_weights,
    )


def load_verifiers_suite(env_id: str, **env_args: Any) -> VerifiersSuite:
    """`from_verifiers(vf.load_environment(env_id, **env_args))`: an installed environment by id (what
    `get_task("verifiers:<env-id>")` returns).

    Example:

    ```python
    >>> load_verifiers_suite("vf-gsm8k", num_train_examples=64).name  # after `prime env install gsm8k`
    'vf-gsm8k'
    ```
    """
    if not env_id:
        raise ValueError("No environment id: write the task as 'verifiers:<env-id>', e.g. 'verifiers:vf-gsm8k'.")
    return from_verifiers(vf.load_environment(env_id, **env_args), name=env_id)


__all__ = [
    "POLICY_ERRORS",
    "VerifiersAgent",
    "VerifiersResult",
    "VerifiersSuite",
    "from_verifiers",
    "load_verifiers_suite",
    "rubric_reward_funcs",
    "verifiers_state",
]
