"""TRL's `environment_factory` contract, run as a built-in agent over the endpoint.

An environment written for `trl.GRPOTrainer(environment_factory=...)` (TRL 1.16) trains unchanged under
[`AgenticGRPOTrainer`]: `AgenticGRPOTrainer(..., environment_factory=MyEnv)` builds an [`EnvironmentAgent`] that
plays TRL's tool loop as an ordinary agent (the package's one tool loop, `rollout/tool_loop.py`, with TRL's rules as
its hooks), through the official `openai` client against the episode's endpoint (so forks, side calls, alarms, the
viewer and asynchronous rollouts apply as to any agent), plus the reward sources TRL derives from the environment. The contract, as TRL implements it in `GRPOTrainer.__init__`,
`_generate_and_score_completions` and `_tool_call_loop`:

- The factory is a zero-argument callable returning an instance (a class, a `functools.partial`); or a dict
  `{name: factory}`, each row then naming its environment in an `environment` column.
- The tools are the instance's public functions, listed on its class (`inspect.getmembers(type(env),
  inspect.isfunction)`, so properties are never evaluated), except `reset` and `get_reward`; their schemas are
  `transformers.utils.get_json_schema` of the bound methods, which is what `apply_chat_template(tools=[method])`
  renders in TRL.
- One instance per episode. `reset(**row)` gets the row's columns (without `environment` in the dict form); text it
  returns is appended to the content of the last prompt message.
- A tool call runs the method with the call's arguments; its result becomes a `{"role": "tool", "name": ...,
  "content": str(result)}` message, an exception (or an unknown tool) the text of `{"error": str(exception)}`, as in
  TRL. Sync results come first, then async ones, as in TRL. At most `max_tool_calling_iterations` rounds of tool calls
  (`None`: no limit; the endpoint's `max_turns` still applies).
- `max_completion_length` bounds the episode after its first prompt, tool results included: results that would
  overflow it are dropped and end the episode, the next reply gets what is left (once `use_tokenizer` was called, as
  the trainer does).
- `get_reward()` (sync or async), where the class defines it, is a reward source named after the class, weight 1,
  scoring only the episodes of exactly that class (TRL's `type(env) is cls`).
- Reward functions receive the live instances as `environments=`, aligned with `completions`.

One extension (not in TRL): an instance whose `done` attribute (or property) is `True` after a round of tool calls
ends the episode without another model call, as a gym environment's done flag does (`gym_text.py`).

Example:

```python
>>> class Counter:
...     def reset(self, **row):
...         self.calls = 0
...     def increment(self, step: int) -> int:
...         \"\"\"Add `step` to the counter.
...
...         Args:
...             step: How much to add.
...         \"\"\"
...         self.calls += step
...         return self.calls
...     def get_reward(self) -> float:
...         return float(self.calls == 3)
>>> agent = EnvironmentAgent(Counter)
>>> [tool["function"]["name"] for tool in agent.tool_schemas[None]]
['increment']
>>> [f.__name__ for f in agent.environment_reward_funcs()]
['Counter']
```
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from transformers.utils import get_json_schema

from ..endpoint import SERVED_MODEL_NAME
from ..rollout.agents import AgentCrash
from ..rollout.tool_loop import ToolLoop


# A zero-argument callable returning an environment instance: public methods = tools, `reset(**row)` -> str | None,
# optionally `get_reward() -> float` (sync or async). TRL's `trl.trainer.grpo_trainer.EnvironmentFactory`.
EnvironmentFactory = Callable[[], Any]

# The column that selects an environment in the dict form, as in TRL.
ENVIRONMENT_COLUMN = "environment"

# Members of an environment that are not tools (TRL's rule, plus anything starting with "_").
_NOT_TOOLS = ("reset", "get_reward")


def environment_methods(environment: Any) -> list[Callable]:
    """The bound tool methods of `environment`, in TRL's order and by TRL's rule: the public functions of its class,
    except `reset` and `get_reward`.

    Example:

    ```python
    >>> class Env:
    ...     def reset(self, **row): ...
    ...     def look(self) -> str: ...
    ...     def _private(self): ...
    >>> [m.__name__ for m in environment_methods(Env())]
    ['look']
    ```
    """
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if name not in _NOT_TOOLS and not name.startswith("_")
    ]


def _check_environment(environment: Any, name: str | None) -> None:
    members = dict(inspect.getmembers(type(environment), predicate=inspect.isfunction))
    if "reset" not in members:
        where = "" if name is None else f" ({name!r})"
        raise ValueError(
            f"The environment{where} built by `environment_factory`, a {type(environment).__name__}, has no `reset` "
            "method. Define `def reset(self, **row) -> str | None` on its class: it starts an episode from the "
            "dataset row and may return text to append to the prompt."
        )


def environment_done(environment: Any) -> bool:
    """Whether an environment says its episode is over: its `done` attribute (or property) is `True` (a bool, so a
    method or any other value named `done` never ends an episode)."""
    try:
        return getattr(environment, "done", False) is True
    except Exception:  # noqa: BLE001 - a property that raises is not a done flag
        return False


class EnvironmentResult(dict):
    """What an [`EnvironmentAgent`] episode returns (`episode.result`): a summary dict for the episode log, with the
    live environment instance as the attribute `environment` (never written to the log)."""

    environment: Any = None


def environment_of(episode: Any) -> Any:
    """The live environment instance of an episode run by an [`EnvironmentAgent`], or `None` when there is none (the
    episode timed out before its agent returned, or another agent ran it)."""
    result = getattr(episode, "result", None)
    if isinstance(result, EnvironmentResult):
        return result.environment
    return getattr(episode, "metadata", {}).get("environment_instance")


class EnvironmentAgent:
    """An agent that runs TRL's `environment_factory` tool loop over the episode's endpoint.

    Args:
        environment_factory: a zero-argument callable returning an environment instance, or a dict of them by name
            (each row then selects one in its `environment` column).
        max_tool_calling_iterations: most rounds of tool calls per episode, TRL's `GRPOConfig` field (`None`: no
            limit beyond the endpoint's `max_turns`).
        model: the model name sent with every request.

    One instance of each environment is built at once, to derive its tools (as TRL probes one); it serves the first
    episode of that environment, and every other episode gets a fresh instance. The agent's `task` must hold the
    columns `reset` reads: [`AgenticGRPOTrainer`] hands it every column of the dataset (see `agent_columns`).

    Example:

    ```python
    >>> agent = EnvironmentAgent({"counter": Counter, "maze": Maze}, max_tool_calling_iterations=8)
    >>> trainer = AgenticGRPOTrainer(model, agent=agent, reward_funcs=agent.reward_funcs(my_reward), args=args,
    ...                              train_dataset=dataset)  # what `environment_factory=` builds for you
    ```
    """

    def __init__(
        self,
        environment_factory: EnvironmentFactory | Mapping[str, EnvironmentFactory],
        max_tool_calling_iterations: int | None = None,
        model: str = SERVED_MODEL_NAME,
    ):
        # Normalize to {name: factory}, `None` naming the single environment, as TRL does.
        self.multi_environment = isinstance(environment_factory, Mapping)
        if self.multi_environment:
            if not environment_factory:
                raise ValueError("`environment_factory` is an empty dict; give at least one {name: factory}.")
            self.factories = dict(environment_factory)
        elif callable(environment_factory):
            self.factories = {None: environment_factory}
        else:
            raise TypeError(
                f"`environment_factory` must be a zero-argument callable (e.g. the environment class) or a dict of "
                f"them by name, got {type(environment_factory).__name__}."
            )
        if max_tool_calling_iterations is not None and max_tool_calling_iterations < 0:
            raise ValueError(f"max_tool_calling_iterations must be >= 0 or None, got {max_tool_calling_iterations}.")
        self.max_tool_calling_iterations = max_tool_calling_iterations
        self.model = model
        # TRL's completion budget, kept once `use_tokenizer` is called (the trainer does)
        self.tokenizer, self.max_completion_length, self.chat_template_kwargs = None, None, {}

        # Probe one instance of each environment: validate it, derive its tool schemas, keep it for a first episode.
        self.tool_schemas: dict[str | None, list[dict[str, Any]]] = {}
        self.reward_classes: list[type] = []  # classes with `get_reward`, deduplicated (two names, one class)
        self._spare: dict[str | None, list[Any]] = {}
        for name, factory in self.factories.items():
            instance = factory()
            _check_environment(instance, name)
            self.tool_schemas[name] = [get_json_schema(method) for method in environment_methods(instance)]
            self._spare[name] = [instance]
            members = dict(inspect.getmembers(type(instance), predicate=inspect.isfunction))
            if "get_reward" in members and type(instance) not in self.reward_classes:
                self.reward_classes.append(type(instance))

    # Episode

    def environment_name(self, task: Mapping[str, Any]) -> str | None:
        """The environment a row selects: `None` for a single factory, else the row's `environment` column."""
        if not self.multi_environment:
            return None
        if ENVIRONMENT_COLUMN not in task:
            raise ValueError(
                f"A dict `environment_factory` selects each row's environment by its `{ENVIRONMENT_COLUMN}` column, "
                f"which this row lacks (its columns: {sorted(task)}). Add the column, naming one of "
                f"{list(self.factories)}."
            )
        name = task[ENVIRONMENT_COLUMN]
        if name not in self.factories:
            raise ValueError(
                f"Example has `environment={name!r}`, which is not among the environments passed to "
                f"`environment_factory`. Expected one of: {list(self.factories)}."
            )
        return name

    def new_environment(self, name: str | None) -> Any:
        """A fresh instance of environment `name` (the probe instance first)."""
        spare = self._spare.get(name)
        if spare:
            return spare.pop()
        return self.factories[name]()

    async def __call__(self, client: Any, task: dict[str, Any]) -> EnvironmentResult:
        name = self.environment_name(task)
        environment = self.new_environment(name)
        try:
            return await self._run(client, task, name, environment)
        except Exception as error:  # a crash of the environment or of a model call: the episode's, with its instance
            message = "".join(traceback.format_exception_only(type(error), error)).strip()
            raise AgentCrash(
                message, {"traceback": traceback.format_exc()[-4000:], "environment_instance": environment}
            ) from error

    async def _run(self, client: Any, task: dict[str, Any], name: str | None, environment: Any) -> EnvironmentResult:
        # `reset(**row)`: every column the agent holds, without the routing column in the dict form (TRL).
        reset_kwargs = {k: v for k, v in task.items() if k != ENVIRONMENT_COLUMN} if self.multi_environment else task
        observation = await _call(environment.reset, reset_kwargs)
        messages = [dict(message) for message in task.get("prompt") or [{"role": "user", "content": ""}]]
        if observation is not None:
            messages[-1] = {**messages[-1], "content": _append(messages[-1]["content"], observation)}
        tools = self.tool_schemas[name]
        methods = {method.__name__: method for method in environment_methods(environment)}
        request = {"model": self.model}
        if tools:  # TRL renders `tools or None`: no tool boilerplate for an environment without tools
            request["tools"] = tools

        hooks = _EnvironmentTools(self, methods, request, environment)
        end = await hooks.run(client, messages)  # the one tool loop (`rollout/tool_loop.py`)

        result = EnvironmentResult(
            environment_name=name,
            answer=end.text,
            tool_calls=hooks.tool_calls,
            tool_failures=hooks.tool_failures,
            observation=observation if isinstance(observation, str | None) else str(observation),
            cut_at_budget=hooks.cut_at_budget,
            ended_on_done=end.finish == "done",
        )
        result.environment = environment
        return result

    # TRL's completion budget

    def use_tokenizer(
        self, tokenizer: Any, max_completion_length: int | None, chat_template_kwargs: dict[str, Any] | None = None
    ) -> None:
        """Hold episodes to TRL's budget: `max_completion_length` tokens after the first prompt, tool results
        included. The tool results' tokens are counted as TRL counts them (`GRPOTrainer._get_tool_suffix_ids`), with
        the chat template the endpoint renders with. Without it, each model call is capped on its own."""
        self.tokenizer, self.max_completion_length = tokenizer, max_completion_length
        self.chat_template_kwargs = chat_template_kwargs or {}

    def tool_suffix_length(self, tool_messages: list[dict[str, Any]]) -> int:
        """Tokens TRL appends for `tool_messages` after an assistant turn (`GRPOTrainer._get_tool_suffix_ids`): the
        tool turns and the next generation prompt."""
        calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        tool_turns = [{"role": "tool", "name": m["name"], "content": m["content"]} for m in tool_messages]
        kwargs = dict(tokenize=True, return_dict=False, **self.chat_template_kwargs)
        prefix = self.tokenizer.apply_chat_template(dummy, add_generation_prompt=False, **kwargs)
        full = self.tokenizer.apply_chat_template(dummy + tool_turns, add_generation_prompt=True, **kwargs)
        ends = [i for i, token in enumerate(prefix) if token == self.tokenizer.eos_token_id]
        if ends:  # aligned on the end-of-turn token, not the newline some templates write after it (TRL)
            prefix = prefix[: ends[-1] + 1]
        return len(full) - len(prefix)

    def _remaining_budget(self, response: Any, tool_messages: list[dict[str, Any]], first_prompt: int | None):
        """Tokens left for the next reply under TRL's budget, or `None` when no budget is kept."""
        if self.tokenizer is None or self.max_completion_length is None or response.usage is None:
            return None
        first = first_prompt if first_prompt is not None else response.usage.prompt_tokens
        used = response.usage.prompt_tokens + response.usage.completion_tokens - first
        return self.max_completion_length - used - self.tool_suffix_length(tool_messages)

    # Reward sources

    def environment_reward_funcs(self) -> list[Callable]:
        """One reward function per environment class defining `get_reward`, named after the class (TRL logs it so),
        scoring the episodes of exactly that class and `None` for the others."""
        return [environment_reward(cls) for cls in self.reward_classes]

    def reward_funcs(self, reward_funcs: Callable | Sequence[Callable] | None = None) -> list[Callable]:
        """`reward_funcs` given `environments=` (the episodes' live instances), followed by the environments'
        `get_reward` sources: what `AgenticGRPOTrainer(environment_factory=...)` trains with.

        Raises a `ValueError` when there is no reward source at all (TRL's rule)."""
        if reward_funcs is None:
            reward_funcs = []
        elif not isinstance(reward_funcs, list | tuple):
            reward_funcs = [reward_funcs]
        funcs = [with_environments(f) for f in reward_funcs] + self.environment_reward_funcs()
        if not funcs:
            raise ValueError(
                "No reward source provided. Pass `reward_funcs`, or an `environment_factory` whose environment "
                "defines a `get_reward` method."
            )
        return funcs


