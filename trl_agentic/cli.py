"""`trl-agentic` command line: each subcommand lives in its own module and parses its own arguments."""

from __future__ import annotations

import importlib
import sys


# subcommand -> (module, one-line help). The module exposes `main(argv: list[str]) -> int | None`.
COMMANDS = {
    "serve": ("trl_agentic.endpoint.serve", "Serve a model behind the OpenAI-compatible, token-recording endpoint."),
    "train": ("trl_agentic.scripts.train", "Train an agent with GRPO from a recipe YAML (TrlParser semantics)."),
    "eval": ("trl_agentic.scripts.eval", "Evaluate a recipe's agent against a model on an eval split."),
    "demo": ("trl_agentic.scripts.demo", "Warm-start a tiny model, GRPO on CPU, compare (the calculator or --task)."),
    "jobs": ("trl_agentic.jobs", "Submit a recipe to Hugging Face Jobs (`jobs submit ... [--dry-run]`)."),
    "inspect": ("trl_agentic.scripts.inspect_episodes", "Write a run's episodes as a static viewer folder."),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = ["usage: trl-agentic <command> [options]", "", "commands:"]
        lines += [f"  {name:<7} {help_}" for name, (_, help_) in COMMANDS.items()]
        print("\n".join(lines))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\ntrl-agentic: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    name = COMMANDS[argv[0]][0]
    if argv[0] == "serve" and "--train" in argv[1:]:  # serve and learn from the traffic (online RL)
        name = "trl_agentic.scripts.serve_train"
    module = importlib.import_module(name)
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
