"""The embedded default engine: dynamic batching of concurrent requests over a transformers causal LM.

Concurrent `generate` calls are queued; a worker takes everything waiting (up to `max_batch_size`, after waiting at
most `batch_wait_s` for company), runs one batched sampling loop with a KV cache in a worker thread, and resolves
each request. Each sampled token comes with `log_softmax(logits / temperature)` at that token: the distribution TRL
scores the same token under (top-p/top-k only restrict which tokens can be drawn).
"""

from __future__ import annotations

import threading

import torch
from transformers import PreTrainedModel

from .batching import DynamicBatcher, RowEmitter
from .engine import GenerationOutput, SamplingParams


class TransformersEngine(DynamicBatcher):
    """Serve a transformers causal LM to many concurrent requests.

    Args:
        model: the policy (the trainer's live model: its weights are current by construction).
        pad_token_id: id used to left-pad prompts in a batch.
        max_batch_size: most requests sampled together.
        batch_wait_s: how long the first request of a batch waits for others to join.
        max_context_length: prompt + completion length the model accepts (defaults to the model's
            `max_position_embeddings`).
        model_lock: a lock held while the model is used (the trainer holds it while it changes weights).

    Example:

    ```python
    >>> engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id)
    >>> out = await engine.generate([1, 2, 3], SamplingParams(max_tokens=8))
    ```
    """

    def __init__(
        self,
        model: PreTrainedModel,
        pad_token_id: int,
        max_batch_size: int = 32,
        batch_wait_s: float = 0.005,
        max_context_length: int | None = None,
        model_lock: threading.Lock | None = None,
    ):
        self.model = model
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_context_length = max_context_length or model.config.max_position_embeddings
        self.model_lock = model_lock or threading.Lock()
        self.policy_version = 0
        self._init_batching()

    @torch.no_grad()
    def generate_batch(
        self,
        prompts: list[list[int]],
        samplings: list[SamplingParams],
        cancelled: list[threading.Event] | None = None,
        emitters: list[RowEmitter] | None = None,
    ) -> list[GenerationOutput]:
        """Sample a completion for each prompt (synchronously). Rows differ in length and sampling parameters; a row
        whose `cancelled` event is set stops sampling (finish reason `"cancelled"`); `emitters[i]` gets each token of
        row `i` as it is sampled."""
        with self.model_lock:
            was_training = self.model.training
            self.model.eval()
            try:
                return self._sample(prompts, samplings, cancelled, emitters)
            finally:
                if was_training:
                    self.model.train()

    def _sample(
        self,
        prompts: list[list[int]],
        samplings: list[SamplingParams],
        cancelled: list[threading.Event] | None,
        emitters: list[RowEmitter] | None,
    ) -> list[GenerationOutput]:
        device = next(self.model.parameters()).device
        batch_size = len(prompts)
        max_prompt = max(len(p) for p in prompts)
        input_ids = torch.full((batch_size, max_prompt), self.pad_token_id, dtype=torch.long, device=device)
        attention_mask = torch.zeros((batch_size, max_prompt), dtype=torch.long, device=device)
        for i, prompt in enumerate(prompts):  # left padding
            input_ids[i, max_prompt - len(prompt) :] = torch.tensor(prompt, device=device)
            attention_mask[i, max_prompt - len(prompt) :] = 1

        temperatures = torch.tensor([max(s.temperature, 1e-5) for s in samplings], device=device).unsqueeze(1)
        generators = []
        for s in samplings:
            generator = torch.Generator(device=device)
            generator.manual_seed(s.seed if s.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
            generators.append(generator)
        max_new = [min(s.max_tokens, self.max_context_length - len(p)) for s, p in zip(samplings, prompts)]
        stop_ids = [set(s.stop_token_ids) for s in samplings]

        tokens: list[list[int]] = [[] for _ in range(batch_size)]
        logprobs: list[list[float]] = [[] for _ in range(batch_size)]
        tops: list[list | None] = [[] if s.top_logprobs else None for s in samplings]
        finish: list[str | None] = [None if m > 0 else "length" for m in max_new]
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = None
        step_ids = input_ids
        while any(f is None for f in finish):
            outputs = self.model(
                input_ids=step_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = outputs.cache
            logits = outputs.logits[:, -1, :].float() / temperatures  # (B, V)
            logps = torch.log_softmax(logits, dim=-1)
            next_ids = torch.full((batch_size,), self.pad_token_id, dtype=torch.long, device=device)
            for i in range(batch_size):
                if finish[i] is None and cancelled is not None and cancelled[i].is_set():
                    finish[i] = "cancelled"  # its client went away: free the row
                if finish[i] is not None:
                    continue
                token = _sample_row(logps[i], samplings[i], generators[i])
                next_ids[i] = token
                tokens[i].append(token)
                logprobs[i].append(logps[i, token].item())
                if emitters is not None:
                    emitters[i]([token], [logprobs[i][-1]])
                if tops[i] is not None:
                    values, ids = torch.topk(logps[i], samplings[i].top_logprobs)
                    tops[i].append(list(zip(ids.tolist(), values.tolist())))
                if token in stop_ids[i]:
                    finish[i] = "stop"
                elif len(tokens[i]) >= max_new[i]:
                    finish[i] = "length"
            step_ids = next_ids.unsqueeze(1)
            attention_mask = torch.cat([attention_mask, torch.ones((batch_size, 1), dtype=torch.long, device=device)], 1)
            position_ids = position_ids[:, -1:] + 1
        return [GenerationOutput(*row) for row in zip(tokens, logprobs, finish, tops, strict=True)]


def _sample_row(logps: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> int:
    """Draw one token from `logps` (already temperature-scaled), restricted by top-k / top-p; greedy at T=0."""
    if sampling.temperature <= 0:
        return int(torch.argmax(logps).item())
    probs = logps.exp()
    if sampling.top_k and sampling.top_k > 0:
        kth = torch.topk(probs, min(sampling.top_k, probs.numel())).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, 0)
        remove = cumulative - sorted_probs > sampling.top_p  # keep the smallest set whose mass reaches top_p
        sorted_probs[remove] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())
