"""vLLM importance-sampling ratios of appended rows follow TRL's rule exactly (issue 10).

CPU runs never take TRL's vLLM branch, so these tests switch the branch on in a built trainer (the IS correction
reads only the sampling logprobs the rollout returns) and feed `_generate_and_score_completions` hand-built rows: the
main rows go through TRL's own code, the appended rows (copies of main rows: a fork or side call with the same tokens)
through ours. For each of TRL's four modes the copies must get exactly the main rows' ratios, in TRL's shape for the
mode, and appending must not change the main rows' ratios.
"""

import math

import pytest
import torch
from datasets import Dataset

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.rollout.loss_weights import IMPORTANCE_SAMPLING_MODES, importance_sampling_ratio
from trl_agentic.rollout.rows import Row, RowsResult
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer
from trl_agentic.trace import Episode, Turn


def never_called_agent(client, task):
    raise AssertionError("the rollout is replaced by hand-built rows")


def reward(prompts, completions, episodes=None, **kwargs):
    return [float(i % 2) for i in range(len(prompts))]  # the groups split, so advantages are non-zero


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


def make_trainer(tmp_path, tokenizer, mode):
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
            vllm_importance_sampling_mode=mode,
            vllm_importance_sampling_clip_min=0.5,
            vllm_importance_sampling_clip_max=2.0,
        ),
    )
    # TRL's vLLM branch of `_generate_and_score_completions`, without vLLM: the rows below carry sampling logprobs
    # that differ from the trainer's, as an inference engine's do.
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    trainer._last_loaded_step = trainer.state.global_step  # no weight sync to a vLLM engine
    trainer.model.train()
    return trainer


