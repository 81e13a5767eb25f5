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
- what the recipe imports (`task`, `agent`, `reward_funcs`), checked by importing it here: a local Python file travels
  with the `.py` files beside it and a module of the working directory as it is (a `.tar.gz` in
  `TRL_AGENTIC_CODE_B64`, unpacked first on the job's `PYTHONPATH`); another installed distribution must be named
  with `--with`, which adds it to what the job installs;
- the package requirement: `--package`, `$TRL_AGENTIC_PACKAGE`, or this checkout's pushed commit
  (`trl-agentic @ git+<origin>@<commit>`; trl-agentic is not on PyPI, and a bare name would fail in the job);
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


# Package data (the job script, which the repository's `jobs/train.py` links to, and copies of
# `recipes/accelerate_configs/`, kept equal by tests/test_jobs.py): what a submission ships must not depend on a git
# checkout being around.
BUNDLED_DIR = Path(resources.files("trl_agentic")) / "bundled"
DEFAULT_SCRIPT = BUNDLED_DIR / "jobs" / "train.py"
ACCELERATE_CONFIGS_DIR = BUNDLED_DIR / "accelerate_configs"

# Launch defaults; `jobs/train.py` carries the same values in its `[tool.hf-jobs]` table for `hf jobs uv run`.
DEFAULT_FLAVOR = "a10g-large"
# HF Jobs stop a job after 30 minutes unless told otherwise. Installing torch (and vLLM), downloading the model and a
# few hundred GRPO steps take longer, and a job stopped before `push_to_hub` loses everything it trained.
DEFAULT_TIMEOUT = "2h"
PACKAGE_NAME = "trl-agentic"

# How the files travel: base64 in the job's environment, decoded by `jobs/train.py` under `JOB_DIR`.
RECIPE_ENV = "TRL_AGENTIC_RECIPE_B64"
ACCELERATE_CONFIG_ENV = "TRL_AGENTIC_ACCELERATE_CONFIG_B64"
CODE_ENV = "TRL_AGENTIC_CODE_B64"  # the user's local modules the recipe names, a .tar.gz
JOB_DIR = "/tmp/trl-agentic"
JOB_RECIPE = "recipe.yaml"
JOB_ACCELERATE_CONFIG = "accelerate_config.yaml"
JOB_CODE = "code"  # under JOB_DIR, first on the job's PYTHONPATH
# Environment variables carry the files: local code past this size belongs in a package the job installs (--with).
MAX_CODE_BYTES = 512 * 1024
# Recipe values that name something to import, and the prefixes that name something else.
_IMPORT_KEYS = ("task", "agent", "reward_funcs")
_NOT_IMPORT_PATHS = ("harness:", "verifiers:")

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


def render_script(script_text: str, package: str, extra: list[str] | tuple[str, ...] = ()) -> str:
    """The uv script with its `trl-agentic` dependency replaced by `package` (a PEP 508 requirement, with extras), and
    the requirements in `extra` added (what the recipe's own imports need, `--with`).

    The header is what `uv run` installs before anything runs, so this is where a git URL or extras must go.
    """
    from packaging.requirements import Requirement

    block = _dependencies_block(script_text)
    dependencies = [
        package if Requirement(dep).name == PACKAGE_NAME else dep for dep in script_dependencies(script_text)
    ]
    dependencies += [dep for dep in extra if dep not in dependencies]
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


def default_package() -> str:
    """The requirement a job installs when `--package` is not given: `$TRL_AGENTIC_PACKAGE`, else this checkout's
    commit on its `origin` remote (`trl-agentic @ git+<url>@<commit>`). `trl-agentic` is not on PyPI: a bare name
    would fail in the job, after its machine started.
    """
    if os.environ.get("TRL_AGENTIC_PACKAGE"):
        return os.environ["TRL_AGENTIC_PACKAGE"]
    import subprocess

    source = Path(__file__).resolve().parents[1]
    fix = (
        "Pass --package with a requirement the job can install, e.g. 'trl-agentic @ "
        "git+https://github.com/<org>/trl-agentic@<commit>' (or set $TRL_AGENTIC_PACKAGE)."
    )

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(source), *args], capture_output=True, text=True, timeout=30)
        return done.stdout.strip() if done.returncode == 0 else ""

    if not (source / ".git").exists() or not (url := git("remote", "get-url", "origin")):
        raise ValueError(
            f"trl-agentic is not published on PyPI, and {source} is not a git checkout with an `origin` "
            f"remote to install it from. {fix}"
        )
    commit = git("rev-parse", "HEAD")
    if not git("branch", "-r", "--contains", commit):
        raise ValueError(
            f"Commit {commit[:12]} of {source} is on no branch of its remotes: the job could not fetch "
            f"it. Push it first, or: {fix}"
        )
    if url.startswith("git@"):  # git@github.com:org/repo.git -> https://github.com/org/repo.git
        url = "https://" + url[len("git@") :].replace(":", "/", 1)
    return f"{PACKAGE_NAME} @ git+{url}@{commit}"


