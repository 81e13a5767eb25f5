"""`trl-agentic jobs submit --dry-run`: what would go to Hugging Face Jobs, and that `jobs/train.py` runs it.

Nothing here talks to the Hub: submitting needs a network and an account.
"""

import base64
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from trl_agentic import jobs


REPO_ROOT = Path(__file__).resolve().parents[1]
JOB_SCRIPTS = sorted((REPO_ROOT / "jobs").glob("*.py"))
LORA_RECIPE = "recipes/calculator/Qwen2.5-1.5B-Instruct/config_lora.yaml"
FULL_RECIPE = "recipes/calculator/Qwen2.5-1.5B-Instruct/config_full.yaml"
VLLM_RECIPE = "recipes/files/Qwen3-4B/config_vllm.yaml"
# Keys `hf jobs uv run` accepts in a script's [tool.hf-jobs] table (huggingface_hub's UvScriptHeader).
HF_JOBS_KEYS = {
    "image",
    "flavor",
    "python",
    "timeout",
    "name",
    "namespace",
    "network_group",
    "env",
    "secrets",
    "labels",
    "volumes",
    "network_aliases",
}


# What the job installs, as a user sets it (`--package` or $TRL_AGENTIC_PACKAGE): trl-agentic is not on PyPI.
GIT = "git+https://github.com/o/trl-agentic@0123abc"
PACKAGE = f"trl-agentic @ {GIT}"


