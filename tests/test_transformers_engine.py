"""TransformersEngine: batched sampling with a KV cache, logprobs, seeds, stop tokens, dynamic batching."""

import asyncio
import copy
import threading

import pytest
import torch

from trl_agentic.generation.engine import GenerationEngine, SamplingParams
from trl_agentic.generation.sampling import _exponential_noise, _stream_key
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
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=10,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=engine.pad_token_id,
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
        results = await asyncio.gather(
            *[
                engine.generate(p, SamplingParams(max_tokens=4, seed=i))
                for i, p in enumerate(prompts([4, 9, 6, 12] * 2))
            ]
        )
        await engine.stop()
        return results

    results = asyncio.run(run())
    assert len(results) == 8 and all(len(r.token_ids) == 4 for r in results)
    assert max(engine.batch_sizes) > 1 and sum(k * v for k, v in engine.batch_sizes.items()) == 8


# The engine and the trainer's module (issue 29: M1, L3, L4)


def chat_prompt(tokenizer, text="What is 12 * (3 + 4)? Use the calculator, then answer."):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def fresh_scores(model, prompt, completion):
    """`score` with the model as it is now, in eval mode, without touching the model itself."""
    return score(copy.deepcopy(model).eval(), prompt, completion, 1.0)


def tiny_engine(train=False, **engine_kwargs):
    """A fresh tiny model (in train or eval mode), an engine over it, and a chat prompt."""
    tokenizer = build_tiny_tokenizer("qwen2_5")
    model = build_tiny_model(tokenizer).train(train)
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, **engine_kwargs)
    return tokenizer, model, engine, chat_prompt(tokenizer)


def optimizer_step(model, prompt):
    """One training step of the trainer's module: a forward and backward in train mode, then AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    ids = torch.tensor([prompt])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_an_abandoned_call_never_flips_the_mode_a_training_forward_sees():
    """M1: a call whose agent was abandoned keeps decoding while training resumes. Every training forward must see
    the module in train mode (the engine used to put the shared module in eval mode around each of its steps: 31% of
    training forwards read the wrong flag), and no engine forward may run through the trainer's module."""
    tokenizer = build_tiny_tokenizer("qwen2_5")
    model = build_tiny_model(tokenizer).train()  # the trainer's module, training
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, inference_copy=True)
    prompt = chat_prompt(tokenizer)
    forwards = []  # (thread, module is the trainer's, module.training) of every forward that reached the hook

    def record(module, args):
        forwards.append((threading.current_thread().name, module is model, module.training))

    handle = model.register_forward_pre_hook(record)
    decoding = threading.Event()

    async def abandoned():
        try:
            await engine.generate(
                prompt,
                SamplingParams(max_tokens=600, seed=0, stop_token_ids=[]),
                on_token=lambda ids, lps: decoding.set(),
            )
        finally:
            await engine.stop()

    caller = threading.Thread(target=asyncio.run, args=(abandoned(),))
    caller.start()
    try:
        assert decoding.wait(30)
        steps = 0
        while caller.is_alive():
            optimizer_step(model, prompt)
            steps += 1
    finally:
        caller.join()
        handle.remove()
    training = [seen for thread, is_trainer, seen in forwards if thread == threading.current_thread().name]
    engine_forwards = [(is_trainer, seen) for thread, is_trainer, seen in forwards if thread == "trl-agentic-engine"]
    assert steps >= 3 and len(training) == steps  # the training forwards overlapped the abandoned call's decoding
    assert all(training), f"{training.count(False)} of {len(training)} training forwards saw eval mode"
    assert engine_forwards and not any(is_trainer for is_trainer, _ in engine_forwards)
    assert model.training


@pytest.mark.parametrize("inference_copy", [True, False])
def test_after_an_optimizer_step_the_engine_samples_from_the_new_weights(inference_copy):
    """The inference copy is synced after optimizer steps (the trainer calls `sync_weights`; alone, the engine sees
    the step before its next admission); a fresh forward of the updated model gives the same logprobs."""
    tokenizer, model, engine, prompt = tiny_engine(train=True, inference_copy=inference_copy)
    sampling = SamplingParams(max_tokens=8, seed=5)
    before = engine.generate_batch([prompt], [sampling])[0]
    assert before.logprobs == pytest.approx(fresh_scores(model, prompt, before.token_ids), abs=1e-5)
    optimizer_step(model, prompt)
    after = engine.generate_batch([prompt], [sampling])[0]
    assert after.logprobs == pytest.approx(fresh_scores(model, prompt, after.token_ids), abs=1e-5)
    assert after.logprobs != pytest.approx(before.logprobs, abs=1e-3)
    assert engine.stats.prefix_hits == 0 and model.training