def _import_names(effective: dict[str, Any]) -> list[tuple[str, str]]:
    """(recipe key, import path) of every value the job will import that is not bundled with the package."""
    from trl_agentic.recipes import REWARD_FUNCS
    from trl_agentic.tasks import BUNDLED_TASKS

    names = []
    for key in _IMPORT_KEYS:
        values = effective.get(key)
        for value in values if isinstance(values, list) else [values]:
            if not isinstance(value, str) or value.startswith(_NOT_IMPORT_PATHS):
                continue
            if value in BUNDLED_TASKS or value in REWARD_FUNCS:
                continue
            names.append((key, value))
    return names


def local_code(
    effective: dict[str, Any], with_requirements: list[str] | tuple[str, ...] = ()
) -> tuple[dict[str, Path], dict[str, str]]:
    """What the job must carry for the recipe's imports to work there, checked here first.

    Each import path the recipe names (`task`, `agent`, `reward_funcs`) is imported now: one that fails here would
    fail in the job. A Python file (`path/file.py:NAME`) travels with the `.py` files beside it (it may import them),
    and the recipe value is pointed at the shipped copy; a module in the working directory (`my_tasks:SUITE`, or a
    package folder) travels as it is; a module of the package itself is installed with it; a module of another
    installed distribution must be installed in the job too (`--with <requirement>`).

    Returns `({archive name: local file}, {recipe key: value pointing at the shipped copy})`.
    """
    import importlib.metadata
    import importlib.util

    from packaging.requirements import Requirement

    from trl_agentic.imports import import_object

    files: dict[str, Path] = {}
    overrides: dict[str, Any] = {}
    cwd = Path.cwd().resolve()
    package_root = Path(__file__).resolve().parent
    installed_with = {Requirement(req).name.lower().replace("_", "-") for req in with_requirements}

    def ship(name: str, path: Path) -> None:
        if files.get(name, path) != path:
            raise ValueError(
                f"Two different local files would be shipped as {name!r} ({files[name]} and {path}): rename one."
            )
        files[name] = path

    for key, value in _import_names(effective):
        module_name, sep, attr = value.partition(":")
        if not sep:
            module_name, _, attr = value.rpartition(".")
        import_object(value)  # a ValueError that says what failed, before anything is submitted
        if module_name.endswith(".py"):
            file = Path(module_name).resolve()
            for sibling in sorted(file.parent.glob("*.py")):
                ship(sibling.name, sibling)
            shipped = f"{JOB_DIR}/{JOB_CODE}/{file.name}:{attr}"
            if key == "reward_funcs":
                overrides.setdefault(key, list(effective[key]))
                overrides[key] = [shipped if v == value else v for v in overrides[key]]
            else:
                overrides[key] = shipped
            continue
        top = module_name.split(".")[0]
        spec = importlib.util.find_spec(top)
        origin = Path(spec.submodule_search_locations[0] if spec.submodule_search_locations else spec.origin)
        origin = origin.resolve()
        if origin == package_root or package_root in origin.parents:
            continue  # installed with the package
        if cwd in origin.parents:
            paths = sorted(origin.rglob("*.py")) if origin.is_dir() else [origin]
            for path in paths:
                ship(path.relative_to(origin.parent).as_posix(), path)
            continue
        distributions = importlib.metadata.packages_distributions().get(top, [])
        if not {d.lower().replace("_", "-") for d in distributions} & installed_with:
            raise ValueError(
                f"{key} {value!r} imports {top!r}, installed here from {', '.join(distributions) or origin} but not "
                f"in the job: add `--with <requirement>` (e.g. --with {distributions[0] if distributions else top}), "
                "or put the module in the working directory so that it travels with the job."
            )
    return files, overrides


