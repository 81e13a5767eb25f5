"""TRL's GRPOConfig settings and GRPOTrainer arguments: each is honoured or refused with how to fix it, never silently
ignored (issue 40, item 6)."""

import openai
import pytest
import torch
from datasets import Dataset

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


def config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path),
        num_generations=2,
        per_device_train_batch_size=2,  # 2 episodes per task
        max_steps=1,
        max_completion_length=6,  # short calls keep the test fast
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        alarms=False,
        seed=0,
    )
    values.update(overrides)
    return AgenticGRPOConfig(**values)


def dataset(n=2):
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"Say {i}."}]} for i in range(n)])


async def one_call_agent(client, task):
    reply = await client.chat.completions.create(model="policy", messages=task["prompt"], max_tokens=4)
    return reply.choices[0].message.content


def constant_reward(prompts, completions, **kwargs):
    return [1.0] * len(prompts)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


def test_trl_sampling_settings_reach_every_model_call(tmp_path, tokenizer):
    """`repetition_penalty`, `min_p` and `generation_kwargs` (which, as in TRL, win over the named settings) are
    what the endpoint samples every call with, whatever the agent asks for."""
    args = config(
        tmp_path,
        temperature=1.0,
        repetition_penalty=1.3,
        min_p=0.05,
        generation_kwargs={"temperature": 0.8, "top_k": 7},
    )
    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=one_call_agent,
        reward_funcs=constant_reward,
        args=args,
        train_dataset=dataset(),
        processing_class=tokenizer,
    )
    try:
        session = trainer.endpoint.open_episode()
        client = openai.OpenAI(base_url=trainer.endpoint.base_url, api_key=session.key, max_retries=0)
        client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0.2
        )
        episode = trainer.endpoint.close_episode(session.episode.id)
    finally:
        trainer.close()
    sampling = episode.turns[0].sampling
    assert (sampling["temperature"], sampling["top_k"], sampling["top_p"]) == (0.8, 7, 1.0)
    assert (sampling["repetition_penalty"], sampling["min_p"]) == (1.3, 0.05)
    assert episode.turns[0].requested_sampling["temperature"] == 0.2  # what the agent asked for, recorded


def test_trl_settings_the_trainer_cannot_honour_are_refused(tmp_path):
    with pytest.raises(ValueError, match="cache_implementation='static'.*Remove it"):
        config(tmp_path, cache_implementation="static")
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="use_transformers_paged.*Set it to False"):
        config(tmp_path, use_transformers_paged=True)  # TRL turns it into use_transformers_continuous_batching
    with pytest.raises(ValueError, match="use_transformers_continuous_batching"):
        config(tmp_path, use_transformers_continuous_batching=True)
    with pytest.raises(ValueError, match=r"generation_kwargs \['num_beams', 'suppress_tokens'\].*min_p"):
        config(tmp_path, generation_kwargs={"num_beams": 2, "suppress_tokens": [3], "top_p": 0.9})
    with pytest.raises(ValueError, match=r"repetition_penalty must be > 0"):
        config(tmp_path, generation_kwargs={"repetition_penalty": 0.0})
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\]"):
        config(tmp_path, min_p=2.0)
    assert config(tmp_path, generation_kwargs='{"min_p": 0.1}').sampling_kwargs()["min_p"] == 0.1  # CLI: JSON


def test_tools_are_refused_with_where_they_belong(tmp_path, tokenizer):
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        return a + b

    with pytest.raises(ValueError, match=r"agent owns its tools.*ToolAgent\(tools=\[\.\.\.\]\)"):
        AgenticGRPOTrainer(
            "tiny:qwen2_5",
            agent=one_call_agent,
            reward_funcs=constant_reward,
            args=config(tmp_path),
            train_dataset=dataset(),
            tools=[add],
        )


