"""Per-episode KV prefix reuse: the key/value states of recently finished requests, looked up by token prefix.

An agent's next call extends its previous call token for token (prompt + sampled ids + the new messages): the engine
keeps the KV states of what it already computed and prefills only the new tokens (issue #12). Keys and values at
position `i` depend on tokens `0..i` only (causal attention), so the states of any common prefix are exact, forks
included: a prompt that shares only its first `m` tokens with an entry reuses those `m`.

Entries are found by hashes of 16-token blocks (a chain hash, as vLLM's prefix caching does), so a lookup costs
O(prompt length) whatever the number of entries; the match is then checked token by token. The store is an LRU
bounded by the bytes of the tensors it holds. It belongs to one set of weights: `clear(policy)` drops everything when
the policy changes, and entries computed under an older policy are refused.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


BLOCK = 16  # tokens per hashed block


def block_hashes(tokens: list[int]) -> list[int]:
    """Chain hashes of the full `BLOCK`-token blocks of `tokens`: `hashes[k]` identifies `tokens[: (k + 1) * BLOCK]`.

    ```python
    >>> a, b = block_hashes(list(range(40))), block_hashes(list(range(32)) + [0] * 8)
    >>> len(a), a[:2] == b[:2]
    (2, True)
    ```
    """
    hashes, h = [], 0
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        h = hash((h, tuple(tokens[start : start + BLOCK])))
        hashes.append(h)
    return hashes


@dataclass
class PrefixEntry:
    """The KV states of `tokens`: per layer, keys and values of shape (heads, len(tokens), head_dim)."""

    tokens: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    hashes: list[int]
    nbytes: int


class PrefixCache:
    """LRU of [`PrefixEntry`] bounded by `max_bytes` (0 disables it).

    Example:

    ```python
    >>> cache = PrefixCache(max_bytes=2**20)
    >>> cache.clear(policy=("model", 0))
    >>> cache.store(list(range(20)), [torch.zeros(1, 20, 4)], [torch.zeros(1, 20, 4)], policy=("model", 0))
    >>> entry, matched = cache.lookup(list(range(20)) + [7, 8])
    >>> matched
    20
    ```
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.policy = None  # the weights the entries were computed with
        self.nbytes = 0
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # id(entry) -> entry, least recent first
        self._by_hash: dict[int, dict[int, None]] = {}  # block hash -> ids of the entries holding that prefix

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self, policy=None) -> None:
        """Drop every entry; the entries stored from now on must have been computed with `policy`."""
        self._entries.clear()
        self._by_hash.clear()
        self.nbytes = 0
        self.policy = policy

    def lookup(self, prompt: list[int]) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the longest prefix with `prompt`, and that prefix's length (at most `len(prompt) - 1`:
        the last prompt token is always fed, its logits give the first sampled token)."""
        if not self._entries:
            return None, 0
        hashes = block_hashes(prompt)
        for k in range(len(hashes) - 1, -1, -1):
            holders = self._by_hash.get(hashes[k])
            if not holders:
                continue
            entry = self._entries[next(reversed(holders))]  # the most recent one
            matched = (k + 1) * BLOCK
            if entry.tokens[:matched] != prompt[:matched]:  # a hash collision: give up rather than search
                return None, 0
            limit = min(len(entry.tokens), len(prompt) - 1)
            matched = min(matched, limit)
            while matched < limit and entry.tokens[matched] == prompt[matched]:
                matched += 1
            self._entries.move_to_end(id(entry))
            return entry, matched
        return None, 0

    def store(
        self,
        tokens: list[int],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        policy,
        replaces: PrefixEntry | None = None,
    ) -> None:
        """Keep the KV states of `tokens` (tensors the cache may hold on to: pass copies). `replaces`: an entry whose
        tokens are a prefix of `tokens` (the request extended it), dropped since the new entry covers it."""
        if policy != self.policy or len(tokens) < BLOCK:
            return
        nbytes = sum(t.numel() * t.element_size() for t in (*keys, *values))
        if nbytes > self.max_bytes:
            return
        if (
            replaces is not None
            and self._entries.get(id(replaces)) is replaces
            and tokens[: len(replaces.tokens)] == replaces.tokens
        ):
            self._remove(replaces)
        entry = PrefixEntry(tokens, keys, values, block_hashes(tokens), nbytes)
        self._entries[id(entry)] = entry
        for h in entry.hashes:
            self._by_hash.setdefault(h, {})[id(entry)] = None
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self._remove(next(iter(self._entries.values())))

    def _remove(self, entry: PrefixEntry) -> None:
        del self._entries[id(entry)]
        for h in entry.hashes:
            holders = self._by_hash[h]
            del holders[id(entry)]
            if not holders:
                del self._by_hash[h]
        self.nbytes -= entry.nbytes
