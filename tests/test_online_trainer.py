"""Online training (issue 43): live traffic through user keys -> rewarded episodes in the store -> GRPO steps that claim
them (each once) -> each step's weights a candidate version, promoted or rolled back by the rule. A real endpoint,
real TransformersEngines, the official `openai` client as the users' client."""

import copy
import threading
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_agentic import AgenticGRPOConfig
from trl_agentic.endpoint.app import EndpointSettings, create_app
from trl_agentic.endpoint.chat import ChatRenderer
from trl_agentic.endpoint.server import EndpointServer
from trl_agentic.endpoint.versions import RolloutPolicy, VersionManager
from trl_agentic.generation.transformers_engine import TransformersEngine
from trl_agentic.online_trainer import OnlineGRPOTrainer, RunningBaselines, _grouped, online_rewards, stored_reward
from trl_agentic.store import SQLiteEpisodeStore
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer
from trl_agentic.trace import Episode, Turn


def test_episodes_of_one_fingerprint_form_whole_groups_and_the_rest_keep_arrival_order():
    items = [(Episode(id=f"e{i}", metadata={"fingerprint": f}), []) for i, f in enumerate("ab" + "a" * 3 + "cb")]
    # a: e0 e2 e3 e4 (one whole group of 2 twice), b: e1 e6 (one group), c: e5 alone
    order = [episode.id for episode, _ in _grouped(items, 2)]
    assert order == ["e0", "e2", "e3", "e4", "e1", "e6", "e5"]


def test_same_task_groups_keep_trls_baseline_and_the_rest_are_judged_against_a_running_per_task_baseline():
    from trl.trainer.utils import nanstd

    baselines = RunningBaselines(window=4)
    for fingerprint, reward in [("b", 0.5), (None, 0.0), (None, 0.25)]:  # earlier steps: b's mean 0.5, all 0.25
        baselines.add(fingerprint, reward)
    named = {"e0": "a", "e1": "a", "e2": "b", "e3": None}
    items = [(Episode(id=i, metadata={"fingerprint": named[i]} if named[i] else {}), v) for i, v in [
        ("e2", [1.0]), ("e0", [1.0]), ("e3", [0.0]), ("e1", [0.5, -0.5]),
    ]]  # fmt: skip
    scored = online_rewards(items, 2, baselines)
    # the whole group of task "a" first (TRL's group mean is its baseline); e2 against task b's running mean, e3 (no
    # task named) against the mean of all
    assert [(e.id, r, b) for e, r, b in scored] == [
        ("e0", 1.0, None), ("e1", 0.0, None), ("e2", 1.0, 0.5), ("e3", 0.0, 0.25),
    ]  # fmt: skip
    for episode, reward, baseline in scored:
        episode.metadata.update(online_reward=reward, online_baseline=baseline)
    handed = stored_reward(None, None, episodes=[e for e, _, _ in scored])
    assert handed == [1.0, 0.0, 0.5, -0.25]
    # TRL's group advantages over what is handed to it (its `scale_rewards="group"` formula and `nanstd`)
    rewards = torch.tensor(handed).view(-1, 2)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (nanstd(rewards, dim=1, keepdim=True) + 1e-4)).flatten()
    assert advantages.tolist() == pytest.approx([0.70701, -0.70701, 0.70697, -0.70697], abs=1e-5)
    # the baselines took this step's rewards: a [1, 0], b [0.5, 1], all the last 4 [1, 0, 1, 0]
    assert (baselines.baseline("a"), baselines.baseline("b"), baselines.baseline("new")) == (0.5, 0.75, 0.5)
    with pytest.raises(ValueError, match="baseline_window"):
        RunningBaselines(window=0)


def stored_episode(store, episode_id, fingerprint, reward):
    turn = Turn(index=0, prompt_ids=[1, 2], completion_ids=[3, 4], logprobs=[-0.5, -0.5], finish_reason="stop")
    store.put_episode(Episode(id=episode_id, status="ok", turns=[turn]), user="u", fingerprint=fingerprint)
    store.add_reward(episode_id, reward, "feedback", "u")