def test_reward_processing_classes_reach_reward_models(tmp_path, tokenizer):
    """As in TRL, a reward model is scored with its entry of `reward_processing_classes`: a module without a
    `name_or_path` to load a tokenizer from needs one, and the given tokenizer is the one that tokenizes."""
    from transformers import AutoModelForSequenceClassification

    config_ = build_tiny_model(tokenizer).config
    config_.num_labels, config_.pad_token_id = 1, tokenizer.pad_token_id
    torch.manual_seed(0)
    reward_model = AutoModelForSequenceClassification.from_config(config_)
    reward_model.config._name_or_path = ""  # nothing to load a tokenizer from
    with pytest.raises(ValueError, match="reward processing classes \\(1\\) must match the number of reward functions"):
        AgenticGRPOTrainer(
            "tiny:qwen2_5",
            agent=one_call_agent,
            reward_funcs=[constant_reward, reward_model],
            args=config(tmp_path),
            train_dataset=dataset(),
            reward_processing_classes=[tokenizer],
        )
    trainer = AgenticGRPOTrainer(
        "tiny:qwen2_5",
        agent=one_call_agent,
        reward_funcs=[constant_reward, reward_model],
        args=config(tmp_path),
        train_dataset=dataset(),
        reward_processing_classes=[None, tokenizer],
    )
    trainer.close()
    reward = trainer.reward_funcs[1]
    prompts = [[{"role": "user", "content": "What is 2 + 3?"}]]
    completions = [[{"role": "assistant", "content": "5"}]]
    text = tokenizer.apply_chat_template(prompts[0] + completions[0], tokenize=False)
    inputs = tokenizer(text=[text], return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        expected = reward_model(**inputs).logits[:, 0].tolist()
    assert reward(prompts, completions) == pytest.approx(expected, abs=1e-5)


def test_importance_sampling_masked_counts_rows_and_tokens_the_correction_zeroes():
    """TRL's `*_mask` modes zero a whole row (sequence_mask) or single tokens (token_mask) of the loss; what is zeroed
    is counted over the trained tokens only (loss mask 1), rows without any trained token left out."""
    from trl_agentic.agentic_grpo_trainer import importance_sampling_masked_counts

    loss_mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]])
    sequence = torch.tensor([[0.0], [1.2], [0.0], [0.9]])  # (B, 1): row 0 masked; row 2 has nothing to train
    assert importance_sampling_masked_counts(sequence, loss_mask) == (1, 3, 3, 7)
    token = torch.tensor([[0.0, 1.0, 0.0, 1.1], [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    # row 0: 1 of 3 trained tokens zeroed; row 1: all 3 zeroed (masked whole); row 3: none
    assert importance_sampling_masked_counts(token, loss_mask) == (1, 3, 4, 7)


async def two_call_agent(client, task):
    messages = list(task["prompt"])
    reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
    reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return reply.choices[0].message.content


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sequence_mask", "token_mask"])
def test_async_rollouts_log_the_share_of_rows_and_tokens_the_correction_masks(tmp_path, tokenizer, mode):
    """Under asynchronous rollouts TRL's `*_mask` correction can zero whole multi-turn rows: the share is logged next to
    TRL's ratio metrics. `max_staleness=0` samples with the weights that score (ratios 1 to float rounding), so a
    lower clip bound of 2 masks every row and token, and the metrics say so."""
    args = config(
        tmp_path,
        async_rollouts=True,
        max_staleness=0,
        logging_steps=1,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=2.0,  # above every ratio: all masked
        vllm_importance_sampling_clip_max=3.0,
    )
    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=two_call_agent,
        reward_funcs=constant_reward,
        args=args,
        train_dataset=dataset(),
        processing_class=tokenizer,
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    logged = next(entry for entry in trainer.state.log_history if "sampling/importance_sampling_ratio/max" in entry)
    assert logged["sampling/importance_sampling_ratio/max"] == 0.0
    assert logged["sampling/importance_sampling_masked_rows"] == 1.0
    assert logged["sampling/importance_sampling_masked_tokens"] == 1.0


def test_the_held_out_evaluation_samples_as_training_does(tmp_path, tokenizer):
    """The held-out evaluator (`held_out_eval_steps`) serves the policy with the training run's sampling, TRL's
    `min_p`, `repetition_penalty` and `generation_kwargs` included (issue 40)."""
    from trl_agentic.alarms.attach import TrainerHeldOutEvaluator

    args = config(tmp_path, min_p=0.05, repetition_penalty=1.3, generation_kwargs={"temperature": 0.8})
    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=one_call_agent,
        reward_funcs=constant_reward,
        args=args,
        train_dataset=dataset(),
        eval_dataset=dataset(1),
        processing_class=tokenizer,
    )
    held_out = TrainerHeldOutEvaluator(trainer)
    try:
        held_out.evaluate(seed=0)  # builds the evaluator
        episodes = held_out.evaluator.run(seed=0)
    finally:
        held_out.close()
        trainer.close()
    sampling = episodes[0].turns[0].sampling
    assert (sampling["temperature"], sampling["min_p"], sampling["repetition_penalty"]) == (0.8, 0.05, 1.3)
