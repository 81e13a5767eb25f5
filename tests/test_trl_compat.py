"""Fails loudly when a TRL internal that AgenticGRPOTrainer overrides or calls changes shape."""

import inspect

import trl
from packaging.version import Version
from trl import GRPOTrainer
from trl.trainer import utils as trl_utils

from trl_agentic.agentic_grpo_trainer import AgenticGRPOTrainer


def test_trl_version_in_verified_range():
    assert Version("1.16.0") <= Version(trl.__version__) < Version("1.17"), "re-verify the overrides, then widen"


def params(func):
    return list(inspect.signature(func).parameters)


def test_overridden_methods_keep_their_signatures():
    assert params(GRPOTrainer._generate) == ["self", "prompts"]
    assert params(GRPOTrainer._generate_and_score_completions) == ["self", "inputs"]
    assert params(GRPOTrainer._prepare_inputs) == ["self", "generation_batch"]
    assert params(GRPOTrainer._calculate_rewards) == ["self", "inputs", "prompts", "completions", "completion_ids_list"]
    for name in ("_generate", "_generate_and_score_completions", "_prepare_inputs", "_calculate_rewards"):
        assert getattr(AgenticGRPOTrainer, name) is not getattr(GRPOTrainer, name)


def test_internals_we_rely_on():
    source = inspect.getsource(GRPOTrainer._generate)
    # rollout_func hook: our rollout returns these keys; env_mask becomes TRL's tool_mask.
    assert "self.rollout_func(prompts, self)" in source
    assert 'extra_fields.pop("env_mask", None)' in source
    assert "return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images" in source
    score = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "inp[key] = values[i]" in score  # extra fields (our `episodes`) reach reward kwargs through the inputs
    assert '"num_items_in_batch": num_items_in_batch' in score
    prepare = inspect.getsource(GRPOTrainer._prepare_inputs)
    assert "split_tensor_dict(generation_batch, self.args.steps_per_generation)" in prepare  # the floor split we replace
    assert "self._buffered_inputs" in prepare and "self._step % generate_every" in prepare
    assert params(GRPOTrainer._get_per_token_logps_and_entropies)[:5] == [
        "self", "model", "input_ids", "attention_mask", "logits_to_keep"]
    assert hasattr(trl_utils, "shuffle_sequence_dict")
    compute = inspect.getsource(GRPOTrainer._compute_loss)
    assert 'completion_mask * inputs["tool_mask"]' in compute  # our env_mask is applied in the loss
