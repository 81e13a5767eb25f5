"""CLI coding agents, unmodified, as episode agents: `Harness("mini-swe-agent")`.

A harness is a program people run themselves (a coding CLI). For each episode [`Harness`]:

1. makes a fresh directory with a `work/` folder (the workspace, filled from the task's `files_column` if given) and a
   `home/` folder (the harness's `HOME`: its configuration is written there, never into the user's own);
2. writes the preset's configuration (telemetry, auto-update and analytics off, headless permissions), points the
   harness at the episode's endpoint URL and key through its documented settings, and gives it the task on its command
   line (opencode: on its standard input);
3. runs it in the episode's sandbox (`sandbox="auto"`: bubblewrap, `trl_agentic.sandbox`; its own install folder
   bound read-only) with a minimal environment (no trainer secrets, as [`CommandAgent`]); when it exits, or its
   episode times out, everything it started is killed;
4. returns `{"harness", "exit_code", "output", "workspace", "files", "sandbox"}`: its exit status, the tail of its
   output, the workspace's path, a snapshot of the workspace's small text files (kept in the episode log after the
   workspace is gone) and the sandbox's spec (a checker runs its tests there: `trl_agentic.sandbox.open_sandbox`). A
   non-zero exit ends the episode as `agent_error`.

The workspace is removed once the reward functions have scored the episode (the trainer and the evaluator call
`release(episodes)`), or at once when the harness failed; `keep_workspaces=True` keeps them all (for the viewer or a
post-mortem).

Presets (`HARNESS_PRESETS`): `"mini-swe-agent"`, `"claude-code"`, `"codex"`, `"gemini-cli"`,
`"opencode"`. Each says how the harness is found (`binary=`, the
`TRL_AGENTIC_<NAME>_BIN` environment variable, or its executable on `PATH`) and installed; a harness that is not found
is a `HarnessNotFoundError` that says how to install it or where to point.

Example:

```python
>>> trainer = AgenticGRPOTrainer(model, agent=Harness("mini-swe-agent", files_column="files"), reward_funcs=[tests_pass],
...                              args=AgenticGRPOConfig(agent_columns=["prompt", "files"]), train_dataset=dataset)
```
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ..sandbox import SandboxLimits, create_sandbox, snapshot
from ..sandbox.base import SNAPSHOT_FILE_LIMIT, SNAPSHOT_TOTAL_LIMIT  # noqa: F401 - their import path before sandbox/
from ..sandbox.binds import program_binds
from ..sandbox.factory import check_sandbox
from .agents import AgentCrash, EpisodeContext, command_environment


class HarnessNotFoundError(ValueError):
    """The harness's executable is not installed where it was looked for."""


@dataclass(frozen=True)
class HarnessPreset:
    """How to run one harness headless against an episode.

    Args:
        executable: the program's name on `PATH`.
        install: how a user installs it (said when it is not found).
        prepare: `prepare(binary, task_text, context, work, home) -> (argv, env)`: writes the harness's configuration
            under `home` and returns its command line and the environment variables it needs (on top of the minimal
            environment, with `HOME=home`). `work` and `home` are the trainer's paths: where the command line and the
            environment start with one, the harness gets the path it sees (`Harness.same_paths`); files written under
            `home` should not name them.
        task_on_stdin: the task is written to the harness's standard input (then closed) rather than being on its
            command line, for a harness that would alter it there.
        in_sandbox: `in_sandbox(argv) -> argv`: the command line when the episode runs in a sandbox, for a harness
            whose own sandbox cannot nest in it (Codex's: the episode's sandbox confines it instead).
    """

    executable: str
    install: str
    prepare: Callable[[str, str, EpisodeContext, Path, Path], tuple[list[str], dict[str, str]]]
    task_on_stdin: bool = False
    in_sandbox: Callable[[list[str]], list[str]] | None = None


def _mini_swe_agent(binary: str, task: str, context: EpisodeContext, work: Path, home: Path):
    # mini-swe-agent 2.x: litellm with an `openai/<model>` name reads OPENAI_BASE_URL / OPENAI_API_KEY; its global
    # config (`.env`) lives in MSWEA_GLOBAL_CONFIG_DIR, and MSWEA_CONFIGURED skips its first-run setup wizard.
    config_dir = home / ".config" / "mini-swe-agent"
    config_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        binary,
        "--yolo",
        "--exit-immediately",
        "--task",
        task,
        "--model",
        f"openai/{context.model}",
        "--output",
        str(home / "trajectory.json"),
        "--config",
        "mini.yaml",
        "--config",
        "agent.cost_limit=0",
        "--config",
        "agent.step_limit=0",
    ]
    env = {
        "OPENAI_BASE_URL": context.base_url,
        "OPENAI_API_BASE": context.base_url,
        "OPENAI_API_KEY": context.api_key,
        "MSWEA_GLOBAL_CONFIG_DIR": str(config_dir),
        "MSWEA_CONFIGURED": "true",
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_COST_TRACKING": "ignore_errors",
        # mini retries every error but a few (a 400 included) 10 times, 4-60 s apart: the endpoint's refusals (episode
        # limits) are final, and the retries held each such episode ~4.5 min (mini-swe-agent 2.4.6).
        "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no price-list download
    }
    return argv, env