def test_the_online_trainer_starts_no_endpoint_and_claims_same_task_groups_first(tmp_path):
    tokenizer = build_tiny_tokenizer("qwen2_5")
    store = SQLiteEpisodeStore(tmp_path / "store.db")
    for episode_id, fingerprint, reward in [("a1", "a", 1.0), ("x", None, 0.0), ("a2", "a", 0.0), ("b", "b", 1.0)]:
        stored_episode(store, episode_id, fingerprint, reward)
    args = online_config(tmp_path, per_device_train_batch_size=4, num_generations=2)
    trainer = OnlineGRPOTrainer(build_tiny_model(tokenizer, seed=0), store, args, processing_class=tokenizer)
    try:
        assert trainer.endpoint is None and trainer.engine is None  # nothing served that no one would call
        episodes = trainer._claim(4)
        assert [(e.id, e.metadata["online_baseline"]) for e in episodes] == [
            ("a2", None), ("a1", None), ("b", 0.0), ("x", 0.0),  # newest first; no history yet: baseline 0
        ]  # fmt: skip
        assert trainer._metrics["train"]["online/fingerprint_groups"] == [0.5]
        assert trainer._metrics["train"]["online/reward"] == [0.5]
        assert trainer.baselines.baseline("a") == 0.5
        with pytest.raises(ValueError, match="engine"):
            OnlineGRPOTrainer(build_tiny_model(tokenizer), store, args, processing_class=tokenizer, engine=object())
        with pytest.raises(ValueError, match="group_wait"):
            OnlineGRPOTrainer(build_tiny_model(tokenizer), store, args, processing_class=tokenizer, group_wait=-1)
    finally:
        trainer.close()


def online_config(tmp_path, **overrides) -> AgenticGRPOConfig:
    """Three steps of four episodes (one group), on CPU."""
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_steps=3,
        max_completion_length=6,
        learning_rate=1e-2,
        use_cpu=True,
        bf16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=0,
    )
    return AgenticGRPOConfig(**{**values, **overrides})


def users_traffic(server, keys, stop, reward_of, served):
    """Simulated users: each asks, ends its episode and gives feedback from a checker, until `stop` is set."""

    def user(key):
        client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)
        headers = {"Authorization": f"Bearer {key}"}
        while not stop.is_set():
            raw = client.chat.completions.with_raw_response.create(
                model="policy", messages=[{"role": "user", "content": "Say something."}], max_tokens=6
            )
            text = raw.parse().choices[0].message.content or ""
            episode_id, version = raw.headers["x-trl-agentic-episode"], int(raw.headers["x-trl-agentic-version"])
            served.append(version)
            value = reward_of(text, version)
            httpx.post(f"{server.base_url}/feedback", json={"episode_id": episode_id, "value": value}, headers=headers)

    threads = [threading.Thread(target=user, args=(key,), daemon=True) for key in keys]
    for thread in threads:
        thread.start()
    return threads


