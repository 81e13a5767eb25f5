"""What the pipeline prints: a header per stage, indented progress lines, and no library chatter."""

from __future__ import annotations

import logging
import os
import warnings


def stage(index: int, total: int, title: str) -> None:
    line = f"[{index}/{total}] {title}"
    print(f"\n{line}\n{'=' * len(line)}", flush=True)


def info(message: str) -> None:
    print(f"  {message}", flush=True)


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
