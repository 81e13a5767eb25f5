"""Train opencode (npm install -g opencode-ai): Chat Completions, opencode run.

```bash
python examples/harnesses/opencode.py --model Qwen/Qwen3-4B-Instruct-2507 --use-vllm   # one GPU
```

Settings the preset writes for each episode: docs/harnesses.md. Pass `Harness("opencode", binary=...)` when the
program is not on PATH (or set $TRL_AGENTIC_OPENCODE_BIN).
"""

from answer_file import train

from trl_agentic.rollout.harnesses import Harness


if __name__ == "__main__":
    train(Harness("opencode"))
