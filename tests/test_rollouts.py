"""`rollouts.Rollouts`, the trainer's rollout side, without a trainer: an endpoint over a scripted engine, episodes run
against it, the producer it makes, and what `rollout_process=True` refuses."""

import contextlib

import pytest

from conftest import ScriptedEngine
from trl_agentic import AgenticGRPOConfig
from trl_agentic.endpoint import SERVED_MODEL_NAME
from trl_agentic.generation.transformers_engine import TransformersEngine
from trl_agentic.rollout.agents import resolve_agent
from trl_agentic.rollout.producer import RolloutProducer
from trl_agentic.rollout.rows import Row
from trl_agentic.rollouts import Rollouts, check_rollout_process, log_engine_stats, rollout_output, trainer_inputs
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer
from trl_agentic.trace import Episode


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


def config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=2, max_completion_length=8)
    values.update(overrides)
    return AgenticGRPOConfig(use_cpu=True, report_to="none", agent_columns=["question"], **values)


async def ask(client, task):
    response = await client.chat.completions.create(
        model=SERVED_MODEL_NAME, messages=[{"role": "user", "content": task["question"]}]
    )
    return response.choices[0].message.content


def test_rollouts_run_episodes_without_a_trainer(tmp_path, tokenizer):
    engine = ScriptedEngine(tokenizer, lambda prompt_ids: "four")
    model = object()
    rollouts = Rollouts(
        config(tmp_path),
        resolve_agent(ask),  # as the trainer resolves it
        engine,
        tokenizer,
        {},
        model=lambda: model,
        generation_model=lambda: contextlib.nullcontext(model),
    )
    try:
        inputs = [{"question": "2+2?", "answer": "4"}] * 2
        tasks = rollouts.agent_tasks(inputs)
        assert tasks == [{"question": "2+2?"}] * 2  # the checker's columns stay on the trainer's side
        episodes = rollouts.run(tasks, num_generations=2, stats=None, rollout_index=1, step=3)
        assert engine.policy_version == 3
        assert [episode.result for episode in episodes] == ["four", "four"]
        rows = rollouts.episode_rows(episodes)
        assert [len(result.rows) for result in rows] == [1, 1]
        main = rollouts.main_rows([[{"role": "user", "content": "2+2?"}]] * 2, rows, tokenizer)
        assert main[0].completion_ids == tokenizer.encode("four", add_special_tokens=False) + [tokenizer.eos_token_id]
        assert rollouts.batch_seed(0) is None  # seeds are the embedded engine's
        producer = rollouts.make_producer(version=0)
        assert isinstance(producer, RolloutProducer)
        with pytest.raises(ValueError, match="agent_columns names"):
            rollouts.agent_tasks([{"prompt": "x"}])
    finally:
        rollouts.close()


def test_rollouts_placeholder_row_for_an_agent_that_never_called(tmp_path, tokenizer):
    rollouts = Rollouts(
        config(tmp_path),
        resolve_agent(ask),
        ScriptedEngine(tokenizer, lambda prompt_ids: ""),
        tokenizer,
        {},
        model=lambda: None,
        generation_model=contextlib.nullcontext,
    )
    try:

        class NoRows:
            rows = []

        prompt = [{"role": "user", "content": "hi"}]
        (row,) = rollouts.main_rows([prompt], [NoRows()], tokenizer)
        assert row.completion_ids == [tokenizer.pad_token_id] and row.env_mask == [0]
    finally:
        rollouts.close()


def test_check_rollout_process_names_what_the_child_cannot_rebuild(tokenizer):
    model = build_tiny_model(tokenizer)
    with pytest.raises(ValueError, match="an `engine=` of your own.*2 training processes"):
        check_rollout_process(object(), model, 2, ask)
    check_rollout_process(None, model, 1, ask)  # a module-level async function pickles


