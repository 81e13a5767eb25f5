"""TransformersEngine serving concurrent requests: streaming, continuous batching, isolation."""

import asyncio
import threading

import pytest

from trl_agentic.generation import transformers_engine
from trl_agentic.generation.engine import SamplingParams
from trl_agentic.generation.transformers_engine import EngineStats, TransformersEngine
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_model(tokenizer).eval()


def chat_prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_streamed_chunks_concatenate_to_the_output_and_arrive_before_it(tokenizer, model):
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id)
    prompts = [chat_prompt(tokenizer, text) for text in ("Hello there", "What is 2 + 3?", "Hi")]
    events: dict[int, list] = {i: [] for i in range(len(prompts))}

    async def one(i: int):
        def on_token(ids, logprobs):
            events[i].append((list(ids), list(logprobs), task.done()))

        task = asyncio.ensure_future(
            engine.generate(prompts[i], SamplingParams(max_tokens=6 + i, seed=i), on_token=on_token)
        )
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


def alone(engine, prompt, sampling):
    return TransformersEngine(engine.model, pad_token_id=engine.pad_token_id, prefix_cache_bytes=0).generate_batch(
        [prompt], [sampling]
    )[0]


async def join_while_running(engine, running, joiners, after_tokens=5):
    """Start `running`; once it has streamed `after_tokens` tokens, hold the model between two steps, queue the
    `joiners` (prompt, sampling) and let go. Returns the outputs and the order in which they completed."""
    order = []
    streamed = asyncio.Event()
    counted = []

    def on_token(ids, logprobs):
        counted.extend(ids)
        if len(counted) >= after_tokens:
            streamed.set()

    async def tracked(name, coroutine):
        result = await coroutine
        order.append(name)
        return result

    first = asyncio.ensure_future(tracked("running", engine.generate(*running, on_token=on_token)))
    await streamed.wait()
    with engine.model_lock:  # the worker is between two steps: the joiners are queued before its next one
        others = [asyncio.ensure_future(tracked(i, engine.generate(*joiner))) for i, joiner in enumerate(joiners)]
        await asyncio.sleep(0)
    results = await asyncio.gather(first, *others, return_exceptions=True)
    await engine.stop()
    return results, order


def test_requests_join_the_running_batch_and_leave_it_when_done(tokenizer, model):
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id)
    # Long enough that it is still running when the joiners come: the worker decodes while the event loop
    # waits for the GIL to see the fifth token, and with 64 tokens on a busy 2-core machine it sometimes finished first.
    running = (chat_prompt(tokenizer, "Tell a long story."), SamplingParams(max_tokens=600, seed=0))
    joiners = [
        # Longer than the running row's cache (it gets left-padded) ...
        (chat_prompt(tokenizer, "Summarize: " + "the cat sat on the mat. " * 12), SamplingParams(max_tokens=3, seed=1)),
        # ... and shorter, greedy, with top logprobs and a stop id.
        (chat_prompt(tokenizer, "Hi"), SamplingParams(max_tokens=6, temperature=0.0, top_logprobs=2)),
    ]
    greedy = alone(engine, *joiners[1])
    stop = greedy.token_ids[3]
    joiners[1][1].stop_token_ids = [stop]
    results, order = asyncio.run(join_while_running(engine, running, joiners))
    assert order[-1] == "running"  # the joiners did not wait for the running row to finish, nor it for them
    assert engine.stats.decoded_rows > engine.stats.decode_steps  # steps that decoded several rows
    # Each row samples what it samples alone: per-row seeds, positions and masks.
    for (prompt, sampling), result in zip([running, *joiners], results):
        reference = alone(engine, prompt, sampling)
        assert result.token_ids == reference.token_ids and result.finish_reason == reference.finish_reason
        assert result.logprobs == pytest.approx(reference.logprobs, abs=1e-5)
    assert results[2].finish_reason == "stop"
    assert results[2].token_ids == greedy.token_ids[: greedy.token_ids.index(stop) + 1]
    assert [ids for ids, _ in results[2].top_logprobs[0]] == [ids for ids, _ in greedy.top_logprobs[0]]


