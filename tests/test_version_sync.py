"""Serving and training in two processes that share only the store (issue 43): the trainer publishes each step's
weights through the store, the serving process loads them into an engine and rolls them out, and writes its verdicts
back, which the trainer reads (waiting for a verdict, going back to the incumbent after a rollback). Real
TransformersEngines over the saved weights, a real SQLite store, the real `OnlineGRPOTrainer`."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_agentic import AgenticGRPOConfig
from trl_agentic.endpoint.version_sync import PublishedVersions
from trl_agentic.endpoint.versions import RolloutPolicy, VersionManager
from trl_agentic.generation.transformers_engine import TransformersEngine
from trl_agentic.online_trainer import OnlineGRPOTrainer
from trl_agentic.store import SQLiteEpisodeStore
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


def test_versions_published_through_the_store_are_rolled_out_by_the_serving_process_and_verdicts_come_back(tmp_path):
    tokenizer = build_tiny_tokenizer("qwen2_5")
    store = SQLiteEpisodeStore(tmp_path / "store.db")  # what both processes share
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path / "train"), per_device_train_batch_size=2, num_generations=2, max_steps=3,
        max_completion_length=4, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
    )  # fmt: skip
    initial = build_tiny_model(tokenizer, seed=0)
    trainer = OnlineGRPOTrainer(initial, store, args, processing_class=tokenizer, versions=None, wait_for_verdict=True)
    start = {k: v.clone() for k, v in initial.state_dict().items()}

    # the serving process: its own incumbent (version 0), versions loaded from where the trainer published them
    loaded = []

    def load(path, version):
        loaded.append((path, version))
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        return TransformersEngine(model, pad_token_id=tokenizer.pad_token_id)

    incumbent = TransformersEngine(build_tiny_model(tokenizer, seed=0).eval(), pad_token_id=tokenizer.pad_token_id)
    versions = VersionManager(incumbent, RolloutPolicy(candidate_share=0.5, min_episodes=2, margin=0.0))
    sync = PublishedVersions(versions, store, load)

    async def scenario():
        await incumbent.start()
        assert await sync.poll() is None  # nothing published yet
        assert [(r["version"], r["state"]) for r in store.published_versions()] == [(0, "incumbent")]
        # an optimizer step: its weights change, and the trainer publishes them
        with torch.no_grad():
            for parameter in initial.parameters():
                parameter.add_(0.5)
        trainer.publish(1)
        published = store.published_versions(0)
        assert [(r["version"], r["state"]) for r in published] == [(1, "published")]
        assert trainer._on_trial() == 1  # a step with wait_for_verdict waits for it
        trainer.publish(2)  # one on trial at a time: a later step's weights wait
        assert [r["version"] for r in store.published_versions(0)] == [1]
        # serving loads it into an engine of its own and puts it on trial
        assert await sync.poll() == 1
        assert loaded == [(published[0]["path"], 1)] and versions.candidate == 1
        served = versions.engine_of(1).model.state_dict()
        assert all(torch.equal(served[k], v) for k, v in initial.state_dict().items())
        assert store.published_versions(0)[0]["state"] == "candidate"
        # its online reward is worse: rolled back at the serving side, and the verdict reaches the store
        for value in (1.0, 1.0):
            versions.record_reward(0, value)
        for value in (0.0, 0.0):
            versions.record_reward(1, value)
        assert versions.decisions[-1].action == "rolled_back"
        await sync.poll()
        row = store.published_versions(0)[0]
        assert row["state"] == "rolled_back" and "mean reward 0.000" in row["reason"]
        assert trainer._on_trial() is None
        for engine in (incumbent, versions.engine_of(1)):
            await engine.stop()

    asyncio.run(scenario())
    # the trainer reads the verdict and trains on from the incumbent's weights (serving's version 0: its start)
    trainer._restore_incumbent_if_rolled_back()
    assert all(torch.equal(start[k], v) for k, v in initial.state_dict().items())
    assert trainer._metrics["train"]["online/rollbacks"] == [1.0]
    # the next step's weights go on trial; the rollback that arrives while the step after it trains is acted on at its
    # end: back to the incumbent, and that step's weights (built on the refused ones) are not published
    with torch.no_grad():
        for parameter in initial.parameters():
            parameter.add_(0.25)
    trainer.publish(2)
    store.set_version_state(2, "candidate")
    with torch.no_grad():
        for parameter in initial.parameters():
            parameter.add_(0.25)
    store.set_version_state(2, "rolled_back", "worse")
    trainer.publish(3)
    assert [r["version"] for r in store.published_versions(0)] == [1, 2]
    assert all(torch.equal(start[k], v) for k, v in initial.state_dict().items())
    assert trainer._metrics["train"]["online/rollbacks"] == [1.0, 1.0]
    # a verdict on an older version than the latest published leaves the weights alone (the later one's trial decides)
    with torch.no_grad():
        for parameter in initial.parameters():
            parameter.add_(0.25)
    trainer.publish(4)
    stepped = {k: v.clone() for k, v in initial.state_dict().items()}
    trainer._decided_up_to = 2
    store.set_version_state(3, "rolled_back", "worse")  # (as if v3 had been published and refused)
    assert trainer._restore_incumbent_if_rolled_back() is False
    assert all(torch.equal(stepped[k], v) for k, v in initial.state_dict().items())
    trainer.close()
    with pytest.raises(ValueError, match="published already"):
        store.publish_version(1, "elsewhere")


def test_serve_refuses_published_versions_without_a_store(capsys):
    from trl_agentic.endpoint import serve

    with pytest.raises(SystemExit) as exit_info:
        serve.main(["--model", "tiny:qwen2_5", "--published-versions"])
    assert exit_info.value.code == 2 and "--published-versions needs --store" in capsys.readouterr().err
