"""Submit a training recipe to Hugging Face Jobs.

```bash
trl-agentic jobs submit --config recipes/calculator/Qwen2.5-1.5B-Instruct/config_lora.yaml \
    --flavor a10g-large --hub-model-id my-org/calculator-lora [--timeout 3h] [--detach] [--dry-run] \
    [-- --learning_rate 2e-5]
```

What is submitted (`--dry-run` prints it as JSON and submits nothing):

- the uv script `jobs/train.py` (the copy bundled with the package, `trl_agentic/bundled/jobs/train.py`, so that
  submitting works from an installed wheel), whose PEP 723 header names the package to install (`--package`, plus the `vllm` and
  `deepspeed` extras when the recipe or the accelerate config needs them);
- the recipe itself, base64 in the environment variable `TRL_AGENTIC_RECIPE_B64` (and, on a multi-GPU flavor, the
  accelerate config in `TRL_AGENTIC_ACCELERATE_CONFIG_B64`): the job does not need this checkout;
- `HF_TOKEN` as a secret (only names are printed, never values);
- an explicit timeout, `push_to_hub true` and a `hub_model_id`: the machine is ephemeral, what is not pushed is lost.

Inside the job `jobs/train.py` decodes the files under `JOB_DIR` and runs `command`: `python -m
trl_agentic.scripts.train ...` on one GPU, `accelerate launch --num_processes N ...` on `a100x4`, `h200x8`, ...
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import yaml


# Package data (copies of the repository's `jobs/train.py` and `recipes/accelerate_configs/`, kept equal by
# tests/test_jobs.py): what a submission ships must not depend on a git checkout being around.
BUNDLED_DIR = Path(resources.files("trl_agentic")) / "bundled"
DEFAULT_SCRIPT = BUNDLED_DIR / "jobs" / "train.py"
ACCELERATE_CONFIGS_DIR = BUNDLED_DIR / "accelerate_configs"

# Launch defaults; `jobs/train.py` carries the same values in its `[tool.hf-jobs]` table for `hf jobs uv run`.
DEFAULT_FLAVOR = "a10g-large"
# HF Jobs stop a job after 30 minutes unless told otherwise. Installing torch (and vLLM), downloading the model and a
# few hundred GRPO steps take longer, and a job stopped before `push_to_hub` loses everything it trained.
DEFAULT_TIMEOUT = "2h"
DEFAULT_PACKAGE = "trl-agentic"
PACKAGE_NAME = "trl-agentic"

# How the files travel: base64 in the job's environment, decoded by `jobs/train.py` under `JOB_DIR`.
RECIPE_ENV = "TRL_AGENTIC_RECIPE_B64"
ACCELERATE_CONFIG_ENV = "TRL_AGENTIC_ACCELERATE_CONFIG_B64"
JOB_DIR = "/tmp/trl-agentic"
JOB_RECIPE = "recipe.yaml"
JOB_ACCELERATE_CONFIG = "accelerate_config.yaml"

# Training flags the submission sets itself.
_RESERVED_TRAIN_FLAGS = ("--push_to_hub", "--hub_model_id", "--config")


def gpu_count(flavor: str) -> int:
    """Number of GPUs of a Jobs flavor, read from its name: `a100x4` → 4, `h200x8` → 8, `a10g-large` → 1.

    Example:

    ```python
    >>> gpu_count("l40sx4"), gpu_count("a10g-largex2"), gpu_count("h200")
    (4, 2, 1)
    ```
    """
    match = re.search(r"x(\d+)$", flavor)
    return int(match.group(1)) if match else 1


def launch_command(
    *,
    recipe_path: str,
    num_processes: int = 1,
    accelerate_config_path: str | None = None,
    train_args: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """The command that trains a recipe on `num_processes` GPUs: plain `python -m` on one, `accelerate launch` on more.

    Example:

    ```python
    >>> launch_command(recipe_path="r.yaml", num_processes=4, accelerate_config_path="zero3.yaml")[:6]
    ['accelerate', 'launch', '--config_file', 'zero3.yaml', '--num_processes', '4']
    ```
    """
    train = ["-m", "trl_agentic.scripts.train", "--config", recipe_path, *train_args]
    if num_processes <= 1:
        return ["python", *train]
    launcher = ["accelerate", "launch"]
    # Without a config file accelerate needs to be told it is multi-GPU (mixed precision comes from the recipe's bf16).
    launcher += ["--config_file", accelerate_config_path] if accelerate_config_path else ["--multi_gpu"]
    return [*launcher, "--num_processes", str(num_processes), *train]


def encode_file(path: str | Path) -> str:
    """Base64 of a file's bytes, to ship it in a job's environment."""
    return base64.b64encode(Path(path).read_bytes()).decode("ascii")


def decode_file(encoded: str, path: str | Path) -> Path:
    """Write base64 `encoded` to `path` (parents created) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(encoded))
    return path