def test_a_bad_request_joining_a_running_batch_fails_alone(tokenizer, model):
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id)
    running = (chat_prompt(tokenizer, "Tell a long story."), SamplingParams(max_tokens=32, seed=0))
    good = (chat_prompt(tokenizer, "Hello there"), SamplingParams(max_tokens=4, seed=3))
    poison = ([len(tokenizer) + 1000], SamplingParams(max_tokens=4))  # past the embedding table: the prefill raises
    results, _ = asyncio.run(join_while_running(engine, running, [good, poison]))
    assert isinstance(results[2], IndexError)
    assert results[0].token_ids == alone(engine, *running).token_ids
    assert results[1].token_ids == alone(engine, *good).token_ids


def test_a_cancelled_request_leaves_the_batch(tokenizer, model):
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id)
    prompt = chat_prompt(tokenizer, "Tell a long story.")

    async def main():
        streamed = asyncio.Event()
        doomed = asyncio.ensure_future(
            engine.generate(
                prompt, SamplingParams(max_tokens=3000, stop_token_ids=[]), on_token=lambda ids, lps: streamed.set()
            )
        )
        await streamed.wait()
        doomed.cancel()  # the client disconnected
        # A request queued after the cancellation: by the time it is done (several steps), the row is gone.
        after = await engine.generate(prompt, SamplingParams(max_tokens=4, seed=0))
        rows = engine.stats.decoded_rows
        await engine.stop()
        return doomed, after, rows

    doomed, after, rows = asyncio.run(main())
    assert doomed.cancelled() and len(after.token_ids) == 4
    assert rows < 1000  # far from the 3000 tokens it asked for


def test_requests_sent_together_to_an_idle_engine_are_admitted_together(tokenizer, model, monkeypatch):
    """An event loop starting many agents sends their first calls back to back while the engine's fresh worker thread
    competes for the GIL: admitted as they came, they split over several prefills and end at different steps (issue
    29: on a 16-core machine every fresh start split, e.g. 3 + 29; 32 agents kept 0.74-0.80 of the batching gain).

    The behaviour, not the 0.3 ms window: on a loaded machine the event loop can be descheduled for longer between two
    calls (issue 40: 20 rounds of the real window were flaky), so the arrival gap is widened to a second here."""
    monkeypatch.setattr(transformers_engine, "_ARRIVAL_GAP_S", 1.0)
    monkeypatch.setattr(transformers_engine, "_ARRIVALS_MAX_S", 30.0)
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id)

    async def together():
        try:
            await asyncio.gather(
                *[engine.generate([10 + i, 20, 30], SamplingParams(max_tokens=2, seed=i)) for i in range(16)]
            )
        finally:
            await engine.stop()  # the worker thread ends: the next round starts a fresh one

    admissions = []
    for _ in range(3):  # each round waits a gap after the last arrival
        engine.batch_sizes.clear()
        asyncio.run(together())
        admissions.append(sorted(engine.batch_sizes.elements()))
    assert admissions == [[16]] * 3


def test_stats_taken_while_serving_lose_no_step(tokenizer, model):
    """`take_stats` copies and resets under the lock the worker counts under: taken over and over while 12 requests
    are served, the pieces add up to every request and every decoded row (issue 40: copied and reset apart, a step
    counted in between was lost)."""
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, prefix_cache_bytes=0)
    lengths = [3 + i % 5 for i in range(12)]
    taken, done = [], threading.Event()

    def take():
        while not done.is_set():
            taken.append(engine.take_stats())

    async def serve():
        try:
            return await asyncio.gather(
                *[
                    engine.generate([10 + i, 20, 30], SamplingParams(max_tokens=n, seed=i, stop_token_ids=[]))
                    for i, n in enumerate(lengths)
                ]
            )
        finally:
            await engine.stop()

    taker = threading.Thread(target=take)
    taker.start()
    try:
        outputs = asyncio.run(serve())
    finally:
        done.set()
        taker.join()
    taken.append(engine.take_stats())
    assert [len(output.token_ids) for output in outputs] == lengths
    assert sum(stats.requests for stats in taken) == 12
    # The first token of a request is sampled at its prefill, each other one at a decode step.
    assert sum(stats.decoded_rows for stats in taken) == sum(n - 1 for n in lengths)
    assert sum(stats.prefilled_tokens for stats in taken) == 3 * 12
    assert engine.stats == EngineStats()  # nothing counted twice: the last take reset it
