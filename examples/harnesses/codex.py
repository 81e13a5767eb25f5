"""Train Codex CLI (npm install -g @openai/codex): Responses, codex exec in its workspace-write sandbox.

```bash
python examples/harnesses/codex.py --model Qwen/Qwen3-4B-Instruct-2507 --use-vllm   # one GPU
```

Settings the preset writes for each episode: docs/harnesses.md. Pass `Harness("codex", binary=...)` when the
program is not on PATH (or set $TRL_AGENTIC_CODEX_BIN).
"""

from answer_file import train

from trl_agentic.rollout.harnesses import Harness


if __name__ == "__main__":
    train(Harness("codex"))
