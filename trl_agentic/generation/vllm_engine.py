"""vLLM generation for GPUs, following TRL's `use_vllm` / `vllm_mode` semantics.

- `VLLMServerEngine` (`vllm_mode="server"`): talks to a `trl vllm-serve` / `vllm serve` server with the same wire
  protocol TRL's `VLLMClient.generate` uses (`POST /v1/completions` with token-id prompts, `return_token_ids`,
  `return_tokens_as_token_ids`, `logprobs=0`), so prompt and sampled ids are exact and each sampled token comes with
  its logprob. The server batches concurrent requests itself (continuous batching). Weights are synced by TRL's
  `VLLMGeneration.sync_weights()` before every rollout phase (GRPOTrainer does it on the `rollout_func` path) and
  TRL's importance-sampling correction (`vllm_importance_sampling_correction`) is applied to the recorded logprobs.
  Launch the server with `--logprobs-mode processed_logprobs` so logprobs are temperature-scaled like TRL scores them.
- `VLLMColocateEngine` (`vllm_mode="colocate"`): the trainer's in-process `vllm.LLM`; concurrent requests are
  coalesced into one `llm.generate` call (it is not thread-safe).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from .batching import DynamicBatcher
from .engine import GenerationOutput, SamplingParams, TokenCallback


def _parse_choice(choice: dict[str, Any]) -> GenerationOutput:
    token_ids = list(choice["token_ids"])
    logprobs_block = choice.get("logprobs")
    if not logprobs_block:
        raise ValueError("The vLLM server returned no logprobs; the engine asks for logprobs=0 on every request.")
    # Completions format: tokens are "token_id:<id>" strings (return_tokens_as_token_ids), aligned with token_logprobs.
    tokens = [int(str(t).removeprefix("token_id:")) for t in logprobs_block["tokens"]]
    if tokens != token_ids:
        raise ValueError(f"vLLM logprob tokens {tokens[:8]}... do not match the sampled token ids {token_ids[:8]}...")
    logprobs = [float("nan") if lp is None else float(lp) for lp in logprobs_block["token_logprobs"]]
    top = None
    if logprobs_block.get("top_logprobs") and any(logprobs_block["top_logprobs"]):
        top = [
            sorted(((int(k.removeprefix("token_id:")), v) for k, v in (entry or {}).items()), key=lambda kv: -kv[1])
            for entry in logprobs_block["top_logprobs"]
        ]
    finish = "length" if choice.get("finish_reason") == "length" else "stop"
    return GenerationOutput(token_ids, logprobs, finish, top)


class VLLMServerEngine:
    """Generate through a vLLM server (TRL's `vllm_mode="server"`).

    Args:
        base_url: the server, e.g. `http://127.0.0.1:8000` (TRL's `vllm_server_base_url`).
        max_context_length: the server's `max_model_len`.
        model: model name to send (defaults to the first of `GET /v1/models`).
        timeout: seconds per request.
    """

    def __init__(self, base_url: str, max_context_length: int, model: str | None = None, timeout: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.max_context_length = max_context_length
        self.model = model
        self.timeout = timeout
        self.policy_version = 0
        self._client: httpx.AsyncClient | None = None
        self._loop = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client = httpx.AsyncClient(timeout=self.timeout)
            self._loop = loop
        if self.model is None:
            response = await self._client.get(f"{self.base_url}/v1/models")
            response.raise_for_status()
            self.model = response.json()["data"][0]["id"]

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def payload(self, prompt_ids: list[int], sampling: SamplingParams) -> dict[str, Any]:
        payload = {
            "model": self.model,
            "prompt": [prompt_ids],
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "n": 1,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "min_p": sampling.min_p,
            "repetition_penalty": sampling.repetition_penalty,
            "max_tokens": sampling.max_tokens,
            "logprobs": sampling.top_logprobs,
            "stop_token_ids": sampling.stop_token_ids,
            "skip_special_tokens": False,
        }
        if sampling.seed is not None:
            payload["seed"] = sampling.seed
        return payload

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, on_token: TokenCallback | None = None
    ) -> GenerationOutput:
        """Generate through the server (one non-streaming call: `on_token` gets everything at once, at the end)."""
        await self.start()
        response = await self._client.post(f"{self.base_url}/v1/completions", json=self.payload(prompt_ids, sampling))
        if response.status_code != 200:
            raise RuntimeError(f"vLLM server error {response.status_code}: {response.text[:500]}")
        choice = response.json()["choices"][0]
        if "prompt_token_ids" in choice and choice["prompt_token_ids"] is not None:
            if list(choice["prompt_token_ids"]) != list(prompt_ids):
                raise ValueError("The vLLM server changed the prompt token ids; token-in generation must be exact.")
        output = _parse_choice(choice)
        if on_token is not None:
            on_token(output.token_ids, output.logprobs)
        return output


class VLLMColocateEngine(DynamicBatcher):
    """Generate with the trainer's in-process `vllm.LLM` (TRL's `vllm_mode="colocate"`), batching concurrent calls
    into one `llm.generate` (it is not thread-safe)."""

    def __init__(self, llm, max_context_length: int, batch_wait_s: float = 0.005, max_batch_size: int = 256):
        self.llm = llm
        self.max_context_length = max_context_length
        self.batch_wait_s = batch_wait_s
        self.max_batch_size = max_batch_size
        self.policy_version = 0
        self._init_batching()

    def generate_batch(
        self, prompts: list[list[int]], samplings: list[SamplingParams], cancelled=None, emitters=None
    ) -> list[GenerationOutput]:
        # `cancelled` rows are not stopped early (one `llm.generate` call); their outputs are discarded. Nothing is
        # streamed (`emitters` unused): the batcher sends each output in one chunk before resolving its request.
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            VLLMSamplingParams(
                n=1,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k if s.top_k > 0 else -1,
                min_p=s.min_p,
                repetition_penalty=s.repetition_penalty,
                max_tokens=s.max_tokens,
                logprobs=s.top_logprobs,
                seed=s.seed,
                stop_token_ids=s.stop_token_ids,
                skip_special_tokens=False,
            )
            for s in samplings
        ]
        results = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        outputs = []
        for result in results:
            completion = result.outputs[0]
            ids = list(completion.token_ids)
            logprobs = [entry[token].logprob for token, entry in zip(ids, completion.logprobs)]
            finish = "length" if completion.finish_reason == "length" else "stop"
            outputs.append(GenerationOutput(ids, logprobs, finish))
        return outputs
