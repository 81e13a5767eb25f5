# /// script
# requires-python = ">=3.10"
# dependencies = [
#     "trl-agentic",
# ]
#
# [tool.hf-jobs]
# flavor = "a10g-large"
# # HF Jobs stop a job after 30 minutes unless told otherwise: installing torch, downloading the model and training
# # take longer, and the machine is ephemeral, so a job stopped before `push_to_hub` loses everything.
# timeout = "2h"
# secrets = ["HF_TOKEN"]
# ///
"""Hugging Face Jobs entry point: train a recipe and push the result to the Hub (`jobs/train.py` in the repository links
here: the package carries this one copy).

Submitted by `trl-agentic jobs submit` (see jobs/README.md), which ships the recipe base64 in
`TRL_AGENTIC_RECIPE_B64` (a multi-GPU accelerate config in `TRL_AGENTIC_ACCELERATE_CONFIG_B64`, and the local modules
the recipe imports in `TRL_AGENTIC_CODE_B64`, unpacked here first on the training's `PYTHONPATH`). It also runs on
its own, with the recipe as a local file that `hf jobs uv run` uploads:

```bash
hf jobs uv run --flavor a10g-large --timeout 2h --secrets HF_TOKEN jobs/train.py \
    --config recipes/calculator/Qwen2.5-1.5B-Instruct/config_lora.yaml --hub_model_id <you>/calculator-lora
```

Options of this script: `--config`, `--accelerate_config`, `--num_processes` (default: the visible GPUs) and
`--dry_run` (print the command, run nothing). Every other flag goes to the training script and overrides the recipe;
`$VARS` in them are expanded here, in the job (e.g. `--vllm_server_host '${HF_NETWORK_GROUP_PREFIX}vllm'`).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from trl_agentic.jobs import (
    ACCELERATE_CONFIG_ENV,
    CODE_ENV,
    JOB_ACCELERATE_CONFIG,
    JOB_CODE,
    JOB_DIR,
    JOB_RECIPE,
    RECIPE_ENV,
    decode_file,
    launch_command,
    unpack_code,
)


def shipped_file(option: str | None, env_name: str, path: Path) -> str | None:
    """The file given on the command line, else the one shipped base64 in `env_name` (decoded to `path`)."""
    if option is not None:
        return option
    if env_name in os.environ:
        return str(decode_file(os.environ[env_name], path))
    return None


def in_this_environment(command: list[str]) -> list[str]:
    # uv runs this script in an environment of its own: launch from it, not from whatever comes first on PATH.
    if command[:2] == ["accelerate", "launch"]:
        return [sys.executable, "-m", "accelerate.commands.launch", *command[2:]]
    if command[0] == "python":
        return [sys.executable, *command[1:]]
    return command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--config", help=f"Recipe YAML (default: the one shipped in ${RECIPE_ENV}).")
    parser.add_argument("--accelerate_config", help=f"Accelerate config (default: ${ACCELERATE_CONFIG_ENV}).")
    parser.add_argument("--num_processes", type=int, help="Training processes (default: the visible GPUs).")
    parser.add_argument("--dry_run", action="store_true", help="Print the command as JSON and run nothing.")
    args, train_args = parser.parse_known_args(argv)

    job_dir = Path(os.environ.get("TRL_AGENTIC_JOB_DIR", JOB_DIR))
    recipe = shipped_file(args.config, RECIPE_ENV, job_dir / JOB_RECIPE)
    if recipe is None:
        parser.error(f"no recipe: pass --config recipe.yaml, or submit with `trl-agentic jobs submit` ({RECIPE_ENV}).")
    accelerate_config = shipped_file(args.accelerate_config, ACCELERATE_CONFIG_ENV, job_dir / JOB_ACCELERATE_CONFIG)
    num_processes = args.num_processes
    if num_processes is None:
        import torch

        num_processes = max(1, torch.cuda.device_count())

    # The machine is gone when the job ends: results that are not pushed are lost.
    if "--push_to_hub" not in train_args:
        train_args += ["--push_to_hub", "true"]
    train_args = [os.path.expandvars(arg) for arg in train_args]

    command = launch_command(
        recipe_path=recipe, num_processes=num_processes, accelerate_config_path=accelerate_config, train_args=train_args
    )
    # The recipe's own modules (task, agent, rewards), shipped by the submission: first on the training's path
    env = dict(os.environ)
    if CODE_ENV in os.environ:
        code = unpack_code(os.environ[CODE_ENV], job_dir / JOB_CODE)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), env.get("PYTHONPATH")]))
    if args.dry_run:
        print(json.dumps({"command": command, "pythonpath": env.get("PYTHONPATH")}))
        return 0
    print("Running:", " ".join(command), flush=True)
    return subprocess.call(in_this_environment(command), env=env)


if __name__ == "__main__":
    sys.exit(main())