@pytest.mark.slow
def test_live_traffic_trains_each_episode_once_and_every_step_becomes_a_candidate(tmp_path):
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer("qwen2_5")
    model = build_tiny_model(tokenizer, seed=0)
    serving = TransformersEngine(copy.deepcopy(model).eval(), pad_token_id=tokenizer.pad_token_id)
    versions = VersionManager(serving, RolloutPolicy(candidate_share=0.5, min_episodes=3, margin=1.0))
    store = SQLiteEpisodeStore(tmp_path / "store.db")
    app = create_app(
        serving, ChatRenderer(tokenizer), EndpointSettings(default_max_tokens=6), store=store, versions=versions
    )
    with EndpointServer(app) as server:
        admin = {"Authorization": f"Bearer {server.admin_token}"}
        keys = [httpx.post(f"{server.url}/admin/users", json={"name": n}, headers=admin).json()["key"] for n in "ab"]
        stop = threading.Event()
        threads = users_traffic(server, keys, stop, lambda text, version: float(len(text) % 2), [])
        args = online_config(tmp_path, max_staleness=8)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        trainer = OnlineGRPOTrainer(
            model,
            store,
            args,
            processing_class=tokenizer,
            versions=versions,
            run_on_server=server.call,
            wait_timeout=120,
            wait_for_verdict=True,
        )
        try:
            trainer.train()
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
            trainer.close()
        claimed = store.claimed_episode_ids()
        assert len(claimed) == 12  # 3 steps x 4 episodes, each claimed once
        assert all(store.rewards(e)[0].use == "trained" for e in claimed)
        states = {row["version"]: row["state"] for row in versions.describe()}
        assert {1, 2, 3} <= set(states)  # every step a candidate
        assert all((tmp_path / "out" / "versions" / f"v{s}" / "config.json").exists() for s in (1, 2, 3))
        assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
        logged = [entry for entry in trainer.state.log_history if "online/rewards_per_episode" in entry]
        assert len(logged) == 3 and all(entry["online/rewards_per_episode"] >= 1 for entry in logged)
        # each version serves its own weights: those saved when it was published, never the trainer's later ones
        for version in sorted(states):
            engine = versions.engine_of(version)
            if engine is None:
                continue
            saved = (
                before
                if version == 0
                else AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "versions" / f"v{version}").state_dict()
            )
            served = engine.model.state_dict()
            assert all(torch.equal(served[k], saved[k]) for k in saved), version
        # and the tokens each version's episodes carry were sampled by that version's weights: every stored logprob is
        # what the saved weights of the version it is labelled with give (the engines' copies used to run the trainer's
        # live forward, through TRL's fused-head wrapper: late episodes of v<k> carried v<k+1>'s logprobs)
        weights = {0: build_tiny_model(tokenizer, seed=0).eval()}
        weights[0].load_state_dict(before)
        for version in states:
            if version:
                weights[version] = AutoModelForCausalLM.from_pretrained(
                    tmp_path / "out" / "versions" / f"v{version}"
                ).eval()
        scored = 0
        for episode_id in store.rewarded_episode_ids():
            for turn in store.get_episode(episode_id)[0].turns:
                ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
                with torch.no_grad():
                    logits = weights[turn.policy_version](ids).logits[0, len(turn.prompt_ids) - 1 : -1]
                expected = torch.log_softmax(logits / args.temperature, -1)
                expected = expected.gather(1, torch.tensor(turn.completion_ids)[:, None])[:, 0]
                assert torch.allclose(expected, torch.tensor(turn.logprobs), atol=1e-4), turn.policy_version
                scored += 1
        assert scored >= 12


