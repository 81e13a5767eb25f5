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

Every row is laid out `[padding | tokens]` in the batch's cache, right-aligned: a row is described by its length,
the attention mask and position ids follow from it, and leading columns no row uses are trimmed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch
from accelerate.utils import extract_model_from_parallel
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from .batching import Request, RowEmitter
from .engine import GenerationOutput, SamplingParams, TokenCallback
from .prefix_cache import PrefixCache, PrefixEntry
from .sampling import _exponential_noise, _penalize, _restrict, _stream_key
from .weights import _copy_weights, _inference_module, _partitioned, _same_layout, _weights_checksum


DEFAULT_PREFIX_CACHE_BYTES = 256 * 2**20
# Joiners sharing a prefix at least this much longer than what the cache holds for them get it computed once.
SHARED_PREFIX_MIN = 32


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


@dataclass(eq=False)
class _Row:
    """One request inside the engine."""

    prompt: list[int]
    sampling: SamplingParams
    max_new: int
    key: int  # its random stream (`_exponential_noise`), from its seed
    done: Callable[[GenerationOutput | BaseException], None]  # called once, from the worker thread
    cancelled: threading.Event | None = None
    emit: RowEmitter | None = None
    policy: tuple | None = None  # the weights its key/value states are computed with
    entry: PrefixEntry | None = None  # the prefix-cache entry its prompt extends
    reused: int = 0  # prompt tokens taken from `entry`
    length: int = 0  # tokens with key/value states in its batch's cache: prompt + all sampled ids but the last
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version that sampled each token
    tops: list | None = None
    finish: str | None = None
    error: BaseException | None = None

    def output(self) -> GenerationOutput:
        return GenerationOutput(self.tokens, self.logprobs, self.finish, self.tops, self.versions)


class _Batch:
    """Rows sampled together and their key/value cache: per layer (rows, heads, columns, head_dim), each row
    right-aligned (`[padding | its length tokens]`)."""

    def __init__(self, rows: list[_Row] | None = None, cache: DynamicCache | None = None):
        self.rows = rows or []
        self.cache = cache

    @property
    def columns(self) -> int:
        return self.cache.layers[0].keys.shape[2] if self.rows else 0

    def select(self, keep: list[int]) -> None:
        """Keep these rows (finished rows leave)."""
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache = None
            return
        index = torch.tensor(keep, device=self.cache.layers[0].keys.device)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        self.trim()

    def merge(self, other: _Batch) -> None:
        """Append `other`'s rows: the shorter cache is left-padded to the longer one's columns."""
        if not other.rows:
            return
        if not self.rows:
            self.rows, self.cache = other.rows, other.cache
            return
        width = max(self.columns, other.columns)
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
            mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)])
        self.rows += other.rows
        self.trim()

    def trim(self) -> None:
        """Drop the leading columns that are padding in every row."""
        unused = self.columns - max(row.length for row in self.rows)
        if unused > 0:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, unused:], layer.values[:, :, unused:]


