"""Rows that share a prompt prefix are scored with the prefix computed once: the same log-probabilities, entropies
and parameter gradients as TRL's own scoring (every row whole), in TRL's shapes, with fewer tokens through the model."""

import contextlib
import functools
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from trl import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.shared_prefix import MIN_SHARED_PREFIX, RowScoring, shared_prefix_length
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


def never_called_agent(client, task):
    raise AssertionError("no rollout here")


def reward(prompts, completions, **kwargs):
    return [0.0] * len(prompts)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


@pytest.fixture
def trainer(tmp_path, tokenizer):
    torch.manual_seed(0)
    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=never_called_agent,
        reward_funcs=reward,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}]}] * 2),
        args=AgenticGRPOConfig(
            output_dir=str(tmp_path),
            num_generations=2,
            per_device_train_batch_size=4,
            max_completion_length=8,
            use_cpu=True,
            bf16=False,
            report_to="none",
            seed=0,
        ),
    )
    trainer.model.train()
    assert not trainer.model.is_gradient_checkpointing  # (the trainer's own scoring switches it off otherwise)
    yield trainer
    trainer.close()


def trl_layout(tokenizer, questions, completions):
    """TRL's `[left padding | prompt | completion | right padding]` rows: `(input_ids, attention_mask, width)`."""
    system = {"role": "system", "content": "You are a careful assistant. Use the tools. " * 5}
    prompts = [
        tokenizer.apply_chat_template(
            [system, {"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in questions
    ]
    prompt_width, width = max(map(len, prompts)), max(map(len, completions))
    pad = tokenizer.pad_token_id
    ids = [[pad] * (prompt_width - len(p)) + p + c + [pad] * (width - len(c)) for p, c in zip(prompts, completions)]
    mask = [
        [0] * (prompt_width - len(p)) + [1] * (len(p) + len(c)) + [0] * (width - len(c))
        for p, c in zip(prompts, completions)
    ]
    return torch.tensor(ids), torch.tensor(mask), width, prompts


def test_shared_prefix_scoring_matches_trls(trainer, tokenizer):
    questions = ["What is 12 * 34?", "What is 7 * 8, then plus 100?", "What is 12 * 34?", "Name a prime."]
    generator = torch.Generator().manual_seed(1)
    completions = [torch.randint(20, 300, (n,), generator=generator).tolist() for n in (8, 3, 6, 1)]
    input_ids, attention_mask, width, prompts = trl_layout(tokenizer, questions, completions)
    common = 0
    while all(p[common] == prompts[0][common] for p in prompts):
        common += 1
    prefix_length = shared_prefix_length(input_ids, attention_mask, width)
    assert prefix_length == common >= MIN_SHARED_PREFIX  # the system prompt, up to where the questions differ

    def score(shared: bool):
        trainer.args.shared_prefix_scoring = shared
        trainer.model.zero_grad()
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, width, compute_entropy=True
        )
        weights = torch.linspace(-1.0, 1.0, logps.numel()).view_as(logps)
        (logps * weights).sum().backward()  # a loss that weighs every column differently
        grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
        return logps.detach(), entropies.detach(), grads

    calls = []
    handle = trainer.model.model.register_forward_hook(
        lambda m, args, kwargs, out: calls.append(
            kwargs["input_ids"].numel() if kwargs.get("input_ids") is not None else args[0].numel()
        ),
        with_kwargs=True,
    )
    try:
        logps, entropies, grads = score(True)
        shared_tokens, calls[:] = sum(calls), []
        trl_logps, trl_entropies, trl_grads = score(False)
        trl_tokens = sum(calls)
    finally:
        handle.remove()
    assert logps.shape == trl_logps.shape == (4, width)
    torch.testing.assert_close(logps, trl_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropies, trl_entropies, atol=1e-5, rtol=1e-5)
    for i, completion in enumerate(completions):  # TRL's padding columns are zeros in both
        assert logps[i, len(completion) :].abs().sum() == 0
    assert grads.keys() == trl_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], trl_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    # The prefix went through the model once instead of four times.
    assert trl_tokens == input_ids.numel()
    assert shared_tokens == prefix_length + 4 * (int(attention_mask.sum(dim=1).max()) - prefix_length)
    assert shared_tokens < 0.5 * trl_tokens


@pytest.mark.parametrize("masked_rows", [[1], [0, 1, 2, 3]])
def test_rows_masked_as_truncated_are_scored_like_trls(trainer, tokenizer, masked_rows):
    # `mask_truncated_completions` zeroes a cut row's completion in the attention mask. A group of one task shares its
    # whole prompt, so with every completion masked nothing is left after the prefix (the demo's smoke run crashed
    # there: "index -1 is out of bounds").
    questions = ["What is 12 * 34?"] * 4
    generator = torch.Generator().manual_seed(2)
    completions = [torch.randint(20, 300, (n,), generator=generator).tolist() for n in (8, 3, 6, 1)]
    input_ids, attention_mask, width, _ = trl_layout(tokenizer, questions, completions)
    attention_mask[masked_rows, -width:] = 0
    completion_mask = attention_mask[:, -width:]

    def score(shared: bool):
        trainer.args.shared_prefix_scoring = shared
        trainer.model.zero_grad()
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, width)
        (logps * completion_mask * torch.linspace(-1.0, 1.0, logps.numel()).view_as(logps)).sum().backward()
        grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
        return logps.detach() * completion_mask, grads

    logps, grads = score(True)
    trl_logps, trl_grads = score(False)
    assert logps.shape == trl_logps.shape == (4, width)
    torch.testing.assert_close(logps, trl_logps, atol=1e-5, rtol=1e-5)
    for name in trl_grads:
        torch.testing.assert_close(
            grads.get(name, torch.zeros_like(trl_grads[name])), trl_grads[name], atol=1e-5, rtol=1e-4, msg=name
        )