def test_log_engine_stats():
    class Stats:
        decode_occupancy, mean_decode_batch, reused_tokens, prefilled_tokens = 0.5, 3.0, 0, 0

    metrics = {"engine/decode_occupancy": [], "engine/mean_decode_batch": [], "engine/reused_prompt_tokens": []}
    log_engine_stats(Stats(), metrics)
    assert metrics == {
        "engine/decode_occupancy": [0.5],
        "engine/mean_decode_batch": [3.0],
        "engine/reused_prompt_tokens": [0.0],
    }


def test_trainer_inputs_checks_and_resolves(tmp_path):
    with pytest.raises(ValueError, match="Pass `args="):
        trainer_inputs("m", ask, [len], None, None, None, None, None, None)
    with pytest.raises(ValueError, match="does not take `tools=`"):
        trainer_inputs("m", ask, [len], config(tmp_path), None, None, None, None, [len])
    with pytest.raises(ValueError, match="No reward source"):
        trainer_inputs("m", ask, None, config(tmp_path), None, None, None, None, None)
    model, agent, resolved, rewards, processing_class = trainer_inputs(
        "tiny:qwen2_5", ask, len, config(tmp_path), None, None, None, None, None
    )
    assert agent is ask and resolved is not None and len(rewards) == 1 and processing_class is not None
    assert hasattr(model, "config")


def test_rollouts_take_the_engines_stats_and_sync_weights(tmp_path, tokenizer):
    """Under asynchronous rollouts the engine's work since the last batch is taken (and reset) at once: the embedded
    engine's, the rollout process's through its producer, none for an engine without stats; with vLLM, TRL's sync."""
    model = build_tiny_model(tokenizer)
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, max_context_length=512)
    rollouts = Rollouts(
        config(tmp_path, max_completion_length=3),
        resolve_agent(ask),
        engine,
        tokenizer,
        {},
        model=lambda: model,
        generation_model=lambda: contextlib.nullcontext(model),
    )
    try:
        rollouts.run(rollouts.agent_tasks([{"question": "2+2?"}] * 2), 2, None, rollout_index=1, step=0)
        stats = rollouts.take_stats(producer=None)
        assert stats.requests == 2 and stats.prefilled_tokens > 0
        assert rollouts.take_stats(producer=None).requests == 0  # taken and reset

        class VLLMGeneration:  # TRL's `VLLMGeneration` talks to a vLLM server; only its sync is called here
            synced = 0

            def sync_weights(self):
                self.synced += 1

        vllm = VLLMGeneration()
        rollouts.sync_weights(4, producer=None, vllm_generation=vllm)
        assert vllm.synced == 1 and engine.policy_version == 4
        rollouts.sync_weights(5, producer=None)  # the embedded engine's own sync
        assert vllm.synced == 1 and engine.policy_version == 5
    finally:
        rollouts.close()

    scripted = Rollouts(
        config(tmp_path, rollout_process=True, async_rollouts=True),
        resolve_agent(ask),
        ScriptedEngine(tokenizer, lambda prompt_ids: ""),
        tokenizer,
        {},
        model=lambda: None,
        generation_model=contextlib.nullcontext,
    )
    try:

        class ChildProducer:
            def take_stats(self):
                return "the child's engine's"

        assert scripted.take_stats(ChildProducer()) == "the child's engine's"
    finally:
        scripted.close()
    without_stats = Rollouts(
        config(tmp_path),
        resolve_agent(ask),
        ScriptedEngine(tokenizer, lambda prompt_ids: ""),
        tokenizer,
        {},
        model=lambda: None,
        generation_model=contextlib.nullcontext,
    )
    try:
        assert without_stats.take_stats(producer=None) is None
    finally:
        without_stats.close()


def test_rollout_output_is_trls_rollout_func_contract():
    rows = [Row([1, 2], [3, 4], [1, 0], [-0.5, 0.0], [0]), Row([1], [5], [1], [-0.25], [0])]
    episodes = [Episode("a"), Episode("b")]
    assert rollout_output(rows, episodes) == {
        "prompt_ids": [[1, 2], [1]],
        "completion_ids": [[3, 4], [5]],
        "logprobs": [[-0.5, 0.0], [-0.25]],
        "env_mask": [[1, 0], [1]],
        "episodes": episodes,
    }