@pytest.mark.slow
def test_a_harmful_update_is_rolled_back_within_its_canary_share_and_training_returns_to_the_incumbent(tmp_path):
    """Users reward the incumbent's answers 1 and every candidate's 0 (a harmful update, as a learning-rate spike would
    make): each candidate is rolled back after `min_episodes`, the incumbent keeps serving, no candidate served more
    than its share of episodes (plus those in flight), and each next step starts from the incumbent's weights."""
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer("qwen2_5")
    model = build_tiny_model(tokenizer, seed=0)
    incumbent_weights = {k: v.clone() for k, v in model.state_dict().items()}
    serving = TransformersEngine(copy.deepcopy(model).eval(), pad_token_id=tokenizer.pad_token_id)
    versions = VersionManager(serving, RolloutPolicy(candidate_share=0.25, min_episodes=2, margin=0.1))
    store = SQLiteEpisodeStore(tmp_path / "store.db")
    settings = EndpointSettings(default_max_tokens=6)
    app = create_app(serving, ChatRenderer(tokenizer), settings, store=store, versions=versions)
    with EndpointServer(app) as server:
        admin = {"Authorization": f"Bearer {server.admin_token}"}
        keys = [httpx.post(f"{server.url}/admin/users", json={"name": n}, headers=admin).json()["key"] for n in "abc"]
        stop, served = threading.Event(), []
        threads = users_traffic(server, keys, stop, lambda text, version: 1.0 if version == 0 else 0.0, served)
        args = online_config(
            tmp_path, max_staleness=0
        )  # after a rollback the incumbent's tokens count as fresh (`_rebase_versions`)
        trainer = OnlineGRPOTrainer(
            model,
            store,
            args,
            processing_class=tokenizer,
            versions=versions,
            run_on_server=server.call,
            wait_timeout=120,
            wait_for_verdict=True,
        )
        restored = []  # the weights each step started from, after a rollback it had not seen yet
        original = trainer._restore_incumbent_if_rolled_back

        def recording_restore():
            unseen = len(versions.decisions) > getattr(trainer, "_handled_decisions", 0)
            original()
            if unseen and versions.decisions[-1].action == "rolled_back":
                restored.append({k: v.clone() for k, v in model.state_dict().items()})

        trainer._restore_incumbent_if_rolled_back = recording_restore
        try:
            trainer.train()
            deadline = time.monotonic() + 60
            while versions.candidate is not None and time.monotonic() < deadline:  # the last candidate's trial ends
                time.sleep(0.1)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
            trainer.close()
        assert versions.incumbent == 0
        assert [d.action for d in versions.decisions] and all(d.action == "rolled_back" for d in versions.decisions)
        assert {row["version"]: row["state"] for row in versions.describe()}[0] == "incumbent"
        assert served.count(0) / len(served) > 0.6  # the candidates got their canary share, no more
        assert restored  # at least one step began after a rollback (min_episodes is small enough)
        dropped = [
            entry["async/dropped_groups"] for entry in trainer.state.log_history if "async/dropped_groups" in entry
        ]
        assert dropped and not any(dropped)  # nothing the incumbent sampled counted as stale after the restore
        for weights in restored:  # and it began from the incumbent's weights
            assert all(torch.equal(weights[k], incumbent_weights[k]) for k in incumbent_weights)


@pytest.mark.slow
def test_serve_train_process_learns_from_user_traffic_and_publishes_versions(tmp_path):
    """`trl-agentic serve --train` as users run it: a real process, user keys, feedback; it trains its steps, each a
    candidate (`GET /admin/versions`), and exits."""
    from test_endpoint_serve import start_serve

    token, out = "sk-admin-online-test", tmp_path / "run"
    flags = ["--train", "--store", str(tmp_path / "store.db"), "--admin-token", token, "--output-dir", str(out)]
    flags += ["--max-tokens", "6", "--max-steps", "2", "--episodes-per-step", "4", "--num-generations", "4"]
    flags += ["--min-episodes", "2", "--candidate-share", "0.5", "--margin", "1.0", "--learning-rate", "1e-2"]
    flags += ["--wait-for-verdict", "--log-level", "warning"]
    process, url = start_serve(tmp_path / "serve.log", *flags)
    admin = {"Authorization": f"Bearer {token}"}
    key = httpx.post(f"{url}/admin/users", json={"name": "alice"}, headers=admin).json()["key"]
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "policy", "messages": [{"role": "user", "content": "Say something."}]}
    seen_versions = set()
    try:
        deadline = time.monotonic() + 300
        while process.poll() is None and time.monotonic() < deadline:
            try:
                answer = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30)
                seen_versions.add(answer.headers["x-trl-agentic-version"])
                text = answer.json()["choices"][0]["message"]["content"] or ""
                httpx.post(f"{url}/v1/feedback", json={"value": float(len(text) % 2)}, headers=headers, timeout=30)
                if len(seen_versions) > 1:
                    versions = httpx.get(f"{url}/admin/versions", headers=admin, timeout=30).json()["versions"]
                    assert versions[0]["version"] == 0
            except httpx.HTTPError:  # the server stops when training ends
                break
        assert process.wait(timeout=120) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert (out / "versions" / "v1" / "config.json").exists() and (out / "versions" / "v2" / "config.json").exists()
    assert "1" in seen_versions  # the first candidate served users


