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
    for name in (
        "_generate",
        "_generate_and_score_completions",
        "_prepare_inputs",
        "_calculate_rewards",
        "_get_per_token_logps_and_entropies",
        "_get_train_sampler",
    ):
        assert getattr(AgenticGRPOTrainer, name) is not getattr(GRPOTrainer, name)


def test_internals_we_rely_on():
    source = inspect.getsource(GRPOTrainer._generate)
    # rollout_func hook: our rollout returns these keys; env_mask becomes TRL's tool_mask.
    assert "self.rollout_func(prompts, self)" in source
    assert 'extra_fields.pop("env_mask", None)' in source
    assert (
        "return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images"
        in source
    )
    score = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "inp[key] = values[i]" in score  # extra fields (our `episodes`) reach reward kwargs through the inputs
    assert '"num_items_in_batch": num_items_in_batch' in score
    prepare = inspect.getsource(GRPOTrainer._prepare_inputs)
    assert (
        "split_tensor_dict(generation_batch, self.args.steps_per_generation)" in prepare
    )  # the floor split we replace
    assert "self._buffered_inputs" in prepare and "self._step % generate_every" in prepare
    assert params(GRPOTrainer._get_per_token_logps_and_entropies)[:5] == [
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
    ]
    assert hasattr(trl_utils, "shuffle_sequence_dict")
    # Appended rows' reference logps follow TRL's rule (`shared_prefix.RowScoring.appended_row_logps`)
    assert 'use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None)' in score
    assert hasattr(trl_utils, "use_adapter")
    # unscorable_unless_ok names and awaits reward functions exactly as TRL does (rewards/utils.py)
    assert "is_async_callable(reward_func)" in inspect.getsource(GRPOTrainer._calculate_rewards)
    assert hasattr(trl_utils, "get_callable_name") and hasattr(trl_utils, "is_async_callable")
    # check_weighted_rewards repeats TRL's float32 weighted sum (rewards/utils.py)
    assert "(rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)" in score
    compute = inspect.getsource(GRPOTrainer._compute_loss)
    assert 'completion_mask * inputs["tool_mask"]' in compute  # our env_mask is applied in the loss


def test_per_token_advantages_reach_trl_loss_unchanged():
    """Per-turn rewards (issue 34, `rewards/process.py`) hand TRL's loss advantages of shape (B, T) instead of (B,):
    `_compute_loss` unsqueezes only 1-D advantages and multiplies them into the per-token loss; the shuffle and the
    micro-batch split keep a 2-D tensor's rows together."""
    compute = inspect.getsource(GRPOTrainer._compute_loss)
    assert "if advantages.dim() == 1:\n            advantages = advantages.unsqueeze(1)" in compute
    assert "per_token_loss1 = coef_1 * advantages" in compute and "per_token_loss2 = coef_2 * advantages" in compute
    assert "is_pos_adv = advantages >= 0" in inspect.getsource(GRPOTrainer.get_off_policy_mask)  # broadcasts per token
    shuffle = inspect.getsource(trl_utils.shuffle_sequence_dict)
    assert "isinstance(v, torch.Tensor) and v.ndim >= 1" in shuffle


def test_checkpoint_hooks_we_override():
    """The trainer's own state goes into checkpoints through the hooks TRL itself uses for its entropy controller
    (issue 29, M4): saved after `_save_checkpoint` wrote the folder, loaded in `_load_optimizer_and_scheduler`, which
    must run once on resume after the dataloader (and so the adaptive sampler) exists and before `on_train_begin`."""
    from transformers import Trainer

    assert params(Trainer._save_checkpoint) == ["self", "model", "trial"]
    assert params(Trainer._load_optimizer_and_scheduler) == ["self", "checkpoint"]
    assert params(Trainer._get_output_dir) == ["self", "trial"]
    save = inspect.getsource(Trainer._save_checkpoint)
    assert 'checkpoint_folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"' in save
    assert "output_dir = os.path.join(run_dir, checkpoint_folder)" in save
    loop = inspect.getsource(Trainer._inner_training_loop)
    assert (
        loop.index("self.get_train_dataloader()")
        < loop.index("self._prepare_for_training(")
        < loop.index("self.callback_handler.on_train_begin(")
    )
    assert "self._load_optimizer_and_scheduler(resume_from_checkpoint)" in inspect.getsource(
        Trainer._prepare_for_training
    )
    init = inspect.getsource(GRPOTrainer.__init__)
    assert "self._step = 0" in init and "self._buffered_inputs = None" in init
    assert 'self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}' in init
    for name in ("_save_checkpoint", "_load_optimizer_and_scheduler"):
        assert getattr(AgenticGRPOTrainer, name) is not getattr(GRPOTrainer, name)


def test_importance_sampling_modes_and_shapes_we_follow():
    """`rollout/loss_weights.importance_sampling_ratio` reproduces TRL's vLLM IS rule for appended rows."""
    from trl import GRPOConfig

    from trl_agentic.rollout.loss_weights import IMPORTANCE_SAMPLING_MODES

    assert GRPOConfig.__dataclass_fields__["vllm_importance_sampling_mode"].default == "sequence_mask"
    score = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    for mode in IMPORTANCE_SAMPLING_MODES:
        assert f'"{mode}"' in score, mode
    assert "per_token_logps_diff.sum(dim=-1, keepdim=True)" in score  # sequence_* modes: (B, 1)
    assert "torch.nan_to_num(per_token_logps_diff, nan=0.0)" in score
    assert 'output["importance_sampling_ratio"] = vllm_importance_sampling_ratio' in score
    compute = inspect.getsource(GRPOTrainer._compute_loss)
    assert 'per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]' in compute


