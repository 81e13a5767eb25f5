"""`trl-agentic inspect`: write a run's episodes as a static viewer folder (the trajectory viewer).

```bash
trl-agentic inspect outputs/demo                           # -> outputs/demo/grpo/viewer/index.html
trl-agentic inspect out/episodes/episodes-rank0.jsonl -o viewer --tokenizer Qwen/Qwen2.5-0.5B-Instruct
```

A thin command line over `trl_agentic.viewer`: `index.html` and one data file per step (`steps/`), loaded when the
step is opened. The folder opens from disk (no server, no network) and shows steps -> groups -> episodes with reward,
advantage, status and forks; an episode's messages, tool calls and results, errors, and its training rows token by
token (sampled, trained tokens apart from the masked context; id and logprob on hover). `#step=<n>` in the URL opens a
step, `#episode=<id>` an episode.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-agentic inspect",
        description="Write the episodes of a run (log_episodes=True) or of an evaluation as a viewer folder that opens "
        "from disk (index.html, one data file per step): steps, groups, episodes, messages, and the trained vs masked "
        "tokens of every row.",
    )
    parser.add_argument(
        "path",
        help="an output directory (with episodes/), the demo's folder (outputs/demo), an episodes/ folder or an "
        "episodes JSONL (.jsonl or .jsonl.gz)",
    )
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        help="folder to write index.html and steps/ into (default: <output_dir>/viewer, or <name>-viewer next to a "
        "JSONL)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer to decode token ids (Hub id, path or tiny:<family>); default: the one saved "
        "in the output directory, its newest checkpoint-* or a sibling model/",
    )
    parser.add_argument("--no-tokenizer", action="store_true", help="show token ids, do not look for a tokenizer")
    parser.add_argument(
        "--max-steps",
        type=int,
        default=50,
        help="training steps shown, evenly spaced, the first and the last among them (default 50: a viewer of all "
        "300 steps of the demo is 37 MB); 0 shows every step",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    from trl_agentic.viewer import write_viewer

    if not Path(args.path).exists():
        raise SystemExit(f"trl-agentic inspect: {args.path} does not exist.")
    try:
        page = write_viewer(
            args.path, args.output, tokenizer=args.tokenizer, decode=not args.no_tokenizer, max_steps=args.max_steps
        )
    except ValueError as error:
        raise SystemExit(f"trl-agentic inspect: {error}") from None
    steps = list((page.parent / "steps").glob("*.js"))
    total = (page.stat().st_size + sum(p.stat().st_size for p in steps)) / 1e6
    print(
        f"wrote {page.parent}/ (index.html {page.stat().st_size / 1e6:.2f} MB + {len(steps)} step files, {total:.1f} MB "
        f"in all; share the whole folder); open it in a browser: {page.resolve().as_uri()}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
