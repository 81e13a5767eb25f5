"""What of the host a program needs to run in a sandbox: its install folder and its interpreter's, read-only."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path


SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def install_root(path: str, resolve: bool = True) -> str | None:
    """The folder a program was installed into (`None`: a system directory, always there): the folder holding its
    `node_modules`, the prefix above its `bin/` (a virtual environment, a Python or Node installation), else its own
    folder."""
    real = os.path.realpath(path) if resolve else os.path.abspath(path)
    if any(under(real, d) for d in SYSTEM_DIRS):
        return None
    parts = Path(real).parts
    if "node_modules" in parts:
        return str(Path(*parts[: parts.index("node_modules")]))
    folder = Path(real).parent
    return str(folder.parent if folder.name == "bin" else folder)


def _interpreter(path: str) -> str | None:
    """The program a script's `#!` line runs (`/usr/bin/env node`: `node` on PATH)."""
    try:
        with open(path, "rb") as f:
            line = f.readline(512)
    except OSError:
        return None
    if not line.startswith(b"#!"):
        return None
    words = line[2:].decode(errors="replace").split()
    if not words:
        return None
    if os.path.basename(words[0]) == "env":
        words = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
        return shutil.which(words[0]) if words else None
    return words[0]


def program_binds(program: str) -> list[str]:
    """Host folders `program` (a path or a name on PATH) needs read-only to run: its install root, its `#!`
    interpreter's, and a virtual environment's base Python."""
    found = shutil.which(program) or program
    binds: list[str] = []
    seen: set[str] = set()
    queue = [found]
    while queue:
        path = queue.pop()
        if path in seen or not os.path.exists(path):
            continue
        seen.add(path)
        for root in {install_root(path, resolve=False), install_root(path)} - {None}:
            binds.append(root)
            config = Path(root) / "pyvenv.cfg"
            if config.exists():
                for line in config.read_text().splitlines():
                    key, _, value = line.partition("=")
                    if key.strip() == "home" and value.strip():
                        queue.append(str(Path(value.strip()) / "python3"))
        interpreter = _interpreter(os.path.realpath(path))
        if interpreter:
            queue.append(interpreter)
    return sorted(set(binds))


def command_binds(command: str) -> list[str]:
    """What a shell command line needs read-only: what its programs need, and the existing absolute paths it names
    (its script), plus this Python's environment (a `python` on PATH is most often it)."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    binds = set(program_binds(sys.executable))
    if words:
        binds.update(program_binds(words[0]))
    for word in words[1:]:
        if os.path.isabs(word) and os.path.exists(word) and not any(under(word, d) for d in SYSTEM_DIRS):
            binds.add(os.path.abspath(word))
            if os.access(word, os.X_OK) and os.path.isfile(word):
                binds.update(program_binds(word))
    return sorted(binds)