def script_dependencies(script_text: str) -> list[str]:
    """The `dependencies` of a uv script's PEP 723 header (the quoted entries of the list)."""
    block = _dependencies_block(script_text)
    return re.findall(r'"([^"]+)"', block.group(0))


def render_script(script_text: str, package: str) -> str:
    """The uv script with its `trl-agentic` dependency replaced by `package` (a PEP 508 requirement, with extras).

    The header is what `uv run` installs before anything runs, so this is where a git URL or extras must go.
    """
    from packaging.requirements import Requirement

    block = _dependencies_block(script_text)
    dependencies = [
        package if Requirement(dep).name == PACKAGE_NAME else dep for dep in script_dependencies(script_text)
    ]
    if package not in dependencies:
        raise ValueError(f"The uv script's PEP 723 header does not depend on {PACKAGE_NAME!r}: cannot set {package!r}.")
    lines = "".join(f'#     "{dep}",\n' for dep in dependencies)
    return script_text[: block.start()] + f"# dependencies = [\n{lines}# ]\n" + script_text[block.end() :]


def _dependencies_block(script_text: str) -> re.Match:
    match = re.search(r"^# dependencies = \[\n(?:#.*\n)*?# \]\n", script_text, flags=re.MULTILINE)
    if match is None:
        raise ValueError("The uv script has no PEP 723 `# dependencies = [ ... # ]` block.")
    return match


def package_requirement(package: str, extras: set[str]) -> str:
    """`package` (a name, specifier or `name @ url` requirement) with `extras` added.

    Example:

    ```python
    >>> package_requirement("trl-agentic @ git+https://github.com/org/trl-agentic", {"vllm"})
    'trl-agentic[vllm] @ git+https://github.com/org/trl-agentic'
    ```
    """
    from packaging.requirements import Requirement

    requirement = Requirement(package)
    if requirement.name != PACKAGE_NAME:
        raise ValueError(f"--package must be a requirement for {PACKAGE_NAME!r}, got {package!r}.")
    requirement.extras |= extras
    return str(requirement)


def _parse_train_args(train_args: list[str]) -> dict[str, Any]:
    # `--key value` / `--key` (a true flag) pairs, values read as YAML like the recipe's.
    values, index = {}, 0
    while index < len(train_args):
        flag = train_args[index]
        if not flag.startswith("--"):
            raise ValueError(f"Expected a training flag `--name value`, got {flag!r} in {train_args}.")
        if index + 1 < len(train_args) and not train_args[index + 1].startswith("--"):
            values[flag[2:]] = yaml.safe_load(train_args[index + 1])
            index += 2
        else:
            values[flag[2:]] = True
            index += 1
    return values


def _check_keys(keys, where: str) -> None:
    from trl_agentic.recipes import describe_unknown_keys, recipe_keys

    known = recipe_keys()
    unknown = [key for key in keys if key not in known and not (key.startswith("no_") and key[3:] in known)]
    if unknown:
        raise ValueError(
            f"Unknown training key{'s' if len(unknown) > 1 else ''} {describe_unknown_keys(unknown, known)} in "
            f"{where}: not fields of "
            "ScriptArguments, AgenticGRPOConfig or ModelConfig. Fix before submitting: the job would fail only after "
            "installing everything."
        )


