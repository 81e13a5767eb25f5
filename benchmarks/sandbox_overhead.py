"""What a sandbox costs per episode: start + teardown of an episode's sandbox around a command that does nothing,
beside that command run unsandboxed and beside a harness's own start time, side by side in one run.

```bash
python benchmarks/sandbox_overhead.py                 # 20 episodes per arm, ~15 s on 2 cores
python benchmarks/sandbox_overhead.py --episodes 50 --harness /path/to/mini   # a harness's start (`--help`) beside
```

Each episode is what `CommandAgent` and `Harness` do around the agent: `create_sandbox` (its directories; bubblewrap:
its control folder), `endpoint_url` (the forwarded endpoint), `run(["true"])` (bubblewrap: namespaces, mounts, the
endpoint's port listened on inside, a pids cgroup where one can be made), `destroy`. Arms: unsandboxed (`none`),
bubblewrap without endpoint (a checker's command), with the endpoint forwarded the default way here (`setns` where the
trainer may enter the sandbox's network namespace: root or `CAP_SYS_ADMIN`), and with the fallback forwarder
(`endpoint-init`: `init.py`'s Python started inside first, what an unprivileged user gets). The arms alternate episode by episode so
that drifting machine load hits them alike; the median is reported.

Goal (issue 44): the local sandbox's start + teardown <= 50 ms per episode over the unsandboxed run's, and small beside
a harness's own start time (`--harness`: the median of `<binary> --help` unsandboxed, e.g. mini-swe-agent ~1-2 s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import time
import warnings

from trl_agentic.sandbox import BwrapSandbox, bwrap_unavailable, create_sandbox
from trl_agentic.sandbox.netns import setns_unavailable


async def episode(arm: str) -> float:
    kind, endpoint = arm.split("+")[0], "+endpoint" in arm
    started = time.perf_counter()
    sandbox = BwrapSandbox(forwarder="init") if arm.endswith("-init") else create_sandbox(kind)
    try:
        if endpoint:  # bubblewrap: the port listened on inside (a checker's command runs without it)
            sandbox.endpoint_url("http://127.0.0.1:8000/v1")
        result = await sandbox.run(["true"], {"PATH": "/usr/bin:/bin", "HOME": str(sandbox.home)}, timeout=60)
        assert result.exit_code == 0, result
    finally:
        sandbox.destroy()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--harness", help="a harness's executable: its `--help` start time is measured beside")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="sandbox='none'")
    kinds = ["none"] + (["bwrap", "bwrap+endpoint", "bwrap+endpoint-init"] if bwrap_unavailable() is None else [])
    if len(kinds) == 1:
        print(f"bubblewrap unavailable: {bwrap_unavailable()}")
    else:
        reason = setns_unavailable()
        print(f"bwrap+endpoint forwards with: {'setns' if reason is None else f'init.py ({reason})'}")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for kind in kinds:  # warm up (the first bubblewrap probe, imports)
        asyncio.run(episode(kind))
    for _ in range(args.episodes):
        for kind in kinds:
            times[kind].append(asyncio.run(episode(kind)))
    medians = {k: statistics.median(v) * 1000 for k, v in times.items()}
    for kind in kinds:
        print(f"{kind:>19}: start + run(true) + teardown, median {medians[kind]:.1f} ms over {args.episodes} episodes")
    if "bwrap" in medians:
        for arm in ("bwrap", "bwrap+endpoint", "bwrap+endpoint-init"):
            overhead = medians[arm] - medians["none"]
            verdict = "meets" if overhead <= 50 else "misses"
            print(f"{arm}'s overhead per episode: {overhead:.1f} ms ({verdict} the goal of <= 50 ms)")
    print(f"(load average now: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores)")
    if args.harness:
        starts = []
        for _ in range(3):
            started = time.perf_counter()
            subprocess.run([args.harness, "--help"], capture_output=True, timeout=120)
            starts.append(time.perf_counter() - started)
        start = statistics.median(starts) * 1000
        print(f"{args.harness} --help (the harness's own start, unsandboxed): median {start:.0f} ms")
        if "bwrap" in medians:
            overhead = medians["bwrap+endpoint"] - medians["none"]
            print(
                f"the sandbox's overhead (endpoint forwarded) is {100 * overhead / start:.1f}% of the harness's own start"
            )


if __name__ == "__main__":
    main()
