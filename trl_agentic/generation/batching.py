"""Dynamic batching shared by the in-process engines: concurrent `generate` calls become one `generate_batch`."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

from .engine import GenerationOutput, SamplingParams


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future


class DynamicBatcher:
    """Queue concurrent requests; a worker takes everything waiting (up to `max_batch_size`, after waiting at most
    `batch_wait_s` for company) and runs the subclass's synchronous `generate_batch` in a worker thread.

    Subclasses set `max_batch_size`, `batch_wait_s` and implement `generate_batch(prompts, samplings)`.
    """

    max_batch_size: int
    batch_wait_s: float

    def _init_batching(self) -> None:
        self.batch_sizes: Counter[int] = Counter()  # observed batch sizes, for metrics and tests
        self._queue: asyncio.Queue[_Request] | None = None
        self._worker: asyncio.Task | None = None

    def generate_batch(self, prompts: list[list[int]], samplings: list[SamplingParams]) -> list[GenerationOutput]:
        raise NotImplementedError

    async def start(self) -> None:
        if self._worker is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.create_task(self._serve())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationOutput:
        await self.start()
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(list(prompt_ids), sampling, future))
        return await future

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            deadline = loop.time() + self.batch_wait_s
            while len(batch) < self.max_batch_size:
                timeout = deadline - loop.time()
                try:
                    batch.append(
                        self._queue.get_nowait() if timeout <= 0 else await asyncio.wait_for(self._queue.get(), timeout)
                    )
                except (asyncio.QueueEmpty, asyncio.TimeoutError):
                    break
            batch = [r for r in batch if not r.future.cancelled()]
            if not batch:
                continue
            self.batch_sizes[len(batch)] += 1
            try:
                outputs = await asyncio.to_thread(
                    self.generate_batch, [r.prompt_ids for r in batch], [r.sampling for r in batch]
                )
            except Exception as error:  # noqa: BLE001 - the error belongs to the requests, not to the worker
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(error)
                continue
            for request, output in zip(batch, outputs, strict=True):
                if not request.future.done():
                    request.future.set_result(output)