def _resolve_accelerate_config(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = ACCELERATE_CONFIGS_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in ACCELERATE_CONFIGS_DIR.glob("*.yaml")))
        raise ValueError(
            f"Accelerate config {name_or_path!r} not found (looked for {path}). Pass a bundled name ({names}, as in "
            "recipes/accelerate_configs/) or a path to a YAML file."
        )
    return path


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def build_submission(
    *,
    config: str,
    flavor: str = DEFAULT_FLAVOR,
    timeout: str = DEFAULT_TIMEOUT,
    secrets: list[str] | tuple[str, ...] = ("HF_TOKEN",),
    hub_model_id: str | None = None,
    namespace: str | None = None,
    accelerate_config: str | None = None,
    package: str = DEFAULT_PACKAGE,
    network_group: str | None = None,
    script: str | Path = DEFAULT_SCRIPT,
    train_args: list[str] | tuple[str, ...] = (),
) -> dict[str, Any]:
    """Everything a submission sends to `huggingface_hub.run_uv_job`, plus the `command` the job will run.

    Pure (no network, no secret values): `--dry-run` prints it, `submit` sends it. See the module docstring.
    """
    if not re.fullmatch(r"\d+(\.\d+)?[smhd]?", str(timeout)):
        raise ValueError(f"--timeout {timeout!r}: expected a duration such as 5400, 90m, 4h or 1d.")
    recipe_path = Path(config)
    if not recipe_path.is_file():
        raise ValueError(f"Recipe {config!r} not found.")
    recipe = yaml.safe_load(recipe_path.read_text(encoding="utf-8"))
    if not isinstance(recipe, dict):
        raise ValueError(f"Recipe {config!r} must be a YAML mapping.")
    train_args = list(train_args)
    for flag in _RESERVED_TRAIN_FLAGS:
        if flag in train_args:
            raise ValueError(
                f"Do not pass {flag} after `--`: the submission sets it (use --hub-model-id for the Hub repo)."
            )
    _check_keys([key for key in recipe if key != "env"], f"recipe {config}")
    overrides = _parse_train_args(train_args)
    _check_keys(overrides, "the training flags after `--`")
    effective = {**recipe, **overrides}

    # Where the results go: the machine is gone when the job ends.
    hub_model_id = hub_model_id or effective.get("hub_model_id")
    if hub_model_id is None:
        if not effective.get("output_dir"):
            raise ValueError(
                f"Cannot derive a Hub repository for the results: recipe {config!r} sets neither hub_model_id nor "
                "output_dir. Pass --hub-model-id <namespace>/<name>."
            )
        hub_model_id = Path(effective["output_dir"]).name
    if "/" not in hub_model_id and namespace:
        hub_model_id = f"{namespace}/{hub_model_id}"

    # How the job launches: one process per GPU of the flavor.
    num_processes = gpu_count(flavor)
    extras = {"vllm"} if effective.get("use_vllm") else set()
    env = {"PYTHONUNBUFFERED": "1", RECIPE_ENV: encode_file(recipe_path)}  # unbuffered: logs stream as they come
    job_accelerate_config = None
    if num_processes > 1:
        # LoRA's optimizer state is small: plain DDP. Full fine-tuning shards weights and states with ZeRO-3.
        accelerate_config = accelerate_config or ("ddp" if effective.get("use_peft") else "zero3")
        accelerate_config_path = _resolve_accelerate_config(accelerate_config)
        if yaml.safe_load(accelerate_config_path.read_text(encoding="utf-8")).get("distributed_type") == "DEEPSPEED":
            extras.add("deepspeed")
        env[ACCELERATE_CONFIG_ENV] = encode_file(accelerate_config_path)
        job_accelerate_config = f"{JOB_DIR}/{JOB_ACCELERATE_CONFIG}"
    elif accelerate_config is not None:
        raise ValueError(f"--accelerate-config is for multi-GPU flavors; {flavor!r} has one GPU.")
    script_args = ["--num_processes", str(num_processes), "--push_to_hub", "true", "--hub_model_id", hub_model_id]
    script_args += train_args

    script = Path(script)
    rendered = render_script(script.read_text(encoding="utf-8"), package_requirement(package, extras))
    secret_names = list(dict.fromkeys(["HF_TOKEN", *secrets]))  # pushing needs the token
    return {
        "script": _display_path(script),
        "dependencies": script_dependencies(rendered),
        "script_args": script_args,
        "flavor": flavor,
        "timeout": timeout,
        "secrets": secret_names,
        "env": env,
        "namespace": namespace,
        "network_group": network_group,
        "name": re.sub(r"[^a-z0-9-]+", "-", hub_model_id.split("/")[-1].lower()).strip("-"),
        "command": launch_command(
            recipe_path=f"{JOB_DIR}/{JOB_RECIPE}",
            num_processes=num_processes,
            accelerate_config_path=job_accelerate_config,
            train_args=["--push_to_hub", "true", "--hub_model_id", hub_model_id, *train_args],
        ),
    }


