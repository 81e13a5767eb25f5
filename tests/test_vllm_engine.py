"""The vLLM server engine's wire contract, against a local server that speaks vLLM's token-id completions protocol
(backed by a tiny transformers model, so ids and logprobs are real)."""

import asyncio

import openai
import pytest
import torch
from fastapi import FastAPI

from trl_agentic.endpoint.app import create_app
from trl_agentic.endpoint.chat import ChatRenderer
from trl_agentic.endpoint.server import EndpointServer
from trl_agentic.generation.engine import SamplingParams
from trl_agentic.generation.transformers_engine import TransformersEngine
from trl_agentic.generation.vllm_engine import VLLMServerEngine
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


def vllm_protocol_app(engine: TransformersEngine, requests: list) -> FastAPI:
    """What `vllm serve` answers to TRL's VLLMClient.generate: /v1/models and token-id /v1/completions."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "tiny-policy", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(body: dict):
        requests.append(body)
        assert body["return_token_ids"] and body["return_tokens_as_token_ids"] and body["logprobs"] == 0
        prompt = body["prompt"][0]
        sampling = SamplingParams(
            max_tokens=body["max_tokens"],
            temperature=body["temperature"],
            top_p=body["top_p"],
            min_p=body["min_p"],
            repetition_penalty=body["repetition_penalty"],
            seed=body.get("seed"),
            stop_token_ids=body["stop_token_ids"],
        )
        out = await engine.generate(prompt, sampling)
        return {
            "choices": [
                {
                    "index": 0,
                    "text": "",
                    "prompt_token_ids": prompt,
                    "token_ids": out.token_ids,
                    "finish_reason": "length" if out.finish_reason == "length" else "stop",
                    "logprobs": {
                        "tokens": [f"token_id:{t}" for t in out.token_ids],
                        "token_logprobs": out.logprobs,
                        "top_logprobs": [None] * len(out.token_ids),
                    },
                }
            ]
        }

    return app


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_tiny_tokenizer("qwen2_5")
    return tokenizer, build_tiny_model(tokenizer)


def test_endpoint_over_vllm_server_records_exact_ids_and_logprobs(tiny):
    tokenizer, model = tiny
    requests = []
    backend = EndpointServer(vllm_protocol_app(TransformersEngine(model, tokenizer.pad_token_id), requests)).start()
    engine = VLLMServerEngine(backend.url, max_context_length=4096)
    endpoint = EndpointServer(create_app(engine, ChatRenderer(tokenizer))).start()
    try:
        session = endpoint.open_episode()
        client = openai.OpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0)
        messages = [{"role": "user", "content": "hello"}]
        for turn in range(3):
            reply = client.chat.completions.create(
                model="policy", messages=messages, max_tokens=6, temperature=0.7, seed=turn
            )
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        episode = endpoint.close_episode(session.episode.id)
    finally:
        endpoint.stop()
        backend.stop()

    assert engine.model == "tiny-policy" and len(requests) == 3
    assert [t.prompt_source for t in episode.turns] == ["rendered", "continued", "continued"]
    for turn, request in zip(episode.turns, requests):
        assert request["prompt"] == [turn.prompt_ids]  # token-in: the server got exactly the recorded prompt
        assert request["temperature"] == 0.7 and request["skip_special_tokens"] is False
        # Logprobs as recorded agree with the model's own scoring of the same tokens at the same temperature.
        ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(turn.prompt_ids) - 1 : -1].float() / 0.7
        scored = torch.log_softmax(logits, -1).gather(1, torch.tensor(turn.completion_ids)[:, None])[:, 0]
        assert torch.allclose(scored, torch.tensor(turn.logprobs), atol=1e-3)


def test_server_engine_rejects_inconsistent_answers(tiny):
    tokenizer, model = tiny
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/completions")
    async def completions(body: dict):
        return {
            "choices": [
                {
                    "token_ids": [5, 6],
                    "prompt_token_ids": body["prompt"][0] + [1],
                    "finish_reason": "stop",
                    "logprobs": {
                        "tokens": ["token_id:5", "token_id:6"],
                        "token_logprobs": [-1.0, -2.0],
                        "top_logprobs": [None, None],
                    },
                }
            ]
        }

    server = EndpointServer(app).start()
    try:
        engine = VLLMServerEngine(server.url, max_context_length=128, model="m")
        with pytest.raises(ValueError, match="changed the prompt token ids"):
            asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_tokens=2)))
    finally:
        server.stop()


def test_trls_repetition_penalty_and_min_p_reach_the_vllm_server():
    """TRL passes `repetition_penalty` and `min_p` to vLLM's SamplingParams (issue 40): so does the server engine."""
    engine = VLLMServerEngine("http://127.0.0.1:1", max_context_length=4096)
    payload = engine.payload([5, 6], SamplingParams(max_tokens=4, repetition_penalty=1.3, min_p=0.05))
    assert (payload["repetition_penalty"], payload["min_p"]) == (1.3, 0.05)
    plain = engine.payload([5, 6], SamplingParams(max_tokens=4))
    assert (plain["repetition_penalty"], plain["min_p"]) == (1.0, 0.0)  # vLLM's own defaults: off
