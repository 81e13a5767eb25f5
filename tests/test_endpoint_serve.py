"""`trl-agentic serve` as a real process: open an episode with the admin API, call it with the openai client, close it
and get the recorded Episode back."""

import os
import re
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from trl_agentic.endpoint.serve import make_parser
from trl_agentic.trace import Episode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_parser_defaults_and_overrides():
    args = make_parser().parse_args(["--model", "tiny:qwen2_5"])
    assert (args.host, args.port, args.served_model_name, args.temperature) == ("127.0.0.1", 8000, "policy", None)
    args = make_parser().parse_args(
        [
            "--model",
            "m",
            "--temperature",
            "0.7",
            "--max-turns",
            "4",
            "--chat-template-kwargs",
            '{"enable_thinking": false}',
        ]
    )
    assert (args.temperature, args.max_turns, args.chat_template_kwargs) == (0.7, 4, {"enable_thinking": False})


def start_serve(log, *flags, env=None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "trl_agentic.cli", "serve", "--model", "tiny:qwen2_5", "--port", str(port), *flags],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, f"serve exited early:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"serve did not come up:\n{log.read_text()}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)


def stop_serve(process) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_serve_process(tmp_path):
    log = tmp_path / "serve.log"
    process, url = start_serve(log, "--max-tokens", "8", "--log-level", "warning")
    try:
        printed = log.read_text()
        token = re.search(r"admin token: (\S+)", printed).group(1)
        assert f"curl -s -X POST {url}/admin/episodes -H 'Authorization: Bearer {token}'" in printed

        admin = {"Authorization": f"Bearer {token}"}
        opened = httpx.post(
            f"{url}/admin/episodes", json={"task_index": 3, "metadata": {"task": "demo"}}, headers=admin, timeout=10
        ).json()
        assert opened["base_url"] == f"{url}/v1" and opened["key"].startswith("sk-ep-")
        client = openai.OpenAI(base_url=opened["base_url"], api_key=opened["key"], max_retries=0, timeout=60)
        response = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "Hello!"}], max_tokens=50
        )
        assert response.usage.completion_tokens <= 8  # --max-tokens caps what the request asked for
        running = httpx.get(f"{url}/admin/episodes/{opened['id']}", headers=admin, timeout=10).json()
        assert running["status"] == "running" and len(running["turns"]) == 1

        closed = httpx.post(
            f"{url}/admin/episodes/{opened['id']}/close", json={"result": {"answer": 42}}, headers=admin, timeout=10
        )
        assert closed.status_code == 200
        episode = Episode.from_dict(closed.json())
        assert episode.id == opened["id"] and episode.task_index == 3 and episode.metadata == {"task": "demo"}
        assert episode.status == "ok" and episode.result == {"answer": 42}
        (turn,) = episode.turns
        assert len(turn.completion_ids) == response.usage.completion_tokens == len(turn.logprobs)
        assert turn.response_message["content"] == response.choices[0].message.content
        with pytest.raises(openai.AuthenticationError):  # the key died with the episode
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}])
    finally:
        stop_serve(process)
    assert process.returncode is not None


