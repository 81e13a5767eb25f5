"""TransformersEngine: batched sampling with a KV cache, logprobs, seeds, stop tokens, dynamic batching."""

import asyncio

import pytest
import torch

from trl_agentic.generation.engine import GenerationEngine, SamplingParams
from trl_agentic.generation.transformers_engine import TransformersEngine
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def engine() -> TransformersEngine:
    tokenizer = build_tiny_tokenizer("qwen2_5")
    model = build_tiny_model(tokenizer).eval()  # random weights: a spread-out distribution tests sampling better
    return TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, max_context_length=256)


def prompts(lengths):
    return [[(7 * i + 3 * k) % 500 + 10 for k in range(n)] for i, n in enumerate(lengths)]


def score(model, prompt, completion, temperature):
    """The model's own logprobs of `completion` after `prompt`: one fp32 forward, log_softmax(logits / T)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # (C, V)
    logps = torch.log_softmax(logits / temperature, dim=-1)
    return logps.gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1).tolist()


def test_engine_satisfies_the_protocol(engine):
    assert isinstance(engine, GenerationEngine)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_the_models_own_scoring(engine, temperature):
    """Rows of different lengths (left padding, per-row positions) sampled together score like one forward each."""
    batch = prompts([5, 17, 11])
    params = [SamplingParams(max_tokens=12, temperature=temperature, seed=i) for i in range(3)]
    outputs = engine.generate_batch(batch, params)
    for prompt, out in zip(batch, outputs):
        assert len(out.token_ids) == len(out.logprobs) == 12 and out.finish_reason == "length"
        assert out.logprobs == pytest.approx(score(engine.model, prompt, out.token_ids, temperature), abs=1e-3)


def test_greedy_matches_transformers_generate(engine):
    prompt = prompts([9])[0]
    out = engine.generate_batch([prompt], [SamplingParams(max_tokens=10, temperature=0.0)])[0]
    reference = engine.model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=10,
        do_sample=False, eos_token_id=None, pad_token_id=engine.pad_token_id,
    )[0, len(prompt) :].tolist()
    assert out.token_ids == reference
    # top_k=1 is greedy too, whatever the temperature.
    top1 = engine.generate_batch([prompt], [SamplingParams(max_tokens=10, temperature=1.0, top_k=1, seed=3)])[0]
    assert top1.token_ids == reference


def test_seeds_make_sampling_reproducible(engine):
    prompt = prompts([8])[0]
    params = [SamplingParams(max_tokens=16, seed=s) for s in (1, 1, 2)]
    a, b, c = engine.generate_batch([prompt] * 3, params)
    assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert a.token_ids != c.token_ids
    # The same seed gives the same tokens alone as in a batch.
    alone = engine.generate_batch([prompt], [SamplingParams(max_tokens=16, seed=1)])[0]
    assert alone.token_ids == a.token_ids


def test_stop_tokens_and_length(engine):
    prompt = prompts([6])[0]
    greedy = engine.generate_batch([prompt], [SamplingParams(max_tokens=8, temperature=0.0)])[0]
    stop = greedy.token_ids[2]
    out = engine.generate_batch([prompt], [SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop])])[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop  # the stop token is kept
    assert out.token_ids == greedy.token_ids[: greedy.token_ids.index(stop) + 1]
    # The context length caps the completion.
    long_prompt = prompts([250])[0]
    out = engine.generate_batch([long_prompt], [SamplingParams(max_tokens=50)])[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_top_logprobs_and_top_p(engine):
    prompt = prompts([7])[0]
    out = engine.generate_batch([prompt], [SamplingParams(max_tokens=5, top_logprobs=3, seed=0)])[0]
    assert len(out.top_logprobs) == 5
    for alternatives in out.top_logprobs:
        values = [lp for _, lp in alternatives]
        assert len(alternatives) == 3 and values == sorted(values, reverse=True)
    # A tiny top_p keeps only the most likely token: greedy, but logprobs stay those of the full distribution.
    nucleus = engine.generate_batch([prompt], [SamplingParams(max_tokens=5, top_p=1e-6, seed=0)])[0]
    greedy = engine.generate_batch([prompt], [SamplingParams(max_tokens=5, temperature=1.0, top_k=1)])[0]
    assert nucleus.token_ids == greedy.token_ids
    assert nucleus.logprobs == pytest.approx(score(engine.model, prompt, nucleus.token_ids, 1.0), abs=1e-3)


def test_concurrent_requests_are_batched(engine):
    async def run():
        engine.batch_sizes.clear()
        results = await asyncio.gather(*[
            engine.generate(p, SamplingParams(max_tokens=4, seed=i)) for i, p in enumerate(prompts([4, 9, 6, 12] * 2))
        ])
        await engine.stop()
        return results

    results = asyncio.run(run())
    assert len(results) == 8 and all(len(r.token_ids) == 4 for r in results)
    assert max(engine.batch_sizes) > 1 and sum(k * v for k, v in engine.batch_sizes.items()) == 8
