"""The generation contract: token ids in, sampled token ids and their logprobs out."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol, runtime_checkable


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Receives each newly sampled chunk of one request, in order: `(token_ids, logprobs)`, one logprob per id. Called on
# the event loop that awaits `generate`, before `generate` returns; it must not block (queue the chunk, return).
TokenCallback = Callable[[list[int], list[float]], None]


@dataclass
class SamplingParams:
    """Sampling parameters of one generation request.

    `temperature`, `top_p`, `top_k` decide the distribution the logprobs are reported under (TRL scores tokens
    with `logits / temperature`, so do we). `stop_token_ids` end the generation and are kept in the output.
    `repetition_penalty` and `min_p` are TRL's (`GRPOConfig`): the penalty divides the positive logits (multiplies the
    negative ones) of every token already in the prompt or the completion, as transformers and vLLM do, and the
    logprobs are those of the penalized distribution (what sampled the token, vLLM's `processed_logprobs`); `min_p`
    only restricts which tokens can be drawn (those at least `min_p` times as likely as the most likely), as top-p.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    top_logprobs: int = 0  # also report this many most likely (id, logprob) pairs per position
    repetition_penalty: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off

    def __post_init__(self):
        # The last line of defence of a batch: one request's bad value used to fail every request sampled with it.
        problems = []
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            problems.append(f"max_tokens={self.max_tokens!r} (an int >= 1)")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature={self.temperature!r} (finite, >= 0)")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            problems.append(f"top_p={self.top_p!r} (in (0, 1])")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            problems.append(f"top_k={self.top_k!r} (an int >= 0)")
        if self.seed is not None and not (isinstance(self.seed, int) and INT64_MIN <= self.seed <= INT64_MAX):
            problems.append(f"seed={self.seed!r} (an int64)")
        if not (isinstance(self.top_logprobs, int) and self.top_logprobs >= 0):
            problems.append(f"top_logprobs={self.top_logprobs!r} (an int >= 0)")
        if not (isinstance(self.repetition_penalty, int | float) and 0 < self.repetition_penalty < math.inf):
            problems.append(f"repetition_penalty={self.repetition_penalty!r} (finite, > 0)")
        if not (isinstance(self.min_p, int | float) and 0 <= self.min_p <= 1):
            problems.append(f"min_p={self.min_p!r} (in [0, 1])")
        if problems:
            raise ValueError(f"Invalid sampling parameters: {', '.join(problems)}.")

    def to_dict(self) -> dict:
        return asdict(self)


def derive_seed(*parts: int) -> int:
    """A seed in [0, 2**62) that depends on `parts` alone, unrelated to the seed of any other parts: an episode's from
    its rollout's seed and its position, a model call's from its episode's seed and its index in the episode. What an
    episode samples then never depends on the order its requests reach the engine in (issue 29).

    Example:

    ```python
    >>> derive_seed(7, 0) == derive_seed(7, 0) != derive_seed(7, 1)
    True
    ```
    """
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 2


@dataclass
class GenerationOutput:
    """What the engine sampled for one prompt.

    `finish_reason` is `"stop"` when a stop token was sampled (it is the last id) and `"length"` when `max_tokens`
    ran out. `versions`: the `policy_version` of the weights that sampled each token, from an engine that can take
    new weights while a request decodes (the embedded engine under asynchronous rollouts); `None` from one that
    cannot (all tokens are of the version the engine had when the call ended).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    top_logprobs: list[list[tuple[int, float]]] | None = None
    versions: list[int] | None = None


@runtime_checkable
class GenerationEngine(Protocol):
    """Generates completions for token-id prompts.

    `generate` is awaited from many concurrent requests; implementations batch them. `policy_version` identifies
    the weights that sampled (the trainer's global step); the trainer sets it before each rollout, and an engine that
    keeps state computed with the weights (a KV cache) drops that state when it changes.

    Streaming: when `on_token` is given, `generate` calls `on_token(token_ids, logprobs)` with each newly sampled chunk
    of this request, in order, on the event loop that awaits `generate` (engines that sample in a thread marshal
    the call with `loop.call_soon_threadsafe`), and every chunk arrives before `generate` returns. The chunks
    concatenate to the returned `GenerationOutput.token_ids` / `.logprobs`, which still hold everything. An engine
    that cannot stream (the vLLM server engine) calls it once, with everything, just before returning; a request that
    fails may have streamed some chunks before its exception.

    Example:

    ```python
    >>> chunks = []
    >>> def on_token(token_ids, logprobs):
    ...     chunks.append(token_ids)
    >>> out = await engine.generate([1, 2, 3], SamplingParams(max_tokens=8), on_token=on_token)
    >>> sum(chunks, []) == out.token_ids
    True
    ```
    """

    max_context_length: int
    policy_version: int

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, on_token: TokenCallback | None = None
    ) -> GenerationOutput: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...