class _EnvironmentTools(ToolLoop):
    """The tool loop's hooks for an `environment_factory` instance, as TRL's `_tool_call_loop`: its methods are the
    tools (`run_tool_calls`); the episode ends when the model answers without tool calls, after
    `max_tool_calling_iterations` rounds of tool calls, or when tool results would overflow TRL's completion budget
    (they are dropped, `cut_at_budget`)."""

    # A branch replays the model calls; the tools run again on its fresh environment, whose state they build.
    replay_tool_results = False

    def __init__(
        self, agent: EnvironmentAgent, methods: Mapping[str, Callable], request: dict[str, Any], environment: Any = None
    ):
        self.agent, self.methods, self._request, self.environment = agent, methods, request, environment
        self.tool_calls = self.tool_failures = 0
        self.iteration = 0
        self.first_prompt = None  # tokens of the first prompt: TRL's completion budget counts everything after it
        self.cut_at_budget = False

    def request(self) -> dict[str, Any]:
        return self._request

    def is_completed(self) -> bool:
        # The environment's done flag (gym's): `done is True` after a round of tool calls ends the episode without
        # another model call (an extension of TRL's contract, where the model is asked once more).
        return environment_done(self.environment)

    def is_final(self, message: Any) -> bool:
        limit = self.agent.max_tool_calling_iterations
        return not message.tool_calls or (limit is not None and self.iteration >= limit)

    async def env_response(self, message: Any, response: Any) -> list[dict[str, Any]] | None:
        results, failures = await run_tool_calls(self.methods, message.tool_calls)
        self.tool_calls += len(message.tool_calls)
        self.tool_failures += failures
        self.iteration += 1
        remaining = self.agent._remaining_budget(response, results, self.first_prompt)
        if remaining is not None:
            self.first_prompt = self.first_prompt if self.first_prompt is not None else response.usage.prompt_tokens
            if remaining <= 0:
                # TRL drops tool results that would overflow `max_completion_length` and ends the rollout (the
                # tools ran: their side effects stay).
                self.cut_at_budget = True
                return None
            self._request["max_tokens"] = remaining  # TRL cuts the next reply to what is left of the budget
        return results


