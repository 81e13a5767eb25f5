"""An episode's cgroups: the processes of one sandbox limited together (how many: `pids`; how much memory: `memory`),
where this process can make cgroups (a writable cgroup v1 hierarchy of the controller, or a delegated cgroup v2 one
whose `cgroup.subtree_control` enables it). Elsewhere the rlimits stay the only limits, per process (`bwrap.py`).

A memory cgroup counts every page its processes use, page cache and `/tmp` (tmpfs) included; over its limit the kernel
reclaims, then kills a process of the group (the OOM killer, within the group only). Swap is counted in it where the
kernel accounts swap (`memory.memsw.limit_in_bytes`, `memory.swap.max` = 0).
"""

from __future__ import annotations

import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .process import kill_group


ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("pids", "memory")
_TRIED: dict[str, bool] = {}  # controller -> whether a cgroup of it could be made (learnt at the first try)
# A group's name: who made it (pid) and when (unix seconds), so that one left behind by a process killed before it
# could remove it (SIGKILL, a lost machine) is removed by the next process that makes groups beside it.
_NAME = re.compile(r"trl-agentic-(\d+)-(\d+)-[0-9a-f]{8}")
STALE_SECONDS = 600  # a group is left alone for this long (its maker may be in another PID namespace)
_SWEPT: set[Path] = set()


@dataclass
class EpisodeCgroups:
    """The cgroups made for one command (one per cgroup v1 hierarchy, one in all for cgroup v2) and which
    controllers' limits they hold."""

    groups: list[Path] = field(default_factory=list)
    bound: frozenset[str] = frozenset()

    def join_command(self) -> str:
        """`sh -c` text that moves the shell into every group, then `exec`s its arguments."""
        joins = "".join(f"echo $$ > '{group / 'cgroup.procs'}' && " for group in self.groups)
        return f'{joins}exec "$@"'


def _own_paths() -> dict[str, str]:
    """This process's cgroup per controller (cgroup v1), and under `""` its cgroup v2 path."""
    paths: dict[str, str] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _files(controller: str, limit: int, v1: bool) -> list[tuple[str, str, bool]]:
    """`(file, value, required)`: the limit, then swap counted in it where the kernel accounts swap."""
    if controller == "pids":
        return [("pids.max", str(limit), True)]
    if v1:
        return [("memory.limit_in_bytes", str(limit), True), ("memory.memsw.limit_in_bytes", str(limit), False)]
    return [("memory.max", str(limit), True), ("memory.swap.max", "0", False)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    return True


def sweep_stale(base: Path) -> list[Path]:
    """Remove the groups under `base` that a process left behind: named by this module, empty, older than
    `STALE_SECONDS` and made by a process that is gone. Returns those removed."""
    now, removed = time.time(), []
    try:
        children = list(base.iterdir())
    except OSError:
        return removed
    for group in children:
        match = _NAME.fullmatch(group.name)
        if match is None or now - int(match[2]) < STALE_SECONDS or _alive(int(match[1])):
            continue
        try:
            if not (group / "cgroup.procs").read_text().split():
                group.rmdir()
                removed.append(group)
        except OSError:
            continue
    return removed


def _make(base: Path, files: list[tuple[str, str, bool]]) -> Path | None:
    if base not in _SWEPT:  # once per process and place
        _SWEPT.add(base)
        sweep_stale(base)
    group = base / f"trl-agentic-{os.getpid()}-{int(time.time())}-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError:
        return None
    for name, value, required in files:
        try:
            (group / name).write_text(value)
        except OSError:
            if required:
                try:
                    group.rmdir()
                except OSError:
                    pass
                return None
    return group


def make_cgroups(limits: dict[str, int]) -> EpisodeCgroups:
    """New cgroups holding `limits` (controller -> limit: `pids` processes, `memory` bytes) where they can be made;
    the controllers left out of `bound` are limited by rlimits alone."""
    own = _own_paths()
    made = EpisodeCgroups()
    bound: set[str] = set()
    unified: dict[str, int] = {}
    for controller, limit in limits.items():
        if _TRIED.get(controller) is False:
            continue
        base = ROOT / controller / own.get(controller, "/").lstrip("/")
        if controller in own and (base / "cgroup.procs").exists():  # a cgroup v1 hierarchy of its own
            group = _make(base, _files(controller, limit, v1=True))
            if group is not None:
                made.groups.append(group)
                bound.add(controller)
                continue
        unified[controller] = limit
    if unified and "" in own:  # cgroup v2: one group, under this process's own (delegated) cgroup
        for mount in (ROOT, ROOT / "unified"):
            base = mount / own[""].lstrip("/")
            try:
                enabled = (base / "cgroup.subtree_control").read_text().split()
            except OSError:
                continue
            usable = [controller for controller in unified if controller in enabled]
            files = [entry for controller in usable for entry in _files(controller, unified[controller], v1=False)]
            group = _make(base, files) if usable else None
            if group is not None:
                made.groups.append(group)
                bound.update(usable)
            break
    for controller in limits:
        if _TRIED.get(controller) is not False:
            _TRIED[controller] = controller in bound
    made.bound = frozenset(bound)
    return made


def release(group: Path) -> None:
    """Kill what is left in `group` (nothing should be: the sandbox's PID namespace ended) and remove it; `OSError`
    when it cannot be removed yet."""
    for pid in (group / "cgroup.procs").read_text().split():
        kill_group(int(pid))
    group.rmdir()


def cgroup_limits() -> frozenset[str]:
    """The controllers whose limits a sandbox's cgroups hold here (`{"pids", "memory"}` where both can be made)."""
    made = make_cgroups({"pids": 1 << 20, "memory": 1 << 40})
    for group in made.groups:
        release(group)
    return made.bound
