"""Per-episode KV prefix reuse in TransformersEngine: only the new tokens of a continued turn are prefilled, the
result is what a full prefill gives, and a policy change never samples from the old states (issue #12)."""

import pytest
import torch

from trl_agentic.generation.engine import SamplingParams
from trl_agentic.generation.prefix_cache import BLOCK, PrefixCache
from trl_agentic.generation.transformers_engine import SHARED_PREFIX_MIN, TransformersEngine
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


@pytest.fixture
def model(tokenizer):
    return build_tiny_model(tokenizer).eval()


def first_prompt(tokenizer, text="What is 12 * (3 + 4)? Use the calculator, then answer."):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def tool_turn(tokenizer, result: str) -> list[int]:
    """What the chat template appends after an assistant turn: the tool result and the next generation prompt."""
    return tokenizer.encode(
        f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )


SAMPLING = SamplingParams(max_tokens=8, temperature=1.0, seed=5)


def episode(engine, tokenizer, turns=3):
    """A growing episode: each prompt is the previous prompt + its completion + a tool result."""
    prompt, outputs = first_prompt(tokenizer), []
    for k in range(turns):
        out = engine.generate_batch([prompt], [SAMPLING])[0]
        outputs.append((prompt, out))
        prompt = prompt + out.token_ids + tool_turn(tokenizer, f"{k} " * (4 * k + 3))
    return outputs


def test_continued_turns_prefill_only_their_new_tokens_and_sample_what_a_full_prefill_samples(tokenizer, model):
    reuse = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id)
    cold = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, prefix_cache_bytes=0)
    with_reuse, without = episode(reuse, tokenizer), episode(cold, tokenizer)
    for (prompt, out), (cold_prompt, cold_out) in zip(with_reuse, without):
        assert prompt == cold_prompt and out.token_ids == cold_out.token_ids
        assert out.logprobs == pytest.approx(cold_out.logprobs, abs=1e-5)
    # Turn k+1 reuses all of turn k's prompt and sampled ids but the last (never fed): only the rest is prefilled.
    expected_reused = [len(p) + len(o.token_ids) - 1 for p, o in with_reuse[:-1]]
    assert (reuse.stats.prefix_hits, reuse.stats.reused_tokens) == (2, sum(expected_reused))
    assert reuse.stats.prefilled_tokens == sum(len(p) for p, _ in with_reuse) - sum(expected_reused)
    assert (cold.stats.prefix_hits, cold.stats.reused_tokens) == (0, 0)
    assert len(reuse.prefix_cache) == 1  # each turn's entry replaced the one it extended


def test_a_fork_reuses_the_common_prefix_only(tokenizer, model):
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id)
    cold = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, prefix_cache_bytes=0)
    prompt = first_prompt(tokenizer)
    first = engine.generate_batch([prompt], [SAMPLING])[0]
    # The agent rewrote its last message: the new prompt leaves the cached sequence inside the prompt.
    fork = prompt[:-5] + tokenizer.encode("Answer now.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    out = engine.generate_batch([fork], [SAMPLING])[0]
    assert out.token_ids == cold.generate_batch([fork], [SAMPLING])[0].token_ids
    assert out.logprobs == pytest.approx(cold.generate_batch([fork], [SAMPLING])[0].logprobs, abs=1e-5)
    common = next(i for i, (a, b) in enumerate(zip(prompt, fork)) if a != b)
    assert engine.stats.reused_tokens == common and engine.stats.prefix_hits == 1
    assert len(first.token_ids) == 8


@pytest.mark.parametrize("change", ["policy_version", "in_place_only", "new_model", "fused_adamw", "foreach_adamw"])
def test_a_policy_change_never_samples_from_the_old_states(tokenizer, model, change):
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id)
    prompt = first_prompt(tokenizer)
    first = engine.generate_batch([prompt], [SAMPLING])[0]
    assert len(engine.prefix_cache) == 1
    # The trainer's optimizer step: new weights, and (normally) a new policy_version.
    if change == "new_model":
        engine.model = build_tiny_model(tokenizer, seed=1).eval()
    elif change.endswith("adamw"):
        # TRL's default optimizer (`adamw_torch_fused`) updates the weights without bumping their version counters:
        # an engine that serves the live model without the trainer's `policy_version` (the demo's held-out evaluator)
        # sampled from the old weights' states of the shared system prompt (held-out success 1% while training
        # success was 27%).
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=0.05, fused=change == "fused_adamw", foreach=change == "foreach_adamw" or None
        )
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        if change == "policy_version":
            engine.policy_version += 1
    following = prompt + first.token_ids + tool_turn(tokenizer, "84")
    out = engine.generate_batch([following], [SAMPLING])[0]
    cold = TransformersEngine(engine.model, pad_token_id=tokenizer.pad_token_id).generate_batch(
        [following], [SAMPLING]
    )[0]
    assert (out.token_ids, out.logprobs) == (cold.token_ids, cold.logprobs)  # exactly: a full prefill, as cold
    assert engine.stats.prefix_hits == 0


