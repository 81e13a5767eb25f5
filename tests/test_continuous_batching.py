"""TransformersEngine serving concurrent requests: streaming, continuous batching, isolation."""

import asyncio

import pytest

from trl_agentic.generation.engine import SamplingParams
from trl_agentic.generation.transformers_engine import TransformersEngine
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_model(tokenizer).eval()


def chat_prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def test_streamed_chunks_concatenate_to_the_output_and_arrive_before_it(tokenizer, model):
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id)
    prompts = [chat_prompt(tokenizer, text) for text in ("Hello there", "What is 2 + 3?", "Hi")]
    events: dict[int, list] = {i: [] for i in range(len(prompts))}

    async def one(i: int):
        def on_token(ids, logprobs):
            events[i].append((list(ids), list(logprobs), task.done()))

        task = asyncio.ensure_future(engine.generate(prompts[i], SamplingParams(max_tokens=6 + i, seed=i),
                                                     on_token=on_token))
        output = await task
        events[i].append(("done", len(output.token_ids)))
        return output

    async def main():
        try:
            return await asyncio.gather(*[one(i) for i in range(len(prompts))])
        finally:
            await engine.stop()

    outputs = asyncio.run(main())
    for i, output in enumerate(outputs):
        *chunks, done = events[i]
        assert done == ("done", 6 + i) and len(chunks) > 1  # streamed as sampled, not in one piece at the end
        assert not any(done for _, _, done in chunks)  # every chunk before the output
        assert sum((ids for ids, _, _ in chunks), []) == output.token_ids
        assert sum((lps for _, lps, _ in chunks), []) == output.logprobs
