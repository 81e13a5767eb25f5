"""Versions published through the store: serving and training in two processes (or on two machines) that share only
the episode store.

The trainer (`OnlineGRPOTrainer` without a `VersionManager`) saves each step's weights to a folder both sides can
read (a shared disk) and records the version in the store (`EpisodeStore.publish_version`). The serving process
(`trl-agentic serve --store URL --published-versions`) polls the store (`PublishedVersions`): it loads a published
version into an engine of its own, off the event loop, and puts it on trial in its `VersionManager`, the same
gradual rollout as in one process; and it writes every version's state back to the store (`candidate`, `incumbent`,
`retired`, `rolled_back` with the reason, `superseded`), which the trainer reads to wait for a verdict and to go
back to the incumbent's weights after a rollback.

As in one process, one candidate is on trial at a time: a version published while another is on trial waits; when
several are waiting, the newest goes on trial and the older ones are marked `superseded` (their weights stay on disk).

Example:

```python
>>> sync = PublishedVersions(versions, store, load=lambda path, version: build_engine(load_model(path), tokenizer))
>>> sync.start(server.call)  # a thread that polls every `interval` seconds
```
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from ..store import VERSION_PUBLISHED
from .versions import VersionManager


logger = logging.getLogger(__name__)


class PublishedVersions:
    """Serving's side of versions published through the store.

    Args:
        versions: the endpoint's `VersionManager`.
        store: the `EpisodeStore` the trainer publishes to.
        load: `(path, version) -> engine` (not started): the published weights in an engine (run in a thread).
        interval: seconds between two polls (`start`).
    """

    def __init__(self, versions: VersionManager, store, load: Callable[[str, int], Any], interval: float = 1.0):
        self.versions, self.store, self.load, self.interval = versions, store, load, interval
        self._reported: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    async def poll(self) -> int | None:
        """Report the versions' states to the store, and put the newest waiting published version on trial when no
        candidate is; returns its number (`None`: none went on trial)."""
        await asyncio.to_thread(self.report)
        if self.versions.candidate is not None:
            return None
        known = {row["version"] for row in self.versions.describe()}
        waiting = [
            row
            for row in await asyncio.to_thread(self.store.published_versions, self.versions.incumbent)
            if row["state"] == VERSION_PUBLISHED and row["version"] not in known
        ]
        if not waiting:
            return None
        newest = waiting[-1]
        for row in waiting[:-1]:
            await asyncio.to_thread(
                self.store.set_version_state, row["version"], "superseded", "a newer version was published first"
            )
        engine = await asyncio.to_thread(self.load, newest["path"], newest["version"])
        await self.versions.add_candidate_async(engine, version=newest["version"], path=newest["path"])
        logger.info("version %d (published at %s) is on trial", newest["version"], newest["path"])
        await asyncio.to_thread(self.report)
        return newest["version"]

    def report(self) -> None:
        """Write each version's state that changed since the last report to the store, with the reason of its
        decision."""
        reasons = {d.version: d.reason for d in self.versions.decisions}
        for row in self.versions.describe():
            version, state = row["version"], row["state"]
            if self._reported.get(version) != state:
                self.store.set_version_state(version, state, reasons.get(version))
                self._reported[version] = state

    def start(self, run_on_server: Callable) -> PublishedVersions:
        """Poll every `interval` seconds in a thread, each poll run on the server's event loop (`EndpointServer.call`).
        A poll that fails is logged and retried at the next one."""

        def loop():
            while not self._stop.wait(self.interval):
                try:
                    run_on_server(self.poll())
                except Exception:  # noqa: BLE001 - a version that fails to load must not stop serving
                    logger.exception("Loading published versions failed; retrying")

        self._thread = threading.Thread(target=loop, name="trl-agentic-published-versions", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