@pytest.mark.parametrize("watch_weights", [True, False])
def test_an_engine_told_its_syncs_never_reads_every_weight_per_call(monkeypatch, watch_weights):
    """The trainer's engine (`watch_weights=False`) is synced before each rollout: it skips the checksum of every
    weight that a request reaching an idle engine costs otherwise (~14 ms per 227M bf16 parameters on an H200, nearly
    every call of a rollout with few agents), and still samples from the weights of its last sync."""
    import trl_agentic.generation.transformers_engine as module

    reads = []
    checksum = module._weights_checksum
    monkeypatch.setattr(module, "_weights_checksum", lambda model: reads.append(1) or checksum(model))
    tokenizer, model, engine, prompt = tiny_engine(inference_copy=True, watch_weights=watch_weights)
    sampling = SamplingParams(max_tokens=4, seed=3)
    first = [engine.generate_batch([prompt], [sampling])[0] for _ in range(3)]  # each reaches an idle engine
    assert (len(reads) > 0) == watch_weights
    model.model.layers[0].self_attn.k_proj.weight.data[3, 5] += 0.5
    engine.sync_weights()
    second = engine.generate_batch([prompt], [sampling])[0]
    assert (len(reads) > 0) == watch_weights  # neither the explicit sync nor the next call read them
    cold = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, prefix_cache_bytes=0)
    assert second.logprobs == cold.generate_batch([prompt], [sampling])[0].logprobs != first[0].logprobs


@pytest.mark.parametrize("inference_copy", [True, False])
def test_hooks_on_the_model_fire_for_the_engines_forwards_and_are_not_copied(inference_copy):
    """The engine's module shares the model's hook dicts: a hook holding a lock (unpicklable) failed every request
    with "cannot pickle '_thread.lock'" once the engine built a module of its own, and one registered after the
    engine was built never fired for generation."""
    tokenizer = build_tiny_tokenizer("qwen2_5")
    model = build_tiny_model(tokenizer).eval()
    lock, seen = threading.Lock(), []

    def before_engine(module, args, output):
        with lock:
            seen.append("before")

    model.register_forward_hook(before_engine)
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, inference_copy=inference_copy)
    model.model.layers[0].register_forward_hook(lambda module, args, output: seen.append("after"))
    out = engine.generate_batch([chat_prompt(tokenizer)], [SamplingParams(max_tokens=4, seed=0)])[0]
    assert len(out.token_ids) == 4
    assert seen.count("before") >= 4 and seen.count("after") >= 4  # one forward per decode step at least


@pytest.mark.parametrize("inference_copy", [True, False])
@pytest.mark.parametrize("edit", ["ema", "one_weight", "sync_weights"])
def test_weights_edited_through_data_are_used_by_the_next_request(inference_copy, edit):
    """L3: an edit through `.data` bumps no version counter and steps no optimizer (an EMA callback, an evaluator
    loading weights). The second of two identical requests samples from the new weights: not from the first one's
    cached prefix, nor from a stale inference copy."""
    tokenizer, model, engine, prompt = tiny_engine(inference_copy=inference_copy)
    sampling = SamplingParams(max_tokens=8, seed=5)
    first = engine.generate_batch([prompt], [sampling])[0]
    average = build_tiny_model(tokenizer, seed=1)
    if edit == "one_weight":
        model.model.layers[0].self_attn.k_proj.weight.data[3, 5] += 0.5  # one weight the cached keys depend on
    else:
        for p, q in zip(model.parameters(), average.parameters()):
            p.data.mul_(0.5).add_(q.data, alpha=0.5)
    if edit == "sync_weights":
        engine.sync_weights()  # the public way to say so, whatever the edit
    second = engine.generate_batch([prompt], [sampling])[0]
    cold = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, prefix_cache_bytes=0)
    expected = cold.generate_batch([prompt], [sampling])[0]
    assert (second.token_ids, second.logprobs) == (expected.token_ids, expected.logprobs)
    assert second.logprobs != first.logprobs and engine.stats.prefix_hits == 0


def test_unseeded_requests_leave_the_global_rng_alone(engine):
    """L4: an unseeded request draws its seed from the engine's own generator, never from torch's global RNG."""
    prompt = prompts([8])[0]
    state = torch.get_rng_state()
    outputs = engine.generate_batch([prompt] * 3, [SamplingParams(max_tokens=6)] * 3)
    assert torch.equal(torch.get_rng_state(), state)
    assert len({tuple(out.token_ids) for out in outputs}) > 1  # each request its own draws
    # An engine seeded alike draws alike, whatever the global RNG does in between.
    tokenizer = build_tiny_tokenizer("qwen2_5")
    a, b = (TransformersEngine(engine.model, pad_token_id=tokenizer.pad_token_id, seed=7) for _ in range(2))
    first = a.generate_batch([prompt], [SamplingParams(max_tokens=6)])[0]
    torch.manual_seed(123)
    assert b.generate_batch([prompt], [SamplingParams(max_tokens=6)])[0].token_ids == first.token_ids