def _left_pad(states: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - states.shape[2]
    if missing == 0:
        return states
    return torch.cat([states.new_zeros((*states.shape[:2], missing, states.shape[3])), states], dim=2)


class TransformersEngine:
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

    # Steps

    def _policy(self) -> tuple:
        """Identifies the weights the engine generates with: its module and the syncs it took."""
        return id(self._module), self._syncs

    def _admit(self, rows: list[_Row], idle: bool) -> _Batch:
        """Prefill the joiners (reusing cached prefixes), sample their first token; the rows still running. `idle`:
        no row is running (see `_refresh`)."""
        self._refresh(idle)
        policy = self._policy()
        if policy != self.prefix_cache.policy:
            self.prefix_cache.clear(policy)  # never sample from states of other weights
        for row in rows:
            row.policy = policy
        if self.prefix_cache.max_bytes:
            for row in rows:
                row.entry, row.reused = self.prefix_cache.lookup(row.prompt)
            if len(rows) > 1 and self._prefill_shared_prefixes(rows, policy):
                for row in rows:
                    row.entry, row.reused = self.prefix_cache.lookup(row.prompt)
        admitted = _Batch()
        for group in _prefill_groups(rows):
            for batch in self._prefill_isolating(group):
                admitted.merge(batch)
        return admitted

    def _prefill_shared_prefixes(self, rows: list[_Row], policy: tuple) -> bool:
        """Compute once, into the prefix cache, the prefixes that several joiners share beyond what the cache holds
        for them: a GRPO group's G identical first prompts, the system prompt and tool schemas of every episode.
        Without this each row prefills its whole prompt (a group's first turns cost G full prefills). Returns whether
        anything was computed."""
        fresh = sorted(
            (row for row in rows if len(row.prompt) - 1 - row.reused >= SHARED_PREFIX_MIN), key=lambda row: row.prompt
        )
        computed = False
        for prefix in _shared_prefixes([row.prompt for row in fresh], [row.reused for row in fresh]):
            try:
                computed |= self._prefill_prefix(prefix, policy)
            except Exception:  # noqa: BLE001 - an optimisation: the rows still prefill (and fail) on their own
                return computed
        return computed

    def _prefill_prefix(self, tokens: list[int], policy: tuple) -> bool:
        """Store the key/value states of `tokens` in the prefix cache, computing the ones past its longest cached
        prefix."""
        entry, reused = self.prefix_cache.lookup(tokens + [-1])  # any next token: the match may cover all of `tokens`
        if len(tokens) - reused < SHARED_PREFIX_MIN:
            return False
        device = self._device
        cache = None
        if reused:
            cache = DynamicCache(
                ddp_cache_data=[_stack_prefixes([(entry, reused)], layer, reused) for layer in range(len(entry.keys))]
            )
        outputs = self._module(
            input_ids=torch.tensor([tokens[reused:]], device=device),
            attention_mask=torch.ones((1, len(tokens)), dtype=torch.long, device=device),
            position_ids=torch.arange(reused, len(tokens), device=device).unsqueeze(0),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        keys = [layer.keys[0].clone() for layer in outputs.cache.layers]
        values = [layer.values[0].clone() for layer in outputs.cache.layers]
        self.prefix_cache.store(list(tokens), keys, values, policy)
        with self._stats_lock:
            self.stats.prefilled_tokens += len(tokens) - reused
        return True

    def _prefill_isolating(self, rows: list[_Row]) -> list[_Batch]:
        # One request must never cost the others (issue #9: one bad id failed 80 innocent requests): a failing
        # prefill is retried in halves until the failing request fails alone.
        try:
            return [self._prefill(rows)]
        except Exception as error:  # noqa: BLE001 - the error belongs to the requests
            if len(rows) == 1:
                rows[0].done(error)
                return []
            half = len(rows) // 2
            return self._prefill_isolating(rows[:half]) + self._prefill_isolating(rows[half:])

    def _prefill(self, rows: list[_Row]) -> _Batch:
        device = self._device
        # Every row feeds `width` tokens; a row with fewer new tokens recomputes part of its cached prefix (as many
        # FLOPs as padding would cost, and no hole between its cached and its new tokens).
        width = max(len(row.prompt) - row.reused for row in rows)
        reused = [max(len(row.prompt) - width, 0) for row in rows]
        past = max(reused)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        for i, (row, start) in enumerate(zip(rows, reused)):
            new = row.prompt[start:]
            input_ids[i, width - len(new) :] = torch.tensor(new)
        lengths = torch.tensor([len(row.prompt) for row in rows])
        attention_mask = (torch.arange(past + width) >= (past + width - lengths).unsqueeze(1)).long()
        position_ids = (torch.arange(width) + (lengths - width).unsqueeze(1)).clamp(min=0)
        cache = None
        if past:
            entries = [(row.entry, start) for row, start in zip(rows, reused)]
            cache = DynamicCache(
                ddp_cache_data=[
                    _stack_prefixes(entries, layer, past) for layer in range(len(next(e for e, s in entries if s).keys))
                ]
            )
        sampling = self._sampling_inputs(rows)
        outputs = self._module(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        for row, start in zip(rows, reused):
            row.reused, row.length = start, len(row.prompt)
        with self._stats_lock:
            self.stats.requests += len(rows)
            self.stats.prefix_hits += sum(1 for start in reused if start)
            self.stats.reused_tokens += sum(reused)
            self.stats.prefilled_tokens += int(lengths.sum()) - sum(reused)
        batch = _Batch(rows, outputs.cache)
        self._sample(batch, outputs.logits[:, -1, :], sampling)
        self._retire(batch)
        return batch

    def _decode(self, batch: _Batch, waiting: int) -> None:
        """Feed each row its last sampled token and sample the next."""
        device = self._device
        columns = batch.columns
        lengths = torch.tensor([row.length for row in batch.rows])
        input_ids = torch.tensor([[row.tokens[-1]] for row in batch.rows])
        attention_mask = (torch.arange(columns + 1) >= (columns - lengths).unsqueeze(1)).long()  # (B, columns + 1)
        sampling = self._sampling_inputs(batch.rows)
        outputs = self._module(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=lengths.unsqueeze(1).to(device),
            cache=batch.cache,
            use_cache=True,
        )
        for row in batch.rows:
            row.length += 1
        with self._stats_lock:
            self.stats.decode_steps += 1
            self.stats.decoded_rows += len(batch.rows)
            self.stats.waiting_rows += waiting
        self._sample(batch, outputs.logits[:, -1, :], sampling)

    def _sampling_inputs(self, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """What `_sample` needs of each row, on the model's device: temperatures (B,) and, as int64 (B, 3), stream
        key, draw index and greediness. Made before the forward is queued: a copy from host memory waits for the work
        queued before it, and here there is none."""
        temperatures = torch.tensor([max(row.sampling.temperature, 1e-5) for row in rows])
        streams = torch.tensor(
            [[row.key, len(row.tokens), row.sampling.temperature <= 0] for row in rows], dtype=torch.int64
        )
        return temperatures.to(self._device), streams.to(self._device)

    def _sample(self, batch: _Batch, logits: torch.Tensor, inputs: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Draw each row's next token from `logits` (B, V) and stream it; mark the rows that finished. `inputs`: the
        rows' `_sampling_inputs`."""
        rows = batch.rows
        temperatures, streams = inputs
        logits = logits.float()
        penalized = [i for i, row in enumerate(rows) if row.sampling.repetition_penalty != 1.0]
        if penalized:  # TRL's `repetition_penalty`, on the rows that ask for it (a copy: the model's logits stay)
            logits = logits.clone()
            for i in penalized:
                _penalize(logits[i], rows[i].prompt + rows[i].tokens, rows[i].sampling.repetition_penalty)
        logps = torch.log_softmax(logits / temperatures.unsqueeze(1), dim=-1)  # (B, V)
        # torch.multinomial draws one sample as argmax(probs / q), q ~ Exp(1): here every row's q comes from its own
        # stream, all rows in one go, and the argmax runs over the whole batch at once (a generator per row cost a
        # Python call per row and step: 8% of a 32-row decode step on a 256-hidden model).
        probs = logps.exp()
        for i, row in enumerate(rows):
            if row.cancelled is not None and row.cancelled.is_set():
                row.finish = "cancelled"  # its client went away: free the row
            if (
                row.finish is None
                and row.sampling.temperature > 0
                and (row.sampling.top_k > 0 or row.sampling.top_p < 1.0 or row.sampling.min_p > 0)
            ):
                try:
                    probs[i] = _restrict(probs[i], row.sampling)
                except Exception as error:  # noqa: BLE001 - this row's own failure
                    row.finish, row.error = "error", error
        noise = _exponential_noise(streams[:, 0], streams[:, 1], probs.shape[1])
        chosen_ids = torch.where(streams[:, 2].bool(), logps.argmax(dim=1), (probs / noise).argmax(dim=1))
        chosen = chosen_ids.tolist()
        chosen_logps = logps.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
        for i, (row, token, logprob) in enumerate(zip(rows, chosen, chosen_logps)):
            if row.finish is not None:
                continue
            if not math.isfinite(logprob):  # NaN or inf logits make every logprob of the row NaN
                row.finish = "error"
                row.error = ValueError("The model's next-token probabilities are not finite (NaN or inf logits).")
                continue
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.versions.append(self._weights_version)
            if row.tops is not None:
                values, ids = torch.topk(logps[i], row.sampling.top_logprobs)
                row.tops.append(list(zip(ids.tolist(), values.tolist())))
            if row.emit is not None:
                row.emit([token], [logprob])
            if token in row.sampling.stop_token_ids:
                row.finish = "stop"
            elif len(row.tokens) >= row.max_new:
                row.finish = "length"

    def _retire(self, batch: _Batch) -> None:
        """Finished and cancelled rows leave the batch; finished ones leave their states to the prefix cache."""
        keep = []
        for i, row in enumerate(batch.rows):
            if row.finish is None and row.cancelled is not None and row.cancelled.is_set():
                row.finish = "cancelled"  # its client went away: free the row
            if row.finish is None:
                keep.append(i)
            elif row.finish == "error":
                row.done(row.error)
            else:
                if row.finish != "cancelled":
                    self._store_prefix(batch, i)
                row.done(row.output())
        batch.select(keep)

    def _store_prefix(self, batch: _Batch, i: int) -> None:
        row = batch.rows[i]
        if not self.prefix_cache.max_bytes or row.policy != self.prefix_cache.policy:
            return  # computed with weights the cache no longer holds
        start = batch.columns - row.length
        keys = [layer.keys[i, :, start:].clone() for layer in batch.cache.layers]
        values = [layer.values[i, :, start:].clone() for layer in batch.cache.layers]
        self.prefix_cache.store(row.prompt + row.tokens[:-1], keys, values, row.policy, replaces=row.entry)


def _shared_prefixes(prompts: list[list[int]], cached: list[int]) -> list[list[int]]:
    """The prefixes worth computing once for `prompts` (sorted), parents before children: every prefix that two or
    more prompts share, is at least `SHARED_PREFIX_MIN` tokens longer than its parent's and than what the cache holds
    for all of them (`cached`), and stops before their last token (always fed, its logits give the first sample).

    ```python
    >>> a, b, c = [1] * 40 + [2] * 40 + [5], [1] * 40 + [2] * 40 + [6], [1] * 40 + [3] * 40 + [7]
    >>> [len(prefix) for prefix in _shared_prefixes([a, b, c], [0, 0, 0])]
    [40, 80]
    ```
    """
    found: list[list[int]] = []

    def walk(lo: int, hi: int, depth: int) -> None:  # prompts[lo:hi] share their first `depth` tokens
        if hi - lo < 2:
            return
        lcps = [_common_length(prompts[i - 1], prompts[i], depth) for i in range(lo + 1, hi)]
        shared = min(min(lcps), min(len(p) for p in prompts[lo:hi]) - 1)
        if shared - max(depth, min(cached[lo:hi])) >= SHARED_PREFIX_MIN:
            found.append(prompts[lo][:shared])
            depth = shared
        cuts = [i for i, lcp in zip(range(lo + 1, hi), lcps) if lcp <= shared]
        if not cuts:  # they share more, but only up to the shortest one's last token: nothing longer to compute
            return
        for start, end in zip([lo, *cuts], [*cuts, hi]):  # the runs that share more than `shared`
            walk(start, end, depth)

    walk(0, len(prompts), 0)
    return found


def _common_length(a: list[int], b: list[int], start: int = 0) -> int:
    """Length of the common prefix of `a` and `b`, known to be at least `start`."""
    end = min(len(a), len(b))
    while start < end and a[start] == b[start]:
        start += 1
    return start


def _prefill_groups(rows: list[_Row]) -> list[list[_Row]]:
    """Joiners prefilled together: by decreasing count of new tokens, a group grows while at most half of what it
    computes is padding or recomputed prefix."""
    groups: list[list[_Row]] = []
    for row in sorted(rows, key=lambda r: len(r.prompt) - r.reused, reverse=True):
        new = len(row.prompt) - row.reused
        if groups:
            group = groups[-1]
            width = len(group[0].prompt) - group[0].reused
            if (len(group) + 1) * width <= 2 * (sum(len(r.prompt) - r.reused for r in group) + new):
                group.append(row)
                continue
        groups.append([row])
    return groups


def _stack_prefixes(entries: list[tuple[PrefixEntry | None, int]], layer: int, past: int):
    """One layer's cached states of each row's first `start` prompt tokens, right-aligned in `past` columns."""
    reference = next(entry for entry, start in entries if start).keys[layer]
    heads, _, head_dim = reference.shape
    keys = reference.new_zeros((len(entries), heads, past, head_dim))
    values = reference.new_zeros((len(entries), heads, past, head_dim))
    for i, (entry, start) in enumerate(entries):
        if start:
            keys[i, :, past - start :] = entry.keys[layer][:, :start]
            values[i, :, past - start :] = entry.values[layer][:, :start]
    return keys, values
