"""Train mini-swe-agent (pip install mini-swe-agent): Chat Completions through litellm.

```bash
python examples/harnesses/mini_swe_agent.py --model Qwen/Qwen3-4B-Instruct-2507 --use-vllm   # one GPU
```

Settings the preset writes for each episode: docs/harnesses.md. Pass `Harness("mini-swe-agent", binary=...)` when the
program is not on PATH (or set $TRL_AGENTIC_MINI_SWE_AGENT_BIN).
"""

from answer_file import train

from trl_agentic.rollout.harnesses import Harness


if __name__ == "__main__":
    train(Harness("mini-swe-agent"))