def test_concurrent_episodes_reuse_their_own_prefixes(tokenizer, model):
    """Rows with different cached prefixes and new-token counts prefilled together, as continuous batching admits
    them; each samples what it samples alone without reuse."""
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id)
    cold = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, prefix_cache_bytes=0)
    prompts = [first_prompt(tokenizer, f"Task {i}: " + "compute " * (3 * i + 1)) for i in range(4)]
    samplings = [SamplingParams(max_tokens=6 + i, seed=i) for i in range(4)]
    firsts = engine.generate_batch(prompts, samplings)
    following = [
        p + o.token_ids + tool_turn(tokenizer, "7 " * (5 * i + 1)) for i, (p, o) in enumerate(zip(prompts, firsts))
    ]
    following.append(first_prompt(tokenizer, "A new episode."))  # no cached prefix: prefilled whole, alongside
    samplings.append(SamplingParams(max_tokens=5, seed=9))
    outs = engine.generate_batch(following, samplings)
    for prompt, sampling, out in zip(following, samplings, outs):
        alone = cold.generate_batch([prompt], [sampling])[0]
        assert out.token_ids == alone.token_ids
        assert out.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert engine.stats.prefix_hits >= 4  # the first-turn system prefix may be shared too


def test_the_prefix_cache_is_bounded_by_bytes_least_recently_used_first(tokenizer, model):
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id)
    a, b = first_prompt(tokenizer, "First episode " * 4), first_prompt(tokenizer, "Second one " * 4)
    engine.generate_batch([a], [SAMPLING])
    one_entry = engine.prefix_cache.nbytes
    engine.prefix_cache.max_bytes = int(one_entry * 1.5)  # room for one entry of this size
    engine.generate_batch([b], [SAMPLING])
    assert len(engine.prefix_cache) == 1 and engine.prefix_cache.nbytes <= engine.prefix_cache.max_bytes
    entry, matched = engine.prefix_cache.lookup(b + [5])
    assert matched == len(b) and engine.prefix_cache.lookup(a + [5])[1] < len(a)  # `a` was evicted


def test_prefix_cache_lookup_finds_the_longest_prefix_and_checks_tokens():
    cache = PrefixCache(max_bytes=2**20)
    cache.clear(policy="p")
    states = lambda n: ([torch.zeros(1, n, 2)], [torch.zeros(1, n, 2)])  # noqa: E731
    short, long = list(range(2 * BLOCK)), list(range(3 * BLOCK + 5))
    cache.store(short, *states(len(short)), policy="p")
    cache.store(long, *states(len(long)), policy="p")
    cache.store(list(range(100, 100 + 2 * BLOCK)), *states(2 * BLOCK), policy="old")  # other weights: refused
    assert len(cache) == 2
    entry, matched = cache.lookup(long[:-2] + [999, 998])
    assert entry.tokens == long and matched == len(long) - 2
    assert cache.lookup(long + [1])[1] == len(long)
    assert cache.lookup(list(range(BLOCK - 1)) + [7] * BLOCK) == (None, 0)  # diverges inside the first block
    assert cache.lookup(short)[1] == len(short) - 1  # the last prompt token is always fed


def test_a_prefix_shared_by_joiners_is_prefilled_once(tokenizer, model):
    """A GRPO group's first turns: G identical prompts, and several groups sharing the system prompt. Their common
    prefixes are computed once (the system prompt once, each group's prompt once) and every row samples what it
    samples alone without reuse."""
    system = [{"role": "system", "content": "You are a careful assistant. " * 6}]
    prompts, samplings = [], []
    for task in range(3):
        question = f"Task {task}: what is {task + 11} * {task + 47}? Think it through, show the steps, then answer."
        messages = system + [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        for g in range(4):
            prompts.append(prompt)
            samplings.append(SamplingParams(max_tokens=6, temperature=1.0, seed=10 * task + g))
    common = 0
    while all(p[common] == prompts[0][common] for p in prompts):
        common += 1
    per_task = len(prompts[0]) - 1 - common
    assert min(common, per_task) >= SHARED_PREFIX_MIN  # the system prompt is shared, each question by its group

    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id)
    cold = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, prefix_cache_bytes=0)
    outs = engine.generate_batch(prompts, samplings)
    for prompt, sampling, out in zip(prompts, samplings, outs):
        alone = cold.generate_batch([prompt], [sampling])[0]
        assert out.token_ids == alone.token_ids
        assert out.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    # Computed: the common prefix once, each task's prompt but its last token once (on top of the common prefix),
    # and each row's last prompt token.
    assert engine.stats.prefilled_tokens == common + 3 * per_task + len(prompts)
    assert engine.stats.reused_tokens == len(prompts) * (len(prompts[0]) - 1)
    assert cold.stats.prefilled_tokens == len(prompts) * len(prompts[0])  # (cold: one prompt at a time, 12 of them)