@pytest.fixture(autouse=True)
def in_repo_root(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # recipe paths as a user types them
    monkeypatch.setenv("TRL_AGENTIC_PACKAGE", PACKAGE)


def dry_run(capsys, *argv) -> dict:
    assert jobs.main(["submit", "--dry-run", *argv]) == 0  # before any `--`: what follows it are training flags
    return json.loads(capsys.readouterr().out)


def pep723_header(path: Path) -> dict:
    match = re.search(r"(?m)^# /// script$\s(?P<content>(^#(| .*)$\s)+)^# ///$", path.read_text())
    assert match, f"{path} has no PEP 723 `# /// script` block"
    content = "".join(line[2:] if line.startswith("# ") else line[1:] for line in match["content"].splitlines(True))
    return tomllib.loads(content)


@pytest.mark.parametrize(
    "flavor, count",
    [
        ("a10g-large", 1),
        ("a100-large", 1),
        ("h200", 1),
        ("cpu-basic", 1),
        ("l40sx1", 1),
        ("a10g-largex2", 2),
        ("a100x4", 4),
        ("l40sx4", 4),
        ("h200x8", 8),
    ],
)
def test_gpu_count(flavor, count):
    assert jobs.gpu_count(flavor) == count


def test_dry_run_single_gpu(capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_do_not_print_me")
    submission = dry_run(
        capsys, "--config", LORA_RECIPE, "--flavor", "a10g-large", "--hub-model-id", "my-org/calc-lora"
    )
    assert "hf_do_not_print_me" not in json.dumps(submission)
    assert submission["script"] == "trl_agentic/bundled/jobs/train.py"  # package data, not the checkout's copy
    assert submission["dependencies"] == [PACKAGE]
    assert submission["flavor"] == "a10g-large"
    assert submission["timeout"] == "2h"  # never HF's default of 30 minutes
    assert submission["secrets"] == ["HF_TOKEN"]  # names only
    assert submission["command"] == [
        "python",
        "-m",
        "trl_agentic.scripts.train",
        "--config",
        "/tmp/trl-agentic/recipe.yaml",
        "--push_to_hub",
        "true",
        "--hub_model_id",
        "my-org/calc-lora",
    ]
    assert submission["script_args"] == [
        "--num_processes",
        "1",
        "--push_to_hub",
        "true",
        "--hub_model_id",
        "my-org/calc-lora",
    ]
    shipped = base64.b64decode(submission["env"][jobs.RECIPE_ENV])
    assert shipped == (REPO_ROOT / LORA_RECIPE).read_bytes()
    assert jobs.ACCELERATE_CONFIG_ENV not in submission["env"]


def test_dry_run_multi_gpu_full_uses_zero3(capsys):
    submission = dry_run(
        capsys, "--config", FULL_RECIPE, "--flavor", "a100x4", "--timeout", "4h", "--hub-model-id", "o/m"
    )
    assert submission["timeout"] == "4h"
    assert submission["command"][:7] == [
        "accelerate",
        "launch",
        "--config_file",
        "/tmp/trl-agentic/accelerate_config.yaml",
        "--num_processes",
        "4",
        "-m",
    ]
    assert submission["script_args"][:2] == ["--num_processes", "4"]
    shipped = base64.b64decode(submission["env"][jobs.ACCELERATE_CONFIG_ENV])
    assert shipped == (REPO_ROOT / "recipes/accelerate_configs/zero3.yaml").read_bytes()
    assert submission["dependencies"] == [f"trl-agentic[deepspeed] @ {GIT}"]


def test_dry_run_multi_gpu_lora_uses_ddp(capsys):
    submission = dry_run(capsys, "--config", LORA_RECIPE, "--flavor", "h200x8", "--hub-model-id", "o/m")
    assert submission["command"][4:6] == ["--num_processes", "8"]
    shipped = base64.b64decode(submission["env"][jobs.ACCELERATE_CONFIG_ENV])
    assert shipped == (REPO_ROOT / "recipes/accelerate_configs/ddp.yaml").read_bytes()
    assert submission["dependencies"] == [PACKAGE]  # DDP needs no DeepSpeed


def test_dry_run_accelerate_config_override(capsys):
    submission = dry_run(
        capsys, "--config", LORA_RECIPE, "--flavor", "l40sx4", "--accelerate-config", "zero2", "--hub-model-id", "o/m"
    )
    shipped = base64.b64decode(submission["env"][jobs.ACCELERATE_CONFIG_ENV])
    assert shipped == (REPO_ROOT / "recipes/accelerate_configs/zero2.yaml").read_bytes()
    assert submission["dependencies"] == [f"trl-agentic[deepspeed] @ {GIT}"]


def test_dry_run_vllm_recipe_and_package(capsys):
    submission = dry_run(
        capsys,
        "--config",
        VLLM_RECIPE,
        "--flavor",
        "h200",
        "--namespace",
        "my-org",
        "--package",
        "trl-agentic @ git+https://github.com/my-org/trl-agentic@main",
        "--secret",
        "WANDB_API_KEY",
        "--network-group",
        "grpo-run",
        "--",
        "--learning_rate",
        "2e-6",
    )
    assert submission["dependencies"] == ["trl-agentic[vllm] @ git+https://github.com/my-org/trl-agentic@main"]
    assert submission["secrets"] == ["HF_TOKEN", "WANDB_API_KEY"]
    assert submission["namespace"] == "my-org" and submission["network_group"] == "grpo-run"
    # No --hub-model-id: the recipe's output_dir name, in the namespace.
    assert submission["command"][-4:] == ["--hub_model_id", "my-org/files-Qwen3-4B-vllm", "--learning_rate", "2e-6"]


def test_no_hub_repo_is_an_error(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: tiny:qwen2_5\ntask: calculator\n")
    assert jobs.main(["submit", "--config", str(recipe), "--dry-run"]) == 2
    assert "--hub-model-id" in capsys.readouterr().err


@pytest.mark.parametrize(
    "train_args, message",
    [
        (["--", "--lerning_rate", "1e-5"], "did you mean 'learning_rate'"),
        (["--", "--hub_model_id", "x"], "--hub-model-id"),
        (["--timeout", "two hours"], "--timeout"),
        (["--flavor", "a10g-large", "--accelerate-config", "zero3"], "multi-GPU"),
    ],
)
def test_bad_arguments_fail_before_submitting(capsys, train_args, message):
    assert jobs.main(["submit", "--config", LORA_RECIPE, "--hub-model-id", "o/m", "--dry-run", *train_args]) == 2
    assert message in capsys.readouterr().err


def load_job_script():
    spec = importlib.util.spec_from_file_location("job_train", REPO_ROOT / "jobs" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_job_script_runs_the_submitted_command(tmp_path):
    # Run jobs/train.py as the job would (its own process, the submission's env and args) in its --dry_run mode: it
    # must decode the shipped files and build exactly the command the submission announced.
    submission = jobs.build_submission(config=FULL_RECIPE, flavor="a100x4", hub_model_id="o/m")
    result = subprocess.run(
        [sys.executable, "jobs/train.py", *submission["script_args"], "--dry_run"],
        env={**submission["env"], "TRL_AGENTIC_JOB_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    command = json.loads(result.stdout.splitlines()[-1])["command"]
    assert command == [arg.replace(jobs.JOB_DIR, str(tmp_path)) for arg in submission["command"]]
    assert (tmp_path / jobs.JOB_RECIPE).read_bytes() == (REPO_ROOT / FULL_RECIPE).read_bytes()
    assert (tmp_path / jobs.JOB_ACCELERATE_CONFIG).read_bytes() == (
        REPO_ROOT / "recipes/accelerate_configs/zero3.yaml"
    ).read_bytes()


def test_job_script_single_gpu(tmp_path, monkeypatch, capsys):
    submission = jobs.build_submission(config=LORA_RECIPE, flavor="a10g-large", hub_model_id="o/m")
    for name, value in {**submission["env"], "TRL_AGENTIC_JOB_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    assert load_job_script().main([*submission["script_args"], "--dry_run"]) == 0
    command = json.loads(capsys.readouterr().out)["command"]
    assert command == [arg.replace(jobs.JOB_DIR, str(tmp_path)) for arg in submission["command"]]
    assert not (tmp_path / jobs.JOB_ACCELERATE_CONFIG).exists()


def test_job_script_forces_push_and_expands_vars(monkeypatch, capsys):
    monkeypatch.setenv("HF_NETWORK_GROUP_PREFIX", "grp-")
    argv = [
        "--config",
        FULL_RECIPE,
        "--num_processes",
        "1",
        "--dry_run",
        "--vllm_server_host",
        "${HF_NETWORK_GROUP_PREFIX}vllm",
    ]
    assert load_job_script().main(argv) == 0
    command = json.loads(capsys.readouterr().out)["command"]
    assert command[-4:] == ["--vllm_server_host", "grp-vllm", "--push_to_hub", "true"]


def test_job_script_needs_a_recipe(monkeypatch):
    monkeypatch.delenv(jobs.RECIPE_ENV, raising=False)
    with pytest.raises(SystemExit):
        load_job_script().main(["--num_processes", "1", "--dry_run"])


@pytest.mark.parametrize("script", [*JOB_SCRIPTS, REPO_ROOT / "trl_agentic/scripts/train.py"], ids=lambda p: p.name)
def test_pep723_header(script):
    header = pep723_header(script)
    assert "trl-agentic" in header["dependencies"]
    assert header["requires-python"].startswith(">=")


def test_job_script_launch_defaults_match_cli():
    # `hf jobs uv run jobs/train.py` reads [tool.hf-jobs]; `trl-agentic jobs submit` has the same defaults.
    table = pep723_header(REPO_ROOT / "jobs/train.py")["tool"]["hf-jobs"]
    assert set(table) <= HF_JOBS_KEYS
    assert table["flavor"] == jobs.DEFAULT_FLAVOR
    assert table["timeout"] == jobs.DEFAULT_TIMEOUT
    assert table["secrets"] == ["HF_TOKEN"]


def test_rendered_script_header(tmp_path):
    text = (REPO_ROOT / "jobs/train.py").read_text()
    rendered = tmp_path / "train.py"
    rendered.write_text(jobs.render_script(text, "trl-agentic[vllm] @ git+https://github.com/o/trl-agentic"))
    header = pep723_header(rendered)
    assert header["dependencies"] == ["trl-agentic[vllm] @ git+https://github.com/o/trl-agentic"]
    assert header["tool"]["hf-jobs"]["timeout"] == jobs.DEFAULT_TIMEOUT  # the rest of the header is untouched
    assert rendered.read_text().split("\n# ///\n")[1] == text.split("\n# ///\n")[1]  # and so is the code


def test_readme_dry_run_example(capsys):
    # jobs/README.md shows a command and its dry-run output: they must stay what the code prints.
    readme = (REPO_ROOT / "jobs/README.md").read_text()
    match = re.search(r"```bash\n(trl-agentic jobs submit .*?--dry-run)\n```\n.*?```json\n(.*?)```", readme, re.S)
    assert match, "jobs/README.md lost its dry-run example"
    argv = shlex.split(match[1].replace("\\\n", " "))[2:]
    assert jobs.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    for name in (jobs.RECIPE_ENV, jobs.ACCELERATE_CONFIG_ENV):
        if name in printed["env"]:
            printed["env"][name] = "..."  # elided in the README
    assert json.loads(match[2]) == printed


def test_submit_calls_run_uv_job(monkeypatch, capsys):
    # The network call itself is replaced; what it receives is checked.
    import huggingface_hub

    calls = []

    def fake_run_uv_job(script, **kwargs):
        calls.append({"script_text": Path(script).read_text(), **kwargs})
        return type("Job", (), {"id": "job-123", "url": "https://huggingface.co/jobs/o/job-123"})()

    monkeypatch.setattr(huggingface_hub, "run_uv_job", fake_run_uv_job)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    argv = [
        "submit",
        "--config",
        VLLM_RECIPE,
        "--flavor",
        "h200",
        "--hub-model-id",
        "o/m",
        "--detach",
        "--package",
        "trl-agentic @ git+https://github.com/o/trl-agentic",
    ]
    assert jobs.main(argv) == 0
    assert "job-123" in capsys.readouterr().out
    (call,) = calls
    package = "trl-agentic @ git+https://github.com/o/trl-agentic"
    submission = jobs.build_submission(config=VLLM_RECIPE, flavor="h200", hub_model_id="o/m", package=package)
    assert call["secrets"] == {"HF_TOKEN": "hf_secret_value"}
    assert call["timeout"] == "2h" and call["flavor"] == "h200"
    assert call["script_args"] == submission["script_args"] and call["env"] == submission["env"]
    shipped_header = call["script_text"].split("\n# ///\n")[0]
    assert '#     "trl-agentic[vllm] @ git+https://github.com/o/trl-agentic",' in shipped_header


def test_submit_without_token_fails(monkeypatch, capsys):
    import huggingface_hub

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    monkeypatch.setattr(huggingface_hub, "run_uv_job", lambda *args, **kwargs: pytest.fail("submitted without a token"))
    assert jobs.main(["submit", "--config", LORA_RECIPE, "--hub-model-id", "o/m", "--detach"]) == 2
    assert "HF_TOKEN" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# Package data: submitting works from an installed wheel, outside any checkout


def test_bundled_files_equal_the_repository_files():
    bundled = Path(jobs.BUNDLED_DIR)
    # One job script: jobs/train.py is a link to the copy the wheel carries
    assert (REPO_ROOT / "jobs" / "train.py").resolve() == (bundled / "jobs" / "train.py").resolve()
    repo_configs = sorted(p.name for p in (REPO_ROOT / "recipes" / "accelerate_configs").glob("*.yaml"))
    assert sorted(p.name for p in (bundled / "accelerate_configs").glob("*.yaml")) == repo_configs
    for name in repo_configs:
        assert (bundled / "accelerate_configs" / name).read_bytes() == (
            REPO_ROOT / "recipes" / "accelerate_configs" / name
        ).read_bytes(), f"trl_agentic/bundled/accelerate_configs/{name} differs from recipes/accelerate_configs/{name}"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_submit_dry_run_from_an_installed_wheel(tmp_path):
    # Build the wheel from a copy of the sources (the checkout stays untouched), install it on its own, and submit
    # from a directory outside the repository; the dependencies come from the current environment.
    source = tmp_path / "source"
    shutil.copytree(REPO_ROOT / "trl_agentic", source / "trl_agentic", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = (tmp_path / "dist").glob("trl_agentic-*.whl")
    site = tmp_path / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, capture_output=True, timeout=120
    )

    work = tmp_path / "work"  # a user's directory: a recipe, no checkout
    work.mkdir()
    shutil.copy(REPO_ROOT / FULL_RECIPE, work / "recipe.yaml")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trl_agentic.cli",
            "jobs",
            "submit",
            "--config",
            "recipe.yaml",
            "--flavor",
            "a100x4",
            "--hub-model-id",
            "o/m",
            "--dry-run",
        ],
        cwd=work,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    submission = json.loads(result.stdout)
    script = Path(submission["script"])
    assert script == site / "trl_agentic" / "bundled" / "jobs" / "train.py"  # from the installed wheel
    assert script.read_bytes() == (REPO_ROOT / "jobs" / "train.py").read_bytes()
    assert submission["dependencies"] == [f"trl-agentic[deepspeed] @ {GIT}"]  # zero3: the default for full FT
    assert (
        base64.b64decode(submission["env"][jobs.ACCELERATE_CONFIG_ENV])
        == (REPO_ROOT / "recipes" / "accelerate_configs" / "zero3.yaml").read_bytes()
    )
    job_config = f"{jobs.JOB_DIR}/{jobs.JOB_ACCELERATE_CONFIG}"
    assert submission["command"][:4] == ["accelerate", "launch", "--config_file", job_config]


# Custom code (issue 33): what the recipe imports is checked before submitting, and local modules travel with the job

TASK_MODULE = """\
from helpers import QUESTION
from trl_agentic.tasks.calculator import make_calculator_suite

TASK = make_calculator_suite(digits=1)
"""


def user_dir(tmp_path, monkeypatch, recipe_text):
    """A user's working directory: a recipe naming their own task module, which imports a sibling module."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_task.py").write_text(TASK_MODULE)
    (work / "helpers.py").write_text("QUESTION = 'What is 2 + 2?'\n")
    (work / "recipe.yaml").write_text(f"model_name_or_path: tiny:qwen2_5\noutput_dir: out/mine\n{recipe_text}")
    monkeypatch.chdir(work)
    return work


@pytest.mark.slow
def test_a_local_task_file_travels_with_its_siblings_and_the_job_imports_it(tmp_path, monkeypatch, capsys):
    user_dir(tmp_path, monkeypatch, "task: my_task.py:TASK\n")
    submission = dry_run(capsys, "--config", "recipe.yaml", "--hub-model-id", "o/m")
    assert submission["code"] == ["helpers.py", "my_task.py"]
    shipped = f"{jobs.JOB_DIR}/{jobs.JOB_CODE}/my_task.py:TASK"
    assert submission["command"][-2:] == ["--task", shipped] and submission["script_args"][-2:] == ["--task", shipped]
    # In the job: jobs/train.py unpacks the code first on the training's path, and the task imports from there
    job_dir = tmp_path / "job"
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "jobs" / "train.py"), *submission["script_args"], "--dry_run"],
        env={**os.environ, **submission["env"], "TRL_AGENTIC_JOB_DIR": str(job_dir)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    assert printed["pythonpath"].split(os.pathsep)[0] == str(job_dir / jobs.JOB_CODE)
    imported = subprocess.run(
        [
            sys.executable,
            "-c",
            "from trl_agentic.imports import import_object; "
            f"print(import_object({str(job_dir / 'code' / 'my_task.py') + ':TASK'!r}).name)",
        ],
        env={**os.environ, "PYTHONPATH": printed["pythonpath"]},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert imported.stdout.strip() == "calculator", imported.stderr[-2000:]


def test_a_module_of_the_working_directory_travels_as_it_is(tmp_path, monkeypatch, capsys):
    user_dir(tmp_path, monkeypatch, "task: my_task:TASK\n")
    submission = dry_run(capsys, "--config", "recipe.yaml", "--hub-model-id", "o/m")
    assert submission["code"] == ["my_task.py"]  # its import of `helpers` resolves in the working directory...
    assert "--task" not in submission["command"]  # ...and the module keeps its name


@pytest.mark.parametrize(
    "recipe_text, message",
    [
        ("task: no_such_module:TASK\n", "Cannot load 'no_such_module:TASK'"),
        ("task: my_task.py:NOPE\n", "Cannot load 'my_task.py:NOPE'"),
        ("task: calculator\nreward_funcs: [yaml:safe_load]\n", "--with PyYAML"),
    ],
)
def test_what_would_fail_in_the_job_fails_the_submission(tmp_path, monkeypatch, capsys, recipe_text, message):
    user_dir(tmp_path, monkeypatch, recipe_text)
    assert jobs.main(["submit", "--config", "recipe.yaml", "--hub-model-id", "o/m", "--dry-run"]) == 2
    assert message in capsys.readouterr().err


def test_with_adds_what_the_recipe_imports_to_the_job(tmp_path, monkeypatch, capsys):
    user_dir(tmp_path, monkeypatch, "task: calculator\nreward_funcs: [yaml:safe_load]\n")
    submission = dry_run(capsys, "--config", "recipe.yaml", "--hub-model-id", "o/m", "--with", "PyYAML>=6")
    assert submission["dependencies"] == [PACKAGE, "PyYAML>=6"] and submission["code"] == []


def git(cwd, *args):
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True, capture_output=True
    )


def test_the_default_package_is_this_checkouts_pushed_commit(tmp_path, monkeypatch):
    monkeypatch.delenv("TRL_AGENTIC_PACKAGE")
    checkout = tmp_path / "checkout"
    (checkout / "trl_agentic").mkdir(parents=True)
    monkeypatch.setattr(jobs, "__file__", str(checkout / "trl_agentic" / "jobs.py"))
    with pytest.raises(ValueError, match="not a git checkout with an `origin` remote.*--package"):
        jobs.default_package()
    git(checkout, "init", "-q")
    git(checkout, "commit", "-q", "--allow-empty", "-m", "one")
    git(checkout, "remote", "add", "origin", "git@github.com:my-org/trl-agentic.git")
    git(checkout, "update-ref", "refs/remotes/origin/main", "HEAD")  # as after a push
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True).stdout.strip()
    assert jobs.default_package() == f"trl-agentic @ git+https://github.com/my-org/trl-agentic.git@{commit}"
    git(checkout, "commit", "-q", "--allow-empty", "-m", "two")  # not pushed
    with pytest.raises(ValueError, match="on no branch of its remotes.*Push it first"):
        jobs.default_package()