async def _call(function: Callable, kwargs: Mapping[str, Any]) -> Any:
    """Run a sync environment method in a thread (the episodes share one event loop), or await an async one."""
    if inspect.iscoroutinefunction(function):
        return await function(**kwargs)
    return await asyncio.to_thread(function, **kwargs)


def _append(content: Any, observation: Any) -> Any:
    # TRL's `reset` rule: text to text; a list observation turns text content into a text part, and vice versa.
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return content + observation


def _arguments(raw: Any) -> Any:
    """The call's arguments as TRL hands them to the method: the decoded JSON (the endpoint sends it as text)."""
    if isinstance(raw, str):
        return json.loads(raw) if raw.strip() else {}
    return raw


async def run_tool_calls(methods: Mapping[str, Callable], tool_calls: Sequence[Any]) -> tuple[list[dict], int]:
    """Run one assistant message's tool calls the way TRL's `_tool_call_loop` does; return the tool messages, in
    TRL's order (sync results and errors in call order, then async results), and the number of failures.

    A failure (the method raised, the tool is unknown, the arguments are not a JSON object) becomes the text of
    `{"error": str(exception)}`, TRL's message; a result becomes `str(result)` (a list of content parts is kept).

    Example:

    ```python
    >>> messages, failures = await run_tool_calls({"add": add}, response.choices[0].message.tool_calls)
    ```
    """
    results: list[tuple[Any, str, Any]] = []  # (call id, name, result)
    pending: list[tuple[Any, str, Any]] = []  # (call id, name, coroutine)
    failures = 0
    for call in tool_calls:
        if call.type != "function":
            failures += 1
            name = getattr(call, "name", None) or "unknown"
            results.append((call.id, name, {"error": f"Unsupported tool call type: {call.type}"}))
            continue
        name = call.function.name
        try:
            arguments = _arguments(call.function.arguments)
            if name not in methods:
                raise ValueError(f"Tool {name} not found.")
            method = methods[name]
            if inspect.iscoroutinefunction(method):
                pending.append((call.id, name, method(**arguments)))
            else:
                results.append((call.id, name, await asyncio.to_thread(method, **arguments)))
        except Exception as error:  # noqa: BLE001 - the model reads the failure, as in TRL
            failures += 1
            results.append((call.id, name, {"error": str(error)}))
    if pending:
        outcomes = await asyncio.gather(*(coroutine for _, _, coroutine in pending), return_exceptions=True)
        for (call_id, name, _), outcome in zip(pending, outcomes, strict=True):
            if isinstance(outcome, Exception):
                failures += 1
                outcome = {"error": str(outcome)}
            results.append((call_id, name, outcome))
    messages = [
        {
            "role": "tool",
            "tool_call_id": call_id,
            "name": name,
            "content": result if isinstance(result, list) else str(result),
        }
        for call_id, name, result in results
    ]
    return messages, failures