def submit(submission: dict[str, Any], *, script: str | Path = DEFAULT_SCRIPT, detach: bool = False) -> int:
    """Send a [`build_submission`] result with `huggingface_hub.run_uv_job`; follow the logs unless `detach`."""
    from huggingface_hub import fetch_job_logs, get_token, inspect_job, run_uv_job
    from packaging.requirements import Requirement

    secrets = {}
    for name in submission["secrets"]:
        value = os.environ.get(name) or (get_token() if name == "HF_TOKEN" else None)
        if not value:
            raise ValueError(f"Secret {name} has no value: set the environment variable {name} (or `hf auth login`).")
        secrets[name] = value

    package = next(dep for dep in submission["dependencies"] if Requirement(dep).name == PACKAGE_NAME)
    with tempfile.TemporaryDirectory(prefix="trl-agentic-job-") as tmp:
        # The rendered copy is what uv installs from; run_uv_job uploads it with the job.
        rendered = Path(tmp) / "train.py"
        rendered.write_text(render_script(Path(script).read_text(encoding="utf-8"), package), encoding="utf-8")
        job = run_uv_job(
            str(rendered),
            script_args=submission["script_args"],
            flavor=submission["flavor"],
            timeout=submission["timeout"],
            secrets=secrets,
            env=submission["env"],
            name=submission["name"],
            namespace=submission["namespace"],
            network_group=submission["network_group"],
        )
    print(f"Submitted job {job.id}: {job.url}")
    if detach:
        return 0
    for line in fetch_job_logs(job_id=job.id, namespace=submission["namespace"], follow=True):
        print(line)
    stage = inspect_job(job_id=job.id, namespace=submission["namespace"]).status.stage
    print(f"Job {job.id} ended: {stage}")
    return 0 if stage == "COMPLETED" else 1


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-agentic jobs", description="Run recipes on Hugging Face Jobs.")
    commands = parser.add_subparsers(dest="command", required=True)
    sub = commands.add_parser(
        "submit",
        help="Submit a recipe as a training job.",
        description="Submit a recipe as a Hugging Face training job. Training flags after `--` override the recipe.",
    )
    sub.add_argument("--config", required=True, help="Recipe YAML (shipped with the job).")
    sub.add_argument("--flavor", default=DEFAULT_FLAVOR, help=f"Jobs hardware flavor (default {DEFAULT_FLAVOR}).")
    sub.add_argument(
        "--timeout",
        default=DEFAULT_TIMEOUT,
        help=f"Max duration, e.g. 90m, 4h (default {DEFAULT_TIMEOUT}; HF's own default of 30m is too short to train).",
    )
    sub.add_argument("--detach", action="store_true", help="Return after submitting instead of following the logs.")
    sub.add_argument("--dry-run", action="store_true", help="Print the submission as JSON and submit nothing.")
    sub.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="NAME",
        help="Secret passed from your environment, by name (repeatable). HF_TOKEN is always passed.",
    )
    sub.add_argument(
        "--hub-model-id", help="Hub repo of the results (default: the recipe's, else its output_dir name)."
    )
    sub.add_argument("--namespace", help="Namespace of the job and of a hub_model_id given without one.")
    sub.add_argument(
        "--accelerate-config",
        help="Multi-GPU flavors: name in recipes/accelerate_configs or a path (default: ddp for LoRA, else zero3).",
    )
    sub.add_argument(
        "--package",
        default=os.environ.get("TRL_AGENTIC_PACKAGE", DEFAULT_PACKAGE),
        help="Requirement the job installs, e.g. 'trl-agentic @ git+https://github.com/<org>/trl-agentic@main' "
        "(default: $TRL_AGENTIC_PACKAGE or trl-agentic).",
    )
    sub.add_argument("--network-group", help="Join a network group (e.g. with a `trl vllm-serve` job).")
    sub.add_argument("--script", default=str(DEFAULT_SCRIPT),
                     help="The uv script to run (default: the bundled copy of jobs/train.py).")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`trl-agentic jobs submit --config recipe.yaml [options] [-- training flags]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = []
    if "--" in argv:
        split = argv.index("--")
        argv, train_args = argv[:split], argv[split + 1 :]
    args = make_parser().parse_args(argv)
    try:
        submission = build_submission(
            config=args.config,
            flavor=args.flavor,
            timeout=args.timeout,
            secrets=args.secret,
            hub_model_id=args.hub_model_id,
            namespace=args.namespace,
            accelerate_config=args.accelerate_config,
            package=args.package,
            network_group=args.network_group,
            script=args.script,
            train_args=train_args,
        )
    except ValueError as error:
        print(f"trl-agentic jobs: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(json.dumps(submission, indent=2))
        return 0
    try:
        return submit(submission, script=args.script, detach=args.detach)
    except ValueError as error:
        print(f"trl-agentic jobs: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