@pytest.mark.slow
def test_serve_keeps_secrets_out_of_its_output_and_bounds_its_episodes(tmp_path):
    """A token the user chose is not printed; episode ids (the secret of the path route) are not in the access log;
    `--max-open-episodes` answers 429 beyond the cap (issue #9)."""
    args = make_parser().parse_args(["--model", "m"])
    assert (args.max_open_episodes, args.episode_idle_timeout) == (4096, 1800.0)  # bounded by default
    token = "sk-admin-chosen-by-the-user"
    log = tmp_path / "serve.log"
    process, url = start_serve(
        log,
        "--max-tokens",
        "4",
        "--log-level",
        "info",
        "--max-open-episodes",
        "1",
        "--episode-idle-timeout",
        "60",
        env={**os.environ, "TRL_AGENTIC_ADMIN_TOKEN": token},
    )
    try:
        admin = {"Authorization": f"Bearer {token}"}
        opened = httpx.post(f"{url}/admin/episodes", json={}, headers=admin, timeout=10).json()
        refused = httpx.post(f"{url}/admin/episodes", json={}, headers=admin, timeout=10)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_open_episodes"
        client = openai.OpenAI(base_url=opened["path_base_url"], api_key="EMPTY", max_retries=0, timeout=60)
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hello!"}])
        # The Gemini API takes its key in the query string too: the access log must not print it
        gemini_body = {"contents": [{"role": "user", "parts": [{"text": "Hello!"}]}]}
        gemini = httpx.post(
            f"{url}/v1beta/models/policy:generateContent", params={"key": opened["key"]}, json=gemini_body, timeout=60
        )
        assert gemini.status_code == 200, gemini.text
        # Percent-encoded, the parameter name and the episode id still authenticate (the server decodes them): the
        # access log prints them raw, and redacts them all the same (issue 40: `?%6Bey=<key>` was printed as sent).
        hex_id = opened["id"].removeprefix("ep-")
        encoded_id = f"%65p-%{ord(hex_id[0]):02X}{hex_id[1:]}"
        for path, headers in [
            (f"/v1beta/models/policy:generateContent?%6Bey={opened['key']}", {}),
            (f"/v1beta/models/policy:generateContent?k%65%79={opened['key']}", {}),
            (f"/episodes/{encoded_id}/v1beta/models/policy:generateContent", {}),
        ]:
            response = httpx.post(f"{url}{path}", json=gemini_body, headers=headers, timeout=60)
            assert response.status_code == 200, (path, response.text)
        assert httpx.post(f"{url}/admin/episodes/{opened['id']}/close", headers=admin, timeout=10).status_code == 200
        time.sleep(0.5)  # let the access log reach the file
        printed = log.read_text()
        assert "admin token: as given ($TRL_AGENTIC_ADMIN_TOKEN)" in printed
        assert "Authorization: Bearer $TRL_AGENTIC_ADMIN_TOKEN" in printed
        assert token not in printed and hex_id not in printed and hex_id[1:] not in printed
        assert opened["key"] not in printed
        assert "/episodes/ep-<redacted>/v1/chat/completions" in printed  # the access log is there, redacted
        assert "generateContent?key=<redacted>" in printed
        assert "generateContent?%6Bey=<redacted>" in printed and "generateContent?k%65%79=<redacted>" in printed
    finally:
        stop_serve(process)


@pytest.mark.slow
def test_serve_with_a_store_loses_no_completed_episode_or_acknowledged_reward_to_kill_9(tmp_path):
    """Issue 43's crash test on the real process: user traffic (episodes ended, feedback given), `kill -9` mid-traffic,
    restart on the same store: every episode whose end was answered and every reward whose id was answered is there,
    and the user's key still works."""
    import signal

    from trl_agentic.store import SQLiteEpisodeStore

    store_path, token = tmp_path / "store.db", "sk-admin-crash-test"
    flags = ["--store", str(store_path), "--admin-token", token, "--max-tokens", "4", "--log-level", "warning"]
    process, url = start_serve(tmp_path / "serve.log", *flags)
    admin = {"Authorization": f"Bearer {token}"}
    key = httpx.post(f"{url}/admin/users", json={"name": "alice"}, headers=admin).json()["key"]
    user = {"Authorization": f"Bearer {key}"}
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    ended, rewarded = [], []
    try:
        for i in range(12):
            assert httpx.post(f"{url}/v1/chat/completions", json=body, headers=user, timeout=60).status_code == 200
            if i % 2:
                episode_id = httpx.post(f"{url}/v1/episodes/end", headers=user, timeout=60).json()["episode_id"]
                ended.append(episode_id)
                answer = httpx.post(f"{url}/v1/feedback", json={"value": 1.0}, headers=user, timeout=60).json()
                rewarded.append((answer["episode_id"], answer["id"]))
        process.send_signal(signal.SIGKILL)  # the episode of the last call is open: not completed, not promised
        process.wait()
        store = SQLiteEpisodeStore(store_path)
        assert all(store.get_episode(e)[1] == "alice" for e in ended) and len(ended) == 6
        assert all(reward_id in [r.id for r in store.rewards(e)] for e, reward_id in rewarded)
        process, url = start_serve(tmp_path / "serve2.log", *flags)
        assert httpx.post(f"{url}/v1/chat/completions", json=body, headers=user, timeout=60).status_code == 200
    finally:
        stop_serve(process)
