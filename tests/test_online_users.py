"""Serving with user keys (issue 43): a plain client points at the endpoint with one key and no per-episode
handshake; the endpoint groups the key's calls into episodes, stores them when they close, and takes rewards from
the user (their own episodes only) and from the admin. A real uvicorn server, the official `openai` client."""

import time

import httpx
import openai
import pytest

from conftest import ScriptedEngine
from trl_agentic.endpoint.app import EndpointSettings, create_app
from trl_agentic.endpoint.chat import ChatRenderer
from trl_agentic.endpoint.server import EndpointServer
from trl_agentic.endpoint.users import task_fingerprint
from trl_agentic.store import SQLiteEpisodeStore
from trl_agentic.tiny_models import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


@pytest.fixture
def serve(tokenizer, tmp_path):
    servers = []

    def start(**settings):
        store = SQLiteEpisodeStore(tmp_path / "store.db")
        engine = ScriptedEngine(tokenizer, lambda prompt: "Fine.")
        app = create_app(engine, ChatRenderer(tokenizer), EndpointSettings(**settings), store=store)
        server = EndpointServer(app).start()
        servers.append(server)
        return server, store

    yield start
    for server in servers:
        server.stop()


def admin(server) -> dict:
    return {"Authorization": f"Bearer {server.admin_token}"}


def add_user(server, name: str) -> str:
    response = httpx.post(f"{server.url}/admin/users", json={"name": name}, headers=admin(server))
    assert response.status_code == 200, response.text
    return response.json()["key"]


def chat(client, messages):
    raw = client.chat.completions.with_raw_response.create(model="policy", messages=messages)
    return raw.headers["x-trl-agentic-episode"], raw.parse().choices[0].message.content


def test_a_user_keys_calls_are_grouped_into_episodes_that_are_stored_when_they_end(serve):
    server, store = serve(user_episode_idle_timeout=60.0)
    key = add_user(server, "alice")
    client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)
    messages = [{"role": "user", "content": "How are you?"}]
    first, answer = chat(client, messages)
    second, _ = chat(client, [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "Ok"}])
    assert first == second and first.startswith("ep-")
    ended = httpx.post(f"{server.base_url}/episodes/end", headers={"Authorization": f"Bearer {key}"})
    assert ended.status_code == 200 and ended.json()["episode_id"] == first
    stored, user = store.get_episode(first)
    assert user == "alice" and stored.status == "ok" and len(stored.turns) == 2
    assert stored.turns[1].prompt_source == "continued"  # token-exact continuation, as for admin-opened episodes
    assert stored.turns[1].prompt_ids[: len(stored.turns[0].prompt_ids)] == stored.turns[0].prompt_ids
    third, _ = chat(client, messages)
    assert third != first  # the next call opens the next episode
    assert store.episodes_of("alice") == [first]


def test_an_idle_user_episode_is_closed_and_stored(serve):
    server, store = serve(user_episode_idle_timeout=0.2)
    key = add_user(server, "alice")
    client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)
    episode_id, _ = chat(client, [{"role": "user", "content": "Hi"}])
    deadline = time.monotonic() + 10
    while not store.owner(episode_id)[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    stored, user = store.get_episode(episode_id)
    assert (user, stored.status, len(stored.turns)) == ("alice", "ok", 1)
    # the admin reads it from the store once it left the endpoint
    response = httpx.get(f"{server.url}/admin/episodes/{episode_id}", headers=admin(server))
    assert response.status_code == 200 and response.json()["id"] == episode_id


def test_feedback_reaches_only_the_users_own_episodes_and_a_revoked_key_is_refused(serve):
    server, store = serve(user_episode_idle_timeout=60.0, feedback_per_minute=3)
    alice, bob = add_user(server, "alice"), add_user(server, "bob")
    alice_client = openai.OpenAI(base_url=server.base_url, api_key=alice, max_retries=0)
    episode_id, _ = chat(alice_client, [{"role": "user", "content": "Hi"}])

    def feedback(key, **body):
        return httpx.post(f"{server.base_url}/feedback", json=body, headers={"Authorization": f"Bearer {key}"})

    # feedback on the open episode ends it (a reward closes an episode), then is stored with who gave it
    given = feedback(alice, episode_id=episode_id, value=1.0, note="great")
    assert given.status_code == 200, given.text
    assert [(r.value, r.source, r.giver, r.note) for r in store.rewards(episode_id)] == [
        (1.0, "feedback", "alice", "great")
    ]
    # bob can neither reward alice's episode nor learn that it exists
    refused = feedback(bob, episode_id=episode_id, value=0.0)
    assert refused.status_code == 404 and "episode" in refused.json()["error"]["message"]
    # nor call the model on it through its path
    path_call = httpx.post(
        f"{server.url}/episodes/{episode_id}/v1/chat/completions",
        json={"model": "policy", "messages": [{"role": "user", "content": "x"}]},
        headers={"Authorization": f"Bearer {bob}"},
    )
    assert path_call.status_code in (401, 404)
    # the admin rewards with a source of its own
    response = httpx.post(
        f"{server.url}/admin/rewards",
        json={"episode_id": episode_id, "value": 0.25, "source": "ci", "note": "3/4 tests"},
        headers=admin(server),
    )
    assert response.status_code == 200, response.text
    assert [(r.source, r.giver) for r in store.rewards(episode_id)] == [("feedback", "alice"), ("ci", "admin")]
    # rate limit: 3 per minute per user
    assert [feedback(alice, episode_id=episode_id, value=1.0).status_code for _ in range(3)] == [200, 200, 429]
    # a revoked key is refused everywhere, at once
    assert httpx.delete(f"{server.url}/admin/users/bob", headers=admin(server)).status_code == 200
    assert feedback(bob, episode_id=episode_id, value=1.0).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key=bob, max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}]
        )
    # user routes need a user key; admin routes need the admin token
    assert feedback(server.admin_token, episode_id=episode_id, value=1.0).status_code == 401
    assert (
        httpx.post(
            f"{server.url}/admin/users", json={"name": "eve"}, headers={"Authorization": f"Bearer {alice}"}
        ).status_code
        == 401
    )
    listed = httpx.get(f"{server.url}/admin/users", headers=admin(server)).json()["users"]
    assert [(u["name"], u["revoked"] is None) for u in listed] == [("alice", True), ("bob", False)]
    assert all("key" not in u for u in listed)