def test_the_use_vllm_reads_asynchronous_rollouts_rely_on():
    """Under asynchronous rollouts with the embedded engine, `AgenticGRPOTrainer.use_vllm` reads True after `__init__`
    so that TRL computes its old logprobs and importance-sampling correction (issue 30): TRL must read the flag (not
    `args.use_vllm`) there, and nowhere a rollout_func run would reach vLLM but where `_last_loaded_step` guards it."""
    score = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert score.count("self.use_vllm and self.vllm_importance_sampling_correction") == 4
    assert "args.use_vllm" not in score
    compute = inspect.getsource(GRPOTrainer._compute_loss)
    assert 'if self.use_vllm and self.vllm_importance_sampling_correction and self.loss_type != "vespo":' in compute
    generate = inspect.getsource(GRPOTrainer._generate)
    assert "if self.use_vllm and self.state.global_step != self._last_loaded_step:" in generate
    assert generate.count("self.use_vllm") == 1
    init = inspect.getsource(GRPOTrainer.__init__)
    assert "self.use_vllm = args.use_vllm" in init
    assert isinstance(AgenticGRPOTrainer.__dict__["use_vllm"], property)


def test_loss_normalisations_our_row_weighting_assumes():
    """`rollout/loss_weights.py` spreads an episode's advantage over its rows by how each loss type normalises."""
    from trl_agentic.rollout.loss_weights import ROW_MEAN_LOSSES, ROW_SUM_LOSSES, TOKEN_LEVEL_LOSSES

    compute = inspect.getsource(GRPOTrainer._compute_loss)
    assert "((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()" in compute  # grpo, sapo
    assert "(per_token_loss * mask).sum() / (per_token_loss.size(0) * self.max_completion_length)" in compute  # dr_grpo
    assert "(per_token_loss * mask).sum(-1).mean()" in compute  # luspo
    assert 'inputs["num_items_in_batch"].clamp(min=1.0)' in compute  # dapo, cispo, vespo
    assert "(per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)" in compute  # bnpo
    assert 'self.loss_type in ["grpo", "sapo"]' in compute and 'self.loss_type in ["cispo", "dapo", "vespo"]' in compute
    assert set(TOKEN_LEVEL_LOSSES + ROW_SUM_LOSSES + ROW_MEAN_LOSSES) == {
        "dapo",
        "bnpo",
        "cispo",
        "vespo",
        "dr_grpo",
        "luspo",
        "grpo",
        "sapo",
    }


def test_transformers_internals_the_endpoint_relies_on():
    """The endpoint's fast paths lean on transformers internals (trl_agentic/endpoint/encoding.py, chat.py): fail here,
    by name, when they move, rather than through a silent fallback or a wrong token somewhere else."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend
    from transformers.utils.chat_parsing.response_templates import load_response_template  # noqa: F401 (chat.py)

    from trl_agentic.endpoint.encoding import _plain_backend
    from trl_agentic.tiny_models import build_tiny_tokenizer

    # parse_response(ids, schema=<compiled template>, prefix=..., tools=...): ChatRenderer.parse compiles it once.
    assert params(PreTrainedTokenizerBase.parse_response) == ["self", "response", "schema", "prefix", "tools"]
    # TextEncoder tokenizes through the tokenizers backend of a plain fast tokenizer, as its `__call__` would.
    assert "_encode_plus" in vars(TokenizersBackend)
    tokenizer = build_tiny_tokenizer("qwen2_5")
    assert isinstance(tokenizer, TokenizersBackend) and isinstance(_plain_backend(tokenizer), Tokenizer)


# GRPOTrainer arguments AgenticGRPOTrainer does not take, and why (issue 40: none may be silently dropped).
NOT_TAKEN = {
    "rollout_func": "the rollout is the agents' episodes (set internally through this very hook)",
    "quantization_config": "not wired: the embedded engine's inference copy of a quantized model is untested",
}


def test_every_grpo_trainer_argument_is_taken_or_known_not_to_be():
    """A GRPOTrainer argument a new TRL adds must be taken (honoured or refused with a reason, as `tools` is) or
    listed in NOT_TAKEN with its reason; a TypeError naming it would otherwise be the only explanation."""
    ours = set(params(AgenticGRPOTrainer.__init__))
    missing = [name for name in params(GRPOTrainer.__init__) if name not in ours and name not in NOT_TAKEN]
    assert missing == []
    assert "reward_processing_classes" in ours and "tools" in ours


def test_trl_generation_settings_we_honour_or_refuse():
    """AgenticGRPOConfig honours `min_p`, `repetition_penalty` and `generation_kwargs`, and refuses
    `cache_implementation` and `use_transformers_continuous_batching`, which `use_transformers_paged` sets in TRL's
    `__post_init__` (issue 40). The masked-share metric counts TRL's `*_mask` zeros (`masked_fill(..., value=0.0)`)."""
    from trl import GRPOConfig

    fields = GRPOConfig.__dataclass_fields__
    defaults = {name: fields[name].default for name in ("min_p", "repetition_penalty", "generation_kwargs")}
    assert defaults == {"min_p": None, "repetition_penalty": 1.0, "generation_kwargs": None}
    assert fields["cache_implementation"].default is None
    assert fields["use_transformers_continuous_batching"].default is False
    assert "self.use_transformers_continuous_batching = True" in inspect.getsource(GRPOConfig.__post_init__)
    assert "generation_kwargs" in GRPOConfig._VALID_DICT_FIELDS  # given as JSON text on the CLI, parsed by TRL
    score = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "invalid_mis_mask, value=0.0" in score