def test_a_peft_model_is_served_with_its_adapters_and_its_frozen_base_is_not_copied():
    from peft import LoraConfig, get_peft_model

    tokenizer = build_tiny_tokenizer("qwen2_5")
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # adapters that matter
    model = get_peft_model(build_tiny_model(tokenizer), config).train()
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, inference_copy=True)
    prompt = chat_prompt(tokenizer)
    sampling = SamplingParams(max_tokens=8, seed=5)
    out = engine.generate_batch([prompt], [sampling])[0]
    assert out.logprobs == pytest.approx(fresh_scores(model, prompt, out.token_ids), abs=1e-5)
    with model.disable_adapter():
        assert out.logprobs != pytest.approx(fresh_scores(model, prompt, out.token_ids), abs=1e-3)
    optimizer_step(model, prompt)  # trains the adapters only
    engine.sync_weights()  # as the trainer does before a rollout
    out = engine.generate_batch([prompt], [sampling])[0]
    assert out.logprobs == pytest.approx(fresh_scores(model, prompt, out.token_ids), abs=1e-5)
    # The copy holds the adapters (what trains) and shares the base weights.
    own = [p for p in engine._module.parameters() if all(p is not q for q in model.parameters())]
    assert sum(p.numel() for p in own) == sum(p.numel() for p in model.parameters() if p.requires_grad) > 0
    assert model.training and all(m.training for m in model.modules())


def test_each_rows_noise_follows_exp1_and_gives_draws_at_the_models_probabilities():
    """The rows' random streams (SplitMix64, counter-based: all rows drawn at once): argmax(p / q) with q ~ Exp(1)
    draws token i with probability p_i, rows and draws are independent of each other, and a row's draws are the
    same whatever rows share its batch."""
    probs = torch.softmax(torch.randn(10, generator=torch.Generator().manual_seed(0)), dim=0)
    rows = 100_000
    keys = torch.tensor([_stream_key(seed) for seed in range(rows)])  # seeds 0, 1, 2...: neighbours must not correlate
    noise = _exponential_noise(keys, torch.zeros(rows, dtype=torch.long), 10)
    assert noise.mean().item() == pytest.approx(1.0, abs=0.01) and noise.var().item() == pytest.approx(1.0, abs=0.02)
    counts = torch.bincount((probs / noise).argmax(dim=1), minlength=10).float()
    chi2 = (((counts - rows * probs) ** 2) / (rows * probs)).sum().item()
    assert chi2 < 27.9  # chi-square, 9 degrees of freedom, p = 0.001
    later = _exponential_noise(keys, torch.full((rows,), 7), 10)  # draw 7 of each row
    assert abs(torch.corrcoef(torch.stack([noise.flatten(), later.flatten()]))[0, 1].item()) < 0.01
    assert abs(torch.corrcoef(torch.stack([noise[:-1].flatten(), noise[1:].flatten()]))[0, 1].item()) < 0.01
    alone = _exponential_noise(keys[5:6], torch.tensor([3]), 10)
    assert torch.equal(alone[0], _exponential_noise(keys[:9], torch.full((9,), 3), 10)[5])


def test_a_row_whose_logits_are_not_finite_fails_greedy_or_sampled():
    tokenizer = build_tiny_tokenizer("qwen2_5")
    model = build_tiny_model(tokenizer).eval()
    model.lm_head.register_forward_hook(lambda module, args, logits: logits.fill_(float("nan")))
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="not finite"):
        engine.generate_batch(prompts([5]), [SamplingParams(max_tokens=3, temperature=0.0)])
    with pytest.raises(ValueError, match="not finite"):
        engine.generate_batch(prompts([5]), [SamplingParams(max_tokens=3, seed=0)])