def _claude_code(binary: str, task: str, context: EpisodeContext, work: Path, home: Path):
    # Claude Code 2.x headless (`-p`): the Anthropic Messages route, its key as ANTHROPIC_API_KEY; no telemetry, error
    # reports, auto-update or other non-essential traffic. `--allowedTools` is the headless permission rule for its
    # file and shell tools (`--dangerously-skip-permissions` refuses to run as root outside a declared sandbox).
    argv = [
        binary,
        "-p",
        task,
        "--model",
        context.model,
        "--allowedTools",
        "Bash",
        "Edit",
        "Write",
        "Read",
        "Glob",
        "Grep",
    ]
    env = {
        "ANTHROPIC_BASE_URL": context.anthropic_base_url,
        "ANTHROPIC_API_KEY": context.api_key,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }
    return argv, env


_CODEX_CONFIG = """\
model = {model}
model_provider = "trl-agentic"
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.trl-agentic]
name = "trl-agentic"
base_url = {base_url}
env_key = "TRL_AGENTIC_API_KEY"
wire_api = "responses"
"""


def _codex(binary: str, task: str, context: EpisodeContext, work: Path, home: Path):
    # Codex CLI (`codex exec`): a custom model provider on the Responses route in CODEX_HOME/config.toml, update checks
    # and analytics off; its own sandbox confines the commands it runs to the workspace (`workspace-write`).
    codex_home = home / ".codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        _CODEX_CONFIG.format(model=json.dumps(context.model), base_url=json.dumps(context.base_url))
    )
    argv = [binary, "exec", "--skip-git-repo-check", "--sandbox", "workspace-write", task]
    return argv, {"CODEX_HOME": str(codex_home), "TRL_AGENTIC_API_KEY": context.api_key}


_GEMINI_SETTINGS = {
    "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
    "security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": False}},
}


def _gemini_cli(binary: str, task: str, context: EpisodeContext, work: Path, home: Path):
    # Gemini CLI (`gemini -p`): the Gemini API route (`GOOGLE_GEMINI_BASE_URL`, the root the SDK appends `/v1beta/...`
    # to), API-key auth; auto-update, usage statistics and telemetry off, folder trust off; `--yolo` approves its tools.
    (home / ".gemini").mkdir()
    (home / ".gemini" / "settings.json").write_text(json.dumps(_GEMINI_SETTINGS))
    argv = [binary, "-m", context.model, "--yolo", "-p", task]
    env = {
        "GOOGLE_GEMINI_BASE_URL": context.anthropic_base_url,
        "GEMINI_API_KEY": context.api_key,
        "NO_COLOR": "1",
        "TERM": "dumb",
        "CI": "1",
    }
    return argv, env


def _opencode(binary: str, task: str, context: EpisodeContext, work: Path, home: Path):
    # opencode (`opencode run`): a custom provider (`@ai-sdk/openai-compatible`, bundled, on the Chat Completions
    # route) in its global config under XDG_CONFIG_HOME, the key read from the environment; auto-update and sharing
    # off; edits and shell commands allowed headless, web fetches denied (the endpoint is the only host it needs).
    # OPENCODE_DISABLE_MODELS_FETCH: no models.dev download at startup; OPENCODE_DISABLE_LSP_DOWNLOAD: no language
    # servers fetched for the files it touches. It also installs `@opencode-ai/plugin` into each config directory in
    # the background through npm, with no setting to turn that off: `offline=true` in the home's .npmrc makes it fail
    # at once without a request (a logged warning, nothing lost: no plugins are configured). It asks for a session
    # title first (a side call of the episode). The task goes on its standard input: a message on the command line
    # reaches the model in quotes (`opencode run` quotes an argument with spaces), read from stdin it arrives as is.
    config_home = home / ".config"
    (config_home / "opencode").mkdir(parents=True)
    config = {
        "model": f"trl-agentic/{context.model}",
        "autoupdate": False,
        "share": "disabled",
        "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny"},
        "provider": {
            "trl-agentic": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "trl-agentic",
                "options": {"baseURL": context.base_url, "apiKey": "{env:TRL_AGENTIC_API_KEY}"},
                "models": {context.model: {"name": context.model}},
            }
        },
    }
    (config_home / "opencode" / "opencode.json").write_text(json.dumps(config, indent=2))
    (home / ".npmrc").write_text("offline=true\n")
    env = {
        "TRL_AGENTIC_API_KEY": context.api_key,
        "XDG_CONFIG_HOME": str(config_home),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "NO_COLOR": "1",
    }
    return [binary, "run", "--model", f"trl-agentic/{context.model}"], env


