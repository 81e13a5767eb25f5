"""`trl-agentic inspect`: write a run's episodes as one self-contained HTML page (the trajectory viewer).

```bash
trl-agentic inspect outputs/demo/grpo                      # -> outputs/demo/grpo/episodes.html
trl-agentic inspect out/episodes/episodes-rank0.jsonl -o episodes.html --tokenizer Qwen/Qwen2.5-0.5B-Instruct
```

A thin command line over `trl_agentic.viewer`: the page opens from disk (no server, no network) and shows steps ->
groups -> episodes with reward, advantage, status and forks; an episode's messages, tool calls and results, errors,
and its training rows token by token (sampled, trained tokens apart from the masked context; id and logprob on
hover). `#episode=<id>` in the URL opens an episode.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-agentic inspect",
        description="Write the episodes of a run (log_episodes=True) or of an evaluation as one self-contained HTML "
        "file: steps, groups, episodes, messages, and the trained vs masked tokens of every row.",
    )
    parser.add_argument("path", help="an output directory (with episodes/), an episodes/ folder or an episodes JSONL")
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        help="HTML file to write (default: <output_dir>/episodes.html, or next to the JSONL)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer to decode token ids (Hub id, path or tiny:<family>); default: the one saved "
        "in the output directory, its newest checkpoint-* or a sibling model/",
    )
    parser.add_argument("--no-tokenizer", action="store_true", help="show token ids, do not look for a tokenizer")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    from trl_agentic.viewer import write_viewer

    if not Path(args.path).exists():
        raise SystemExit(f"trl-agentic inspect: {args.path} does not exist.")
    path = write_viewer(args.path, args.output, tokenizer=args.tokenizer, decode=not args.no_tokenizer)
    size = path.stat().st_size / 1e6
    print(f"wrote {path} ({size:.1f} MB); open it in a browser: file://{path.resolve()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