# Reward functions


def environment_reward(environment_class: type) -> Callable:
    """TRL's reward source for an environment class with `get_reward`: `get_reward()` of each episode's instance when
    it is exactly of that class, `None` otherwise; named after the class, so logged as `rewards/<ClassName>/mean`."""
    if inspect.iscoroutinefunction(environment_class.get_reward):

        async def reward(prompts=None, completions=None, environments=None, **kwargs):
            return [await e.get_reward() if type(e) is environment_class else None for e in environments]

    else:

        def reward(prompts=None, completions=None, environments=None, **kwargs):
            return [e.get_reward() if type(e) is environment_class else None for e in environments]

    reward.__name__ = reward.__qualname__ = environment_class.__name__
    return with_environments(reward)


def with_environments(reward_func: Callable) -> Callable:
    """Wrap a TRL reward function so it receives `environments=`, the live instances of its episodes (from
    `episodes=`), aligned with `completions`, and `prompts` as the model saw them (with `reset`'s text), as in TRL.

    An episode without an instance (it timed out before its agent returned) is left out of the call and gets `None`
    (unscorable): the function only ever sees real instances, as in TRL.

    Example:

    ```python
    >>> def solved(prompts, completions, environments, **kwargs):
    ...     return [float(env.solved) for env in environments]
    >>> reward_funcs = [with_environments(solved)]
    ```
    """
    if getattr(reward_func, "_with_environments", False):
        return reward_func

    def split(kwargs):
        episodes = kwargs.get("episodes")
        if episodes is None:  # called outside the trainer/evaluator: nothing to add
            return None, kwargs
        environments = [environment_of(episode) for episode in episodes]
        kept = [i for i, env in enumerate(environments) if env is not None]
        n = len(episodes)
        if isinstance(kwargs.get("prompts"), list) and len(kwargs["prompts"]) == n:
            # The prompts the model saw, `reset`'s text included, as TRL passes them.
            kwargs = {
                **kwargs,
                "prompts": [
                    episode.messages[: len(prompt)]
                    if isinstance(episode.result, EnvironmentResult)
                    and isinstance(prompt, list)
                    and len(episode.messages) >= len(prompt)
                    else prompt
                    for episode, prompt in zip(episodes, kwargs["prompts"], strict=True)
                ],
            }
        if len(kept) == n:
            return None, {**kwargs, "environments": environments}
        subset = {k: [v[i] for i in kept] if isinstance(v, list) and len(v) == n else v for k, v in kwargs.items()}
        subset["environments"] = [environments[i] for i in kept]
        return (kept, n), subset

    def scatter(layout, rewards):
        if layout is None:
            return rewards
        kept, n = layout
        out: list[Any] = [None] * n
        for i, reward in zip(kept, list(rewards), strict=True):
            out[i] = reward
        return out

    if inspect.iscoroutinefunction(reward_func):

        @functools.wraps(reward_func)
        async def wrapped(**kwargs):
            layout, kwargs = split(kwargs)
            if layout is not None and not layout[0]:
                return [None] * layout[1]
            return scatter(layout, await reward_func(**kwargs))

    else:

        @functools.wraps(reward_func)
        def wrapped(**kwargs):
            layout, kwargs = split(kwargs)
            if layout is not None and not layout[0]:
                return [None] * layout[1]
            return scatter(layout, reward_func(**kwargs))

    wrapped._with_environments = True
    return wrapped


