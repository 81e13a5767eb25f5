"""Dynamic batching: one request must never cost the others of its batch (issue #9)."""

import asyncio

import pytest

from trl_agentic.generation.engine import SamplingParams
from trl_agentic.generation.transformers_engine import TransformersEngine
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


def test_one_failing_request_fails_alone_and_its_batch_mates_are_served(tokenizer):
    model = build_tiny_model(tokenizer)
    # A long batch wait: the four requests below are sampled as one batch.
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, batch_wait_s=0.5)
    good = tokenizer.encode("Hello there", add_special_tokens=False)
    poison = [len(tokenizer) + 1000]  # an id past the embedding table: the batched forward raises

    async def main():
        requests = [engine.generate(good, SamplingParams(max_tokens=3, seed=i)) for i in range(3)]
        requests.insert(1, engine.generate(poison, SamplingParams(max_tokens=3)))
        try:
            return await asyncio.gather(*requests, return_exceptions=True)
        finally:
            await engine.stop()

    results = asyncio.run(main())
    assert isinstance(results[1], IndexError)
    served = [results[0], results[2], results[3]]
    assert all(not isinstance(r, BaseException) and len(r.token_ids) == 3 for r in served), results
    assert engine.batch_sizes[4] == 1  # they did share a batch
    # The retried members sampled what they would have sampled alone (same seed, same prompt).
    alone = engine.generate_batch([good], [SamplingParams(max_tokens=3, seed=0)])[0]
    assert served[0].token_ids == alone.token_ids


def test_sampling_parameters_are_validated_before_they_reach_a_batch():
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    SamplingParams(seed=-(2**63), temperature=0.0, top_p=1.0)  # the edges are fine


def test_row_of_a_disconnected_caller_stops_sampling(tokenizer):
    # The batcher sets a row's event when its caller is cancelled (the client disconnected); the engine frees the row.
    import threading

    engine = TransformersEngine(build_tiny_model(tokenizer), pad_token_id=tokenizer.pad_token_id)
    prompt = tokenizer.encode("Hello there", add_special_tokens=False)
    gone, waiting = threading.Event(), threading.Event()
    gone.set()
    sampling = SamplingParams(max_tokens=20, seed=0, stop_token_ids=[])
    outputs = engine.generate_batch([prompt, prompt], [sampling, sampling], cancelled=[gone, waiting])
    assert (outputs[0].finish_reason, outputs[0].token_ids) == ("cancelled", [])
    assert (outputs[1].finish_reason, len(outputs[1].token_ids)) == ("length", 20)
