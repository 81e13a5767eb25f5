"""Train Gemini CLI (npm install -g @google/gemini-cli): the Gemini API, gemini -p --yolo.

```bash
python examples/harnesses/gemini_cli.py --model Qwen/Qwen3-4B-Instruct-2507 --use-vllm   # one GPU
```

Settings the preset writes for each episode: docs/harnesses.md. Pass `Harness("gemini-cli", binary=...)` when the
program is not on PATH (or set $TRL_AGENTIC_GEMINI_CLI_BIN).
"""

from answer_file import train

from trl_agentic.rollout.harnesses import Harness


if __name__ == "__main__":
    train(Harness("gemini-cli"))
