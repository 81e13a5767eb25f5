"""`AgenticGRPOTrainer`: TRL's GRPO on black-box agent episodes.

TRL's `GRPOTrainer` does what it already does (rewards, group advantages, loss types, clipping, KL, importance
sampling, entropy, logging); its single-turn generation becomes G agent episodes per task against an in-process
OpenAI-compatible endpoint serving the live policy, through TRL's `rollout_func` hook. Each episode's main row goes
through TRL's pipeline; extra rows (forks, side calls) are appended with their episode's advantage, and no row is
dropped by the micro-batch split (REFERENCES: ROLL#409).

The class reads as TRL's hooks and delegates: the endpoint and the episodes to `rollouts.py` (`Rollouts`), batch
assembly (episodes -> rows -> tensors) to `rollout/batch.py`, the asynchronous schedule to `rollout/schedule.py`
(`AsyncSchedule`), scoring rows to `shared_prefix.py` (`RowScoring`), its checkpoint state to `checkpoint_state.py`
(`CheckpointState`), the episode log and the episodes' rewards to `episode_log.py`, task sampling and the
`sampling/*` metrics to `task_sampling.py`.

TRL internals overridden (checked in tests/test_trl_compat.py): `_generate` (completions = episode messages),
`_generate_and_score_completions` (extra rows, episode metrics, per-token advantages from per-turn rewards),
`_prepare_inputs` (row-count-agnostic split, tasks drawn as a batch is consumed), `_calculate_rewards` (checked, kept
per episode), `_get_per_token_logps_and_entropies` (the shared prefix computed once), `_get_train_sampler` (adaptive
sampling), `_save_checkpoint` / `_load_optimizer_and_scheduler` (the trainer's own state: a resumed run is the run
that was never stopped).
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate.utils import gather_object
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import shuffle_sequence_dict

from .agentic_grpo_config import AgenticGRPOConfig
from .alarms import attach_alarms
from .checkpoint_state import CheckpointState
from .console import install_step_lines, quiet_known_warnings
from .endpoint import SERVED_MODEL_NAME  # noqa: F401 - also importable from here, as before
from .endpoint.launch import default_engine
from .episode_log import EpisodeLog, keep_episode_rewards, log_episode_metrics
from .generation.engine import GenerationEngine
from .prefix_tree import chunked_prefix_tree_logps, prefix_tree_mode
from .rewards.process import batch_turn_advantage_terms, episode_token_advantages
from .rewards.utils import check_weighted_rewards
from .rollout.batch import (  # noqa: F401 - split_rows, importance_sampling_masked_counts: importable here too
    append_rows,
    importance_sampling_masked_counts,
    log_importance_sampling_masked,
    micro_batches,
    pad_extra_rows,
    row_scales,
    split_rows,
    spread_advantages,
)
from .rollout.harnesses import release_episodes
from .rollout.loss_weights import micro_batch_scale
from .rollout.rows import Row
from .rollout.schedule import AsyncSchedule, AsyncWeightSync, behaviour_correction, check_staleness, task_batches
from .rollout.tree_groups import batch_tree
from .rollouts import Rollouts, check_rollout_process, log_engine_stats, rollout_output, trainer_inputs
from .shared_prefix import RowScoring
from .task_sampling import TaskSlots, adaptive_sampler, draw_generation_batch, observe_tasks, target_levels
from .trace import Episode, weighted_reward


class AgenticGRPOTrainer(GRPOTrainer):
    """GRPO on episodes of a black-box agent that talks to the policy through an OpenAI-compatible endpoint.

    Args (docs/trainer.md has them all): `model` (also `"tiny:<family>[:<hidden>x<layers>]"`), `agent`
    (`async def agent(client, task)`, a plain function, a `CommandAgent`; `client` points at the episode, model name
    `"policy"`), `reward_funcs` (TRL's, given `completions` = the episode's messages after the prompt and `episodes`;
    `None` = unscorable), `args` (an `AgenticGRPOConfig`), `engine` (a `GenerationEngine`, default the embedded one),
    `environment_factory` (TRL's environment contract instead of `agent`), `reward_processing_classes` (as in TRL);
    `tools` is refused (the agent owns its tools: `agent=ToolAgent(tools=[...])`).

    ```python
    >>> task = get_task("calculator")  # trl_agentic.tasks
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

    _runs_agents = True  # False: episodes come from elsewhere; no engine or endpoint is started (`OnlineGRPOTrainer`)

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
        model, agent, self.agent, reward_funcs, processing_class = trainer_inputs(
            model, agent, reward_funcs, args, train_dataset, processing_class, reward_processing_classes,
            environment_factory, tools,
        )  # fmt: skip
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
        # Scoring rows: TRL's, with their shared prefix computed once (shared_prefix.py), or every prefix they share
        # (prefix_tree.py, `prefix_tree_training`)
        self._scoring = RowScoring(
            args,
            super()._get_per_token_logps_and_entropies,
            unwrap=self.accelerator.unwrap_model,
            autocast=self.accelerator.autocast,
            distributed=self.accelerator.num_processes > 1 or self.is_deepspeed_enabled or self.is_fsdp_enabled,
            tree_mode=prefix_tree_mode,
            tree_logps=chunked_prefix_tree_logps,
        )
        if environment_factory is not None:  # TRL's completion budget counts tool results: the agent measures them
            agent.use_tokenizer(self._tokenizer, args.max_completion_length, self.chat_template_kwargs)

        if args.rollout_process:  # before anything starts: a refusal leaves no server running
            check_rollout_process(
                engine, self.accelerator.unwrap_model(self.model), self.accelerator.num_processes, self.agent
            )
        # The endpoint serving the live policy, and the episodes run against it (rollouts.py)
        # (none for a trainer that runs no agent: `_runs_agents`, the online trainer's episodes come from users' traffic)
        if engine is None and self._runs_agents:
            engine = default_engine(
                args, self.accelerator.unwrap_model(self.model), self._tokenizer, getattr(self, "vllm_generation", None)
            )
        self.engine = engine
        self._rollouts_side = Rollouts(
            args,
            self.agent,
            self.engine,
            self._tokenizer,
            self.chat_template_kwargs,
            model=lambda: self.accelerator.unwrap_model(self.model),
            generation_model=lambda: unwrap_model_for_generation(
                self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation
            ),
            process_index=self.accelerator.process_index,
            launch=self._runs_agents,
        )
        self.endpoint = self._rollouts_side.endpoint
        self._pending_inputs: list[dict] | None = None
        self._episode_log = EpisodeLog(
            Path(args.output_dir) / "episodes" if args.log_episodes else None, self.accelerator.process_index
        )
        # What the trainer holds besides TRL's state, saved in each checkpoint (checkpoint_state.py)
        self._own_state = CheckpointState(
            self._metrics, self._episode_log, self.accelerator.process_index, self.accelerator.num_processes
        )
        # Asynchronous rollouts (issue 30): a producer runs the next batches' episodes while this one trains
        self._schedule: AsyncSchedule | None = None
        if args.async_rollouts:
            self._schedule = self._own_state.schedule = AsyncSchedule(
                args,
                num_iterations=self.num_iterations,
                num_generations=self.num_generations,
                dataset=self.train_dataset,
                process_index=self.accelerator.process_index,
                make_producer=self._rollouts_side.make_producer,
                sync_weights=self._sync_engine_weights,
                stream=self._task_batches,
                draw=(lambda: self.task_sampler.draw_batch()) if args.task_sampling == "adaptive" else None,
                seed_for=self._rollouts_side.batch_seed,
            )
        self._ready_episodes: list[Episode] | None = None  # the batch being scored, from the producer
        if behaviour_correction(args):  # episodes sampled by earlier versions: TRL's importance-sampling correction
            self._behaviour_correction, self._last_loaded_step = True, -1
        if args.async_rollouts:  # the engine takes each optimizer step's weights at once, before logs and saves
            self.add_callback(AsyncWeightSync(self._schedule))
        # Alarms (issue #11): training metrics checked against each other and a held-out split (trl_agentic/alarms/)
        self.alarms_callback = attach_alarms(self) if args.alarms else None
        self._own_state.alarms = self.alarms_callback
        self.alarms = self.alarms_callback.alarms if self.alarms_callback else []  # also in output_dir/alarms.json
        # The console: one line per step (after the alarms, so it shows those that fire), warnings a user can act on
        install_step_lines(self)
        quiet_known_warnings()

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
            self.task_sampler = adaptive_sampler(dataset, self.args, self.num_generations, self.num_iterations)
            self._own_state.task_sampler = self.task_sampler
        return TaskSlots(self.task_sampler)

    def _reward_weights_by_name(self) -> dict[str, float]:
        return dict(zip(self.reward_func_names, self.reward_weights.tolist(), strict=True))

    def _mode(self) -> str:
        """`"train"` or `"eval"`: the trainer module's own flag, which the engine never touches (it generates with a
        module of its own, issue 29 M1)."""
        return "train" if self.model.training else "eval"

    def _observe_tasks(self, inputs: list[dict], episodes: list[Episode]) -> None:
        """Log the `sampling/*` metrics of this batch and feed the adaptive sampler (`task_sampling.observe_tasks`)."""
        mode = self._mode()
        observe_tasks(
            inputs,
            episodes,
            mode=mode,
            weights=self._reward_weights_by_name(),
            agent_columns=self.args.agent_columns,
            difficulty_column=self.args.difficulty_column,
            group_size=self.num_generations if mode == "train" else self.num_generations_eval,  # (issue 29, L4)
            seen=self._own_state.seen_tasks,
            targets=self._target_levels(),
            metrics=self._metrics[mode],
            sampler=getattr(self, "task_sampler", None),
            gather=gather_object,
        )

    def _target_levels(self) -> tuple:
        return target_levels(getattr(self, "task_sampler", None), self.args.target_difficulty)

    # Rollout

    def _rollout_episodes(self, prompts: list, trainer=None) -> dict[str, list]:
        """TRL's `rollout_func`: run one episode per generation slot and return its main row (plus the episodes)."""
        inputs = self._pending_inputs
        num_generations = self.num_generations if self.model.training else self.num_generations_eval
        tasks = self._rollouts_side.agent_tasks(inputs)
        stats = getattr(self.engine, "stats", None)
        from_producer = self._ready_episodes is not None
        if from_producer:  # asynchronous rollouts: the producer ran them (`_prepare_inputs`)
            episodes, self._ready_episodes = self._ready_episodes, None
            stats = self._rollouts_side.take_stats(self._producer)  # the engine's work since the last step's batch
        else:  # now, on the current weights (the synchronous schedule, and evaluation)
            self._own_state.rollouts += 1  # each rollout samples from a seed of its own
            episodes = self._rollouts_side.run(
                tasks,
                num_generations,
                stats,
                rollout_index=self._own_state.rollouts,
                step=self.state.global_step,
                tree=self.args.rollout_tree and self.model.training,  # trees in training; evaluation stays flat
            )
        if stats is not None:  # the embedded engine's work during this rollout (continuous batching, KV reuse)
            log_engine_stats(stats, self._metrics[self._mode()])
        rows_results = self._rollouts_side.episode_rows(episodes)
        if from_producer:  # the bound on staleness, checked on what is trained
            check_staleness(
                episodes,
                rows_results,
                num_generations,
                step=self.state.global_step,
                max_staleness=self.args.max_staleness,
                metrics=self._metrics["train"],
                gather=self.accelerator.gather,
                device=self.accelerator.device,
            )
        main_rows = self._rollouts_side.main_rows(prompts, rows_results, self.processing_class)
        self._pending_rows = rows_results
        return rollout_output(main_rows, episodes)

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
        # Per-turn (process) rewards, when the batch has any: one advantage per completion token, (B, T), which TRL's
        # loss takes as it takes (B,) (rewards/process.py); without, TRL's (B,) exactly as before.
        advantages = episode_advantages = output["advantages"]
        scales = row_scales(rows_results, self.loss_type, self.args.row_weighting)
        terms = self._turn_advantage_terms(episodes)
        token_advantages = None
        if self.args.rollout_tree and self._mode() == "train":  # tree advantages per segment, shared ones counted once
            output, token_advantages = self._tree_advantages(output, episodes, rows_results, terms)
        elif terms is not None:
            rows = [result.rows for result in rows_results]
            token_advantages = episode_token_advantages(episodes, rows, advantages.tolist(), terms, scales)
        output["advantages"], extra_rows, extra_advantages = spread_advantages(
            advantages, rows_results, scales, token_advantages, output["completion_ids"].size(1)
        )
        # Every rank appends the same number of rows (padding with empty, zero-advantage rows), so the forward passes
        # that score them, and any collective they imply (DDP buffers, ZeRO-3 gathers), match across ranks.
        num_extra = int(self.accelerator.gather(torch.tensor([len(extra_rows)], device=advantages.device)).max())
        if num_extra:
            pad_id, per_token = self._tokenizer.pad_token_id, token_advantages is not None
            extra_rows, extra = pad_extra_rows(
                extra_rows, extra_advantages, num_extra, pad_id, per_token, advantages.device
            )
            output = self._append_rows(output, extra_rows, extra)
        if "importance_sampling_ratio" in output:  # beside TRL's ratio metrics: what its correction zeroed
            log_importance_sampling_masked(output, self._metrics[self._mode()], self.accelerator.gather)

        metrics = self._metrics[self._mode()]
        log_episode_metrics(episodes, rows_results, metrics, self.accelerator.gather, self.accelerator.device)
        self._episode_log.write(episodes, rows_results, episode_advantages.tolist(), inputs, **self._record_fields())
        self._observe_tasks(inputs, episodes)
        return output

    def _tree_advantages(self, output: dict, episodes: list[Episode], rows_results, terms) -> tuple[dict, list]:
        """Tree rollouts (`rollout_tree`): each group's tree of segments and their advantages (`rollout.tree_groups.
        batch_tree`), per token; the tokens a main row does not own (the copies of a shared segment, unscorable
        segments) leave the loss and its token count (TRL's `tool_mask`, `num_items_in_batch`). Logs `tree/branches`
        and `tree/forward_tokens_saved`."""
        if terms is not None:
            raise ValueError(
                "rollout_tree=True does not combine with per-turn (process) rewards yet: set turn_reward_weight=0 "
                "(they are then logged, not trained on), return final rewards only, or set rollout_tree=False."
            )
        weights = self._reward_weights_by_name()
        rewards = [weighted_reward(episode, weights) for episode in episodes]
        tree = batch_tree(
            episodes,
            rows_results,
            rewards,
            self.num_generations,
            local_weight=self.args.tree_local_weight,
            scale=self.scale_rewards != "none",
        )
        device = self.accelerator.device
        width = output["completion_ids"].size(1)
        owned = torch.tensor([o[:width] + [1] * (width - len(o)) for o in tree.owned], device=device)
        tool_mask = output.get("tool_mask")
        output["tool_mask"] = owned.to(output["completion_mask"].dtype) * (1 if tool_mask is None else tool_mask)
        loss_mask = output["completion_mask"] * output["tool_mask"]
        output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        counts = torch.tensor(
            [tree.branches, tree.groups, tree.flat_tokens, tree.tree_tokens], dtype=torch.float64, device=device
        )
        branches, groups, flat, trie = self.accelerator.gather(counts).reshape(-1, 4).sum(0).tolist()
        metrics = self._metrics["train"]
        metrics["tree/branches"].append(branches / max(groups, 1.0))
        # With prefix-tree training: what its forwards saved since the last batch (the last step's training forwards,
        # this batch's scoring); without: what it would save, each tree's rows scored together.
        stats, self._scoring.tree_stats = dict(self._scoring.tree_stats), {}
        if self.args.prefix_tree_training:  # (gathered on every process, whichever scored anything)
            run = [stats.get("forward_tokens", 0), stats.get("flat_tokens", 0)]
            forward, ran = (
                self.accelerator.gather(torch.tensor(run, dtype=torch.float64, device=device))
                .reshape(-1, 2)
                .sum(0)
                .tolist()
            )
            if ran:
                trie, flat = forward, ran
        metrics["tree/forward_tokens_saved"].append(1.0 - trie / flat if flat else 0.0)
        return output, tree.token_advantages

    def _turn_advantage_terms(self, episodes: list[Episode]) -> list[list[float] | None] | None:
        """The per-turn term of each of this process's episodes' advantages (`rewards/process.py`), or `None` when no
        episode of the batch, on any process, has per-turn rewards (or `turn_reward_weight` is 0)."""
        mode = self._mode()
        return batch_turn_advantage_terms(
            episodes,
            dict(zip(self.reward_func_names, self.reward_weights.tolist(), strict=True)),
            self.num_generations if mode == "train" else self.num_generations_eval,
            discount=self.args.turn_reward_discount,
            normalization=self.args.turn_reward_normalization,
            weight=self.args.turn_reward_weight,
            metrics=self._metrics[mode],
            process_index=self.accelerator.process_index,
            gather=gather_object,
        )

    def _append_rows(self, output: dict, rows: list[Row], advantages: torch.Tensor) -> dict:
        """Append rows to TRL's padded generation batch, with the per-token logps TRL computed for the others
        (`rollout/batch.append_rows`)."""
        pad_id = self._tokenizer.pad_token_id
        return append_rows(
            output,
            rows,
            advantages,
            pad_id=pad_id,
            device=self.accelerator.device,
            end_ids={*self.eos_token_ids, pad_id} if self.mask_truncated_completions else None,
            score=lambda key, *rows: self._scoring.appended_row_logps(
                key, *rows, model=self.model, ref_model=self.ref_model, score=self._get_per_token_logps_and_entropies
            ),
            importance_sampling=(
                self.vllm_importance_sampling_mode,
                self.vllm_importance_sampling_clip_min,
                self.vllm_importance_sampling_clip_max,
            ),
            gather=self.accelerator.gather,
        )

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
        """TRL's, with the prompt prefix the rows share computed once per chunk (`shared_prefix.RowScoring`)."""
        return self._scoring.logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
            **model_inputs,
        )  # fmt: skip

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
            self._schedule.sync(self.state.global_step)  # every micro-step: the version moves at each optimizer step
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            if self.args.async_rollouts:  # the producer's batch (waited for): its tasks were drawn when submitted
                generation_batch, self._ready_episodes = self._schedule.take(
                    len(generation_batch), self.state.global_step, self._metrics["train"]
                )
            elif self.args.task_sampling == "adaptive":  # drawn now, after every earlier batch's results (L2)
                generation_batch = draw_generation_batch(
                    self.task_sampler, self.train_dataset, self.accelerator.process_index, len(generation_batch)
                )
            num_episodes = len(generation_batch)
            generation_batch = self._generate_and_score_completions(generation_batch)
            generation_batch = shuffle_sequence_dict(generation_batch)
            self._buffered_inputs = micro_batches(
                generation_batch, self.args.steps_per_generation, num_episodes, self.loss_type, self.args.row_weighting
            )
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    # Asynchronous rollouts (issue 30): the schedule is `rollout/schedule.AsyncSchedule`

    @property
    def _producer(self):
        return self._schedule.producer if self._schedule is not None else None

    def _task_batches(self):
        """The global generation batches of dataset indices in the order the dataloader would yield them (each
        once, not `num_iterations * steps_per_generation` times): TRL's `RepeatSampler`, epoch after epoch."""
        return task_batches(super()._get_train_sampler(), self.args.generation_batch_size)

    def _sync_engine_weights(self, version: int) -> None:
        """After an optimizer step: the engine takes the new weights (`Rollouts.sync_weights`)."""
        if self._use_vllm:
            self._last_loaded_step = version  # TRL's record of the weights its vLLM server has
        self._rollouts_side.sync_weights(version, self._producer, self.vllm_generation if self._use_vllm else None)

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:  # the producer stops: episodes of batches no step will train are cancelled (a later `train` resumes)
            if self._schedule is not None:
                self._schedule.stop()

    # Checkpoints: everything the trainer holds besides TRL's state (`CheckpointState`), so that a resumed run is the
    # run that was never stopped (issue 29, M4). One file per process, as transformers' RNG states.

    @property
    def _seen_tasks(self) -> set[str]:  # the tasks drawn so far (their agent and difficulty columns, as JSON)
        return self._own_state.seen_tasks

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        generate_every = self.args.steps_per_generation * self.num_iterations
        self._own_state.save_step(folder, self._step, self._buffered_inputs, generate_every)

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Called once on resume, after the dataloader (and the adaptive sampler) exist and before training begins.
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self._own_state.resume(
            checkpoint, self.accelerator.device, self.state.global_step
        ):
            self._step = self._own_state.step
            if self._own_state.buffer is not None:
                self._buffered_inputs, self._own_state.buffer = self._own_state.buffer, None

    # Rewards: TRL's, checked; the episode log (`episode_log.py`)

    def _record_fields(self) -> dict:
        """The episode log's fields of this step (`EpisodeLog.write`)."""
        return {
            "step": self.state.global_step,
            "mode": self._mode(),
            "difficulty_column": self.args.difficulty_column,
            "targets": self._target_levels(),
        }

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        episodes = [example["episodes"] for example in inputs]
        try:
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            group_size = self.num_generations if self._mode() == "train" else self.num_generations_eval
            check_weighted_rewards(rewards_per_func, self.reward_weights, self.reward_func_names, group_size)
        except Exception as error:
            release_episodes(self.agent, episodes)
            # A reward function that raises stops the run, as in TRL: an error in the checker must not pass as a
            # score. The step's episodes are logged first: they are what to read to fix it.
            self._episode_log.write_reward_error(error, episodes, self._pending_rows, inputs, **self._record_fields())
            raise
        release_episodes(self.agent, episodes)  # scored: what the agent kept for the rewards (workspaces) can go
        keep_episode_rewards(episodes, rewards_per_func, self.reward_func_names, self.accelerator.process_index)
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
        if self._schedule is not None:
            self._schedule.stop()
        self._rollouts_side.close()
