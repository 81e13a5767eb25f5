"""The durable episode store of online training (issue 43): users, closed episodes, rewards and training claims in
SQLite, surviving a `kill -9` of the process that wrote them."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from trl_agentic.store import SQLiteEpisodeStore, hash_key, open_store
from trl_agentic.trace import Episode, Turn


@pytest.fixture(scope="module")
def postgres():
    """A private PostgreSQL server (tests/pg_server.py), started once for the module."""
    pytest.importorskip("psycopg", reason='the [postgres] extra is not installed (pip install -e ".[postgres]")')
    from pg_server import PostgresServer, postgres_bin

    if postgres_bin() is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql; .ci/run installs it)")
    server = PostgresServer().start()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def location(request, tmp_path):
    """Where a store lives: a SQLite file, or a fresh database of the private PostgreSQL server (`open_store`)."""
    if request.param == "sqlite":
        return str(tmp_path / "store.db")
    return request.getfixturevalue("postgres").new_database()


def episode(episode_id: str, reward_hint: int = 0) -> Episode:
    turn = Turn(
        index=0, prompt_ids=[1, 2, 3], completion_ids=[4, 5 + reward_hint], logprobs=[-0.5, -0.25], finish_reason="stop"
    )
    return Episode(id=episode_id, status="ok", turns=[turn], messages=[{"role": "user", "content": "hi"}])


def test_users_keys_are_stored_hashed_and_revocable(tmp_path):
    store = SQLiteEpisodeStore(tmp_path / "store.db")  # the file's bytes are read below: SQLite only
    key = store.add_user("alice")
    assert key.startswith("sk-user-") and len(key) > 40
    assert store.user_for_key(key) == "alice"
    raw = (tmp_path / "store.db").read_bytes() + b"".join(
        p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("store.db-")
    )
    assert key.encode() not in raw and hash_key(key).encode() in raw  # only the hash is on disk
    with pytest.raises(ValueError, match="already exists"):
        store.add_user("alice")
    assert store.revoke_user("alice") is True
    assert store.user_for_key(key) is None
    assert store.revoke_user("alice") is False  # already revoked
    assert store.user_for_key("sk-user-guess") is None


def test_episodes_and_rewards_round_trip_with_their_sources(location):
    store = open_store(location)
    store.put_episode(episode("ep-a"), user="alice", fingerprint="task-1")
    got, user = store.get_episode("ep-a")
    assert user == "alice"
    assert got.turns[0].completion_ids == [4, 5] and got.turns[0].logprobs == [-0.5, -0.25]
    first = store.add_reward("ep-a", 1.0, source="feedback", giver="alice")
    second = store.add_reward("ep-a", 0.0, source="admin", giver="admin", note="CI failed")
    rewards = store.rewards("ep-a")
    assert [(r.id, r.value, r.source, r.giver, r.note) for r in rewards] == [
        (first, 1.0, "feedback", "alice", None),
        (second, 0.0, "admin", "admin", "CI failed"),
    ]
    with pytest.raises(KeyError):
        store.add_reward("ep-missing", 1.0, source="admin", giver="admin")
    assert store.episodes_of("alice") == ["ep-a"] and store.episodes_of("bob") == []


def test_a_claimed_episode_is_never_claimed_again_and_late_rewards_are_kept_for_evaluation(location):
    store = open_store(location)
    for name in ("ep-a", "ep-b", "ep-c"):
        store.put_episode(episode(name), user="alice", fingerprint="task-1")
    store.add_reward("ep-a", 1.0, source="admin", giver="admin")
    store.add_reward("ep-b", 0.0, source="admin", giver="admin")
    # ep-c has no reward: not trainable yet
    claim = store.claim_for_training(limit=10, step=1)
    assert sorted(e.id for e, _ in claim.items) == ["ep-a", "ep-b"]
    assert store.claim_for_training(limit=10, step=2).items == []
    late = store.add_reward("ep-a", 0.5, source="feedback", giver="alice")
    assert [r.use for r in store.rewards("ep-a")] == ["trained", "evaluation"]
    assert late == store.rewards("ep-a")[1].id
    store.add_reward("ep-c", 1.0, source="admin", giver="admin")
    assert [e.id for e, _ in store.claim_for_training(limit=10, step=2).items] == ["ep-c"]


def test_claims_of_steps_that_were_never_checkpointed_are_released_on_restart(location):
    """A trainer that crashed after claiming step 3's episodes but before checkpointing step 3 trains them again
    after its restart from step 2, exactly once."""
    store = open_store(location)
    for name in ("ep-a", "ep-b"):
        store.put_episode(episode(name), user=None, fingerprint=None)
        store.add_reward(name, 1.0, source="admin", giver="admin")
    assert len(store.claim_for_training(limit=1, step=2).items) == 1
    assert len(store.claim_for_training(limit=1, step=3).items) == 1
    store.close()
    reopened = open_store(location)
    assert reopened.release_claims_after(step=2) == 1
    again = reopened.claim_for_training(limit=10, step=3).items
    assert [e.id for e, _ in again] == ["ep-b"]
    assert reopened.claim_for_training(limit=10, step=4).items == []


WRITER = textwrap.dedent(
    """
    import sys
    from trl_agentic.store import open_store
    from trl_agentic.trace import Episode, Turn
    store = open_store(sys.argv[1])
    i = 0
    while True:
        ep = Episode(id=f"ep-{i}", status="ok", turns=[Turn(index=0, prompt_ids=[1], completion_ids=[i], logprobs=[0.0], finish_reason="stop")])
        store.put_episode(ep, user="alice", fingerprint="t")
        print("episode", i, flush=True)  # acknowledged: it is on disk
        store.add_reward(f"ep-{i}", float(i % 2), source="feedback", giver="alice")
        print("reward", i, flush=True)
        if i % 3 == 0:
            store.claim_for_training(limit=2, step=i)
            print("claim", i, flush=True)
        i += 1
    """
)


def test_kill_9_mid_traffic_loses_no_acknowledged_episode_or_reward_and_trains_nothing_twice(location):
    path = location
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True, env={**os.environ}
    )
    acknowledged = {"episode": set(), "reward": set(), "claim": set()}
    for line in process.stdout:
        kind, number = line.split()
        acknowledged[kind].add(int(number))
        if len(acknowledged["reward"]) >= 60:
            break
    process.send_signal(signal.SIGKILL)
    process.wait()
    store = open_store(path)
    for number in acknowledged["episode"]:
        assert store.get_episode(f"ep-{number}")[0].turns[0].completion_ids == [number]
    for number in acknowledged["reward"]:
        assert len(store.rewards(f"ep-{number}")) == 1
    claimed_before = store.claimed_episode_ids()
    rest = store.claim_for_training(limit=1000, step=10**6).items
    assert not claimed_before & {e.id for e, _ in rest}  # nothing trained twice
    assert len(claimed_before) + len(rest) == len(store.rewarded_episode_ids())


def test_a_claim_can_take_the_freshest_episodes_of_given_versions_only(location):
    store = open_store(location)
    for number, version in enumerate([0, 0, 1, 2, 2]):
        ep = episode(f"ep-{number}")
        ep.turns[0].policy_version = version
        store.put_episode(ep, user=None, fingerprint=None)
        store.add_reward(ep.id, 1.0, source="admin", giver="admin")
    newest = store.claim_for_training(limit=2, step=1, versions=[1, 2], newest_first=True).items
    assert [e.id for e, _ in newest] == ["ep-4", "ep-3"]
    assert [e.id for e, _ in store.claim_for_training(limit=5, step=2, versions=[1, 2]).items] == ["ep-2"]
    assert store.claim_for_training(limit=5, step=3, versions=[]).items == []
    assert [e.id for e, _ in store.claim_for_training(limit=5, step=3).items] == ["ep-0", "ep-1"]  # any version


def test_a_claim_can_take_whole_groups_of_one_task_fingerprint_only(location):
    store = open_store(location)
    fingerprints = ["a", "b", "a", None, "b", "a", "c", "b", "a", "a"]
    for number, fingerprint in enumerate(fingerprints):
        store.put_episode(episode(f"ep-{number}"), user=None, fingerprint=fingerprint)
        store.add_reward(f"ep-{number}", 1.0, source="admin", giver="admin")
    store.put_episode(episode("ep-unrewarded"), user=None, fingerprint="a")  # never claimed: no reward
    # newest first: "a" fills first (ep-9, ep-8, ep-5), then "b" (ep-7, ep-4, ep-1); "c" and the unnamed one stay
    claim = store.claim_for_training(limit=7, step=1, newest_first=True, group=3)
    assert [(e.id, e.metadata["fingerprint"]) for e, _ in claim.items] == [
        ("ep-9", "a"), ("ep-8", "a"), ("ep-5", "a"), ("ep-7", "b"), ("ep-4", "b"), ("ep-1", "b"),
    ]  # fmt: skip
    assert store.claim_for_training(limit=6, step=2, group=3).items == []  # "a" has 2 left, "c" 1
    assert [e.id for e, _ in store.claim_for_training(limit=6, step=2, group=2).items] == ["ep-0", "ep-2"]
    assert [e.id for e, _ in store.claim_for_training(limit=6, step=3).items] == ["ep-3", "ep-6"]
    with pytest.raises(ValueError, match="group"):
        store.claim_for_training(limit=6, step=4, group=0)


def test_published_versions_and_their_states_round_trip(location):
    store = open_store(location)
    store.set_version_state(0, "incumbent")  # serving's own first version: added, without a path
    store.publish_version(1, "/shared/run/versions/v1")
    store.publish_version(2, "/shared/run/versions/v2")
    store.set_version_state(1, "rolled_back", "mean reward 0.1 vs 0.4")
    store.set_version_state(1, "rolled_back")  # a later report without a reason keeps it
    rows = [(r["version"], r["path"], r["state"], r["reason"]) for r in store.published_versions()]
    assert rows == [
        (0, None, "incumbent", None),
        (1, "/shared/run/versions/v1", "rolled_back", "mean reward 0.1 vs 0.4"),
        (2, "/shared/run/versions/v2", "published", None),
    ]
    assert [r["version"] for r in store.published_versions(after=1)] == [2]
    with pytest.raises(ValueError, match="published already"):
        store.publish_version(2, "/elsewhere")