def penalized_score(model, prompt, completion, penalty):
    """TRL's transformers sampling of `completion` after `prompt` with `repetition_penalty` (transformers'
    `RepetitionPenaltyLogitsProcessor` over the prompt and the tokens sampled so far): the logprob of each token."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    process = RepetitionPenaltyLogitsProcessor(penalty)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # (C, V)
    logps = []
    for t, token in enumerate(completion):
        scores = process(torch.tensor([prompt + completion[:t]]), logits[t : t + 1].clone())
        logps.append(torch.log_softmax(scores, dim=-1)[0, token].item())
    return logps


def test_repetition_penalty_samples_as_transformers_generate_does(engine):
    """TRL's `repetition_penalty` (issue 40): greedy decoding picks what `generate(repetition_penalty=...)` picks, and
    a sampled token's logprob is that of the penalized distribution it was drawn from (vLLM's `processed_logprobs`,
    which TRL's importance-sampling correction is built on)."""
    prompt = prompts([9])[0]
    plain = engine.generate_batch([prompt], [SamplingParams(max_tokens=12, temperature=0.0)])[0]
    out = engine.generate_batch([prompt], [SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=5.0)])[0]
    reference = engine.model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=12,
        do_sample=False,
        repetition_penalty=5.0,
        eos_token_id=None,
        pad_token_id=engine.pad_token_id,
    )[0, len(prompt) :].tolist()
    assert out.token_ids == reference
    assert out.token_ids != plain.token_ids  # the penalty changed what was sampled
    sampled = engine.generate_batch([prompt], [SamplingParams(max_tokens=12, repetition_penalty=1.5, seed=4)])[0]
    expected = penalized_score(engine.model, prompt, sampled.token_ids, 1.5)
    assert sampled.logprobs == pytest.approx(expected, abs=1e-3)
    assert sampled.logprobs != pytest.approx(score(engine.model, prompt, sampled.token_ids, 1.0), abs=1e-3)


def test_min_p_restricts_which_tokens_can_be_drawn(engine):
    """TRL's `min_p`: only tokens at least `min_p` times as likely as the most likely one can be drawn; as top-p,
    the logprobs stay those of the full distribution. `min_p=1` leaves only the most likely token: greedy."""
    prompt = prompts([7])[0]
    greedy = engine.generate_batch([prompt], [SamplingParams(max_tokens=8, temperature=0.0)])[0]
    for seed in range(3):
        out = engine.generate_batch([prompt], [SamplingParams(max_tokens=8, min_p=1.0, seed=seed)])[0]
        assert out.token_ids == greedy.token_ids
        assert out.logprobs == pytest.approx(score(engine.model, prompt, out.token_ids, 1.0), abs=1e-3)
    out = engine.generate_batch([prompt], [SamplingParams(max_tokens=16, temperature=2.0, min_p=0.3, seed=1)])[0]
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        probs = torch.softmax(engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / 2.0, dim=-1)
    for t, token in enumerate(out.token_ids):
        assert probs[t, token] >= 0.3 * probs[t].max() - 1e-6


def test_sampling_params_refuse_bad_penalties():
    with pytest.raises(ValueError, match=r"repetition_penalty=0.0 \(finite, > 0\)"):
        SamplingParams(repetition_penalty=0.0)
    with pytest.raises(ValueError, match=r"min_p=1.5 \(in \[0, 1\]\)"):
        SamplingParams(min_p=1.5)


def test_a_copy_of_a_model_trl_wrapped_runs_on_its_own_weights():
    """TRL's GRPOTrainer wraps the policy's `forward` (its fused LM head) in a closure holding the original bound
    `forward`; `copy.deepcopy` keeps that closure, so a copy ran the source's forward (its weights, its training flag):
    every serving version of online training served the trainer's latest weights (issue 43). `copy_model` rebinds it."""
    from trl.trainer.utils import add_fused_lm_head

    from trl_agentic.generation.weights import copy_model

    tokenizer = build_tiny_tokenizer("qwen2_5")
    model = build_tiny_model(tokenizer)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids = torch.tensor([chat_prompt(tokenizer)])
    with torch.no_grad():
        before = model(ids).logits
    naive, copied = copy.deepcopy(model), copy_model(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
        after = model(ids).logits
        assert not torch.allclose(after, before)
        assert torch.equal(naive(ids).logits, after)  # the defect: the plain copy follows the source
        assert torch.equal(copied(ids).logits, before)  # the copy runs on its own weights
        # the fused path works on the copy too, and uses the copy's weights
        fused = copied(ids, labels=ids, fused_lm_head=True).log_probs
        reference = torch.log_softmax(before[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
        assert torch.allclose(fused[0], reference, atol=1e-5)


def test_the_engines_inference_copy_of_a_trl_wrapped_model_never_runs_the_trainers_module():
    """The engine's inference copy (`inference_copy=True`) of a policy TRL wrapped generates through its own module,
    in eval mode: no engine forward reaches the trainer's module."""
    from trl.trainer.utils import add_fused_lm_head

    tokenizer = build_tiny_tokenizer("qwen2_5")
    model = build_tiny_model(tokenizer).train()
    add_fused_lm_head(model)
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, inference_copy=True)
    reached = []
    # on the backbone: the wrapper calls the source's `forward` directly (no hook of the source's top module fires)
    handle = model.model.register_forward_pre_hook(lambda module, args: reached.append(module is model.model))
    try:
        out = asyncio.run(engine.generate(chat_prompt(tokenizer), SamplingParams(max_tokens=4, seed=0)))
    finally:
        asyncio.run(engine.stop())
        handle.remove()
    assert len(out.token_ids) == 4
    assert reached and not any(reached)  # hooks are shared (they fire for the copy's forwards), the module is not
