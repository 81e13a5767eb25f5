"""The embedded engine's model steps (`TransformersEngine`'s base class `ModelSteps`): joiners prefilled (their cached
prefixes reused, the prefixes they share computed once), rows decoded one token per step, each row's token sampled and
streamed, finished rows retired into the prefix cache.

Every row is laid out `[padding | tokens]` in the batch's cache, right-aligned: a row is described by its length,
the attention mask and position ids follow from it, and leading columns no row uses are trimmed. Request bookkeeping
(the queue, the worker thread, which requests join), the weights and the stats stay in `transformers_engine.py`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .batching import RowEmitter
from .engine import GenerationOutput, SamplingParams
from .prefix_cache import PrefixEntry
from .sampling import _exponential_noise, _penalize, _restrict


# Joiners sharing a prefix at least this much longer than what the cache holds for them get it computed once.
SHARED_PREFIX_MIN = 32


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


class ModelSteps:
    """The model steps of [`TransformersEngine`] (its base class), run by its worker thread (or `generate_batch`) with
    the model lock held: `_admit` (prefill the joiners, sample their first token), `_decode` (one token more for every
    row), `_retire` (finished rows leave, their key/value states go to the prefix cache).

    What they use of the engine: `_module` (what generates) and `_device`, `_refresh` (the weights taken before an
    admission), `_syncs` and `_weights_version` (which weights sample), `prefix_cache`, `pad_token_id`, and `stats`
    under `_stats_lock`.
    """

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
