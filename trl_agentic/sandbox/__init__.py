"""Sandboxes: where an episode's agent process runs (`Sandbox`), and what it can reach. It imports nothing of the
package above it; `rollout/` runs command agents and harnesses through it.

- [`NoSandbox`]: the trainer's machine and user (an explicit opt-in, `sandbox="none"`, that warns once);
- [`BwrapSandbox`]: Linux namespaces through bubblewrap: the workspace and the endpoint, nothing else (`"bwrap"`; the
  default wherever it works, `"auto"`);
- [`DockerSandbox`]: a container per episode through the `docker` SDK (`"docker"`).
"""

from .base import NoSandbox, Sandbox, SandboxLimits, SandboxResult, snapshot
from .bwrap import BwrapSandbox, bwrap_unavailable
from .docker import DockerSandbox, docker_unavailable
from .factory import SANDBOXES, SandboxOptions, create_sandbox, open_sandbox, resolve_kind


__all__ = [
    "SANDBOXES",
    "BwrapSandbox",
    "DockerSandbox",
    "NoSandbox",
    "Sandbox",
    "SandboxLimits",
    "SandboxOptions",
    "SandboxResult",
    "bwrap_unavailable",
    "create_sandbox",
    "docker_unavailable",
    "open_sandbox",
    "resolve_kind",
    "snapshot",
]
