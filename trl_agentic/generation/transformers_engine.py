"""The embedded default engine: continuous batching over a transformers causal LM, with per-episode KV prefix reuse.

Concurrent `generate` calls are queued for one worker thread that runs the model step by step (issue #12):

- between two decode steps, waiting requests join the running batch (their prompts are prefilled together, and
  their key/value states are merged into the running cache by left-padding along the sequence), and finished rows
  leave it (`index_select` along the batch); no request waits for a batch to end, and none waits for company unless
  `batch_wait_s` asks for it;
- each row keeps its own sampling parameters, seed (a random stream of its own), stop ids, top logprobs and
  cancellation;
  each sampled token comes with `log_softmax(logits / temperature)` at that token, the distribution TRL scores the same
  token under (top-p/top-k/min-p only restrict which tokens can be drawn; a `repetition_penalty` changes the logits,
  and the logprob is then the penalized distribution's, what sampled the token);
- the key/value states of finished requests (prompt + sampled ids) are kept in a [`PrefixCache`]: an agent's next
  call, which extends its previous call token for token, prefills only its new tokens. The cache belongs to one
  set of weights: it is dropped whenever the engine takes new weights (see below).

The engine never runs the module it is given, nor changes its state (issue 29, M1: it used to put the trainer's
module in eval mode around each step, and a training forward running beside an abandoned call's decoding read the
wrong `training` flag). It generates with a module of its own, in eval mode: with `inference_copy=True` (the
trainer's engine) a copy of the weights, refreshed only by a sync, so what trains is never read mid-update; otherwise
a view sharing the model's parameters (no extra memory: an evaluator or a server, where nothing trains while it
generates). The engine takes the model's weights (syncs) before it admits requests, when it sees they changed:
`policy_version`, the model object, the parameters' version counters or storage, any optimizer step in the process
(fused optimizers bump no version counter), and, when a request reaches an idle engine, a checksum of the weights
(edits through `.data`, which bump nothing: an EMA callback). `sync_weights()` does it at once, whatever changed.

The model steps (prefill, decode, sampling, the prefix cache's stores) are `model_steps.py`'s `ModelSteps`, this
class's base: here, the requests' bookkeeping (the queue, the worker thread, which requests join), the weights and
the stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
from accelerate.utils import extract_model_from_parallel
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from .batching import Request
from .engine import GenerationOutput, SamplingParams, TokenCallback
from .model_steps import SHARED_PREFIX_MIN, ModelSteps, _Batch, _Row  # noqa: F401 - SHARED_PREFIX_MIN: importable here
from .prefix_cache import PrefixCache
from .sampling import _stream_key
from .weights import _copy_weights, _inference_module, _partitioned, _same_layout, _weights_checksum


DEFAULT_PREFIX_CACHE_BYTES = 256 * 2**20


class _OptimizerSteps:
    """Counts optimizer steps taken anywhere in this process (a global post-step hook, registered on first use).

    `torch.optim.AdamW(fused=True)`, TRL's default optimizer, updates the weights in place *without* bumping their
    version counters, so the counters alone cannot tell an engine that serves the live model (without the trainer's
    `policy_version`, e.g. a held-out evaluator) that its cached states are stale.
    """

    count = 0
    _handle = None
    _lock = threading.Lock()

    @classmethod
    def ensure_hooked(cls) -> None:
        with cls._lock:
            if cls._handle is None:
                from torch.optim.optimizer import register_optimizer_step_post_hook

                cls._handle = register_optimizer_step_post_hook(cls._step)

    @classmethod
    def _step(cls, optimizer, args, kwargs) -> None:
        cls.count += 1


# The worker thread ends after this long without work; the next request starts a new one.
_IDLE_EXIT_S = 1.0
# Requests reaching an idle engine together (an event loop starting many agents sends their first calls back to back,
# one Python call at a time, while the engine's thread competes with it for the GIL) are admitted once they stop
# arriving for this long (at most `_ARRIVALS_MAX_S`): admitted as they came, they split over several prefills and end
# at different steps (32 agents kept 0.74-0.80 of transformers' batching gain, issue 29).
_ARRIVAL_GAP_S = 0.0003
_ARRIVALS_MAX_S = 0.005


@dataclass
class EngineStats:
    """What the engine did since it was built (or since `reset()`), for metrics and benchmarks."""

    requests: int = 0  # requests prefilled
    prefix_hits: int = 0  # of which reused cached key/value states
    reused_tokens: int = 0  # prompt tokens whose key/value states came from the prefix cache
    prefilled_tokens: int = 0  # prompt tokens computed
    decode_steps: int = 0
    decoded_rows: int = 0  # rows decoded, summed over decode steps
    waiting_rows: int = 0  # requests waiting on the model (decoding or queued) at each decode step, summed
    busy_s: float = 0.0  # seconds spent prefilling, decoding and sampling

    @property
    def mean_decode_batch(self) -> float:
        """Mean number of sequences decoded per step."""
        return self.decoded_rows / self.decode_steps if self.decode_steps else 0.0

    @property
    def decode_occupancy(self) -> float:
        """Rows decoded per step / requests waiting on the model at that step (1.0: nobody waits for a batch)."""
        return self.decoded_rows / self.waiting_rows if self.waiting_rows else 1.0

    def reset(self) -> None:
        for name, value in asdict(EngineStats()).items():
            setattr(self, name, value)

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "mean_decode_batch": self.mean_decode_batch, "decode_occupancy": self.decode_occupancy}


class TransformersEngine(ModelSteps):
    """Serve a transformers causal LM to many concurrent requests, batching them continuously.

    Args:
        model: the policy. The engine generates with a module of its own built from it (it never runs this one or
            changes its state) and takes its weights again when they change (see `sync_weights`). Assign
            `engine.model` to swap it; a module wrapped for distributed training (DDP, DeepSpeed) is unwrapped.
        pad_token_id: id used to left-pad prompts in a batch.
        max_batch_size: most requests sampled together; more wait in the queue and join as rows finish.
        batch_wait_s: how long the first request to reach an idle engine waits for others before the batch starts
            (0: none; requests that arrive later join the running batch between steps anyway).
        max_context_length: prompt + completion length the model accepts (defaults to the model's
            `max_position_embeddings`).
        model_lock: a lock held while the model is used (one prefill or decode step at a time), so that weights can
            be changed between steps.
        prefix_cache_bytes: memory the key/value states of finished requests may take, for reuse by the requests that
            extend them (0 disables the reuse).
        inference_copy: generate with a copy of the weights, taken by each sync, instead of a view sharing the
            model's parameters. For a model that trains while the engine serves it (the trainer's engine): a call
            still decoding while the optimizer steps samples from consistent weights. Memory: one more copy of the
            trainable parameters and of the buffers (frozen parameters, a LoRA model's base weights, are shared);
            a sync copies them in place (no allocation). Under DeepSpeed ZeRO-3 the copy holds the full weights (all
            of them: partitioned parameters cannot be shared), taken where the trainer has gathered them.
        seed: seed of the generator that draws a seed for each request that brings none (default: from the
            system's entropy). Requests never draw from torch's global RNG.
        watch_weights: when a request reaches an idle engine, compare a checksum of the weights with the last sync's,
            to see edits through `.data` (which bump no version counter): a read of every weight. Off where the owner
            calls `sync_weights()` whenever it changes them (the trainer's engine, synced before each rollout): the
            read cost ~14 ms per 227M bf16 parameters on an H200, on nearly every call of a rollout with few agents.

    `stats` ([`EngineStats`]) counts prefix hits, reused and prefilled tokens and the decode batch occupancy;
    `batch_sizes` counts the requests admitted together, per admission.

    A PEFT model is served with its adapters applied (its copy or view is a `PeftModel` too).

    Example:

    ```python
    >>> engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id)
    >>> out = await engine.generate([1, 2, 3], SamplingParams(max_tokens=8))
    ```
    """

    def __init__(
        self,
        model: PreTrainedModel,
        pad_token_id: int,
        max_batch_size: int = 32,
        batch_wait_s: float = 0.0,
        max_context_length: int | None = None,
        model_lock: threading.Lock | None = None,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        inference_copy: bool = False,
        seed: int | None = None,
        watch_weights: bool = True,
    ):
        model = extract_model_from_parallel(model)
        layer_types = {type(layer).__name__ for layer in DynamicCache(config=model.config).layers}
        if layer_types - {DynamicLayer.__name__}:
            raise ValueError(
                f"TransformersEngine batches continuously by editing full-attention key/value caches, but "
                f"{type(model).__name__} uses {sorted(layer_types)} cache layers (sliding-window or linear attention). "
                f"Generate with vLLM instead (`use_vllm=True`)."
            )
        self._source = model  # `self.model`: the module whose weights are served
        self.inference_copy = inference_copy
        self.watch_weights = watch_weights
        self._module: torch.nn.Module | None = None  # what generates: a copy or a view of `self.model`, in eval mode
        self._module_of: torch.nn.Module | None = None  # the model `_module` was built from
        self._syncs = 0  # weights taken so far; with `_module`, identifies the weights the prefix cache holds
        self._synced_state: tuple | None = None  # `_source_state()` at the last sync
        self._synced_checksum: list[int] | None = None  # `_weights_checksum()` at the last sync
        self._weights_version = 0  # `policy_version` at the last sync: the version of the weights that generate
        self._seeds = torch.Generator()  # draws the seeds of requests that bring none
        if seed is None:
            self._seeds.seed()
        else:
            self._seeds.manual_seed(seed)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_context_length = max_context_length or model.config.max_position_embeddings
        self.model_lock = model_lock or threading.Lock()
        self.policy_version = 0
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        _OptimizerSteps.ensure_hooked()
        self.stats = EngineStats()
        # Guards `stats`: the worker counts each step under it, `take_stats` copies and resets under it.
        self._stats_lock = threading.Lock()
        self.batch_sizes: Counter[int] = Counter()  # requests admitted together (size: count)
        self._pending: deque[Request] = deque()
        self._lock = threading.Lock()  # guards _pending and _worker
        self._wakeup = threading.Condition(self._lock)
        self._worker: threading.Thread | None = None
        self._stop_worker = threading.Event()

    def take_stats(self) -> EngineStats:
        """What the engine did since the last `take_stats` (or since it was built), counting afresh from now on.

        The copy and the reset are one step under the lock the worker counts under: copied and reset apart, a step
        counted in between was lost, and a count the worker was adding up could come back after the reset (issue 40).

        Example:

        ```python
        >>> work = engine.take_stats()  # e.g. once per training step, while the engine keeps serving
        >>> work.requests, work.decode_occupancy
        ```
        """
        with self._stats_lock:
            stats = replace(self.stats)
            self.stats.reset()
        return stats

    # Weights

    @property
    def model(self) -> torch.nn.Module:
        """The model whose weights the engine serves (it generates with its own copy or view of it)."""
        return self._source

    @model.setter
    def model(self, model: torch.nn.Module) -> None:
        self._source = extract_model_from_parallel(model)  # taken before the next admission

    def sync_weights(self, policy_version: int | None = None) -> None:
        """Take the model's current weights now: the inference copy is refreshed (or the view checked) and the prefix
        cache dropped. Waits for the decode step in progress, if any; rows still decoding go on with the new weights
        (their next tokens are sampled by the new weights attending to the key/value states the old ones computed;
        each token's `GenerationOutput.versions` entry says which weights sampled it, its logprob what they gave it).

        The engine does it by itself before admitting requests when it sees the weights changed; call this where it
        cannot see it (an edit through `.data` while the engine is busy, one that keeps every tensor's checksum), or
        where the sync must happen at a known point: the trainer calls it before each rollout, where no optimizer
        step runs and, under ZeRO-3, the parameters are gathered.

        Example:

        ```python
        >>> for p, q in zip(model.parameters(), ema_model.parameters()):
        ...     p.data.copy_(q.data)
        >>> engine.sync_weights()
        ```

        `policy_version`: set `self.policy_version` with the weights, under the lock that decode steps hold: no
        token is sampled by the old weights once the new version shows.
        """
        with self.model_lock, torch.inference_mode():
            if policy_version is not None:
                self.policy_version = policy_version
            self._sync(self._source_state(), explicit=True)

    def manual_seed(self, seed: int) -> None:
        """Seed the generator that draws the seeds of the requests that bring none (the evaluator's `seed`)."""
        self._seeds.manual_seed(seed)

    def _source_state(self) -> tuple:
        """What tells cheaply that the model's weights changed: the model object, the trainer's `policy_version`, the
        process's optimizer steps (a fused optimizer step bumps no version counter), the parameters' in-place version
        counters (`load_state_dict`, an unfused optimizer step) and their storage (`p.data = ...`)."""
        versions = pointers = 0
        for p in self._source.parameters():
            versions += p._version
            pointers += p.data_ptr()
        return id(self._source), self.policy_version, _OptimizerSteps.count, versions, pointers

    def _refresh(self, idle: bool) -> None:
        """Before an admission, with the model lock held: take the weights if they changed. A request reaching an idle
        engine also compares the weights' checksum (edits through `.data` change nothing else), once per busy
        period: a read of the weights, as one decode step costs."""
        state = self._source_state()
        checksum = None
        if self._module is not None and state == self._synced_state:
            if not (idle and self.watch_weights):
                return
            checksum = _weights_checksum(self._source)
            if checksum == self._synced_checksum:
                return
        self._sync(state, checksum, explicit=False)

    def _sync(self, state: tuple, checksum: list[int] | None = None, explicit: bool = False) -> None:
        """Point `_module` at the model's current weights (rebuilding it if the model or its layout changed), and
        drop the prefix cache. `explicit`: a `sync_weights()` call, which must take the weights."""
        source = self._source
        partitioned = [name for name, p in source.named_parameters() if _partitioned(p)]
        if partitioned:
            if explicit or self._module is None:
                raise RuntimeError(
                    f"The model's parameters are partitioned (DeepSpeed ZeRO-3: {partitioned[0]!r} and "
                    f"{len(partitioned) - 1} more): the engine generates with full weights and cannot gather them "
                    f"from its own thread. Sync where they are gathered: the trainer does, inside "
                    f"`unwrap_model_for_generation`, with `ds3_gather_for_generation=True` (TRL's default)."
                )
            return  # outside the trainer's gathered rollout: the copy keeps the weights of the last sync
        if self._module_of is not source or not _same_layout(self._module, source, self.inference_copy):
            self._module, self._module_of = None, None  # free the old copy before allocating the new one
            self._module, self._module_of = _inference_module(source, self.inference_copy), source
        if self.inference_copy:
            _copy_weights(source, self._module)
        self._syncs += 1
        self._synced_state = state
        self._weights_version = self.policy_version
        if self.watch_weights:
            self._synced_checksum = checksum if checksum is not None else _weights_checksum(source)
        self.prefix_cache.clear(self._policy())

    # Serving

    async def start(self) -> None:
        pass  # the worker thread starts with the first request

    async def stop(self) -> None:
        """End the worker thread; requests still queued or running are cancelled."""
        with self._lock:
            worker, stop = self._worker, self._stop_worker
            stop.set()
            self._wakeup.notify_all()
        if worker is not None:
            await asyncio.to_thread(worker.join)

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, on_token: TokenCallback | None = None
    ) -> GenerationOutput:
        request = Request(list(prompt_ids), sampling, asyncio.get_running_loop().create_future(), on_token)
        with self._lock:
            self._pending.append(request)
            if self._worker is None:
                self._stop_worker = threading.Event()
                self._worker = threading.Thread(
                    target=self._work, args=(self._stop_worker,), name="trl-agentic-engine", daemon=True
                )
                self._worker.start()
            self._wakeup.notify()
        try:
            return await request.future
        except asyncio.CancelledError:
            request.cancelled.set()  # a running row stops sampling
            raise

    def _work(self, stop: threading.Event) -> None:
        batch = _Batch()
        try:
            while True:
                with self._lock:
                    if not batch.rows and not self._wait_for_requests(stop):
                        self._worker = None  # under the lock: the next `generate` starts a new worker
                        return
                    if stop.is_set():
                        return
                    room = self.max_batch_size - len(batch.rows)
                    joiners = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
                rows = [row for row in map(self._row_of_request, joiners) if row is not None]
                started = time.perf_counter()
                try:
                    with self._using_model():
                        if rows:
                            self.batch_sizes[len(rows)] += 1
                            batch.merge(self._admit(rows, idle=not batch.rows))
                        self._retire(batch)  # cancelled rows leave before the step
                        if batch.rows:
                            self._decode(batch, waiting=len(batch.rows) + len(self._pending))
                            self._retire(batch)
                except Exception as error:  # noqa: BLE001 - a failed step of the whole batch
                    # Not one row's fault (a bad prompt fails alone at prefill): the rows have streamed tokens and
                    # cannot be retried, so they fail with the error; the engine goes on serving.
                    for row in [*rows, *batch.rows]:
                        row.done(error)
                    batch = _Batch()
                with self._stats_lock:
                    self.stats.busy_s += time.perf_counter() - started
        finally:
            with self._lock:
                if self._worker is threading.current_thread():
                    self._worker = None
                leftovers = list(self._pending) if stop.is_set() or self._worker is None else []
                for request in leftovers:
                    self._pending.remove(request)
            for row in batch.rows:
                row.done(asyncio.CancelledError("The engine stopped."))
            for request in leftovers:
                request.cancel_threadsafe()

    def _wait_for_requests(self, stop: threading.Event) -> bool:
        """With the lock held and no row running: wait for a request (False after `_IDLE_EXIT_S` without one), then
        for company if `batch_wait_s` asks for it, then for the requests arriving with it."""
        deadline = time.monotonic() + _IDLE_EXIT_S
        while not self._pending and not stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._wakeup.wait(remaining)
        company = time.monotonic() + self.batch_wait_s
        while len(self._pending) < self.max_batch_size and not stop.is_set():
            remaining = company - time.monotonic()
            if remaining <= 0:
                break
            self._wakeup.wait(remaining)
        settled = time.monotonic() + _ARRIVALS_MAX_S
        while len(self._pending) < self.max_batch_size and not stop.is_set():
            arrived = len(self._pending)
            self._wakeup.wait(_ARRIVAL_GAP_S)  # returns early when one more arrives
            if len(self._pending) == arrived or time.monotonic() > settled:
                break
        return True

    def _row_of_request(self, request: Request) -> _Row | None:
        if request.cancelled.is_set():
            return None
        try:
            return self._new_row(
                request.prompt_ids,
                request.sampling,
                self._answer(request),
                request.cancelled,
                request.emit if request.on_token is not None else None,
            )
        except Exception as error:  # noqa: BLE001 - this request's own failure
            request.fail_threadsafe(error)
            return None

    @staticmethod
    def _answer(request: Request) -> Callable[[GenerationOutput | BaseException], None]:
        """The row's `done`: hands its outcome to the request's event loop."""

        def done(result: GenerationOutput | BaseException) -> None:
            if isinstance(result, asyncio.CancelledError):
                request.cancel_threadsafe()
            elif isinstance(result, BaseException):
                request.fail_threadsafe(result)
            else:
                request.resolve_threadsafe(result)

        return done

    def _new_row(self, prompt, sampling, done, cancelled=None, emit=None) -> _Row | None:
        """A row for this request, or None when it is answered at once (no room left in the context)."""
        max_new = min(sampling.max_tokens, self.max_context_length - len(prompt))
        if max_new <= 0:
            done(GenerationOutput([], [], "length", [] if sampling.top_logprobs else None))
            return None
        # A random stream of its own (issue 29, L4): a request's draws never depend on or move torch's global RNG, nor
        # another request's draws.
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        return _Row(
            prompt,
            sampling,
            max_new,
            _stream_key(seed),
            done,
            cancelled,
            emit,
            tops=[] if sampling.top_logprobs else None,
        )

    @property
    def _device(self) -> torch.device:
        return next(self._source.parameters()).device  # the copy or view lives where the model does

    @contextlib.contextmanager
    def _using_model(self):
        with self.model_lock, torch.inference_mode():
            yield

    # One batch, synchronously

    def generate_batch(
        self, prompts: list[list[int]], samplings: list[SamplingParams], cancelled: list[threading.Event] | None = None
    ) -> list[GenerationOutput]:
        """Sample a completion for each prompt, together, in the calling thread (the same prefill, decode and prefix
        cache as `generate`). A row whose `cancelled` event is set stops sampling (finish reason `"cancelled"`).
        Raises the first failing row's error."""
        results: list[GenerationOutput | BaseException | None] = [None] * len(prompts)
        rows = []
        for i, (prompt, sampling) in enumerate(zip(prompts, samplings, strict=True)):
            row = self._new_row(
                list(prompt),
                sampling,
                lambda result, i=i: results.__setitem__(i, result),
                cancelled[i] if cancelled is not None else None,
            )
            if row is not None:
                rows.append(row)
        with self._using_model():
            batch = self._admit(rows, idle=True) if rows else _Batch()
            while batch.rows:
                self._decode(batch, waiting=len(batch.rows))
                self._retire(batch)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results