def pack_code(files: dict[str, Path]) -> str:
    """The files as a base64 `.tar.gz` (archive name -> file), for the job's environment."""
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, path in sorted(files.items()):
            archive.add(path, arcname=name, recursive=False)
    data = buffer.getvalue()
    if len(data) > MAX_CODE_BYTES:
        raise ValueError(
            f"The local modules the recipe imports are {len(data) // 1024} KiB compressed, more than a "
            f"job's environment carries ({MAX_CODE_BYTES // 1024} KiB): make them a package the job "
            "installs (--with <requirement>)."
        )
    return base64.b64encode(data).decode("ascii")


def unpack_code(encoded: str, folder: str | Path) -> Path:
    """Extract what `pack_code` packed into `folder` (inside the job)."""
    import io
    import tarfile

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(encoded)), mode="r:gz") as archive:
        archive.extractall(folder, filter="data")
    return folder


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
    package: str | None = None,
    network_group: str | None = None,
    script: str | Path = DEFAULT_SCRIPT,
    train_args: list[str] | tuple[str, ...] = (),
    with_requirements: list[str] | tuple[str, ...] = (),
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
    # What the recipe imports: checked here, local modules shipped, values pointed at the shipped copies.
    files, code_overrides = local_code(effective, with_requirements)
    if files:
        env[CODE_ENV] = pack_code(files)
    for key, value in code_overrides.items():
        train_args += [f"--{key}", *(value if isinstance(value, list) else [value])]
    script_args = ["--num_processes", str(num_processes), "--push_to_hub", "true", "--hub_model_id", hub_model_id]
    script_args += train_args

    script = Path(script)
    package = package_requirement(package or default_package(), extras)
    rendered = render_script(script.read_text(encoding="utf-8"), package, with_requirements)
    secret_names = list(dict.fromkeys(["HF_TOKEN", *secrets]))  # pushing needs the token
    return {
        "script": _display_path(script),
        "dependencies": script_dependencies(rendered),
        "code": sorted(files),
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
    extra = [dep for dep in submission["dependencies"] if Requirement(dep).name != PACKAGE_NAME]
    with tempfile.TemporaryDirectory(prefix="trl-agentic-job-") as tmp:
        # The rendered copy is what uv installs from; run_uv_job uploads it with the job.
        rendered = Path(tmp) / "train.py"
        rendered.write_text(render_script(Path(script).read_text(encoding="utf-8"), package, extra), encoding="utf-8")
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
        help="Requirement the job installs, e.g. 'trl-agentic @ git+https://github.com/<org>/trl-agentic@main' "
        "(default: $TRL_AGENTIC_PACKAGE, else this checkout's commit on its origin remote).",
    )
    sub.add_argument(
        "--with",
        dest="with_requirements",
        action="append",
        default=[],
        metavar="REQUIREMENT",
        help="A requirement the job installs too (repeatable): what the recipe's own task, agent or rewards import.",
    )
    sub.add_argument("--network-group", help="Join a network group (e.g. with a `trl vllm-serve` job).")
    sub.add_argument(
        "--script",
        default=str(DEFAULT_SCRIPT),
        help="The uv script to run (default: the bundled copy of jobs/train.py).",
    )
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
            with_requirements=args.with_requirements,
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
