"""`trl_agentic/endpoint/launch.py`: the one way the trainer, eval, the demo and serve build the endpoint."""

import dataclasses

import openai
import pytest

from trl_agentic.agentic_grpo_config import AgenticGRPOConfig
from trl_agentic.endpoint import SERVED_MODEL_NAME
from trl_agentic.endpoint.app import EndpointSettings
from trl_agentic.endpoint.launch import (
    DEFAULT_BATCH_WAIT_MS,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_TOKENS,
    build_engine,
    create_endpoint_app,
    launch_endpoint,
)
from trl_agentic.endpoint.serve import make_parser as serve_parser
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


def test_served_model_name_is_defined_once():
    import trl_agentic.agentic_grpo_trainer as trainer_module

    assert SERVED_MODEL_NAME == "policy"
    assert trainer_module.SERVED_MODEL_NAME is SERVED_MODEL_NAME  # still importable from the trainer module
    assert serve_parser().parse_args(["--model", "m"]).served_model_name == SERVED_MODEL_NAME


def test_one_default_engine_batch_everywhere():
    fields = {f.name: f.default for f in dataclasses.fields(AgenticGRPOConfig)}
    serve_args = serve_parser().parse_args(["--model", "m"])
    assert fields["max_generation_batch_size"] == DEFAULT_MAX_BATCH_SIZE == serve_args.max_batch_size == 64
    assert fields["generation_batch_wait_ms"] == DEFAULT_BATCH_WAIT_MS == serve_args.batch_wait_ms
    assert serve_args.default_max_tokens == DEFAULT_MAX_TOKENS


def test_settings_reach_the_app(tokenizer):
    engine = build_engine(build_tiny_model(tokenizer), tokenizer, max_batch_size=8, batch_wait_ms=20.0)
    assert (engine.max_batch_size, engine.batch_wait_s, engine.pad_token_id) == (8, 0.02, tokenizer.pad_token_id)

    app = create_endpoint_app(
        engine,
        tokenizer,
        temperature=0.5,
        top_p=0.9,
        top_k=0,
        max_tokens=16,
        max_turns=3,
        max_episode_tokens=40,
        chat_template_kwargs={"enable_thinking": False},
        admin_token="sk-admin-test",
    )
    settings = app.state.settings
    assert settings.served_model_names == [SERVED_MODEL_NAME] and settings.admin_token == "sk-admin-test"
    assert (settings.overrides.temperature, settings.overrides.top_p, settings.overrides.max_tokens) == (0.5, 0.9, 16)
    assert settings.overrides.top_k is None  # TRL's top_k=0 means off
    assert settings.default_max_tokens == 16  # a request without max_tokens gets the cap
    assert (settings.default_limits.max_turns, settings.default_limits.max_episode_tokens) == (3, 40)
    assert app.state.renderer.chat_template_kwargs == {"enable_thinking": False}

    # Nothing imposed: the request decides, 512 tokens when it does not say.
    bare = create_endpoint_app(engine, tokenizer).state.settings
    assert bare.default_max_tokens == DEFAULT_MAX_TOKENS and bare.overrides.max_tokens is None
    assert bare.overrides.temperature is None and bare.default_limits.max_turns is None


def test_launched_endpoint_serves_and_records(tokenizer):
    engine = build_engine(build_tiny_model(tokenizer), tokenizer)
    server = launch_endpoint(engine, tokenizer, temperature=1.0, max_tokens=4, max_turns=1)
    try:
        assert server.served_model_name == SERVED_MODEL_NAME and server.host == "127.0.0.1"
        session = server.open_episode()
        client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "hi"}]
        response = client.chat.completions.create(model=SERVED_MODEL_NAME, messages=messages, max_tokens=100)
        assert response.usage.completion_tokens <= 4  # the cap wins over the request
        with pytest.raises(openai.BadRequestError, match="at most 1 model calls"):  # the default limit
            client.chat.completions.create(model=SERVED_MODEL_NAME, messages=messages)
        episode = server.close_episode(session.episode.id)
        assert len(episode.turns) == 1 and len(episode.turns[0].completion_ids) <= 4
    finally:
        server.call(engine.stop(), timeout=10)
        server.stop()


@pytest.mark.parametrize("token", ["", "   ", "\t\n"])
def test_empty_admin_token_is_refused_not_open_to_all(tokenizer, token):
    # An empty token used to let any request without an Authorization header through the admin routes.
    engine = build_engine(build_tiny_model(tokenizer), tokenizer)
    with pytest.raises(ValueError, match="admin_token is empty"):
        EndpointSettings(admin_token=token)
    with pytest.raises(ValueError, match="admin_token is empty"):
        create_endpoint_app(engine, tokenizer, admin_token=token)
    with pytest.raises(ValueError, match="admin_token is empty"):
        launch_endpoint(engine, tokenizer, admin_token=token)
