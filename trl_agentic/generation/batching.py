"""Requests of the in-process engines, and dynamic batching: concurrent `generate` calls become one `generate_batch`.

`Request` carries one `generate` call to a sampling thread and back (streamed chunks, result or error, marshalled to
the caller's event loop). `DynamicBatcher` serves engines that can only sample a whole batch at once (vLLM colocate);
`TransformersEngine` batches continuously instead (requests join and leave between decode steps).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from .engine import GenerationOutput, SamplingParams, TokenCallback


# What a sampling thread calls with each chunk of one row: marshalled to the row's event loop (see `Request.emit`).
RowEmitter = Callable[[list[int], list[float]], None]


@dataclass
class Request:
    """One `generate` call. The `*_threadsafe` methods and `emit` may be called from any thread; the rest run on the
    caller's loop."""

    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    on_token: TokenCallback | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)  # read by the sampling thread
    streamed: int = 0  # tokens handed to `on_token` so far (updated on the event loop)

    def emit(self, token_ids: list[int], logprobs: list[float]) -> None:
        """Thread-safe: hand a chunk to `on_token` on the request's loop. `call_soon_threadsafe` runs callbacks in
        the order they were scheduled, so chunks keep their order and all precede the future's resolution."""
        if self.on_token is not None:
            self._call_on_loop(self._deliver, token_ids, logprobs)

    def resolve_threadsafe(self, output: GenerationOutput) -> None:
        self._call_on_loop(self.resolve, output)

    def fail_threadsafe(self, error: BaseException) -> None:
        self._call_on_loop(self.fail, error)

    def cancel_threadsafe(self) -> None:
        self._call_on_loop(self.future.cancel)

    def _call_on_loop(self, callback, *args) -> None:
        try:
            self.future.get_loop().call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the caller's loop is closed: nobody waits for this request any more
            pass

    def _deliver(self, token_ids: list[int], logprobs: list[float]) -> None:
        self.streamed += len(token_ids)
        if not self.future.done():
            self.on_token(token_ids, logprobs)

    def resolve(self, output: GenerationOutput) -> None:
        """On the loop: flush what the engine did not stream, then resolve the future."""
        if self.future.done():
            return
        if self.on_token is not None and self.streamed < len(output.token_ids):
            self._deliver(output.token_ids[self.streamed :], output.logprobs[self.streamed :])
        self.future.set_result(output)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


class DynamicBatcher:
    """Queue concurrent requests; a worker takes everything waiting (up to `max_batch_size`, after waiting at most
    `batch_wait_s` for company) and runs the subclass's synchronous `generate_batch` in a worker thread.

    Subclasses set `max_batch_size`, `batch_wait_s` and implement `generate_batch(prompts, samplings, cancelled,
    emitters)`; `cancelled[i]` is set when the caller of row `i` went away (its client disconnected): the row may stop
    early, its output is discarded. `emitters[i](token_ids, logprobs)` streams row `i`'s newly sampled chunk to its
    caller (thread-safe); what a subclass does not stream is sent in one chunk before the request resolves.

    One request must never cost the others of its batch: when `generate_batch` raises, the batch is retried in halves
    until the failing request fails alone (issue #9: one bad seed failed 80 innocent requests).
    """

    max_batch_size: int
    batch_wait_s: float

    def _init_batching(self) -> None:
        self.batch_sizes: Counter[int] = Counter()  # observed batch sizes, for metrics and tests
        self._queue: asyncio.Queue[Request] | None = None
        self._worker: asyncio.Task | None = None

    def generate_batch(
        self,
        prompts: list[list[int]],
        samplings: list[SamplingParams],
        cancelled: list[threading.Event] | None = None,
        emitters: list[RowEmitter] | None = None,
    ) -> list[GenerationOutput]:
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

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, on_token: TokenCallback | None = None
    ) -> GenerationOutput:
        await self.start()
        request = Request(list(prompt_ids), sampling, asyncio.get_running_loop().create_future(), on_token)
        await self._queue.put(request)
        try:
            return await request.future
        except asyncio.CancelledError:
            request.cancelled.set()  # a running batch stops sampling this row
            raise

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
            await self._run_isolating(batch)

    async def _run_isolating(self, batch: list[Request]) -> None:
        try:
            outputs = await asyncio.to_thread(
                self.generate_batch,
                [r.prompt_ids for r in batch],
                [r.sampling for r in batch],
                [r.cancelled for r in batch],
                [r.emit for r in batch],
            )
        except Exception as error:  # noqa: BLE001 - the error belongs to the requests, not to the worker
            batch = [r for r in batch if not r.future.done()]
            for request in [r for r in batch if r.streamed]:  # a retry would stream its tokens twice
                request.fail(error)
            batch = [r for r in batch if not r.streamed]
            if len(batch) == 1:
                batch[0].fail(error)
            elif batch:  # one member may be the cause: halves until it fails alone, the others are served
                half = len(batch) // 2
                await self._run_isolating(batch[:half])
                await self._run_isolating(batch[half:])
            return
        for request, output in zip(batch, outputs, strict=True):
            request.resolve(output)