def environment_suite(
    environment_factory: EnvironmentFactory | Mapping[str, EnvironmentFactory],
    dataset: Any,
    reward_funcs: Callable | Sequence[Callable] | None = None,
    *,
    name: str = "environment",
    max_tool_calling_iterations: int | None = None,
    train_dataset: Any = None,
    solver: Callable | None = None,
    chance_success: float | None = None,
):
    """A [`TaskSuite`] running `environment_factory`, for `trl-agentic eval`, [`Evaluator`] and, with a training split
    and a reference solver, `trl-agentic demo --task`: the same agent and reward sources
    `AgenticGRPOTrainer(environment_factory=...)` trains with. Its agent sees every column (they reach `reset`).

    Args:
        environment_factory, reward_funcs, max_tool_calling_iterations: as `AgenticGRPOTrainer(environment_factory=...)`
            takes them.
        dataset: the rows of the **eval** split (`build_dataset(split="eval")`), what `trl-agentic eval` measures.
        name: the task's name.
        train_dataset: the rows of the **training** split (`build_dataset(split="train")`: demonstrations, GRPO's
            tasks). Without it the suite has no training split and asking for it raises a `ValueError` (held-out
            success must never be measured on training tasks); a row in both splits is refused.
        solver: a reference solver, `solver(messages, tools) -> reply` (`trl_agentic.envs.demonstrations`): its
            successful plays against the real environment, on training rows, are the warm start's demonstrations.
        chance_success: the success rate of random play, when known (the demo's warm start stops above it).

    `build_dataset(split, size, seed)` returns the split's rows, `size` of them drawn with `seed` when the split has
    more.

    Example:

    ```python
    >>> from trl_agentic.evaluation import Evaluator
    >>> suite = environment_suite(MyEnv, eval_rows, reward_funcs=[my_reward], train_dataset=train_rows, solver=solve)
    >>> summary = Evaluator(model, tokenizer, suite, eval_rows, num_samples=4).evaluate(seed=0)
    ```
    """
    from ..tasks import TaskSuite
    from .demonstrations import record_demonstrations

    agent = EnvironmentAgent(environment_factory, max_tool_calling_iterations)
    tools = [schema for schemas in agent.tool_schemas.values() for schema in schemas]
    if train_dataset is not None:
        _check_disjoint(train_dataset, dataset, name)
    splits = {"eval": dataset, "train": train_dataset}

    def build_dataset(split: str = "train", size: int | None = None, seed: int = 0, **knobs: Any):
        if split not in splits:
            raise ValueError(f"split={split!r}: task {name!r} has the splits 'train' and 'eval'.")
        rows = splits[split]
        if rows is None:
            raise ValueError(
                f"Task {name!r} has no training split: environment_suite(factory, dataset) holds the eval split's rows "
                "only (what `trl-agentic eval` measures). Pass train_dataset=... (rows not in `dataset`) to train on "
                "it or record demonstrations; training on the eval rows would measure held-out success on training "
                "tasks."
            )
        if size is None or size >= len(rows):
            return rows
        return rows.shuffle(seed=seed).select(range(size))

    suite = TaskSuite(
        name=name,
        tools=tools,
        system_prompt="",
        build_dataset=build_dataset,
        agent=agent,
        reward_funcs=agent.reward_funcs(reward_funcs),
        demonstrations=lambda n, seed=0, **knobs: [],
        agent_columns=tuple(dataset.column_names),
        chance_success=chance_success,
    )
    if solver is not None:
        suite.demonstrations = lambda n, seed=0, **knobs: record_demonstrations(suite, solver, n, seed, **knobs)
    return suite


