"""Train Claude Code (npm install -g @anthropic-ai/claude-code): Anthropic Messages, claude -p.

```bash
python examples/harnesses/claude_code.py --model Qwen/Qwen3-4B-Instruct-2507 --use-vllm   # one GPU
```

Settings the preset writes for each episode: docs/harnesses.md. Pass `Harness("claude-code", binary=...)` when the
program is not on PATH (or set $TRL_AGENTIC_CLAUDE_CODE_BIN).
"""

from answer_file import train

from trl_agentic.rollout.harnesses import Harness


if __name__ == "__main__":
    train(Harness("claude-code"))
