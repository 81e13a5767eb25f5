"""Gemini CLI, unmodified, through the endpoint's Gemini API: `gemini -p` completes "Create a file answer.txt
containing 42." with a scripted model that calls Gemini CLI's own shell tool, and the episode is one conversation that
continues token for token (0 forks).

Needs the `gemini` binary (npm `@google/gemini-cli`): `TRL_AGENTIC_GEMINI_CLI_BIN`, else `gemini` on PATH; skipped
otherwise. Install it outside the repository, e.g. `npm install --prefix /tmp/harnesses/gemini @google/gemini-cli`
(then `TRL_AGENTIC_GEMINI_CLI_BIN=/tmp/harnesses/gemini/node_modules/.bin/gemini`).

Gemini CLI runs in a fresh HOME and workdir, pointed at the endpoint only through its documented settings:
`GOOGLE_GEMINI_BASE_URL`, `GEMINI_API_KEY` (the episode key, sent as `x-goog-api-key`), `-m policy`, `--yolo`
(headless: tool calls approved), and `~/.gemini/settings.json` with telemetry, usage statistics and auto-update off.
"""

import json
import os
import shutil
import subprocess

import pytest

from conftest import ScriptedEngine
from trl_agentic.tiny_models import build_tiny_tokenizer


TASK = "Create a file answer.txt containing 42."
SETTINGS = {
    "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
    "security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": False}},
}


def gemini_cli_binary() -> str | None:
    return os.environ.get("TRL_AGENTIC_GEMINI_CLI_BIN") or shutil.which("gemini")


pytestmark = [
    pytest.mark.slow,  # the real program, end to end
    pytest.mark.skipif(
        gemini_cli_binary() is None,
        reason="Gemini CLI not found: set TRL_AGENTIC_GEMINI_CLI_BIN or put `gemini` on PATH "
        "(npm install --prefix <dir> @google/gemini-cli)",
    ),
]


def shell_tool_model(tokenizer, think: bool = False):
    """A scripted model in the Qwen tool-call format: the first call runs Gemini CLI's `run_shell_command` to write
    the file; once a tool response is in the prompt, it answers. `think`: each answer starts with reasoning (Qwen3),
    which Gemini CLI shows as thoughts and leaves out of the history it sends back."""

    def respond(prompt_ids):
        reasoning = "<think>\nThe shell can write the file.\n</think>\n\n" if think else ""
        if "<tool_response>" in tokenizer.decode(prompt_ids[-400:]):
            return reasoning + "Created answer.txt containing 42."
        call = {
            "name": "run_shell_command",
            "arguments": {"command": "echo 42 > answer.txt", "description": "Write 42 to answer.txt."},
        }
        return reasoning + "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"

    return respond


def run_gemini_cli(base_url: str, key: str, workdir, home, timeout: float = 120) -> subprocess.CompletedProcess:
    """`gemini -p TASK` in `workdir` with `home` as HOME, talking to `base_url` only."""
    (home / ".gemini").mkdir(parents=True, exist_ok=True)
    (home / ".gemini" / "settings.json").write_text(json.dumps(SETTINGS))
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "GOOGLE_GEMINI_BASE_URL": base_url,
        "GEMINI_API_KEY": key,
        "NO_COLOR": "1",
        "TERM": "dumb",
        "CI": "1",
    }
    command = [gemini_cli_binary(), "-m", "policy", "--yolo", "-p", TASK]
    return subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(("family", "by_path"), [("qwen2_5", False), ("qwen2_5", True), ("qwen3", False)])
def test_gemini_cli_completes_the_task_with_zero_forks(start_server, tmp_path, family, by_path):
    tokenizer = build_tiny_tokenizer(family)
    engine = ScriptedEngine(tokenizer, shell_tool_model(tokenizer, think=family == "qwen3"), max_context_length=65536)
    server = start_server(engine, tokenizer)
    session = server.open_episode()
    workdir, home = tmp_path / "work", tmp_path / "home"
    workdir.mkdir()
    if by_path:  # the episode in the URL, a placeholder key
        result = run_gemini_cli(server.episode_base_url(session).removesuffix("/v1"), "EMPTY", workdir, home)
    else:
        result = run_gemini_cli(server.url, session.key, workdir, home)
    episode = server.close_episode(session.episode.id)
    assert result.returncode == 0, (result.stdout, result.stderr[-3000:])
    assert (workdir / "answer.txt").read_text().strip() == "42"
    assert "Created answer.txt containing 42." in result.stdout
    assert len(episode.turns) == 2 and {t.wire_format for t in episode.turns} == {"gemini"}
    assert episode.num_forks == 0
    first, second = episode.turns
    assert (second.prompt_source, second.parent_turn) == ("continued", 0)
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == (
        first.prompt_ids + first.completion_ids
    )
    call = first.response_message["tool_calls"][0]
    assert call["function"]["name"] == "run_shell_command"
    assert [m["role"] for m in second.request_messages] == ["system", "user", "assistant", "tool"]
    assert "run_shell_command" in {t["function"]["name"] for t in first.request_tools}
    if family == "qwen3":  # the reasoning is recorded, and continued although the CLI sends it back as nothing
        assert first.response_message["reasoning_content"] == "The shell can write the file."
        assert "reasoning_content" not in second.request_messages[2]
