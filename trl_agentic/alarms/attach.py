"""Wiring the alarms into [`AgenticGRPOTrainer`]: the held-out evaluation its config asks for
([`TrainerHeldOutEvaluator`]) and [`attach_alarms`], which puts the callback first in the trainer's list."""

from __future__ import annotations

from typing import Any

from .callback import AlarmsCallback
from .definitions import AlarmSettings


class TrainerHeldOutEvaluator:
    """The held-out evaluation a trainer's config asks for (`held_out_eval_steps`): the trainer's agent and checkers on
    its `eval_dataset`, served as in training (same sampling and limits) by an [`Evaluator`] built on first use.

    Set `reward_funcs` (before training) to score the held-out episodes with a stricter checker than the training one:
    `trainer.alarms_callback.held_out.reward_funcs = [exact_answer]`.
    """

    def __init__(self, trainer, reward_funcs: list | None = None):
        if trainer.eval_dataset is None:
            raise ValueError(
                f"held_out_eval_steps={trainer.args.held_out_eval_steps} needs a held-out split: pass eval_dataset= "
                "(tasks never trained on, e.g. task.build_dataset('eval')) to the trainer, or set "
                "held_out_eval_steps=0."
            )
        if trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3:
            raise ValueError(
                "Held-out evaluation runs on the main process only and cannot gather ZeRO-3 shards; "
                "set held_out_eval_steps=0 (or evaluate the saved model with `trl-agentic eval`)."
            )
        self.trainer = trainer
        self.reward_funcs = reward_funcs
        self.evaluator = None

    def evaluate(self, model=None, seed: int | None = None) -> dict[str, Any]:
        from ..evaluation import Evaluator
        from ..tasks import TaskSuite

        trainer, args = self.trainer, self.trainer.args
        model = trainer.accelerator.unwrap_model(model if model is not None else trainer.model)
        if self.evaluator is None:
            reward_funcs, reward_weights = self.reward_funcs, None
            if reward_funcs is None:
                reward_funcs, reward_weights = list(trainer.reward_funcs), trainer.reward_weights.tolist()
            suite = TaskSuite(
                name="held_out",
                tools=[],
                system_prompt="",
                build_dataset=None,
                agent=trainer.agent,
                reward_funcs=reward_funcs,
                demonstrations=None,
                agent_columns=tuple(args.agent_columns),
            )
            self.evaluator = Evaluator(
                model,
                trainer.processing_class,
                suite,
                trainer.eval_dataset,
                num_samples=args.held_out_num_samples,
                **args.sampling_kwargs(),  # TRL's sampling settings, `generation_kwargs` overriding them (issue 40)
                max_tokens=args.max_completion_length,
                reward_weights=reward_weights,
                concurrency=args.max_concurrent_episodes,
                max_turns=args.max_turns,
                max_episode_tokens=args.max_episode_tokens,
                episode_timeout=args.episode_timeout,
                max_generation_batch_size=args.max_generation_batch_size,
                generation_batch_wait_ms=args.generation_batch_wait_ms,
                chat_template_kwargs=trainer.chat_template_kwargs,
            )
        return self.evaluator.evaluate(model, seed=seed)

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
            self.evaluator = None


def attach_alarms(trainer) -> AlarmsCallback:
    """Put an [`AlarmsCallback`] first in `trainer`'s callbacks (the one passed in `callbacks=`, or a new one built from
    the config) and give it the held-out evaluation the config asks for; returns it."""
    args = trainer.args
    callbacks = trainer.callback_handler.callbacks
    callback = next((c for c in callbacks if isinstance(c, AlarmsCallback)), None)
    if callback is None:
        callback = AlarmsCallback(AlarmSettings.from_config(args))
    else:
        callbacks.remove(callback)
    if callback.held_out is None and args.held_out_eval_steps > 0:
        callback.held_out = TrainerHeldOutEvaluator(trainer)
        callback.held_out_eval_steps = args.held_out_eval_steps
    callbacks.insert(0, callback)
    return callback
