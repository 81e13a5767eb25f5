"""`AgenticGRPOTrainer`: TRL's GRPO on black-box agent episodes.

TRL's `GRPOTrainer` does everything it already does (rewards, group advantages, loss types, clipping, KL to the
reference, importance sampling, entropy, logging); we replace its single-turn generation with a rollout of G agent
episodes per task against an in-process OpenAI-compatible endpoint serving the live policy, through TRL's documented
`rollout_func` hook. Each episode's main row goes through TRL's pipeline; extra rows (forks, side calls) are appended
with their episode's advantage, and the generation batch is split into `steps_per_generation` micro-batches without
dropping any row (REFERENCES: ROLL#409).

TRL internals overridden (checked in tests/test_trl_compat.py): `_generate` (completions = episode messages),
`_generate_and_score_completions` (extra rows, episode metrics, per-token advantages from per-turn rewards, which
TRL's `_compute_loss` takes unchanged), `_prepare_inputs` (row-count-agnostic split, tasks
drawn as a batch is consumed), `_save_checkpoint` / `_load_optimizer_and_scheduler` (the trainer's own state in each
checkpoint: a resumed run is the run that was never stopped).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl import GRPOTrainer
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import shuffle_sequence_dict

from .agentic_grpo_config import AgenticGRPOConfig
from .alarms import attach_alarms
from .console import install_step_lines, quiet_known_warnings
from .endpoint import SERVED_MODEL_NAME  # also importable from here, as before
from .endpoint.launch import build_engine, launch_endpoint
from .envs.environment_factory import environment_factory_agent
from .generation.engine import GenerationEngine
from .generation.transformers_engine import TransformersEngine
from .generation.vllm_engine import VLLMColocateEngine, VLLMServerEngine
from .rewards.process import (
    TURN_REWARDS_KEY,
    combine_turn_rewards,
    row_token_advantages,
    turn_advantage_terms,
    turn_conversation_ids,
)
from .rewards.utils import RewardModelFunc, check_weighted_rewards, unscorable_unless_ok
from .rollout.agents import resolve_agent
from .rollout.harnesses import release_episodes
from .rollout.loss_weights import importance_sampling_ratio, micro_batch_scale, row_advantage_scales
from .rollout.process import ProcessRolloutProducer, ensure_picklable_agent
from .rollout.producer import RolloutProducer
from .rollout.rows import Row, episode_to_rows
from .rollout.runner import run_episodes, run_rollout
from .shared_prefix import MIN_SHARED_PREFIX, shared_prefix_length, shared_prefix_logps
from .task_sampling import AdaptiveTaskSampler, TaskSlots, group_split_rate
from .tiny_models import load_model_and_tokenizer
from .trace import EPISODE_STATUSES, Episode, json_text


logger = logging.get_logger(__name__)


def split_rows(batch: dict[str, Any], num_chunks: int) -> list[dict[str, Any]]:
    """Split a batch of R rows into `num_chunks` micro-batches of near-equal size, dropping none (TRL's
    `split_tensor_dict` floor-divides, which would drop rows when R is not a multiple of `num_chunks`)."""
    num_rows = len(batch["prompt_ids"])
    if num_rows < num_chunks:
        raise ValueError(f"Cannot split {num_rows} rows into {num_chunks} micro-batches.")
    bounds = [round(i * num_rows / num_chunks) for i in range(num_chunks + 1)]
    chunks = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0 or isinstance(value, list):
                chunk[key] = value[start:end]
            else:
                chunk[key] = value
        chunks.append(chunk)
    return chunks


def _padded(values: list[list[float]], width: int, device) -> torch.Tensor:
    """Per-token advantages of rows, right-padded with 0 to `width`: (R, width), as TRL pads completions."""
    return torch.tensor([v + [0.0] * (width - len(v)) for v in values], dtype=torch.float32, device=device)


def importance_sampling_masked_counts(ratio: torch.Tensor, loss_mask: torch.Tensor) -> tuple[int, int, int, int]:
    """What TRL's importance-sampling correction zeroes out of the loss: `(masked rows, rows, masked tokens, tokens)`,
    counted over the trained tokens (`loss_mask` (B, T) 1) and the rows holding any. `ratio` is TRL's
    `importance_sampling_ratio`, (B, 1) in `sequence_*` modes and (B, T) in `token_*` modes; a `*_mask` mode sets it to
    0 beyond the clip bounds. A masked row is one whose every trained token is zeroed: under asynchronous rollouts
    TRL's default (`sequence_mask`, `vllm_importance_sampling_clip_max=3`) drops a whole multi-turn row once its
    summed log-ratio passes log(3), which TRL's min/mean/max ratio metrics do not show (issue 40).

    Example:

    ```python
    >>> importance_sampling_masked_counts(torch.tensor([[0.0], [1.2]]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    (1, 2, 2, 3)
    ```
    """
    trained = loss_mask.bool()  # (B, T)
    zeroed = (ratio == 0).expand_as(trained) & trained  # (B, T)
    rows = trained.any(dim=1)  # (B,)
    masked_rows = rows & (zeroed.sum(dim=1) == trained.sum(dim=1))
    counts = torch.stack([masked_rows.sum(), rows.sum(), zeroed.sum(), trained.sum()])
    return tuple(counts.tolist())


def rollout_seed(seed: int, process_index: int, rollout: int) -> int:
    """The seed of one process's `rollout`-th rollout: distinct per process and rollout, the same in every run."""
    digest = hashlib.sha256(f"{seed}/{process_index}/{rollout}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def _log_digest(path: Path, size: int, window: int = 1 << 16) -> str | None:
    """A fingerprint of the first `size` bytes of an episode log (its first and last 64 KiB of them): a resumed run
    cuts the log only when it is the one its checkpoint counted."""
    if not path.exists():
        return None
    with path.open("rb") as f:
        head = f.read(min(size, window))
        f.seek(max(size - window, 0))
        tail = f.read(size - max(size - window, 0))
    return hashlib.sha256(head + b"|" + tail).hexdigest()


class _AsyncWeightSync(TrainerCallback):
    """Under asynchronous rollouts: the engine takes the new weights right after each optimizer step (episodes in
    flight go on with them), not only when the next step asks for its batch."""

    def __init__(self, trainer: AgenticGRPOTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._async_sync_weights()


class AgenticGRPOTrainer(GRPOTrainer):
    """GRPO on episodes of a black-box agent that talks to the policy through an OpenAI-compatible endpoint.

    Args:
        model: model id/path or a `PreTrainedModel` (as for `trl.GRPOTrainer`), or `"tiny:<family>[:<hidden>x<layers>]"`
            for a tiny randomly initialised model built locally (`trl_agentic.tiny_models`; its tokenizer comes with it).
        agent: `async def agent(client, task)`, a plain `def agent(client, task)`, or a `CommandAgent`. `client` is an
            `openai` client already pointed at the episode (model name `"policy"`); `task` is the dataset row.
        reward_funcs: TRL reward functions. They receive `completions` (each episode's messages after the prompt),
            `episodes` (the `Episode` objects; `episode.result` is the agent's return value) and the dataset
            columns. Return `None` for an episode that cannot be scored. Episodes that crashed, timed out, overflowed
            the context or hit a limit are unscorable unless the function sets `scores_failed_episodes = True`. A
            function that raises stops training, as in TRL, once the step's episodes are in the episode log; one that
            returns another count than episodes, or a reward beyond float32 (inf, 1e39), raises a `ValueError`.
        args: an `AgenticGRPOConfig`.
        engine: a `GenerationEngine`; defaults to the embedded `TransformersEngine` over the live policy.
        environment_factory: instead of `agent`, TRL's `environment_factory` (a class or zero-argument callable whose
            public methods are the tools, with `reset(**row)` and optionally `get_reward()`; or a dict of them
            selected by an `environment` column), run by a built-in agent over the endpoint: see
            `trl_agentic.envs.environment_factory` and docs/envs_environment_factory.md.
        reward_processing_classes: as in TRL, the tokenizer of each reward model in `reward_funcs` (one entry per
            reward function, `None` for plain functions and for reward models whose tokenizer loads from their path).
        tools: TRL's argument, refused: the agent owns its tools. Pass `agent=ToolAgent(tools=[...])`
            (`trl_agentic.tasks.agent_loop`) for TRL's tool loop over plain functions.

    Example:

    ```python
    >>> from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
    >>> from trl_agentic.tasks import get_task
    >>> task = get_task("calculator")
    >>> trainer = AgenticGRPOTrainer(
    ...     "Qwen/Qwen2.5-0.5B-Instruct", agent=task.agent, reward_funcs=task.reward_funcs,
    ...     args=AgenticGRPOConfig(output_dir="out", num_generations=8), train_dataset=task.build_dataset("train"),
    ... )
    >>> trainer.train()
    ```
    """

    _tag_names = ["trl", "grpo", "trl-agentic"]
    _name = "AgenticGRPO"
    _behaviour_correction = False  # set under async_rollouts with the embedded engine (see `use_vllm`)

    @property
    def use_vllm(self) -> bool:
        """TRL's flag, read where it computes the old logprobs and the importance-sampling correction between the
        sampling policy and the trainer's (`_generate_and_score_completions`, `_compute_loss`): also `True` under
        asynchronous rollouts with the embedded engine, whose tokens come from earlier policy versions (issue 30).
        Everything else TRL does with vLLM is not reached: `rollout_func` generates."""
        return self._use_vllm or self._behaviour_correction

    @use_vllm.setter
    def use_vllm(self, value: bool) -> None:
        self._use_vllm = value

    def __init__(
        self,
        model,
        agent=None,
        reward_funcs=None,
        args: AgenticGRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        engine: GenerationEngine | None = None,
        environment_factory=None,
        tools=None,
    ):
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
            if not isinstance(reward_funcs, list):
                reward_funcs = [reward_funcs]
            if reward_processing_classes is None:
                reward_processing_classes = [None] * len(reward_funcs)
            elif not isinstance(reward_processing_classes, list):
                reward_processing_classes = [reward_processing_classes]
            if len(reward_processing_classes) != len(reward_funcs):
                raise ValueError(
                    f"The number of reward processing classes ({len(reward_processing_classes)}) must match the "
                    f"number of reward functions ({len(reward_funcs)}): give `None` for the functions that are not "
                    "reward models."
                )
            reward_funcs = [
                RewardModelFunc(f, tokenizer=tok) if isinstance(f, str | torch.nn.Module) else f
                for f, tok in zip(reward_funcs, reward_processing_classes, strict=True)
            ]

        # Environments (TRL's `environment_factory`, issue 32): a built-in agent plays TRL's tool loop over the
        # endpoint, and the environments' `get_reward` join the reward sources (trl_agentic/envs/environment_factory.py)
        if environment_factory is not None:
            agent, reward_funcs = environment_factory_agent(
                environment_factory, agent, reward_funcs, args, train_dataset
            )

        # Agent
        if agent is None:
            raise ValueError(
                "Pass `agent=` (an async function (client, task), a CommandAgent, ...) or "
                "`environment_factory=` (TRL's environment contract)."
            )
        if reward_funcs is None:
            raise ValueError("No reward source provided. Pass `reward_funcs=` (TRL reward functions).")
        self.agent = resolve_agent(agent)

        # Reward functions: failed episodes are unscorable (NaN-excluded from the group baseline), never zero
        if not isinstance(reward_funcs, list):
            reward_funcs = [reward_funcs]
        reward_funcs = [unscorable_unless_ok(f) for f in reward_funcs]

        # `tiny:<family>[:<hidden>x<layers>]`: the locally built test models the CLI takes (no Hub download), with
        # their tokenizer unless one is given
        if isinstance(model, str) and model.startswith("tiny:"):
            model, tiny_tokenizer = load_model_and_tokenizer(model)
            processing_class = tiny_tokenizer if processing_class is None else processing_class

        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
        )
        # TRL's hook for custom rollouts; set after __init__ so TRL's "experimental" warning does not fire for a
        # use the package owns.
        self.rollout_func = self._rollout_episodes
        if environment_factory is not None:  # TRL's completion budget counts tool results: the agent measures them
            agent.use_tokenizer(self._tokenizer, args.max_completion_length, self.chat_template_kwargs)

        if args.rollout_process:  # before anything starts: a refusal leaves no server running
            self._check_rollout_process(engine)
        # Endpoint serving the live policy
        self.engine = engine or self._default_engine(args)
        self._endpoint_kwargs = dict(  # also the rollout process's (`rollout_process`)
            **args.sampling_kwargs(),  # TRL's sampling settings, `generation_kwargs` overriding them (issue 40)
            max_tokens=args.max_completion_length,
            max_turns=args.max_turns,
            max_episode_tokens=args.max_episode_tokens,
            chat_template_kwargs=self.chat_template_kwargs,
            max_open_episodes=args.max_open_episodes,
            episode_idle_timeout=args.episode_idle_timeout,
            host=args.endpoint_host,
        )
        self.endpoint = launch_endpoint(self.engine, self._tokenizer, port=args.endpoint_port, **self._endpoint_kwargs)
        self._pending_inputs: list[dict] | None = None
        self._seen_tasks: set[str] = set()  # the tasks drawn so far (their agent and difficulty columns, as JSON)
        self._rollouts = 0  # rollouts run so far (train and eval): each samples from a seed of its own
        self._rollout_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trl-agentic-rollout")
        self._episode_log_dir = Path(args.output_dir) / "episodes" if args.log_episodes else None
        # Asynchronous rollouts (issue 30): a producer runs the next batches' episodes while this one trains
        self._producer: RolloutProducer | None = None
        self._async_state: dict[str, Any] | None = None  # from a checkpoint, applied when the producer starts
        self._ready_episodes: list[Episode] | None = None  # the batch being scored, from the producer
        self._batch_versions: list[int] | None = None  # start version of each of its episodes
        if args.async_rollouts and not args.use_vllm:
            # The episodes of a batch were sampled by up to `max_staleness` earlier versions: TRL's importance-sampling
            # correction (behaviour -> the policy at the consuming step), which TRL applies when vLLM samples.
            self._behaviour_correction = True
            self._last_loaded_step = -1
            if not args.vllm_importance_sampling_correction:
                logger.warning(
                    "async_rollouts=True with vllm_importance_sampling_correction=False: tokens sampled by "
                    "earlier policy versions are trained without the importance-sampling correction."
                )

        if args.async_rollouts:  # the engine takes each optimizer step's weights at once, before logs and saves
            self.add_callback(_AsyncWeightSync(self))
        # Alarms (issue #11): training metrics checked against each other and a held-out split (trl_agentic/alarms/)
        self.alarms_callback = attach_alarms(self) if args.alarms else None
        self.alarms = self.alarms_callback.alarms if self.alarms_callback else []  # also in output_dir/alarms.json
        # The console: one line per step (after the alarms, so it shows those that fire), warnings a user can act on
        install_step_lines(self)
        quiet_known_warnings()

    def _check_rollout_process(self, engine: GenerationEngine | None) -> None:
        """`rollout_process=True`: what the child can rebuild (at construction, not at the first step)."""
        model = self.accelerator.unwrap_model(self.model)
        problems = []
        if engine is not None:
            problems.append("an `engine=` of your own (the child builds the embedded engine)")
        if self.accelerator.num_processes > 1:
            problems.append(f"{self.accelerator.num_processes} training processes (one only)")
        if hasattr(model, "peft_config"):
            problems.append("a PEFT model (merge the adapter, or train without rollout_process)")
        if any(p.device.type != "cpu" for p in model.parameters()):
            problems.append("a model off the CPU (on a GPU, serve the policy with vLLM: use_vllm=True, server mode)")
        if problems:
            raise ValueError(
                "rollout_process=True cannot run with " + "; ".join(problems) + ". Set rollout_process=False."
            )
        ensure_picklable_agent(self.agent)

    def _default_engine(self, args: AgenticGRPOConfig) -> GenerationEngine:
        context = args.vllm_max_model_length or self.accelerator.unwrap_model(self.model).config.max_position_embeddings
        if args.use_vllm and args.vllm_mode == "server":
            # TRL's VLLMGeneration keeps the server's weights in sync (sync_weights before each rollout phase).
            base_url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
            return VLLMServerEngine(base_url, max_context_length=context)
        if args.use_vllm:
            return VLLMColocateEngine(
                self.vllm_generation.llm, max_context_length=context, batch_wait_s=args.generation_batch_wait_ms / 1000
            )
        return build_engine(
            self.accelerator.unwrap_model(self.model),
            self._tokenizer,
            max_batch_size=args.max_generation_batch_size,
            batch_wait_ms=args.generation_batch_wait_ms,
            max_context_length=context,
            inference_copy=True,  # the module trains while abandoned calls may still decode (issue 29, M1)
            watch_weights=False,  # synced in each `_rollout_episodes`: no read of every weight per idle call
            seed=args.seed,
        )

    # Task sampling

    def _get_train_sampler(self, dataset=None):
        """TRL's `RepeatSampler`, or with `task_sampling="adaptive"` the slots of an [`AdaptiveTaskSampler`]'s batches
        ([`TaskSlots`]: the same layout, no task drawn), whose tasks `_prepare_inputs` draws as it consumes each
        generation batch. The sampler (`self.task_sampler`) is kept across calls so its estimates survive a new
        dataloader."""
        if self.args.task_sampling != "adaptive":
            return super()._get_train_sampler(dataset)
        if getattr(self, "task_sampler", None) is None:
            dataset = dataset if dataset is not None else self.train_dataset
            columns = list(self.args.agent_columns)
            if self.args.difficulty_column and self.args.difficulty_column not in columns:
                columns.append(self.args.difficulty_column)
            self.task_sampler = AdaptiveTaskSampler(
                dataset,
                num_generations=self.num_generations,
                tasks_per_batch=self.args.generation_batch_size // self.num_generations,
                repeat_count=self.num_iterations * self.args.steps_per_generation,
                difficulty_column=self.args.difficulty_column,
                target_difficulty=self.args.target_difficulty,
                target_min_share=self.args.target_min_share,
                target_affinity=self.args.target_affinity,
                explore=self.args.sampling_explore,
                memory=self.args.sampling_memory,
                revisit=self.args.sampling_revisit,
                key_columns=columns,
                seed=self.args.seed,
            )
        return TaskSlots(self.task_sampler)

    def _draw_generation_batch(self, num_slots: int) -> list[dict]:
        """This process's rows of a generation batch drawn now by the adaptive sampler (every process draws the same
        batch, and takes its slice as accelerate's batch sampler would have: process i the i-th of the batch's
        `num_processes` consecutive slices)."""
        indices = self.task_sampler.draw_batch()
        start = self.accelerator.process_index * num_slots
        return [self.train_dataset[i] for i in indices[start : start + num_slots]]

    def _mode(self) -> str:
        """`"train"` or `"eval"`: the trainer module's own flag, which the engine never touches (it generates with a
        module of its own, issue 29 M1)."""
        return "train" if self.model.training else "eval"

    def _observe_tasks(self, inputs: list[dict], episodes: list[Episode]) -> None:
        """Log the `sampling/*` metrics of this batch and feed the adaptive sampler (every rank sees every result, so
        every rank's sampler draws the same next tasks)."""
        mode = self._mode()
        column = self.args.difficulty_column
        weights = self.reward_weights.tolist()
        local = []
        for example, episode in zip(inputs, episodes, strict=True):
            scores = list((episode.metadata.get("rewards") or {}).values())
            scored = [w * v for w, v in zip(weights, scores, strict=False) if v is not None]
            keep = {c: example.get(c) for c in (*self.args.agent_columns, column) if c and c in example}
            local.append((keep, sum(scored) if scored else None, len(episode.turns), episode.num_malformed_tool_calls))
        gathered = gather_object(local)
        rows, rewards = [g[0] for g in gathered], [g[1] for g in gathered]
        keys = [json_text(row) for row in rows]
        # Tasks not drawn before in this run: to the policy what held-out tasks are (a revisited task may have been
        # learned by heart; on the demo, late in training, 0.56 success on revisits against 0.43 on first visits).
        seen = self._seen_tasks if mode == "train" else set()
        unseen = [key not in seen for key in keys]
        metrics = self._metrics[mode]
        group_size = self.num_generations if mode == "train" else self.num_generations_eval  # (issue 29, L4)
        metrics["sampling/split_rate"].append(group_split_rate(rewards, group_size))
        if mode == "train" and unseen:  # share of groups whose task this run had drawn before
            firsts = unseen[::group_size]
            metrics["sampling/revisit_share"].append(1.0 - sum(firsts) / len(firsts))
        sampler = getattr(self, "task_sampler", None)
        if column and rows and column in rows[0]:
            levels = [row[column] for row in rows]
            if all(isinstance(v, int | float) and not isinstance(v, bool) for v in levels):
                metrics["sampling/difficulty_mean"].append(sum(levels) / len(levels))
                threshold = sampler.success_threshold if sampler is not None else 1.0
                for level in sorted(set(levels)):
                    outcomes = [
                        float(r >= threshold)
                        for lv, r in zip(levels, rewards, strict=True)
                        if lv == level and r is not None
                    ]
                    metrics[f"sampling/share/{level:g}"].append(levels.count(level) / len(levels))
                    # What `malformed_tool_calls` compares at the same mix of difficulties: model calls at this level
                    # in the step (a count), its groups, and the share of the calls with a malformed tool call.
                    calls = sum(g[2] for lv, g in zip(levels, gathered, strict=True) if lv == level)
                    metrics[f"sampling/model_calls/{level:g}"].append(float(calls))
                    metrics[f"sampling/groups/{level:g}"].append(levels.count(level) / group_size)
                    # ... and what `unscorable_episodes` compares: the level's episodes and the share left unscored.
                    metrics[f"sampling/episodes/{level:g}"].append(float(levels.count(level)))
                    metrics[f"sampling/unscorable/{level:g}"].append(
                        sum(r is None for lv, r in zip(levels, rewards, strict=True) if lv == level)
                        / levels.count(level)
                    )
                    if calls:
                        malformed = sum(g[3] for lv, g in zip(levels, gathered, strict=True) if lv == level)
                        metrics[f"sampling/malformed_rate/{level:g}"].append(malformed / calls)
                    if outcomes:
                        metrics[f"sampling/success/{level:g}"].append(sum(outcomes) / len(outcomes))
                        if level in self._target_levels():  # what the reward_hacking alarm holds to held-out
                            metrics["sampling/target_success"].append(sum(outcomes) / len(outcomes))
                            fresh = [
                                float(r >= threshold)
                                for lv, r, new in zip(levels, rewards, unseen, strict=True)
                                if lv == level and r is not None and new
                            ]
                            if fresh:
                                metrics["sampling/target_success_unseen"].append(sum(fresh) / len(fresh))
        if mode == "train":
            self._seen_tasks.update(keys)
        if sampler is not None and mode == "train":
            sampler.observe(rows, rewards)
            for level, value in sampler.estimates().items():
                metrics[f"sampling/estimate/{level:g}"].append(value)
            for level, value in sampler.split_rates().items():
                metrics[f"sampling/split_estimate/{level:g}"].append(value)

    def _target_levels(self) -> tuple:
        """The target difficulty: the sampler's, else `target_difficulty`, else none (a mix without a target)."""
        sampler = getattr(self, "task_sampler", None)
        if sampler is not None:
            return tuple(sampler.targets)
        return () if self.args.target_difficulty is None else (self.args.target_difficulty,)

    # Rollout

    def _rollout_episodes(self, prompts: list, trainer=None) -> dict[str, list]:
        """TRL's `rollout_func`: run one episode per generation slot and return its main row (plus the episodes)."""
        inputs = self._pending_inputs
        num_generations = self.num_generations if self.model.training else self.num_generations_eval
        # The agent sees only the columns meant for it: the checker's (`answer`, `expected`) stay on this side, where
        # every column still reaches the reward functions (issue #9: an agent returning task["answer"] scored 1.0).
        missing = [c for c in self.args.agent_columns if c not in inputs[0]]
        if missing:
            raise ValueError(
                f"agent_columns names {missing}, which the dataset does not have; its columns are "
                f"{sorted(inputs[0])}. Fix `agent_columns`."
            )
        tasks = [{c: example[c] for c in self.args.agent_columns} for example in inputs]
        stats = getattr(self.engine, "stats", None)
        from_producer = self._ready_episodes is not None
        if from_producer:  # asynchronous rollouts: the producer ran them (`_prepare_inputs`)
            episodes, self._ready_episodes = self._ready_episodes, None
            # The engine's work since the last step's batch (the producer never stops: taken, copied and reset at once)
            if self.args.rollout_process:  # the child's engine's
                stats = self._producer.take_stats()
            elif stats is not None:
                stats = self.engine.take_stats()
        else:
            episodes = self._run_rollout(tasks, num_generations, stats)
        if stats is not None:  # the embedded engine's work during this rollout (continuous batching, KV reuse)
            mode = self._mode()
            self._metrics[mode]["engine/decode_occupancy"].append(stats.decode_occupancy)
            self._metrics[mode]["engine/mean_decode_batch"].append(stats.mean_decode_batch)
            prompt_tokens = stats.reused_tokens + stats.prefilled_tokens
            self._metrics[mode]["engine/reused_prompt_tokens"].append(
                stats.reused_tokens / prompt_tokens if prompt_tokens else 0.0
            )
        rows_results = [
            episode_to_rows(
                ep.turns,
                self.args.max_rows_per_episode,
                forks=self.args.forks,
                side_calls=self.args.side_calls,
                sub_agents=self.args.sub_agents,
            )
            for ep in episodes
        ]
        if from_producer:
            self._check_staleness(episodes, rows_results, num_generations)
        main_rows = []
        for prompt, result in zip(prompts, rows_results, strict=True):
            if result.rows:
                main_rows.append(result.rows[0])
            else:  # the agent never called the model: a placeholder row with nothing to train
                prompt_ids = self.processing_class.apply_chat_template(
                    prompt, add_generation_prompt=True, tokenize=True, return_dict=False, **self.chat_template_kwargs
                )
                main_rows.append(Row(list(prompt_ids), [self._tokenizer.pad_token_id], [0], [0.0], [], "empty"))
        self._pending_rows = rows_results
        return {
            "prompt_ids": [row.prompt_ids for row in main_rows],
            "completion_ids": [row.completion_ids for row in main_rows],
            "logprobs": [row.logprobs for row in main_rows],
            "env_mask": [row.env_mask for row in main_rows],
            "episodes": episodes,
        }

    def _run_rollout(self, tasks: list[dict], num_generations: int, stats) -> list[Episode]:
        """Run this process's episodes now, on the current weights (the synchronous schedule, and evaluation)."""
        with unwrap_model_for_generation(
            self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation
        ) as unwrapped_model:
            # One gather for the whole rollout phase (ZeRO-3): agents make different numbers of calls per rank, so
            # nothing collective may happen per call.
            self.engine.policy_version = self.state.global_step
            if isinstance(self.engine, TransformersEngine):
                self.engine.model = unwrapped_model
                self.engine.sync_weights()  # its inference copy takes this step's weights, gathered under ZeRO-3
            self._rollouts += 1
            seed = None
            if isinstance(self.engine, TransformersEngine):
                # Episode i's calls sample from seeds derived from (seed, process, rollout), i and the call's index in
                # the episode (`run_episodes`): a resumed run samples what the run that was never stopped did, the
                # episodes' calls may interleave in any order (issue 29), and processes sharing a group do not sample
                # alike. Not for vLLM, which samples seeded requests one by one (a per-request generator).
                seed = rollout_seed(self.args.seed, self.accelerator.process_index, self._rollouts)
                self.engine.manual_seed(seed)  # requests without an episode seed, if any
            if stats is not None:
                stats.reset()
            # A thread of its own: works when the caller already runs an event loop (notebooks). `run_rollout`, not
            # `asyncio.run`: agents that ignore their timeout are abandoned, never awaited.
            episodes = self._rollout_pool.submit(
                run_rollout,
                run_episodes(
                    self.endpoint,
                    self.agent,
                    tasks,
                    group_indices=[i % num_generations for i in range(len(tasks))],
                    max_concurrent=self.args.max_concurrent_episodes,
                    timeout=self.args.episode_timeout,
                    model=SERVED_MODEL_NAME,
                    seed=seed,
                ),
            ).result()
        return episodes

    def _check_staleness(self, episodes: list[Episode], rows_results, group_size: int) -> None:
        """The bound, checked on what is trained: an episode's staleness is the version gap between this step and its
        oldest trained token. A group holding a token beyond `max_staleness` (none under the producer's pacing; a
        resumed run with a lower bound could) is dropped: its rows train nothing, and it is counted."""
        consume = self.state.global_step
        staleness, dropped = [], 0
        for start in range(0, len(episodes), group_size):
            group = range(start, min(start + group_size, len(episodes)))
            gaps = []
            for i in group:
                versions = [row.oldest_version for row in rows_results[i].rows if row.oldest_version is not None]
                gap = consume - min(versions) if versions else None
                episodes[i].metadata["staleness"] = gap
                if gap is not None:
                    gaps.append(gap)
            if gaps and max(gaps) > self.args.max_staleness:
                dropped += 1
                for i in group:
                    episodes[i].metadata["dropped"] = True
                    for row in rows_results[i].rows:
                        row.env_mask = [0] * len(row.env_mask)
            staleness += gaps
        if dropped:
            logger.warning(
                f"Step {consume}: {dropped} group(s) held tokens sampled more than max_staleness="
                f"{self.args.max_staleness} versions ago and were dropped (not trained; in the episode log "
                "with `dropped`)."
            )
        device = self.accelerator.device
        local = torch.tensor(
            [float(dropped), float(len(staleness)), float(sum(staleness)), float(max(staleness, default=0))],
            device=device,
        )
        gathered = self.accelerator.gather(local.unsqueeze(0))
        metrics = self._metrics["train"]
        metrics["async/dropped_groups"].append(gathered[:, 0].sum().item())
        count = gathered[:, 1].sum().item()
        metrics["async/staleness_mean"].append(gathered[:, 2].sum().item() / count if count else 0.0)
        metrics["async/staleness_max"].append(gathered[:, 3].max().item())

    def _generate(self, prompts: list):
        if self._behaviour_correction:  # TRL would sync a vLLM it does not have (`use_vllm`)
            self._last_loaded_step = self.state.global_step
        prompt_ids, completion_ids, tool_mask, _, logprobs, extra_fields, images, tool_images = super()._generate(
            prompts
        )
        # Reward functions see what the agent saw: the episode's messages after the prompt, not a re-parse of ids.
        completions = [
            episode.messages[len(prompt) :] if episode.messages else []
            for episode, prompt in zip(extra_fields["episodes"], prompts, strict=True)
        ]
        return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images

    def _generate_and_score_completions(self, inputs):
        self._pending_inputs = inputs
        output = super()._generate_and_score_completions(inputs)
        episodes = [example["episodes"] for example in inputs]
        rows_results = self._pending_rows
        self._pending_inputs = self._pending_rows = None

        # Spread each episode's advantage over its rows so that every sampled token weighs what TRL's loss would give
        # it if the episode were one sequence (rollout/loss_weights.py); one row per episode leaves TRL's batch as is.
        advantages = episode_advantages = output["advantages"]
        scales = [
            row_advantage_scales(
                [row.num_sampled_tokens for row in result.rows], self.loss_type, self.args.row_weighting
            )
            or [1.0]
            for result in rows_results
        ]
        # Per-turn (process) rewards, when the batch has any: one advantage per completion token, (B, T), which TRL's
        # loss takes as it takes (B,) (rewards/process.py); without, TRL's (B,) exactly as before.
        terms = self._turn_advantage_terms(episodes)
        if terms is None:
            output["advantages"] = advantages * torch.tensor([s[0] for s in scales], device=advantages.device)
        else:
            token_advantages = [
                row_token_advantages(result.rows, ep.turns, advantages[i].item(), terms[i], scales[i])
                or [[advantages[i].item()]]  # the placeholder row of an episode without model calls
                for i, (ep, result) in enumerate(zip(episodes, rows_results, strict=True))
            ]
            output["advantages"] = _padded(
                [rows[0] for rows in token_advantages], output["completion_ids"].size(1), advantages.device
            )
        extra_rows, extra_advantages = [], []
        for i, result in enumerate(rows_results):
            for k, (row, scale) in enumerate(zip(result.rows[1:], scales[i][1:], strict=True), start=1):
                extra_rows.append(row)
                extra_advantages.append(advantages[i] * scale if terms is None else token_advantages[i][k])
        # Every rank appends the same number of rows (padding with empty, zero-advantage rows), so the forward passes
        # that score them, and any collective they imply (DDP buffers, ZeRO-3 gathers), match across ranks.
        num_extra = int(self.accelerator.gather(torch.tensor([len(extra_rows)], device=advantages.device)).max())
        pad_id = self._tokenizer.pad_token_id
        while len(extra_rows) < num_extra:
            extra_rows.append(Row([pad_id], [pad_id], [0], [0.0], [], "padding"))
            extra_advantages.append(torch.zeros((), device=advantages.device) if terms is None else [0.0])
        if extra_rows:
            extra = (
                torch.stack(extra_advantages)
                if terms is None
                else _padded(extra_advantages, max(len(v) for v in extra_advantages), advantages.device)
            )
            output = self._append_rows(output, extra_rows, extra)
        if "importance_sampling_ratio" in output:  # beside TRL's ratio metrics: what its correction zeroed
            self._log_importance_sampling_masked(output)

        self._log_episodes(episodes, rows_results, episode_advantages, inputs)
        self._observe_tasks(inputs, episodes)
        return output

    def _log_importance_sampling_masked(self, output: dict) -> None:
        """`sampling/importance_sampling_masked_rows` and `_tokens`: the share of the batch's rows (those with a trained
        token, every process) and of its trained tokens that TRL's importance-sampling correction zeroed."""
        loss_mask = output["completion_mask"] * output["tool_mask"]  # (B, T): what the loss trains
        counts = importance_sampling_masked_counts(output["importance_sampling_ratio"], loss_mask)
        total = self.accelerator.gather(torch.tensor([counts], device=loss_mask.device)).sum(dim=0).tolist()
        metrics = self._metrics[self._mode()]
        metrics["sampling/importance_sampling_masked_rows"].append(total[0] / total[1] if total[1] else 0.0)
        metrics["sampling/importance_sampling_masked_tokens"].append(total[2] / total[3] if total[3] else 0.0)

    def _turn_advantage_terms(self, episodes: list[Episode]) -> list[list[float] | None] | None:
        """The per-turn term of each of this process's episodes' advantages (`rewards/process.py`), or `None` when no
        episode of the batch, on any process, has per-turn rewards (or `turn_reward_weight` is 0)."""
        weights = dict(zip(self.reward_func_names, self.reward_weights.tolist(), strict=True))
        # Groups may span processes; rewards flow along each conversation (lineage), never across (issue 40)
        gathered = gather_object([(combine_turn_rewards(ep, weights), turn_conversation_ids(ep)) for ep in episodes])
        everyone = [rewards for rewards, _ in gathered]
        if all(rewards is None for rewards in everyone):
            return None
        mode = self._mode()
        terms = turn_advantage_terms(
            everyone,
            self.num_generations if mode == "train" else self.num_generations_eval,
            discount=self.args.turn_reward_discount,
            normalization=self.args.turn_reward_normalization,
            weight=self.args.turn_reward_weight,
            conversations=[conversations for _, conversations in gathered],
        )
        rewarded = [r for rewards in everyone if rewards is not None for r in rewards if r is not None]
        self._metrics[mode]["turn_rewards/mean"].append(sum(rewarded) / len(rewarded) if rewarded else math.nan)
        self._metrics[mode]["turn_rewards/rewarded_turns"].append(float(len(rewarded)))
        start = self.accelerator.process_index * len(episodes)
        local = terms[start : start + len(episodes)]
        for episode, term in zip(episodes, local, strict=True):
            if term is not None:
                episode.metadata["turn_advantages"] = term  # in the episode log, beside the episode's advantage
        return local if self.args.turn_reward_weight != 0 else None

    def _append_rows(self, output: dict, rows: list[Row], advantages: torch.Tensor) -> dict:
        """Append rows to TRL's padded generation batch, with the per-token logps TRL computed for the others."""
        device = self.accelerator.device
        pad_id = self._tokenizer.pad_token_id
        prompt_width = max(output["prompt_ids"].size(1), max(len(r.prompt_ids) for r in rows))
        completion_width = max(output["completion_ids"].size(1), max(len(r.completion_ids) for r in rows))

        def left(values: list[list], fill) -> torch.Tensor:
            return torch.tensor([[fill] * (prompt_width - len(v)) + v for v in values], device=device)

        def right(values: list[list], fill, dtype=None) -> torch.Tensor:
            return torch.tensor([v + [fill] * (completion_width - len(v)) for v in values], device=device, dtype=dtype)

        def widen(tensor: torch.Tensor, width: int, fill, side: str) -> torch.Tensor:
            missing = width - tensor.size(1)
            if missing == 0:
                return tensor
            padding = torch.full((tensor.size(0), missing), fill, dtype=tensor.dtype, device=tensor.device)
            return torch.cat([padding, tensor] if side == "left" else [tensor, padding], dim=1)

        new = {
            "prompt_ids": left([r.prompt_ids for r in rows], pad_id),
            "prompt_mask": left([[1] * len(r.prompt_ids) for r in rows], 0),
            "completion_ids": right([r.completion_ids for r in rows], pad_id),
            "completion_mask": right([[1] * len(r.completion_ids) for r in rows], 0),
            "tool_mask": right([r.env_mask for r in rows], 1),
            # An engine that could not score a token reports None: NaN, as TRL maps it (zeroed in the IS ratio).
            "sampling_per_token_logps": right(
                [[math.nan if lp is None else lp for lp in r.logprobs] for r in rows], 0.0, torch.float32
            ),
        }
        if self.mask_truncated_completions:
            # TRL's rule for its own rows (DAPO's overlong filtering): a row whose last token is not a stop token was
            # cut at `max_tokens` and is left out of the loss; masked before scoring, as TRL does.
            ends = {*self.eos_token_ids, pad_id}
            ended = torch.tensor(
                [[int(bool(r.completion_ids) and r.completion_ids[-1] in ends)] for r in rows], device=device
            )
            new["completion_mask"] = new["completion_mask"] * ended
        if "old_per_token_logps" in output or "ref_per_token_logps" in output:
            input_ids = torch.cat([new["prompt_ids"], new["completion_ids"]], dim=1)
            attention_mask = torch.cat([new["prompt_mask"], new["completion_mask"]], dim=1)
            batch_size = self.args.per_device_train_batch_size
            with torch.no_grad():
                if "old_per_token_logps" in output:
                    new["old_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                        self.model, input_ids, attention_mask, completion_width, batch_size=batch_size
                    )
                if "ref_per_token_logps" in output:
                    new["ref_per_token_logps"] = self._reference_logps(input_ids, attention_mask, completion_width)
        if "importance_sampling_ratio" in output:
            # The rule TRL applied to the main rows (mode, clip bounds, NaN handling), with TRL's shape for the mode:
            # (B, 1) in sequence_* modes, (B, T) in token_* modes.
            new["importance_sampling_ratio"] = importance_sampling_ratio(
                new["old_per_token_logps"],
                new["sampling_per_token_logps"],
                new["completion_mask"] * new["tool_mask"],
                self.vllm_importance_sampling_mode,
                self.vllm_importance_sampling_clip_min,
                self.vllm_importance_sampling_clip_max,
            )

        merged = dict(output)
        for key, tensor in new.items():
            if key not in output and key not in ("tool_mask", "sampling_per_token_logps"):
                continue
            if key == "importance_sampling_ratio" and tensor.size(1) == 1:  # sequence_* modes: one ratio per row
                merged[key] = torch.cat([output[key], tensor], dim=0)
                continue
            current = output.get(key)
            if current is None:  # e.g. no tool_mask in TRL's output: ones
                current = torch.ones_like(output["completion_mask"]) if key == "tool_mask" else None
                if current is None:
                    continue
            side = "left" if key.startswith("prompt") else "right"
            width = prompt_width if side == "left" else completion_width
            # Past a row's end a token-level IS ratio is 1, as TRL pads it (a zero difference, exp(0)).
            fill = {
                "prompt_ids": pad_id,
                "completion_ids": pad_id,
                "tool_mask": 1,
                "importance_sampling_ratio": 1.0,
            }.get(key, 0)
            merged[key] = torch.cat([widen(current, width, fill, side), widen(tensor, width, fill, side)], dim=0)
        if advantages.dim() == 2:  # per-token advantages (per-turn rewards): padded as the completions
            merged["advantages"] = torch.cat(
                [
                    widen(output["advantages"], completion_width, 0.0, "right"),
                    widen(advantages, completion_width, 0.0, "right"),
                ]
            )
        else:
            merged["advantages"] = torch.cat([output["advantages"], advantages])
        loss_mask = merged["completion_mask"] * merged["tool_mask"]
        merged["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()  # every rank appends (see above)
        return merged

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **model_inputs,
    ):
        """TRL's, with the prompt prefix the rows share (system prompt, tool schemas, the task) computed once per
        chunk instead of once per row (`trl_agentic/shared_prefix.py`; `args.shared_prefix_scoring`)."""
        if not self._shared_prefix_scoring(model, compute_aux_loss, model_inputs):
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **model_inputs,
            )
        batch_size = batch_size or input_ids.size(0)
        all_logps, all_entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            prefix_length = shared_prefix_length(ids, mask, logits_to_keep)
            with self.accelerator.autocast():
                if prefix_length < MIN_SHARED_PREFIX:
                    logps, entropies, _ = super()._get_per_token_logps_and_entropies(
                        model, ids, mask, logits_to_keep, compute_entropy=compute_entropy
                    )
                else:
                    logps, entropies = shared_prefix_logps(
                        model, ids, mask, logits_to_keep, prefix_length, compute_entropy=compute_entropy
                    )
            all_logps.append(logps)
            all_entropies.append(entropies)
        entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
        return torch.cat(all_logps, dim=0), entropies, None

    def _shared_prefix_scoring(self, model, compute_aux_loss: bool, model_inputs: dict) -> bool:
        """Whether rows may be scored with their shared prefix computed once: asked for, text-only, not MoE, and a
        plain model on one process (a DDP, DeepSpeed or FSDP wrapper expects one forward per backward; checkpointed
        layers drop the key/value states the rest attends to)."""
        if not self.args.shared_prefix_scoring or compute_aux_loss:
            return False
        if any(value is not None for value in model_inputs.values()):
            return False
        if self.accelerator.num_processes > 1 or self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return False
        unwrapped = self.accelerator.unwrap_model(model)
        # `is_activation_checkpointing` from transformers 5 (the old name warns on every call), else the old name
        checkpointing = getattr(unwrapped, "is_activation_checkpointing", None)
        if checkpointing is None:
            checkpointing = getattr(unwrapped, "is_gradient_checkpointing", False)
        return not checkpointing

    def _reference_logps(self, input_ids, attention_mask, logits_to_keep):
        if self.ref_model is not None:
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.ref_model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=self.args.per_device_train_batch_size,
            )
            return logps
        from trl.models.utils import use_adapter

        model = self.accelerator.unwrap_model(self.model)
        with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, logits_to_keep, batch_size=self.args.per_device_train_batch_size
            )
        return logps

    def _prepare_inputs(self, generation_batch):
        # TRL's schedule (generate every steps_per_generation * num_iterations micro-steps), with a split that keeps
        # every row: the number of micro-steps never depends on the row count, so ranks always agree.
        mode = "train" if self.model.training else "eval"
        if mode == "eval":
            num_episodes = len(generation_batch)
            batch = self._generate_and_score_completions(generation_batch)
            batch["advantages"] = batch["advantages"] * micro_batch_scale(
                len(batch["advantages"]), num_episodes, self.loss_type, self.args.row_weighting
            )
            return batch
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self.args.async_rollouts:
            self._async_sync_weights()  # every micro-step: the version moves at each optimizer step
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            if self.args.async_rollouts:  # the producer's batch: its tasks were drawn when it was submitted
                generation_batch = self._async_take_batch(len(generation_batch))
            elif self.args.task_sampling == "adaptive":  # drawn now, after every earlier batch's results (L2)
                generation_batch = self._draw_generation_batch(len(generation_batch))
            num_episodes = len(generation_batch)
            generation_batch = self._generate_and_score_completions(generation_batch)
            generation_batch = shuffle_sequence_dict(generation_batch)
            chunks = split_rows(generation_batch, self.args.steps_per_generation)
            # Losses normalised by the row count see B_rows rows where TRL would see B_episodes sequences.
            episodes_per_chunk = num_episodes / self.args.steps_per_generation
            for chunk in chunks:
                chunk["advantages"] = chunk["advantages"] * micro_batch_scale(
                    len(chunk["advantages"]), episodes_per_chunk, self.loss_type, self.args.row_weighting
                )
            self._buffered_inputs = chunks
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    # Asynchronous rollouts (issue 30)

    def _consume_version(self, batch: int) -> int:
        """The global step at which generation batch `batch` (counted from the producer's first start) is consumed."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self._async["offset"] + batch * generate_every // self.args.gradient_accumulation_steps

    def _task_batches(self):
        """The global generation batches of dataset indices in the order the dataloader would yield them (each
        once, not `num_iterations * steps_per_generation` times): TRL's `RepeatSampler`, epoch after epoch."""
        sampler = super()._get_train_sampler()
        size, repeats = self.args.generation_batch_size, sampler.repeat_count
        while True:
            indices = list(iter(sampler))
            if len(indices) < size:
                raise ValueError(
                    f"The training dataset makes no whole generation batch of {size} episodes "
                    f"({len(indices)} slots per epoch)."
                )
            for start in range(0, len(indices) - size + 1, size * repeats):
                yield indices[start : start + size]

    def _async_draw(self) -> list[int]:
        """The next global generation batch's dataset indices (every process draws the same)."""
        self._async["drawn"] += 1
        if self.args.task_sampling == "adaptive":
            return self.task_sampler.draw_batch()
        return next(self._async["stream"])

    def _async_start(self, num_slots: int) -> None:
        """Start the producer (first training batch, or after a resume): resubmit a checkpoint's pending batches."""
        saved = self._async_state or {}
        # `offset`: the step of batch 0 (a run resumed from a checkpoint saved without asynchronous rollouts)
        self._async = {
            "consumed": saved.get("consumed", 0),
            "drawn": saved.get("drawn", 0),
            "pending": {},
            "offset": saved.get("offset", self.state.global_step),
            "num_slots": num_slots,
            "version": None,
        }
        self._async_state = None
        if self.args.task_sampling != "adaptive":
            self._async["stream"] = self._task_batches()
            for _ in range(self._async["drawn"]):  # where the stopped run's stream was
                next(self._async["stream"])
        if self.args.rollout_process:
            self._producer = ProcessRolloutProducer(
                self.accelerator.unwrap_model(self.model),
                self._tokenizer,
                self.agent,
                engine_kwargs=dict(
                    max_batch_size=self.args.max_generation_batch_size,
                    batch_wait_ms=self.args.generation_batch_wait_ms,
                    max_context_length=self.engine.max_context_length,
                ),
                endpoint_kwargs=self._endpoint_kwargs,
                max_staleness=self.args.max_staleness,
                max_concurrent=self.args.max_concurrent_episodes,
                timeout=self.args.episode_timeout,
                model_name=SERVED_MODEL_NAME,
                version=self.state.global_step,
            )
        else:
            self._producer = RolloutProducer(
                self.endpoint,
                self.agent,
                max_staleness=self.args.max_staleness,
                max_concurrent=self.args.max_concurrent_episodes,
                timeout=self.args.episode_timeout,
                model=SERVED_MODEL_NAME,
                version=self.state.global_step,
            )
        self._async_sync_weights()
        # The batches the stopped run had drawn but not trained: their episodes were lost with it; run them again.
        for index, indices in sorted((int(k), v) for k, v in saved.get("pending", {}).items()):
            self._async_submit(index, indices)

    def _async_submit(self, index: int, indices: list[int]) -> None:
        num_slots = self._async["num_slots"]
        start = self.accelerator.process_index * num_slots
        inputs = [self.train_dataset[i] for i in indices[start : start + num_slots]]
        self._async["pending"][index] = (indices, inputs)
        tasks = [{c: example[c] for c in self.args.agent_columns} for example in inputs]
        missing = [c for c in self.args.agent_columns if c not in inputs[0]]
        if missing:
            raise ValueError(
                f"agent_columns names {missing}, which the dataset does not have; its columns are "
                f"{sorted(inputs[0])}. Fix `agent_columns`."
            )
        # Seeds by batch index, not by rollout count: a resumed run samples its batches as the stopped one did.
        seed = None
        if isinstance(self.engine, TransformersEngine):
            seed = rollout_seed(self.args.seed, self.accelerator.process_index, -1 - index)
        self._producer.submit(
            index,
            tasks,
            [i % self.num_generations for i in range(len(tasks))],
            consume_version=self._consume_version(index),
            unit_size=self.num_generations,
            seed=seed,
        )

    def _async_fill(self) -> None:
        """Submit every batch the producer may start at the current version (pacing: `max_staleness`)."""
        version = self.state.global_step
        while self._consume_version(self._async["drawn"]) - self.args.max_staleness <= version:
            index = self._async["drawn"]
            self._async_submit(index, self._async_draw())

    def _async_sync_weights(self) -> None:
        """After an optimizer step: the engine takes the new weights (its inference copy, or TRL's vLLM sync) and the
        producer learns the version. Episodes in flight go on with the new weights."""
        if self._producer is None or self._async["version"] == self.state.global_step:
            return
        version = self.state.global_step
        if self._use_vllm:
            self.vllm_generation.sync_weights()  # TRL's own sync with the vLLM server
            self._last_loaded_step = version
            self.engine.policy_version = version
        elif self.args.rollout_process:  # the shared staging copy; the child's engine takes it between decode steps
            self._producer.sync_weights(self.accelerator.unwrap_model(self.model), version)
        else:
            with unwrap_model_for_generation(
                self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation
            ) as unwrapped_model:
                if isinstance(self.engine, TransformersEngine):
                    self.engine.model = unwrapped_model
                    self.engine.sync_weights(policy_version=version)
                else:
                    self.engine.policy_version = version
        self._async["version"] = version
        self._producer.set_version(version)

    def _async_take_batch(self, num_slots: int) -> list[dict]:
        """This process's rows of the next generation batch, its episodes run by the producer (waited for)."""
        if self._producer is None:
            self._async_start(num_slots)
        self._async_fill()
        index = self._async["consumed"]
        if index not in self._async["pending"]:  # every batch up to this step's is submitted by `_async_fill`
            raise RuntimeError(f"Generation batch {index} was never submitted to the producer.")
        episodes, waited = self._producer.result(index)
        _, inputs = self._async["pending"].pop(index)
        self._async["consumed"] += 1
        metrics = self._metrics["train"]
        metrics["async/trainer_wait_s"].append(waited)
        metrics["async/producer_wait_s"].append(self._producer.take_idle_seconds())
        metrics["async/in_flight_episodes"].append(float(self._producer.running))
        self._ready_episodes = episodes
        return inputs

    def _stop_producer(self) -> None:
        """End the producer (after `train`): episodes of batches no step will train are cancelled. A later `train`
        starts it again from the batches it had not trained."""
        if self._producer is None:
            return
        self._producer.close()
        self._producer = None
        self._async_state = self._async_checkpoint_state()

    def _async_checkpoint_state(self) -> dict[str, Any]:
        state = getattr(self, "_async", None)
        if state is None:
            return self._async_state or {}
        return {
            "consumed": state["consumed"],
            "drawn": state["drawn"],
            "offset": state["offset"],
            "pending": {str(k): v[0] for k, v in state["pending"].items()},
        }

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            self._stop_producer()

    # Checkpoints: everything the trainer holds besides TRL's state, so that a resumed run is the run that was never
    # stopped (issue 29, M4). One file per process, as transformers' RNG states.

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        folder.mkdir(parents=True, exist_ok=True)
        generate_every = self.args.steps_per_generation * self.num_iterations
        buffered = self._buffered_inputs is not None and self._step % generate_every != 0
        state = {
            "task_sampler": self.task_sampler.state_dict() if getattr(self, "task_sampler", None) else None,
            "seen_tasks": sorted(self._seen_tasks),
            "alarms": self.alarms_callback.state_dict() if self.alarms_callback is not None else None,
            "metrics": {mode: dict(values) for mode, values in self._metrics.items()},  # not logged yet
            "step": self._step,
            "rollouts": self._rollouts,
            "buffered_inputs": buffered,
            # The producer's batches drawn and not trained yet: their episodes are not saved (they run again on
            # resume, from the same tasks and seeds); nothing trained twice, no task skipped.
            "async": self._async_checkpoint_state() if self.args.async_rollouts else None,
        }
        # The log's length at this step: a resumed run cuts what the stopped run logged after it, once it has checked
        # (`_log_digest`) that the log it finds is this one.
        log = self._episode_log_path() if self._episode_log_dir is not None else None
        state["episode_log_bytes"] = log.stat().st_size if log is not None and log.exists() else 0
        state["episode_log_digest"] = _log_digest(log, state["episode_log_bytes"]) if log is not None else None
        if buffered:  # mid-way through a generation's updates (num_iterations > 1): its rows are not regenerated
            torch.save(self._buffered_inputs, folder / f"trl_agentic_buffer_{self.accelerator.process_index}.pt")
        path = folder / f"trl_agentic_state_{self.accelerator.process_index}.json"
        path.write_text(json.dumps(state, default=str))

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Called once on resume, after the dataloader (and the adaptive sampler) exist and before training begins.
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = Path(checkpoint) / f"trl_agentic_state_{self.accelerator.process_index}.json"
        saved_by = len(list(Path(checkpoint).glob("trl_agentic_state_*.json")))
        if saved_by and saved_by != self.accelerator.num_processes:
            # Per process: restoring some processes' state and not others' made them draw different tasks, or one
            # generate while another trained on its buffer (the collectives then hang).
            processes = f"{self.accelerator.num_processes} process" + "es" * (self.accelerator.num_processes > 1)
            raise ValueError(
                f"{checkpoint} was saved by {saved_by} process{'es' * (saved_by > 1)} (trl_agentic_state_*.json) and this run has "
                f"{processes}: the trainer's state (adaptive sampler, buffered generation, episode log) is per process. "
                f"Resume with the same number of processes (`accelerate launch --num_processes {saved_by}`), or delete "
                f"the checkpoint's trl_agentic_state_*.json and trl_agentic_buffer_*.pt files to resume with that state "
                f"started afresh."
            )
        if not path.is_file():
            logger.warning(
                f"{checkpoint} has no {path.name} (saved before trl-agentic kept its state in checkpoints): "
                "the adaptive sampler, the tasks seen, the alarms and the episode log start afresh."
            )
            return
        state = json.loads(path.read_text())
        if state["task_sampler"] is not None and getattr(self, "task_sampler", None) is not None:
            self.task_sampler.load_state_dict(state["task_sampler"])
        self._seen_tasks = set(state["seen_tasks"])
        if state["alarms"] is not None and self.alarms_callback is not None:
            self.alarms_callback.load_state_dict(state["alarms"])
        for mode, values in state["metrics"].items():
            self._metrics[mode].clear()
            self._metrics[mode].update(values)
        self._step, self._rollouts = state["step"], state["rollouts"]
        if self.args.async_rollouts:
            self._async_state = state.get("async") or {}
            if not self._async_state and self.state.global_step:
                logger.warning(
                    f"{checkpoint} was saved without asynchronous rollouts: the producer starts from the "
                    "dataset's first batch."
                )
        if state["buffered_inputs"]:
            buffer = Path(checkpoint) / f"trl_agentic_buffer_{self.accelerator.process_index}.pt"
            self._buffered_inputs = torch.load(buffer, map_location=self.accelerator.device, weights_only=True)
        if self._episode_log_dir is not None and self._episode_log_path().exists():
            log = self._episode_log_path()
            size = state["episode_log_bytes"]
            if log.stat().st_size < size:
                logger.warning(
                    f"{log} is shorter than when {checkpoint} was saved: it was edited or replaced, and "
                    "the resumed run appends to it as it is."
                )
            elif "episode_log_digest" in state and _log_digest(log, size) != state["episode_log_digest"]:
                # (None: the run that saved the checkpoint logged no episodes.)
                logger.warning(
                    f"{log} is not the log {checkpoint} counted (another run's, or edited): the resumed "
                    "run appends to it as it is, without cutting it."
                )
            else:  # drop what the stopped run logged after the checkpoint: the resumed run logs those steps again
                os.truncate(log, state["episode_log_bytes"])

    # Metrics and episode logs

    def _log_episodes(
        self, episodes: list[Episode], rows_results, advantages: torch.Tensor, inputs: list[dict]
    ) -> None:
        mode = self._mode()
        device = self.accelerator.device
        per_episode = {
            "turns": [len(ep.turns) for ep in episodes],
            "tool_calls": [ep.num_tool_calls for ep in episodes],
            "malformed_tool_calls": [ep.num_malformed_tool_calls for ep in episodes],
            "rows": [len(r.rows) for r in rows_results],
            "forks": [ep.num_forks for ep in episodes],
            "main_line_forks": [ep.num_main_line_forks for ep in episodes],  # rewrites of the task's conversation
            "drift": [ep.total_drift for ep in episodes],
            "wall_time": [ep.wall_time for ep in episodes],
            "sampled_tokens": [ep.num_sampled_tokens for ep in episodes],
            "untrained_turns": [len(r.skipped_turns) + len(r.capped_turns) for r in rows_results],
        }
        for name, values in per_episode.items():
            gathered = self.accelerator.gather(torch.tensor(values, dtype=torch.float32, device=device))
            self._metrics[mode][f"episodes/{name}_mean"].append(gathered.mean().item())
            if name in ("turns", "sampled_tokens"):
                self._metrics[mode][f"episodes/{name}_max"].append(gathered.max().item())
        status_ids = torch.tensor(
            [EPISODE_STATUSES.index(ep.status) for ep in episodes], device=device, dtype=torch.long
        )
        all_status = Counter(self.accelerator.gather(status_ids).tolist())
        total = sum(all_status.values())
        for index, status in enumerate(EPISODE_STATUSES):
            if status != "running":
                self._metrics[mode][f"episodes/status_{status}"].append(all_status.get(index, 0) / total)
        # Episodes whose agent never called the model: whatever they scored, it says nothing about the policy.
        no_calls = torch.tensor([float(not ep.turns) for ep in episodes], device=device)
        self._metrics[mode]["episodes/no_model_calls"].append(self.accelerator.gather(no_calls).mean().item())
        # Timed-out agents left behind (blocked in a call, or ignoring their cancellation): each holds a thread until
        # what blocks it returns (issue 40); a share that stays up is a leak worth a look.
        abandoned = torch.tensor([float(bool(ep.metadata.get("abandoned"))) for ep in episodes], device=device)
        self._metrics[mode]["episodes/abandoned"].append(self.accelerator.gather(abandoned).mean().item())
        # Episodes no reward function could score (failed, or every checker returned None): no advantage, no signal.
        unscorable = torch.tensor(
            [
                float(
                    all(v is None for v in (ep.metadata.get("rewards") or {None: None}).values())
                    and not ep.metadata.get(TURN_REWARDS_KEY)  # per-turn rewards alone are a signal
                )
                for ep in episodes
            ],
            device=device,
        )
        self._metrics[mode]["episodes/unscorable"].append(self.accelerator.gather(unscorable).mean().item())

        self._write_episode_records(episodes, rows_results, advantages.tolist(), inputs)

    def _write_episode_records(
        self,
        episodes: list[Episode],
        rows_results,
        advantages: list[float | None],
        inputs: list[dict],
        error: str | None = None,
    ) -> None:
        """Append one record per episode to this rank's episode log (`log_episodes=True`); `error`: why the episodes
        have no rewards (a reward function raised)."""
        if self._episode_log_dir is None:
            return
        self._episode_log_dir.mkdir(parents=True, exist_ok=True)
        mode = self._mode()
        column, targets = self.args.difficulty_column, self._target_levels()
        with self._episode_log_path().open("a") as f:
            for i, (ep, result, example) in enumerate(zip(episodes, rows_results, inputs, strict=True)):
                record = {
                    "step": self.state.global_step,
                    "mode": mode,
                    "advantage": advantages[i],
                    "episode": ep.to_dict(),
                    "rows": [row.to_dict() for row in result.rows],
                    "skipped_turns": result.skipped_turns,
                    "capped_turns": result.capped_turns,
                }
                if error is not None:
                    record["reward_error"] = error
                if column and column in example:  # the task's difficulty: the per-level metrics, recomputable
                    record["difficulty"] = example[column]
                    record["target"] = example[column] in targets
                f.write(json_text(record) + "\n")  # whatever the agent returned: valid JSON, never a crash

    def _episode_log_path(self) -> Path:
        return self._episode_log_dir / f"episodes-rank{self.accelerator.process_index}.jsonl"

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        try:
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            group_size = self.num_generations if self._mode() == "train" else self.num_generations_eval
            check_weighted_rewards(rewards_per_func, self.reward_weights, self.reward_func_names, group_size)
        except Exception as error:
            release_episodes(self.agent, [example["episodes"] for example in inputs])
            # A reward function that raises stops the run, as in TRL: an error in the checker must not pass as a
            # score. The step's episodes are logged first (issue 29, N4): they are what to read to fix it.
            episodes = [example["episodes"] for example in inputs]
            self._write_episode_records(
                episodes, self._pending_rows, [None] * len(episodes), inputs, error=f"{type(error).__name__}: {error}"
            )
            if self._episode_log_dir is not None:
                logger.error(
                    f"A reward function raised at step {self.state.global_step}; the step's "
                    f"{len(episodes)} episodes are in {self._episode_log_path()} (`reward_error`)."
                )
            raise
        # Scored: what the agent kept for the reward functions (a harness's workspaces) can go.
        release_episodes(self.agent, [example["episodes"] for example in inputs])
        # Keep the local slice per episode for the episode log (TRL gathers across processes).
        start = self.accelerator.process_index * len(prompts)
        local = rewards_per_func[start : start + len(prompts)]
        for example, values in zip(inputs, local.tolist(), strict=True):
            example["episodes"].metadata["rewards"] = {
                name: None if value != value else value  # NaN = unscorable
                for name, value in zip(self.reward_func_names, values, strict=True)
            }
        return rewards_per_func

    def __del__(self):
        endpoint = getattr(self, "endpoint", None)
        if endpoint is not None:
            try:
                endpoint.stop()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    def close(self) -> None:
        """Stop the producer, the endpoint server and the rollout thread."""
        self._stop_producer()
        self.endpoint.stop()
        self._rollout_pool.shutdown(wait=False)