def _check_disjoint(train_dataset: Any, eval_dataset: Any, name: str) -> None:
    """A `ValueError` when a row (all its columns) is in both splits."""
    if list(train_dataset.column_names) != list(eval_dataset.column_names):
        raise ValueError(
            f"Task {name!r}: train_dataset has the columns {train_dataset.column_names}, dataset (the eval split) "
            f"{eval_dataset.column_names}; give both splits the same columns."
        )
    held_out = {json.dumps(row, sort_keys=True, default=str) for row in eval_dataset}
    shared = [i for i, row in enumerate(train_dataset) if json.dumps(row, sort_keys=True, default=str) in held_out]
    if shared:
        raise ValueError(
            f"Task {name!r}: {len(shared)} rows of train_dataset are also in dataset, the eval split (the first: row "
            f"{shared[0]}); held-out success would be measured on training tasks. Remove them from one split."
        )


__all__ = [
    "ENVIRONMENT_COLUMN",
    "EnvironmentAgent",
    "EnvironmentFactory",
    "EnvironmentResult",
    "environment_methods",
    "environment_done",
    "environment_of",
    "environment_reward",
    "environment_suite",
    "with_environments",
]


def environment_factory_agent(
    environment_factory: EnvironmentFactory | Mapping[str, EnvironmentFactory],
    agent: Any,
    reward_funcs: Callable | Sequence[Callable] | None,
    args: Any,
    train_dataset: Any,
) -> tuple[EnvironmentAgent, list[Callable]]:
    """What `AgenticGRPOTrainer(environment_factory=...)` trains with: the [`EnvironmentAgent`] and the reward
    functions (`reward_funcs` given `environments=`, then each environment's `get_reward`).

    Adjusts `args` as TRL's trainer does internally: `reward_weights` given for `reward_funcs` alone get weight 1 for
    each `get_reward` source; and `agent_columns` left at `["prompt"]` become every column of `train_dataset`, since
    TRL passes the whole row to `reset` (the environment sees every column: docs/envs_environment_factory.md).
    """
    if agent is not None:
        raise ValueError(
            "Pass either `agent=` or `environment_factory=`, not both: `environment_factory` builds the "
            "agent (TRL's tool loop over the endpoint)."
        )
    environment_agent = EnvironmentAgent(environment_factory, args.max_tool_calling_iterations)
    num_user_funcs = 0 if reward_funcs is None else len(reward_funcs) if isinstance(reward_funcs, list | tuple) else 1
    funcs = environment_agent.reward_funcs(reward_funcs)
    if args.reward_weights is not None and len(args.reward_weights) == num_user_funcs < len(funcs):
        args.reward_weights = [*args.reward_weights, *[1.0] * (len(funcs) - num_user_funcs)]
    if train_dataset is None:
        raise ValueError(
            "`environment_factory` needs a `train_dataset` (at least a `prompt` column, and an "
            "`environment` column for a dict of factories); rows generated by `reset` alone are not "
            "supported yet."
        )
    columns = getattr(train_dataset, "column_names", None)
    if columns is not None:
        if "prompt" not in columns:
            raise ValueError(
                f"The dataset has no `prompt` column (columns: {columns}). Add one, e.g. "
                "`[{'role': 'user', 'content': ''}]` when `reset` returns the task's text."
            )
        if environment_agent.multi_environment and ENVIRONMENT_COLUMN not in columns:
            raise ValueError(
                f"A dict `environment_factory` needs an `{ENVIRONMENT_COLUMN}` column naming each row's "
                f"environment (one of {list(environment_agent.factories)}); the dataset has {columns}."
            )
        if list(args.agent_columns) == ["prompt"]:
            args.agent_columns = list(columns)
    return environment_agent, funcs
