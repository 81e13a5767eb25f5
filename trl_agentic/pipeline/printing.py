"""What the pipeline prints: a header per stage, indented progress lines, and no library chatter."""

from __future__ import annotations

import logging
import os
import sys
import warnings


def stage(index: int, total: int, title: str) -> None:
    line = f"[{index}/{total}] {title}"
    print(f"\n{line}\n{'=' * len(line)}", flush=True)


def info(message: str) -> None:
    print(f"  {message}", flush=True)


class LineProgress:
    """A progress bar's stand-in off a terminal: a plain line every tenth of `total` (and at the end), with the
    postfix of the last update, and `write` as `print`. tqdm's own output there is `\r` updates on one line."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n, self.postfix = total, desc.strip(), 0, ""
        self.every = max(1, total // 10)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self.every == 0 or self.n == self.total:
            info(f"{self.desc}: step {self.n}/{self.total}" + (f", {self.postfix}" if self.postfix else ""))

    def set_postfix(self, refresh: bool = False, **values) -> None:
        self.postfix = ", ".join(f"{k} {v}" for k, v in values.items())

    def write(self, line: str) -> None:
        print(line, flush=True)

    def close(self) -> None:
        pass


def progress(total: int, desc: str):
    """A tqdm bar on `desc` when stdout and stderr are terminals, else a [`LineProgress`]."""
    from tqdm.auto import tqdm

    from ..console import interactive_console

    if not interactive_console():
        return LineProgress(total, desc)
    return tqdm(total=total, desc=desc, unit="step", file=sys.stdout, mininterval=1.0, dynamic_ncols=True)


def quiet_libraries() -> None:
    """Keep the console to the pipeline's own progress: library warnings that do not concern its user are muted."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("transformers", "trl", "accelerate", "datasets", "httpx", "uvicorn"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars of the cached model
    except Exception:  # noqa: BLE001
        pass