def test_rows_without_a_long_common_prefix_are_scored_trls_way(trainer, tokenizer):
    input_ids = torch.tensor([[5, 6, 7, 8, 9], [6, 6, 7, 8, 9]])
    attention_mask = torch.ones_like(input_ids)
    assert shared_prefix_length(input_ids, attention_mask, 2) == 0
    trainer.args.shared_prefix_scoring = True
    logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, 2)
    trainer.args.shared_prefix_scoring = False
    trl_logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, 2)
    assert torch.equal(logps, trl_logps)


def test_checkpointed_models_are_scored_trls_way(trainer, tokenizer):
    """Checkpointed layers recompute their forward in the backward, and the key/value states of the prefix would be
    appended to twice: TRL's scoring runs instead."""
    input_ids, attention_mask, width, _ = trl_layout(tokenizer, ["What is 1 + 2?", "What is 3 + 4?"], [[30, 31]] * 2)
    trainer.model.gradient_checkpointing_enable()
    calls = []
    handle = trainer.model.model.register_forward_hook(
        lambda m, args, kwargs, out: calls.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    try:
        trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, width)
    finally:
        handle.remove()
        trainer.model.gradient_checkpointing_disable()
    assert calls == [input_ids.numel()]


# `RowScoring` without a trainer: TRL's own scoring function on a plain tiny model with TRL's fused LM head.


def trl_scoring():
    """TRL's `_get_per_token_logps_and_entropies`, bound to the one thing it reads of a trainer (`accelerator`)."""
    accelerator = SimpleNamespace(autocast=contextlib.nullcontext, is_main_process=True)
    return functools.partial(GRPOTrainer._get_per_token_logps_and_entropies, SimpleNamespace(accelerator=accelerator))


def fused(model):
    add_fused_lm_head(model.get_base_model() if hasattr(model, "get_base_model") else model, outputs=LM_HEAD_OUTPUTS)
    return model


LM_HEAD_OUTPUTS = ("log_probs", "entropy")


def test_row_scoring_applies_only_where_the_prefix_may_be_shared(tokenizer):
    model = fused(build_tiny_model(tokenizer))
    args = SimpleNamespace(shared_prefix_scoring=True, per_device_train_batch_size=4)
    scoring = RowScoring(args, trl_scoring())
    assert scoring.applies(model, False, {"pixel_values": None})
    assert not scoring.applies(model, True, {})  # MoE aux loss
    assert not scoring.applies(model, False, {"pixel_values": torch.zeros(1)})  # images
    assert not RowScoring(args, trl_scoring(), distributed=True).applies(model, False, {})
    args.shared_prefix_scoring = False  # read at each call
    assert not scoring.applies(model, False, {})
    args.shared_prefix_scoring = True
    model.gradient_checkpointing_enable()
    assert not scoring.applies(model, False, {})


