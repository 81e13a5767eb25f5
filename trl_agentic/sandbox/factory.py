"""How a `sandbox=` setting picks a backend and makes one sandbox per episode, or reopens one for a checker."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .base import NoSandbox, Sandbox, SandboxLimits
from .bwrap import BwrapSandbox
from .docker import DockerSandbox


SANDBOXES = ("auto", "bwrap", "docker", "none")


@dataclass(frozen=True)
class SandboxOptions:
    """How each episode's sandbox is made (what `sandbox=` on an agent resolves to).

    Args:
        kind: `"auto"` (bubblewrap where it works, else an error that says what to install or opt into), `"bwrap"`,
            `"docker"` or `"none"` (unsandboxed, warns once).
        binds: host paths the command sees read-only at the same path (the agent's program, its interpreter).
        limits: the resource limits.
        image: the container image (`"docker"`).
    """

    kind: str = "auto"
    binds: tuple[str, ...] = ()
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    image: str | None = None


SANDBOX_ENV = "TRL_AGENTIC_SANDBOX"  # what `"auto"` means on this machine, when set: a machine-wide opt-in


def resolve_kind(kind: str | None) -> str:
    """The backend `kind` names, `"auto"` resolved: `$TRL_AGENTIC_SANDBOX` when set (e.g. `none` on a machine without
    bubblewrap, an explicit opt-in), else `"bwrap"` where bubblewrap runs here, else a `ValueError` that says how to
    get one or opt out."""
    kind = kind or "auto"
    if kind not in SANDBOXES:
        raise ValueError(f"sandbox={kind!r}: use one of {list(SANDBOXES)} (or a Sandbox factory).")
    if kind != "auto":
        return kind
    configured = os.environ.get(SANDBOX_ENV)
    if configured:
        if configured not in SANDBOXES or configured == "auto":
            raise ValueError(f"${SANDBOX_ENV}={configured!r}: use one of {[k for k in SANDBOXES if k != 'auto']}.")
        return configured
    reason = BwrapSandbox.unavailable()
    if reason is None:
        return "bwrap"
    raise ValueError(
        f"No local sandbox for the agent's commands: {reason}. Install bubblewrap (`apt-get install bubblewrap`, "
        "`dnf install bubblewrap`) and allow user namespaces, or choose sandbox='docker', or run them unsandboxed "
        f"with sandbox='none' or ${SANDBOX_ENV}=none (they can then read this user's files and secrets; "
        "docs/trust_model.md)."
    )


def check_sandbox(sandbox: Any) -> None:
    """Fail early, with what to do, when the backend `sandbox` names cannot run here (checked when an agent is made,
    not at its first episode: a backend missing there would make every episode unscorable)."""
    if callable(sandbox):
        return
    kind = resolve_kind(sandbox)
    if kind == "bwrap":
        reason = BwrapSandbox.unavailable()
    elif kind == "docker":
        from .docker import docker_unavailable

        reason = docker_unavailable()
    else:
        return
    if reason is not None:
        raise ValueError(
            f"sandbox={kind!r}: {reason}. Install it, choose another backend, or run unsandboxed with "
            "sandbox='none' (docs/sandboxes.md)."
        )


def create_sandbox(
    sandbox: str | Callable[..., Sandbox] | None,
    *,
    prefix: str = "trl-agentic-",
    binds: Sequence[str] = (),
    limits: SandboxLimits | None = None,
    image: str | None = None,
    inside_root: str | None = None,
) -> Sandbox:
    """A new sandbox for one episode: `sandbox` is a backend's name (`"auto"`, `"bwrap"`, `"docker"`, `"none"`) or a
    factory called with the same keyword arguments but `inside_root` (a remote backend). `inside_root`: where a
    bubblewrap sandbox's command sees the episode's directory (`BwrapSandbox`); the other backends ignore it."""
    if callable(sandbox):
        return sandbox(prefix=prefix, binds=tuple(binds), limits=limits or SandboxLimits(), image=image)
    kind = resolve_kind(sandbox)
    if kind == "none":
        return NoSandbox(prefix)
    if kind == "bwrap":
        return BwrapSandbox(prefix=prefix, binds=binds, limits=limits or SandboxLimits(), inside_root=inside_root)
    return DockerSandbox(prefix=prefix, binds=binds, limits=limits or SandboxLimits(), image=image)


def open_sandbox(spec: dict[str, Any]) -> Sandbox:
    """The sandbox an episode ran in, from its `spec()` (kept in the episode's result), for a checker to run its
    commands in after the agent finished. Every process the agent started is dead by then: the bubblewrap backend's
    PID namespace ended with the agent's command, the unsandboxed one's process group was killed."""
    kind = spec.get("kind")
    if kind == "none":
        return NoSandbox(root=Path(spec["root"]), warn=False)
    if kind == "bwrap":
        return BwrapSandbox.reopen(spec)
    raise ValueError(f"Cannot reopen a sandbox of kind {kind!r} (only 'none' and 'bwrap' ones are kept).")