def hand_built_rows(trainer):
    """4 rows of different lengths, with masked context (env_mask 0) inside, sampling logprobs = the trainer's own
    logprobs + noise (so some ratios leave [0.5, 2.0]), and one logprob an engine could not give (None)."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for i, length in enumerate((8, 5, 7, 3)):
        prompt = torch.randint(10, 200, (4 + i,), generator=generator).tolist()
        completion = torch.randint(10, 200, (length,), generator=generator).tolist()
        env_mask = [1] * length
        if length > 4:
            env_mask[2:4] = [0, 0]  # a tool output between two sampled stretches
        input_ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, input_ids, torch.ones_like(input_ids), length, batch_size=1
            )
        # Per token: ratios exp(-0.9) and exp(0.9) leave [0.5, 2], exp(0.2) and exp(-0.1) stay; per sequence, row 1
        # (sum 0.7 over its sampled tokens) leaves the range, the others (0.6, 0.5, -0.2) stay.
        noise = [(0.9, -0.2, -0.9, 0.1)[k % 4] for k in range(length)]
        logprobs = [lp + n if m else 0.0 for lp, n, m in zip(logps[0].tolist(), noise, env_mask)]
        if i == 1:
            logprobs[-1] = None
        rows.append(Row(prompt, completion, env_mask, logprobs, [0], "main"))
    return rows


def run(trainer, main_rows, copies: dict[int, int]):
    """Score the main rows through TRL, with `copies[j] = i`: extra row j of episode i is a copy of main row i."""
    episodes = [
        Episode(
            id=f"ep{i}",
            turns=[Turn(0, r.prompt_ids, r.completion_ids, [0.0] * len(r.completion_ids), "stop")],
            status="ok",
        )
        for i, r in enumerate(main_rows)
    ]
    extra = {
        i: [
            Row(r.prompt_ids, r.completion_ids, r.env_mask, r.logprobs, [1], "fork")
            for j, source in sorted(copies.items())
            if source == i
        ]
        for i, r in enumerate(main_rows)
    }

    def rollout(prompts, trainer_):
        trainer._pending_rows = [RowsResult([r, *extra[i]], [], []) for i, r in enumerate(main_rows)]
        return {
            "prompt_ids": [r.prompt_ids for r in main_rows],
            "completion_ids": [r.completion_ids for r in main_rows],
            "logprobs": [r.logprobs for r in main_rows],
            "env_mask": [r.env_mask for r in main_rows],
            "episodes": episodes,
        }

    trainer.rollout_func = rollout
    inputs = [{"prompt": [{"role": "user", "content": "hi"}]} for _ in main_rows]
    return trainer._generate_and_score_completions(inputs)


@pytest.mark.parametrize("mode", IMPORTANCE_SAMPLING_MODES)
def test_appended_rows_get_trls_importance_sampling_ratio(tmp_path, tokenizer, mode):
    trainer = make_trainer(tmp_path, tokenizer, mode)
    try:
        rows = hand_built_rows(trainer)
        alone = run(trainer, rows, {})
        merged = run(trainer, rows, {0: 1, 1: 3, 2: 0})  # extra rows: copies of main rows 1, 3, 0 (episode order)
    finally:
        trainer.close()
    ratio, alone_ratio = merged["importance_sampling_ratio"], alone["importance_sampling_ratio"]
    width = merged["completion_ids"].size(1)
    sequence_mode = mode.startswith("sequence")
    # TRL's shape for the mode: (B, 1) per sequence, (B, T) per token.
    assert ratio.shape == ((7, 1) if sequence_mode else (7, width))
    assert alone_ratio.shape == ((4, 1) if sequence_mode else (4, width))
    # Appending leaves the main rows' ratios as TRL computed them...
    torch.testing.assert_close(ratio[:4], alone_ratio)
    # ...and each copy gets exactly the ratio TRL computed for its main row (extra rows in episode order: 0, 1, 3).
    for position, source in zip((4, 5, 6), (0, 1, 3)):
        torch.testing.assert_close(ratio[position], ratio[source])
    # The per-token IS weights the loss multiplies main rows by are unchanged by appending (a (B, 1) ratio widened
    # with zeros used to zero every main row after its first token).
    mask = merged["completion_mask"] * merged["tool_mask"]
    weights = torch.broadcast_to(ratio, mask.shape) * mask
    alone_mask = alone["completion_mask"] * alone["tool_mask"]
    torch.testing.assert_close(weights[:4], torch.broadcast_to(alone_ratio, alone_mask.shape) * alone_mask)
    # The NaN logprob (None from the engine) is neutral, as in TRL: no NaN anywhere.
    assert not torch.isnan(ratio).any()
    # The rule is TRL's: our function on the main rows reproduces TRL's own numbers.
    ours = importance_sampling_ratio(
        alone["old_per_token_logps"], alone["sampling_per_token_logps"], alone_mask, mode, 0.5, 2.0
    )
    torch.testing.assert_close(ours, alone_ratio)
    # Bounds were exercised: some ratios were clipped or masked, some kept.
    sampled = ratio.flatten() if sequence_mode else ratio[mask.bool()]
    if mode.endswith("mask"):
        assert (sampled == 0).any() and (sampled != 0).any()
    else:
        assert ((sampled == 0.5) | (sampled == 2.0)).any() and ((sampled > 0.5) & (sampled < 2.0)).any()


def test_importance_sampling_ratio_rule_by_hand():
    old = torch.tensor([[-1.0, -1.0, -2.0], [-1.0, -1.0, 0.0]])
    sampling = torch.tensor([[-1.5, float("nan"), -1.0], [-1.0, -3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # token_truncate: exp(old - sampling) per token, NaN -> 1, clamped to [0.5, 2].
    expected = torch.tensor([[math.exp(0.5), 1.0, 0.5], [1.0, 2.0, 1.0]])
    torch.testing.assert_close(importance_sampling_ratio(old, sampling, mask, "token_truncate", 0.5, 2.0), expected)
    # token_mask: out of [0.5, 2] -> 0.
    expected = torch.tensor([[math.exp(0.5), 1.0, 0.0], [1.0, 0.0, 1.0]])
    torch.testing.assert_close(importance_sampling_ratio(old, sampling, mask, "token_mask", 0.5, 2.0), expected)
    # sequence_*: exp(sum of the differences) per row, shape (B, 1).
    torch.testing.assert_close(
        importance_sampling_ratio(old, sampling, mask, "sequence_truncate", 0.5, 2.0),
        torch.tensor([[math.exp(-0.5)], [2.0]]),
    )
    torch.testing.assert_close(
        importance_sampling_ratio(old, sampling, mask, "sequence_mask", None, 3.0),
        torch.tensor([[math.exp(-0.5)], [0.0]]),
    )
    with pytest.raises(ValueError, match="Unknown vllm_importance_sampling_mode"):
        importance_sampling_ratio(old, sampling, mask, "tokens", 0.5, 2.0)