TRAIN_FROM_STORE = """
import sys, torch
from trl_agentic import AgenticGRPOConfig
from trl_agentic.online_trainer import OnlineGRPOTrainer
from trl_agentic.store import open_store
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer
location, out = sys.argv[1], sys.argv[2]
tokenizer = build_tiny_tokenizer("qwen2_5")
model = build_tiny_model(tokenizer, seed=0)
args = AgenticGRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=4, max_steps=2,
    max_completion_length=6, learning_rate=1e-2, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
    max_staleness=8, seed=0)
trainer = OnlineGRPOTrainer(model, open_store(location), args, processing_class=tokenizer, wait_timeout=60)
trainer.train()
trainer.close()
torch.save(model.state_dict(), out + "/params.pt")
"""


@pytest.mark.slow
def test_training_in_another_process_that_shares_only_the_database_trains_the_same(tmp_path, request):
    """Serving writes episodes and rewards to PostgreSQL; a trainer in another process that has only the database's
    URL trains exactly as the same training does on a copy of the data written by this process (the store adds
    nothing and loses nothing between the machines)."""
    import subprocess
    import sys

    pytest.importorskip("psycopg", reason='the [postgres] extra is not installed (pip install -e ".[postgres]")')
    from pg_server import PostgresServer, postgres_bin
    from trl_agentic.store import open_store

    if postgres_bin() is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql; .ci/run installs it)")
    postgres = PostgresServer().start()
    request.addfinalizer(postgres.stop)
    served, copy_url = postgres.new_database(), postgres.new_database()

    # Serving: user traffic into the database (a real endpoint and engine)
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer("qwen2_5")
    engine = TransformersEngine(build_tiny_model(tokenizer, seed=0).eval(), pad_token_id=tokenizer.pad_token_id)
    store = open_store(served)
    app = create_app(engine, ChatRenderer(tokenizer), EndpointSettings(default_max_tokens=6), store=store)
    with EndpointServer(app) as server:
        admin = {"Authorization": f"Bearer {server.admin_token}"}
        key = httpx.post(f"{server.url}/admin/users", json={"name": "a"}, headers=admin).json()["key"]
        headers = {"Authorization": f"Bearer {key}"}
        for i in range(8):
            body = {"model": "policy", "messages": [{"role": "user", "content": f"Say {i}."}], "temperature": 1.0}
            text = httpx.post(f"{server.base_url}/chat/completions", json=body, headers=headers).json()
            value = float(len(text["choices"][0]["message"]["content"] or "") % 2)
            assert httpx.post(f"{server.base_url}/feedback", json={"value": value}, headers=headers).status_code == 200
    # the same data in a second database, for the in-process trainer
    copy = open_store(copy_url)
    for episode_id in sorted(store.rewarded_episode_ids(), key=lambda e: store.episodes_of("a").index(e)):
        episode, user = store.get_episode(episode_id)
        copy.put_episode(episode, user=user, fingerprint=None)
        for reward in store.rewards(episode_id):
            copy.add_reward(episode_id, reward.value, reward.source, reward.giver, reward.note)

    # Training in another process, with only the URL
    out = tmp_path / "remote"
    out.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", TRAIN_FROM_STORE, served, str(out)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    remote = torch.load(out / "params.pt")
    # The same training on the copy
    local_out = tmp_path / "local"
    local_out.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", TRAIN_FROM_STORE, copy_url, str(local_out)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    local = torch.load(local_out / "params.pt")
    assert len(store.claimed_episode_ids()) == 8 and len(copy.claimed_episode_ids()) == 8
    initial = build_tiny_model(tokenizer, seed=0).state_dict()
    assert any(not torch.equal(remote[k], initial[k]) for k in remote)  # it trained
    for name in remote:
        torch.testing.assert_close(remote[name], local[name], rtol=0, atol=1e-6)
