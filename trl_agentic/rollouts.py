"""The trainer's rollout side, testable without a trainer: the endpoint serving the live policy, the episodes run now
(the synchronous schedule, and evaluation) or by a producer (asynchronous rollouts), the engine's weights after each
optimizer step, and what `rollout_process=True` can run with. `AgenticGRPOTrainer` holds one `Rollouts` and hands it
what it owns (the model, by callables; the step; the metrics).

Also `trainer_inputs`: the constructor's argument handling (checks, environments, agent, reward wrapping, tiny models).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, Callable

from .agentic_grpo_config import AgenticGRPOConfig
from .endpoint import SERVED_MODEL_NAME
from .endpoint.launch import launch_endpoint
from .envs.environment_factory import environment_factory_agent
from .generation.engine import GenerationEngine
from .generation.transformers_engine import TransformersEngine
from .rewards.utils import reward_model_funcs, unscorable_unless_ok
from .rollout.agents import resolve_agent
from .rollout.process import ProcessRolloutProducer, ensure_picklable_agent
from .rollout.producer import RolloutProducer
from .rollout.rows import Row, episode_to_rows
from .rollout.runner import run_episodes, run_rollout
from .rollout.schedule import rollout_seed
from .rollout.tree_groups import TreeSpec, run_tree_groups
from .tiny_models import load_model_and_tokenizer
from .trace import Episode


def trainer_inputs(
    model, agent, reward_funcs, args, train_dataset, processing_class, reward_processing_classes, environment_factory,
    tools,
):  # fmt: skip
    """`AgenticGRPOTrainer`'s arguments checked and resolved: `(model, agent, resolved_agent, reward_funcs,
    processing_class)`. `agent`: the one passed or `environment_factory`'s built-in agent; `resolved_agent`: it through
    `rollout.agents.resolve_agent`; reward functions wrapped (unscorable unless ok); `tiny:` models built."""
    # Args
    if args is None:
        raise ValueError("Pass `args=AgenticGRPOConfig(output_dir=...)`: the agent knobs live there.")
    if not isinstance(args, AgenticGRPOConfig):
        raise TypeError(
            f"`args` must be an AgenticGRPOConfig, got {type(args).__name__}; build it with "
            "AgenticGRPOConfig(**grpo_config.to_dict()) to keep your GRPO settings."
        )

    if tools is not None:  # TRL's argument, refused rather than ignored (issue 40)
        raise ValueError(
            "AgenticGRPOTrainer does not take `tools=`: the agent owns its tools (it sends their schemas with its "
            "model calls and runs them). Pass `agent=ToolAgent(tools=[...])` (trl_agentic.tasks.agent_loop) for "
            "TRL's tool loop over plain functions, or give your own agent its tools."
        )

    # Reward processing classes, as in TRL: entry i tokenizes for reward model i (ignored for functions); applied
    # before the environments' own reward sources join
    if reward_funcs is not None:
        reward_funcs = reward_model_funcs(reward_funcs, reward_processing_classes)

    # Environments (TRL's `environment_factory`, issue 32): a built-in agent plays TRL's tool loop over the
    # endpoint, and the environments' `get_reward` join the reward sources (trl_agentic/envs/environment_factory.py)
    if environment_factory is not None:
        agent, reward_funcs = environment_factory_agent(environment_factory, agent, reward_funcs, args, train_dataset)

    # Agent
    if agent is None:
        raise ValueError(
            "Pass `agent=` (an async function (client, task), a CommandAgent, ...) or "
            "`environment_factory=` (TRL's environment contract)."
        )
    if reward_funcs is None:
        raise ValueError("No reward source provided. Pass `reward_funcs=` (TRL reward functions).")
    raw_agent, agent = agent, resolve_agent(agent)

    # Reward functions: failed episodes are unscorable (NaN-excluded from the group baseline), never zero
    if not isinstance(reward_funcs, list):
        reward_funcs = [reward_funcs]
    reward_funcs = [unscorable_unless_ok(f) for f in reward_funcs]

    # `tiny:<family>[:<hidden>x<layers>]`: the locally built test models the CLI takes (no Hub download), with
    # their tokenizer unless one is given
    if isinstance(model, str) and model.startswith("tiny:"):
        model, tiny_tokenizer = load_model_and_tokenizer(model)
        processing_class = tiny_tokenizer if processing_class is None else processing_class
    return model, raw_agent, agent, reward_funcs, processing_class


def check_rollout_process(engine: GenerationEngine | None, model, num_processes: int, agent) -> None:
    """`rollout_process=True`: what the child can rebuild (at construction, not at the first step)."""
    problems = []
    if engine is not None:
        problems.append("an `engine=` of your own (the child builds the embedded engine)")
    if num_processes > 1:
        problems.append(f"{num_processes} training processes (one only)")
    if hasattr(model, "peft_config"):
        problems.append("a PEFT model (merge the adapter, or train without rollout_process)")
    if any(p.device.type != "cpu" for p in model.parameters()):
        problems.append("a model off the CPU (on a GPU, serve the policy with vLLM: use_vllm=True, server mode)")
    if problems:
        raise ValueError("rollout_process=True cannot run with " + "; ".join(problems) + ". Set rollout_process=False.")
    ensure_picklable_agent(agent)


class Rollouts:
    """The endpoint over `engine` and the episodes of `agent` run against it.

    `model()`: the unwrapped policy; `generation_model()`: a context manager yielding it ready to generate from (the
    trainer's `unwrap_model_for_generation`, one ZeRO-3 gather for a whole rollout)."""

    def __init__(
        self,
        args: AgenticGRPOConfig,
        agent,
        engine: GenerationEngine,
        tokenizer,
        chat_template_kwargs: dict,
        *,
        model: Callable[[], Any],
        generation_model: Callable[[], AbstractContextManager],
        process_index: int = 0,
    ):
        self.args, self.agent, self.engine, self._tokenizer = args, agent, engine, tokenizer
        self.chat_template_kwargs = chat_template_kwargs
        self.model, self.generation_model, self.process_index = model, generation_model, process_index
        self.endpoint_kwargs = dict(  # also the rollout process's (`rollout_process`)
            **args.sampling_kwargs(),  # TRL's sampling settings, `generation_kwargs` overriding them (issue 40)
            max_tokens=args.max_completion_length,
            max_turns=args.max_turns,
            max_episode_tokens=args.max_episode_tokens,
            chat_template_kwargs=chat_template_kwargs,
            max_open_episodes=args.max_open_episodes,
            episode_idle_timeout=args.episode_idle_timeout,
            host=args.endpoint_host,
        )
        self.endpoint = launch_endpoint(engine, tokenizer, port=args.endpoint_port, **self.endpoint_kwargs)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trl-agentic-rollout")

    def agent_tasks(self, inputs: list[dict]) -> list[dict]:
        """What the agent sees of each dataset row: the `agent_columns` only."""
        # The agent sees only the columns meant for it: the checker's (`answer`, `expected`) stay on this side, where
        # every column still reaches the reward functions (issue #9: an agent returning task["answer"] scored 1.0).
        missing = [c for c in self.args.agent_columns if c not in inputs[0]]
        if missing:
            raise ValueError(
                f"agent_columns names {missing}, which the dataset does not have; its columns are "
                f"{sorted(inputs[0])}. Fix `agent_columns`."
            )
        tasks = [{c: example[c] for c in self.args.agent_columns} for example in inputs]
        return tasks

    def episode_rows(self, episodes: list[Episode]) -> list:
        """Each episode's rows (`rollout.rows.episode_to_rows`, under the config's `forks` / `side_calls` / ...)."""
        return [
            episode_to_rows(
                ep.turns,
                self.args.max_rows_per_episode,
                forks=self.args.forks,
                side_calls=self.args.side_calls,
                sub_agents=self.args.sub_agents,
            )
            for ep in episodes
        ]

    def tree_spec(self) -> TreeSpec | None:
        """The trees training groups are sampled as (`rollout_tree`), `None` for flat groups."""
        args = self.args
        return TreeSpec(args.tree_branches, args.tree_branch_points, args.tree_depth) if args.rollout_tree else None

    def run(
        self, tasks: list[dict], num_generations: int, stats, *, rollout_index: int, step: int, tree: bool = False
    ) -> list[Episode]:
        """Run this process's episodes now, on the current weights (the synchronous schedule, and evaluation);
        `rollout_index`: the rollouts run so far, this one included (its seed); `tree`: sample the groups as trees
        (`rollout_tree`, training only)."""
        with self.generation_model() as unwrapped_model:
            # One gather for the whole rollout phase (ZeRO-3): agents make different numbers of calls per rank, so
            # nothing collective may happen per call.
            self.engine.policy_version = step
            if isinstance(self.engine, TransformersEngine):
                self.engine.model = unwrapped_model
                self.engine.sync_weights()  # its inference copy takes this step's weights, gathered under ZeRO-3
            seed = None
            if isinstance(self.engine, TransformersEngine):
                # Episode i's calls sample from seeds derived from (seed, process, rollout), i and the call's index in
                # the episode (`run_episodes`): a resumed run samples what the run that was never stopped did, the
                # episodes' calls may interleave in any order (issue 29), and processes sharing a group do not sample
                # alike. Not for vLLM, which samples seeded requests one by one (a per-request generator).
                seed = rollout_seed(self.args.seed, self.process_index, rollout_index)
                self.engine.manual_seed(seed)  # requests without an episode seed, if any
            if stats is not None:
                stats.reset()
            # A thread of its own: works when the caller already runs an event loop (notebooks). `run_rollout`, not
            # `asyncio.run`: agents that ignore their timeout are abandoned, never awaited.
            spec = self.tree_spec() if tree else None
            if spec is not None:  # roots, then branches from them once they closed (rollout/tree_groups.py)
                rollout = run_tree_groups(
                    self.endpoint,
                    self.agent,
                    tasks,
                    num_generations,
                    spec,
                    max_concurrent=self.args.max_concurrent_episodes,
                    timeout=self.args.episode_timeout,
                    model=SERVED_MODEL_NAME,
                    seed=seed,
                )
            else:
                rollout = run_episodes(
                    self.endpoint,
                    self.agent,
                    tasks,
                    group_indices=[i % num_generations for i in range(len(tasks))],
                    max_concurrent=self.args.max_concurrent_episodes,
                    timeout=self.args.episode_timeout,
                    model=SERVED_MODEL_NAME,
                    seed=seed,
                )
            episodes = self.pool.submit(run_rollout, rollout).result()
        return episodes

    def batch_seed(self, index: int) -> int | None:
        # Seeds by batch index, not by rollout count: a resumed run samples its batches as the stopped one did.
        if isinstance(self.engine, TransformersEngine):
            return rollout_seed(self.args.seed, self.process_index, -1 - index)
        return None

    def make_producer(self, version: int):
        """The producer of the asynchronous schedule: in this process, or in a process of its own
        (`rollout_process`)."""
        if self.args.rollout_process:
            producer = ProcessRolloutProducer(
                self.model(),
                self._tokenizer,
                self.agent,
                engine_kwargs=dict(
                    max_batch_size=self.args.max_generation_batch_size,
                    batch_wait_ms=self.args.generation_batch_wait_ms,
                    max_context_length=self.engine.max_context_length,
                ),
                endpoint_kwargs=self.endpoint_kwargs,
                max_staleness=self.args.max_staleness,
                max_concurrent=self.args.max_concurrent_episodes,
                timeout=self.args.episode_timeout,
                model_name=SERVED_MODEL_NAME,
                version=version,
            )
        else:
            producer = RolloutProducer(
                self.endpoint,
                self.agent,
                max_staleness=self.args.max_staleness,
                max_concurrent=self.args.max_concurrent_episodes,
                timeout=self.args.episode_timeout,
                model=SERVED_MODEL_NAME,
                version=version,
                tree=self.tree_spec(),
            )
        return producer

    def sync_weights(self, version: int, producer, vllm_generation=None) -> None:
        """After an optimizer step: the engine takes the new weights (its inference copy; the rollout process's
        staging copy; with vLLM, `vllm_generation`: TRL's own sync with the vLLM server)."""
        if vllm_generation is not None:
            vllm_generation.sync_weights()
            self.engine.policy_version = version
        elif self.args.rollout_process:  # the shared staging copy; the child's engine takes it between decode steps
            producer.sync_weights(self.model(), version)
        else:
            with self.generation_model() as unwrapped_model:
                if isinstance(self.engine, TransformersEngine):
                    self.engine.model = unwrapped_model
                    self.engine.sync_weights(policy_version=version)
                else:
                    self.engine.policy_version = version

    def take_stats(self, producer):
        """The engine's work since the producer's last batch was taken (the producer never stops: taken, copied and
        reset at once): the rollout process's engine's, else the embedded engine's, else `None`."""
        if self.args.rollout_process:
            return producer.take_stats()
        return self.engine.take_stats() if getattr(self.engine, "stats", None) is not None else None

    def main_rows(self, prompts: list, rows_results, processing_class) -> list[Row]:
        """Each episode's main row; for an agent that never called the model, a placeholder row with nothing to train."""
        main_rows = []
        for prompt, result in zip(prompts, rows_results, strict=True):
            if result.rows:
                main_rows.append(result.rows[0])
            else:  # the agent never called the model: a placeholder row with nothing to train
                prompt_ids = processing_class.apply_chat_template(
                    prompt, add_generation_prompt=True, tokenize=True, return_dict=False, **self.chat_template_kwargs
                )
                main_rows.append(Row(list(prompt_ids), [self._tokenizer.pad_token_id], [0], [0.0], [], "empty"))
        return main_rows

    def close(self) -> None:
        """Stop the endpoint server and the rollout thread."""
        self.endpoint.stop()
        self.pool.shutdown(wait=False)


def rollout_output(main_rows: list[Row], episodes: list[Episode]) -> dict[str, list]:
    """TRL's `rollout_func` output: each episode's main row (its `env_mask` becomes TRL's `tool_mask`), and the
    episodes, an extra field TRL hands to the reward functions through the inputs."""
    return {
        "prompt_ids": [row.prompt_ids for row in main_rows],
        "completion_ids": [row.completion_ids for row in main_rows],
        "logprobs": [row.logprobs for row in main_rows],
        "env_mask": [row.env_mask for row in main_rows],
        "episodes": episodes,
    }


def log_engine_stats(stats, metrics) -> None:
    """The embedded engine's work during a rollout (continuous batching, KV reuse) into `metrics` (one mode's)."""
    metrics["engine/decode_occupancy"].append(stats.decode_occupancy)
    metrics["engine/mean_decode_batch"].append(stats.mean_decode_batch)
    prompt_tokens = stats.reused_tokens + stats.prefilled_tokens
    metrics["engine/reused_prompt_tokens"].append(stats.reused_tokens / prompt_tokens if prompt_tokens else 0.0)