def test_user_routes_are_refused_with_a_clear_error_when_serving_has_no_store(tokenizer):
    app = create_app(ScriptedEngine(tokenizer, lambda prompt: "Fine."), ChatRenderer(tokenizer), EndpointSettings())
    with EndpointServer(app) as server:
        response = httpx.post(f"{server.url}/admin/users", json={"name": "a"}, headers=admin(server))
        assert response.status_code == 400 and "--store" in response.json()["error"]["message"]


def test_a_client_names_its_episodes_task_and_episodes_of_one_task_share_a_fingerprint(serve):
    server, store = serve(user_episode_idle_timeout=60.0)
    alice, bob = add_user(server, "alice"), add_user(server, "bob")

    def episode(key, task_in_body=None, task_header=None):
        headers = {"x-trl-agentic-task": task_header} if task_header is not None else None
        client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, default_headers=headers)
        episode_id, _ = chat(client, [{"role": "user", "content": "What is 12 * 34?"}])
        body = {"task": task_in_body} if task_in_body is not None else None
        ended = httpx.post(f"{server.base_url}/episodes/end", json=body, headers={"Authorization": f"Bearer {key}"})
        assert ended.status_code == 200 and ended.json()["episode_id"] == episode_id, ended.text
        store.add_reward(episode_id, 1.0, "feedback", "test")
        return episode_id

    first = episode(alice, task_in_body="12*34")
    second = episode(bob, task_header="12*34")  # another user, the header on its model call
    other = episode(alice, task_in_body="56*78")
    unnamed = episode(bob)
    claimed = {e.id: e.metadata.get("fingerprint") for e, _ in store.claim_for_training(limit=10, step=1).items}
    assert claimed[first] == claimed[second] == task_fingerprint("12*34")
    assert claimed[other] == task_fingerprint("56*78") != claimed[first]
    assert claimed[unnamed] is None
    assert task_fingerprint("12*34").startswith("task-") and "12*34" not in task_fingerprint("12*34")
    # a bad name is refused with a clear 400, before anything ends
    client = openai.OpenAI(base_url=server.base_url, api_key=alice, max_retries=0)
    chat(client, [{"role": "user", "content": "Hi"}])
    headers = {"Authorization": f"Bearer {alice}"}
    refused = httpx.post(f"{server.base_url}/episodes/end", json={"task": ""}, headers=headers)
    assert refused.status_code == 400 and "task" in refused.json()["error"]["message"]
    refused = httpx.post(f"{server.base_url}/episodes/end", json={"tsak": "x"}, headers=headers)
    assert refused.status_code == 400 and "tsak" in refused.json()["error"]["message"]
    assert httpx.post(f"{server.base_url}/episodes/end", headers=headers).json()["episode_id"] is not None


def test_a_rewarded_user_episode_reaches_the_rollout_rule_with_its_task_tokens_calls_and_malformed_calls(
    tokenizer, tmp_path
):
    """What the guards compare comes from the stored episode: the first reward of an episode is counted for its version
    with its task's fingerprint, its sampled tokens, its model calls and those with a malformed tool call."""
    from conftest import CALCULATOR_TOOL
    from trl_agentic.endpoint.versions import RolloutPolicy, VersionManager

    replies = iter(
        ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}\n</tool_call>', "It is 5."]
    )
    engine = ScriptedEngine(tokenizer, lambda prompt: next(replies))
    store = SQLiteEpisodeStore(tmp_path / "store.db")
    versions = VersionManager(engine, RolloutPolicy(min_episodes=1))
    settings = EndpointSettings(user_episode_idle_timeout=60.0)
    app = create_app(engine, ChatRenderer(tokenizer), settings, store=store, versions=versions)
    with EndpointServer(app) as server:
        key = add_user(server, "alice")
        client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        raw = client.chat.completions.with_raw_response.create(
            model="policy", messages=messages, tools=[CALCULATOR_TOOL]
        )
        broken = raw.parse().choices[0].message
        assert broken.tool_calls is None  # malformed: returned as text
        messages += [{"role": "assistant", "content": broken.content}, {"role": "user", "content": "And?"}]
        client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_TOOL])
        user = {"Authorization": f"Bearer {key}"}
        ended = httpx.post(f"{server.base_url}/episodes/end", json={"task": "2 + 3"}, headers=user)
        episode_id = ended.json()["episode_id"]
        given = httpx.post(f"{server.base_url}/feedback", json={"episode_id": episode_id, "value": 1.0}, headers=user)
        assert given.status_code == 200, given.text
        httpx.post(f"{server.base_url}/feedback", json={"episode_id": episode_id, "value": 0.0}, headers=user)
    stored = store.get_episode(episode_id)[0]
    assert [turn.malformed_tool_call for turn in stored.turns] == [True, False]
    (reward,) = versions._versions[0].rewards  # the first reward only
    assert reward == (1.0, task_fingerprint("2 + 3"), stored.num_sampled_tokens, 2, 1)
    assert stored.num_sampled_tokens == sum(len(turn.completion_ids) for turn in stored.turns) > 0
