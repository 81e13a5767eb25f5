"""The generation contract: token ids in, sampled token ids and their logprobs out."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Protocol, runtime_checkable


@dataclass
class SamplingParams:
    """Sampling parameters of one generation request.

    `temperature`, `top_p`, `top_k` decide the distribution the logprobs are reported under (TRL scores tokens
    with `logits / temperature`, so do we). `stop_token_ids` end the generation and are kept in the output.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    top_logprobs: int = 0  # also report this many most likely (id, logprob) pairs per position

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationOutput:
    """What the engine sampled for one prompt.

    `finish_reason` is `"stop"` when a stop token was sampled (it is the last id) and `"length"` when `max_tokens`
    ran out.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    top_logprobs: list[list[tuple[int, float]]] | None = None


@runtime_checkable
class GenerationEngine(Protocol):
    """Generates completions for token-id prompts.

    `generate` is awaited from many concurrent requests; implementations batch them. `policy_version` identifies
    the weights that sampled (the trainer's global step).
    """

    max_context_length: int
    policy_version: int

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationOutput: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...