def _codex_in_sandbox(argv: list[str]) -> list[str]:
    # Codex's own Linux sandbox (namespaces, seccomp) cannot set itself up inside the episode's: its commands failed
    # there and the task was never done. The episode's sandbox confines them instead (what Codex's docs advise in a
    # container).
    return [a if a != "workspace-write" else "danger-full-access" for a in argv]


HARNESS_PRESETS: dict[str, HarnessPreset] = {
    "gemini-cli": HarnessPreset("gemini", "npm install -g @google/gemini-cli", _gemini_cli),
    "codex": HarnessPreset("codex", "npm install -g @openai/codex", _codex, in_sandbox=_codex_in_sandbox),
    "mini-swe-agent": HarnessPreset("mini", "pip install mini-swe-agent", _mini_swe_agent),
    "claude-code": HarnessPreset("claude", "npm install -g @anthropic-ai/claude-code", _claude_code),
    "opencode": HarnessPreset("opencode", "npm install -g opencode-ai", _opencode, task_on_stdin=True),
}

OUTPUT_TAIL = 4000  # characters of the harness's output kept in the result


@dataclass
class Harness:
    """A CLI coding agent run headless once per episode, in a workspace and home of its own.

    Args:
        name: a preset of `HARNESS_PRESETS`, e.g. `"mini-swe-agent"`.
        binary: the executable to run (default: `$TRL_AGENTIC_<NAME>_BIN`, else the preset's executable on `PATH`).
        args: extra command-line arguments, appended to the preset's.
        env: extra environment variables for the harness.
        task_column: the task column holding its instructions: text, or a conversational prompt (its last user
            message is the task; the harness brings its own system prompt).
        files_column: a task column with the workspace's initial files, `{relative path: text}` (or that as JSON).
            Name it in `AgenticGRPOConfig.agent_columns` too.
        keep_workspaces: keep every episode's directory instead of removing it after scoring.
        inherit_env: names of the trainer's environment variables the harness also gets (`True`: all, an opt-in).
        sandbox: where each episode runs: `"auto"` (default: bubblewrap where it works here, else an error saying
            what to install or opt into), `"bwrap"`, `"docker"`, `"none"` (unsandboxed: the harness can read what
            the trainer can; warns once), or a sandbox factory (`trl_agentic.sandbox.create_sandbox`).
        binds: host paths the harness sees read-only, besides its own install folder and its interpreter's (found
            from `binary`).
        limits: resource limits of the harness's processes (`trl_agentic.sandbox.SandboxLimits`).
        sandbox_image: the container image, for `sandbox="docker"`.
        same_paths: in a bubblewrap sandbox, every episode sees its workspace and home at the same paths
            (`/tmp/trl-agentic-<name>/work` and `.../home`; the preset's command line and environment are given those):
            a harness that writes its working directory or home into its prompt (Claude Code, Codex, Gemini CLI,
            opencode) then sends the same prompt in every episode, which branching by replay needs (each episode's
            own directory would make every branch diverge at call 0). `False`: each episode's own paths, as unsandboxed
            and in a container.

    Example:

    ```python
    >>> Harness("mini-swe-agent", binary="/opt/mini/bin/mini").name
    'mini-swe-agent'
    ```
    """

    name: str
    binary: str | None = None
    args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    task_column: str = "prompt"
    files_column: str | None = None
    keep_workspaces: bool = False
    inherit_env: bool | Sequence[str] = ()
    sandbox: Any = "auto"
    binds: Sequence[str] = ()
    limits: SandboxLimits | None = None
    sandbox_image: str | None = None
    same_paths: bool = True

    def __post_init__(self):
        if self.name not in HARNESS_PRESETS:
            raise ValueError(f"Unknown harness {self.name!r}; the presets are {sorted(HARNESS_PRESETS)}.")
        self.preset = HARNESS_PRESETS[self.name]
        check_sandbox(self.sandbox)

    @property
    def binary_env_var(self) -> str:
        return "TRL_AGENTIC_" + self.name.upper().replace("-", "_") + "_BIN"

    def find_binary(self) -> str:
        """The executable to run, or a `HarnessNotFoundError` saying how to install it or where to point."""
        candidate = self.binary or os.environ.get(self.binary_env_var) or self.preset.executable
        found = shutil.which(candidate)
        if found is None:
            where = (
                f"{candidate!r} is not an executable"
                if self.binary or os.environ.get(self.binary_env_var)
                else f"{candidate!r} is not on PATH"
            )
            raise HarnessNotFoundError(
                f"Harness {self.name!r} not found: {where}. Install it ({self.preset.install}), or point at it with "
                f"Harness({self.name!r}, binary=...) or ${self.binary_env_var}."
            )
        return found

    def task_text(self, task: dict[str, Any]) -> str:
        if self.task_column not in task:
            raise ValueError(
                f"The task has no {self.task_column!r} column (it has {sorted(task)}); set "
                "Harness(task_column=...) and list that column in AgenticGRPOConfig.agent_columns."
            )
        value = task[self.task_column]
        if isinstance(value, str):
            return value
        users = [m for m in value if m.get("role") == "user"]
        if not users:
            raise ValueError(f"The task's {self.task_column!r} holds no user message to give the harness.")
        content = users[-1]["content"]
        return content if isinstance(content, str) else " ".join(p.get("text", "") for p in content)

    async def run(self, context: EpisodeContext, task: dict[str, Any]) -> dict[str, Any]:
        binary = self.find_binary()
        sandbox = create_sandbox(
            self.sandbox,
            prefix=f"trl-agentic-{self.name}-",
            binds=[*program_binds(binary), *self.binds],
            limits=self.limits,
            image=self.sandbox_image,
            inside_root=f"/tmp/trl-agentic-{self.name}" if self.same_paths else None,
        )
        work, home = sandbox.workspace, sandbox.home
        try:
            self._write_files(work, task)
            text = self.task_text(task)
            context = dataclasses.replace(context, base_url=sandbox.endpoint_url(context.base_url))
            argv, preset_env = self.preset.prepare(binary, text, context, work, home)
            # the preset names the episode's directories by the trainer's paths: the harness sees them where it runs
            argv, preset_env = [sandbox.inside(a) for a in argv], {k: sandbox.inside(v) for k, v in preset_env.items()}
            if self.preset.in_sandbox is not None and sandbox.kind != "none":
                argv = self.preset.in_sandbox(argv)
            env = {
                **command_environment(self.inherit_env),
                **preset_env,
                **self.env,
                "HOME": sandbox.inside(home),
                "TMPDIR": sandbox.tmpdir,
            }
            stdin = text.encode() if self.preset.task_on_stdin else None
            done = await sandbox.run([*argv, *self.args], env, cwd=work, stdin=stdin, merge_stderr=True)
        except BaseException:
            self._destroy(sandbox)  # a failed start, a timeout (cancelled) or a crash: nothing will score this episode
            raise
        metadata = {"exit_code": done.exit_code, "output_tail": done.stdout[-OUTPUT_TAIL:]}
        if done.left_processes:
            metadata["left_processes_killed"] = True
        if done.exit_code != 0:
            self._destroy(sandbox)
            raise AgentCrash(f"harness {self.name!r} exited with status {done.exit_code}", metadata)
        return {
            "harness": self.name,
            "exit_code": done.exit_code,
            "output": done.stdout[-OUTPUT_TAIL:],
            "workspace": str(work),
            "files": sandbox.read_files(),
            "sandbox": sandbox.spec(),
            **({"left_processes_killed": True} if done.left_processes else {}),
        }

    def release(self, episodes: Sequence[Any]) -> None:
        """Remove the workspaces of scored episodes (called by the trainer and the evaluator after the reward
        functions), unless `keep_workspaces`."""
        if self.keep_workspaces:
            return
        for episode in episodes:
            result = getattr(episode, "result", None)
            if isinstance(result, dict) and result.get("harness") == self.name and result.get("workspace"):
                self._remove(Path(result["workspace"]).parent)

    def _write_files(self, work: Path, task: dict[str, Any]) -> None:
        if self.files_column is None:
            return
        files = task.get(self.files_column)
        if files is None:
            raise ValueError(
                f"Harness(files_column={self.files_column!r}): the task has no such column; list it in "
                "AgenticGRPOConfig.agent_columns."
            )
        if isinstance(files, str):
            files = json.loads(files)
        for relative, text in files.items():
            path = PurePosixPath(relative)
            if path.is_absolute() or ".." in path.parts:
                raise ValueError(f"Workspace file {relative!r} must be a relative path inside the workspace.")
            target = work.joinpath(*path.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)

    def _remove(self, root: Path) -> None:
        if not self.keep_workspaces:
            shutil.rmtree(root, ignore_errors=True)

    def _destroy(self, sandbox: Any) -> None:
        if not self.keep_workspaces:
            sandbox.destroy()


def release_episodes(agent: Any, episodes: Sequence[Any]) -> None:
    """Let an agent free what it kept for the reward functions (a harness's workspaces), once they have scored."""
    release = getattr(agent, "release", None)
    if callable(release):
        release(episodes)


__all__ = ["HARNESS_PRESETS", "Harness", "HarnessNotFoundError", "HarnessPreset", "release_episodes", "snapshot"]
