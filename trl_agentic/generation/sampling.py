"""The embedded engine's sampling math: per-row counter-based random streams (so a row's draws depend only on its
seed and their index, whatever batch it shares), the repetition penalty and the top-p/top-k/min-p restriction."""

from __future__ import annotations

import torch

from .engine import SamplingParams


# SplitMix64 (Steele, Lea & Flood, 2014): a counter-based generator, so each row's draws are a pure function of its
# key and their index, computed for the whole batch at once.
_MASK64 = 2**64 - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _stream_key(seed: int) -> int:
    """A row's stream key (an int64) from its seed: SplitMix64's output for that seed, so that seeds 0, 1, 2...
    start far apart in the generator's sequence."""
    z = (seed + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    z ^= z >> 31
    return z - 2**64 if z >= 2**63 else z


def _exponential_noise(keys: torch.Tensor, draws: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise (B, vocab) for sampling: row `b` gets outputs `draws[b] * vocab ...` of the SplitMix64 stream
    keyed `keys[b]` (int64), so a row's draw `k` depends on its seed and `k` only, never on the batch it shares.

    ```python
    >>> keys, draws = torch.tensor([_stream_key(1), _stream_key(2)]), torch.tensor([0, 5])
    >>> torch.equal(_exponential_noise(keys, draws, 8)[1], _exponential_noise(keys[1:], draws[1:], 8)[0])
    True
    ```
    """
    # int64 arithmetic wraps modulo 2**64 as SplitMix64's does; `>>` on int64 keeps the sign, so shifts are masked.
    z = keys.unsqueeze(1) + (draws.unsqueeze(1) * vocab + torch.arange(vocab, device=keys.device)) * _signed(_GOLDEN)
    z = (z ^ _shift_right(z, 30)) * _signed(_MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed(_MIX2)
    z = z ^ _shift_right(z, 31)
    uniform = (_shift_right(z, 40).float() + 0.5) * 2.0**-24  # the top 24 bits, in (0, 1)
    return -torch.log(uniform)


def _signed(value: int) -> int:
    return value - 2**64 if value >= 2**63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _penalize(logits: torch.Tensor, seen: list[int], penalty: float) -> None:
    """Apply a repetition penalty to `logits` (V,) in place, as transformers' `RepetitionPenaltyLogitsProcessor` and
    vLLM do: the logit of every token in `seen` (prompt + tokens sampled so far) divided by `penalty` when positive,
    multiplied when negative (a token seen twice is penalized once)."""
    ids = torch.tensor(seen, dtype=torch.long, device=logits.device)
    scores = logits.gather(0, ids)
    logits.scatter_(0, ids, torch.where(scores < 0, scores * penalty, scores / penalty))


def _restrict(probs: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """`probs` (V,) with the tokens top-k / top-p / min-p exclude set to 0 (the rest is not renormalized: sampling does
    not need it, and the reported logprobs stay those of the full distribution). In transformers' order: top-k, top-p,
    then min-p relative to the most likely token (which the first two always keep)."""
    if sampling.top_k > 0:
        kth = torch.topk(probs, min(sampling.top_k, probs.numel())).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, 0)
        remove = cumulative - sorted_probs > sampling.top_p  # keep the smallest set whose mass reaches top_p
        sorted_probs[remove] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    if sampling.min_p > 0:
        probs = torch.where(probs < sampling.min_p * probs.max(), torch.zeros_like(probs), probs)
    return probs
