"""The one way to build the endpoint: engine + renderer + settings + server, for the trainer, eval, the demo and serve.

Every caller that serves a policy to agents goes through here, so the endpoint an agent meets in training is the one
it meets in `trl-agentic eval`, in the demo's held-out evaluation and behind `trl-agentic serve`: same served model
name, same sampling overrides (the trainer's settings win over the agent's request), same chat-template variables,
same default engine batch.

Example:

```python
>>> from trl_agentic.endpoint.launch import build_engine, launch_endpoint
>>> from trl_agentic.tiny_models import load_model_and_tokenizer
>>> model, tokenizer = load_model_and_tokenizer("tiny:qwen2_5:64x2")
>>> server = launch_endpoint(build_engine(model, tokenizer), tokenizer, temperature=1.0, max_tokens=64, max_turns=8)
>>> server.served_model_name, server.base_url
('policy', 'http://127.0.0.1:...')
>>> server.stop()
```
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from ..generation.engine import GenerationEngine
from ..generation.transformers_engine import TransformersEngine
from ..generation.vllm_engine import VLLMColocateEngine, VLLMServerEngine
from ..store import EpisodeStore
from . import SERVED_MODEL_NAME
from .app import EndpointSettings, SamplingOverrides, create_app
from .chat import ChatRenderer
from .server import EndpointServer
from .sessions import EpisodeLimits
from .versions import VersionManager


# Most requests the embedded engine samples together, wherever it runs (the default of
# `AgenticGRPOConfig.max_generation_batch_size`, of `trl-agentic eval` and of `trl-agentic serve --max-batch-size`).
DEFAULT_MAX_BATCH_SIZE = 64
# How long a request reaching an idle embedded engine waits for company (`generation_batch_wait_ms`,
# `--batch-wait-ms`). 0: batching is continuous, later requests join the running batch between decode steps.
DEFAULT_BATCH_WAIT_MS = 0.0
# `max_tokens` of a request that sets none, when no cap is configured either.
DEFAULT_MAX_TOKENS = 512


def build_engine(
    model,
    tokenizer,
    *,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    batch_wait_ms: float = DEFAULT_BATCH_WAIT_MS,
    max_context_length: int | None = None,
    inference_copy: bool = False,
    seed: int | None = None,
    watch_weights: bool = True,
) -> TransformersEngine:
    """The embedded engine over a transformers causal LM (its current weights; assign `engine.model` to swap it).

    Args:
        model: the causal LM to sample from.
        tokenizer: its tokenizer; prompts of a batch are left-padded with its pad token (its EOS token if it has
            none).
        max_batch_size: most requests sampled together.
        batch_wait_ms: how long the first request of a batch waits for others to join.
        max_context_length: prompt + completion tokens accepted (default: the model's `max_position_embeddings`).
        inference_copy: generate with a copy of the weights taken at each sync (a model that trains meanwhile: the
            trainer's engine) rather than a view of the model's own (see [`TransformersEngine`]).
        seed: seed of the seeds drawn for requests that bring none (default: the system's entropy).
        watch_weights: compare a checksum of the weights when a request reaches an idle engine, to see edits through
            `.data` (off where the owner calls `engine.sync_weights()` after changing them, as the trainer does).

    Example:

    ```python
    >>> engine = build_engine(model, tokenizer, max_batch_size=32)
    ```
    """
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return TransformersEngine(
        model,
        pad_token_id=pad_token_id,
        max_batch_size=max_batch_size,
        batch_wait_s=batch_wait_ms / 1000,
        max_context_length=max_context_length,
        inference_copy=inference_copy,
        seed=seed,
        watch_weights=watch_weights,
    )


def default_engine(args, model, tokenizer, vllm_generation=None) -> GenerationEngine:
    """The trainer's engine for an `AgenticGRPOConfig` (`args`): vLLM in server mode (TRL's `VLLMGeneration` keeps the
    server's weights in sync), vLLM colocated (`vllm_generation`: TRL's), else the embedded engine over `model` (the
    unwrapped policy) with an inference copy of its weights."""
    context = args.vllm_max_model_length or model.config.max_position_embeddings
    if args.use_vllm and args.vllm_mode == "server":
        # TRL's VLLMGeneration keeps the server's weights in sync (sync_weights before each rollout phase).
        base_url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
        return VLLMServerEngine(base_url, max_context_length=context)
    if args.use_vllm:
        return VLLMColocateEngine(
            vllm_generation.llm, max_context_length=context, batch_wait_s=args.generation_batch_wait_ms / 1000
        )
    return build_engine(
        model,
        tokenizer,
        max_batch_size=args.max_generation_batch_size,
        batch_wait_ms=args.generation_batch_wait_ms,
        max_context_length=context,
        inference_copy=True,  # the module trains while abandoned calls may still decode (issue 29, M1)
        watch_weights=False,  # synced in each `_rollout_episodes`: no read of every weight per idle call
        seed=args.seed,
    )


def create_endpoint_app(
    engine: GenerationEngine,
    tokenizer,
    *,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    max_tokens: int | None = None,
    default_max_tokens: int | None = None,
    max_turns: int | None = None,
    max_episode_tokens: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    served_model_name: str = SERVED_MODEL_NAME,
    admin_token: str | None = None,
    max_open_episodes: int | None = None,
    episode_idle_timeout: float | None = None,
    store: EpisodeStore | None = None,
    versions: VersionManager | None = None,
    user_episode_idle_timeout: float = 300.0,
    feedback_per_minute: int = 60,
) -> FastAPI:
    """The endpoint app (routes, renderer, settings) over `engine`, not yet listening: [`launch_endpoint`] starts it
    in-process, `trl-agentic serve` hands it to uvicorn.

    Args:
        engine: a [`GenerationEngine`] (see [`build_engine`]).
        tokenizer: the policy's tokenizer, with its chat template.
        temperature, top_p, top_k: sampling imposed on every call, whatever the agent asks (`None`: the request's
            value; `top_k` 0 or `None`: off, TRL's convention).
        min_p, repetition_penalty: TRL's, on every call (`None`: off; no wire format lets an agent set them).
        max_tokens: cap on the tokens of one call (a request may ask for fewer); `None`: no cap.
        default_max_tokens: `max_tokens` of a request that sets none (default: `max_tokens`, else 512).
        max_turns, max_episode_tokens: default per-episode limits (`None`: none).
        chat_template_kwargs: extra chat-template variables, e.g. `{"enable_thinking": False}`.
        served_model_name: the `model` agents send; others are answered 404.
        admin_token: bearer token of the `/admin` routes (default: a random one; an empty one is a `ValueError`).
        max_open_episodes: most episodes open at once, more are answered 429 (`None`: no cap).
        episode_idle_timeout: seconds without a call after which an episode is closed with status `cancelled`
            (`None`: never).
        store: an `EpisodeStore`: enables user keys, their episodes and feedback, and the admin's rewards.
        versions: a `VersionManager`: several versions served side by side, rolled out gradually.
        user_episode_idle_timeout, feedback_per_minute: with a store, when a user key's episode ends, and how often
            a user may give feedback (`EndpointSettings`).
    """
    settings = EndpointSettings(
        **({} if admin_token is None else {"admin_token": admin_token}),
        served_model_names=[served_model_name],
        default_max_tokens=default_max_tokens or max_tokens or DEFAULT_MAX_TOKENS,
        overrides=SamplingOverrides(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k or None,
            max_tokens=max_tokens,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
        ),
        default_limits=EpisodeLimits(max_turns=max_turns, max_episode_tokens=max_episode_tokens),
        max_open_episodes=max_open_episodes,
        episode_idle_timeout=episode_idle_timeout,
        user_episode_idle_timeout=user_episode_idle_timeout,
        feedback_per_minute=feedback_per_minute,
    )
    return create_app(engine, ChatRenderer(tokenizer, chat_template_kwargs), settings, store=store, versions=versions)


def launch_endpoint(
    engine: GenerationEngine,
    tokenizer,
    *,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    max_tokens: int | None = None,
    default_max_tokens: int | None = None,
    max_turns: int | None = None,
    max_episode_tokens: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    served_model_name: str = SERVED_MODEL_NAME,
    admin_token: str | None = None,
    max_open_episodes: int | None = None,
    episode_idle_timeout: float | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
) -> EndpointServer:
    """Start the endpoint in this process (a uvicorn server in a background thread) and return it, listening.

    The arguments are those of [`create_endpoint_app`], plus `host` (loopback by default) and `port` (`0`: a free
    one). Stop it with `server.stop()`; `server.call(engine.stop())` first ends the engine's batching worker.

    Example:

    ```python
    >>> server = launch_endpoint(engine, tokenizer, temperature=1.0, max_tokens=256, max_turns=16)
    >>> session = server.open_episode()
    >>> client = openai.OpenAI(base_url=server.base_url, api_key=session.key)
    ```
    """
    app = create_endpoint_app(
        engine,
        tokenizer,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        max_tokens=max_tokens,
        default_max_tokens=default_max_tokens,
        max_turns=max_turns,
        max_episode_tokens=max_episode_tokens,
        chat_template_kwargs=chat_template_kwargs,
        served_model_name=served_model_name,
        admin_token=admin_token,
        max_open_episodes=max_open_episodes,
        episode_idle_timeout=episode_idle_timeout,
    )
    return EndpointServer(app, host=host, port=port).start()


__all__ = [
    "DEFAULT_BATCH_WAIT_MS",
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_MAX_TOKENS",
    "SERVED_MODEL_NAME",
    "build_engine",
    "create_endpoint_app",
    "launch_endpoint",
]