def test_row_scoring_gives_trls_logps_with_the_prefix_run_once(tokenizer):
    torch.manual_seed(0)
    model = fused(build_tiny_model(tokenizer))
    questions = ["What is 12 * 34?", "What is 7 * 8, then plus 100?", "Name a prime."]
    completions = [[40, 41, 42, 43], [50, 51], [60]]
    input_ids, attention_mask, width, _ = trl_layout(tokenizer, questions, completions)
    prefix_length = shared_prefix_length(input_ids, attention_mask, width)
    assert prefix_length >= MIN_SHARED_PREFIX
    args = SimpleNamespace(shared_prefix_scoring=True, per_device_train_batch_size=4)
    scoring = RowScoring(args, trl_scoring())
    calls = []
    handle = model.model.register_forward_hook(
        lambda m, a, kwargs, out: calls.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    try:
        logps, entropies, aux = scoring.logps_and_entropies(
            model, input_ids, attention_mask, width, compute_entropy=True
        )
        shared_tokens, calls[:] = sum(calls), []
        trl_logps, trl_entropies, _ = trl_scoring()(model, input_ids, attention_mask, width, compute_entropy=True)
        trl_tokens, calls[:] = sum(calls), []
        args.shared_prefix_scoring = False  # TRL's own, exactly
        off_logps, off_entropies, _ = scoring.logps_and_entropies(
            model, input_ids, attention_mask, width, compute_entropy=True
        )
        assert sum(calls) == trl_tokens == input_ids.numel()
    finally:
        handle.remove()
    assert aux is None and logps.shape == trl_logps.shape == (3, width)
    torch.testing.assert_close(logps, trl_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropies, trl_entropies, atol=1e-5, rtol=1e-5)
    assert torch.equal(off_logps, trl_logps) and torch.equal(off_entropies, trl_entropies)
    assert shared_tokens == prefix_length + 3 * (int(attention_mask.sum(dim=1).max()) - prefix_length)


def test_appended_rows_are_scored_by_the_policy_or_the_reference(tokenizer):
    """`old_per_token_logps` from the policy; `ref_per_token_logps` from `ref_model`, else (PEFT) the policy with its
    adapters disabled; each in chunks of `per_device_train_batch_size`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    policy, reference = fused(build_tiny_model(tokenizer)), fused(build_tiny_model(tokenizer, seed=1))
    input_ids, attention_mask, width, _ = trl_layout(tokenizer, ["What is 1 + 2?", "Hi"], [[30, 31, 32], [33]])
    args = SimpleNamespace(shared_prefix_scoring=False, per_device_train_batch_size=1)
    scoring = RowScoring(args, trl_scoring())
    batch_sizes = []

    def score(model, *inputs, batch_size=None):
        batch_sizes.append(batch_size)
        return trl_scoring()(model, *inputs, batch_size=batch_size)

    def appended(key, model, ref_model):
        return scoring.appended_row_logps(
            key, input_ids, attention_mask, width, model=model, ref_model=ref_model, score=score
        )

    with torch.no_grad():
        policy_logps = trl_scoring()(policy, input_ids, attention_mask, width)[0]
        reference_logps = trl_scoring()(reference, input_ids, attention_mask, width)[0]
        assert not torch.allclose(policy_logps, reference_logps)
        assert torch.equal(appended("old_per_token_logps", policy, reference), policy_logps)
        assert torch.equal(appended("ref_per_token_logps", policy, reference), reference_logps)
        assert batch_sizes == [1, 1]

        adapted = fused(get_peft_model(policy, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)))
        adapted_logps = appended("old_per_token_logps", adapted, None)
        assert not torch.allclose(adapted_logps, policy_logps)  # the adapter is on
        torch.testing.assert_close(appended("ref_per_token_logps", adapted, None), policy_logps)  # and off
