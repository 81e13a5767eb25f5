"""Rendered text -> token ids, as `tokenizer(text, add_special_tokens=False)` gives them, at a fraction of the cost.

Each call tokenizes a rendered prompt (a new episode's whole prompt, a continued call's new messages). Two costs
dominate it and neither is tokenization proper (issue 29: the endpoint cost ~1 ms per call more than a trivial handler):

- transformers' `__call__` (argument handling, `BatchEncoding`): ~100 us a call; the `tokenizers` backend is called
  directly when the tokenizer is a plain fast tokenizer in its default state (no truncation, padding or split special
  tokens set), which is what `__call__` ends up doing.
- The same text again and again: every episode's first prompt starts with the same system block (the tools' schemas
  are most of it) and a GRPO group sends the same task `num_generations` times. The text is cut after each special
  token, where tokenization restarts (the backend splits added tokens out before normalizing and pre-tokenizing the
  pieces between them), and the ids of each piece are kept (least recently used pieces dropped first). A tokenizer
  whose pieces do not add up to the ids of the whole text (e.g. a Metaspace pre-tokenizer that marks only the start
  of the input) is found by a probe at construction and tokenizes whole texts.

Example:

```python
>>> encode = TextEncoder(tokenizer)
>>> encode("<|im_start|>user\\nHi<|im_end|>\\n") == tokenizer("<|im_start|>user\\nHi<|im_end|>\\n",
...                                                          add_special_tokens=False)["input_ids"]
True
```
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend


# `Tokenizer.encode` holds the GIL while it works, `encode_batch` releases it: a long text, which the endpoint tokenizes
# in a worker thread (`service.OFFLOAD_BYTES`), must not stop the event loop meanwhile (issue 29, N7: a 3.9 MB body
# stalled every episode's calls for seconds). Short texts keep the cheaper call.
RELEASE_GIL_CHARS = 1 << 16


def _encode(backend: Tokenizer, text: str) -> list[int]:
    if len(text) > RELEASE_GIL_CHARS:
        return backend.encode_batch([text], add_special_tokens=False)[0].ids
    return backend.encode(text, add_special_tokens=False).ids


class TextEncoder:
    """`tokenizer(text, add_special_tokens=False)["input_ids"]`, computed through the backend with pieces cached.

    Args:
        tokenizer: the served tokenizer (any; a slow one, or a fast one with its own `__call__`, is simply called).
        max_cached_chars: characters of text whose ids are kept, all pieces together.
    """

    max_piece_chars = 1 << 20  # longer pieces are tokenized every time (a huge tool result is seen once)

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_cached_chars: int = 8 << 20):
        self.tokenizer = tokenizer
        self.max_cached_chars = max_cached_chars
        self._backend = _plain_backend(tokenizer)
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()
        self._cut: re.Pattern | None = None
        self._cut_after: set[str] = set()
        if self._backend is not None:
            raw = [t for t in self._backend.get_added_tokens_decoder().values() if not t.normalized]
            # Every token the backend splits out of the raw text is matched, leftmost-longest as the backend does;
            # the cut goes only after those that strip no whitespace around them.
            self._cut_after = {t.content for t in raw if not (t.lstrip or t.rstrip or t.single_word)}
            if self._cut_after:
                self._cut = re.compile(
                    "|".join(re.escape(t) for t in sorted({t.content for t in raw}, key=lambda t: (-len(t), t)))
                )
                if not self._pieces_add_up():
                    self._cut = None

    def __call__(self, text: str) -> list[int]:
        backend = self._backend
        if backend is None or not self._default_state():
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if self._cut is None:
            return _encode(backend, text)
        pieces = self._pieces(text)
        found: list[list[int] | None] = []
        with self._lock:
            for piece in pieces:
                ids = self._cache.get(piece)
                if ids is not None:
                    self._cache.move_to_end(piece)
                found.append(ids)
        missing = [piece for piece, ids in zip(pieces, found) if ids is None]
        if missing:
            encoded = iter([_encode(backend, piece) for piece in missing])
            found = [ids if ids is not None else next(encoded) for ids in found]
            with self._lock:
                for piece, ids in zip(pieces, found):
                    if piece not in self._cache and len(piece) <= self.max_piece_chars:
                        self._cache[piece] = ids
                        self._cached_chars += len(piece)
                while self._cached_chars > self.max_cached_chars:
                    piece, _ = self._cache.popitem(last=False)
                    self._cached_chars -= len(piece)
        if len(found) == 1:
            return list(found[0])
        return [i for ids in found for i in ids]

    def _pieces(self, text: str) -> list[str]:
        pieces, start = [], 0
        for match in self._cut.finditer(text):
            if match.group() in self._cut_after:
                pieces.append(text[start : match.end()])
                start = match.end()
        if start < len(text) or not pieces:
            pieces.append(text[start:])
        return pieces

    def _default_state(self) -> bool:
        # What `__call__` would reset or honour before calling the backend.
        backend = self._backend
        return (
            backend.truncation is None
            and backend.padding is None
            and not backend.encode_special_tokens
            and not self.tokenizer.split_special_tokens
        )

    def _pieces_add_up(self) -> bool:
        tokens = sorted(self._cut_after)
        words = ["x", " x", "  x", "\nx", " \n", "Hello world", " Hello", "é", "e\u0301", "ﬁ", "12 34", "\t", ""]
        texts = [
            "".join(t + w for t, w in zip(tokens * len(words), words)),
            "".join(w + t + w for t in tokens for w in words),
            " ".join(tokens) + " end",
        ]
        for text in texts + [w + tokens[0] for w in words]:
            whole = self._backend.encode(text, add_special_tokens=False).ids
            split = [
                i for piece in self._pieces(text) for i in self._backend.encode(piece, add_special_tokens=False).ids
            ]
            if whole != split:
                return False
        return True


def _plain_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The `tokenizers` backend of a fast tokenizer whose `__call__` only calls it (no subclass overrides it)."""
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or not isinstance(tokenizer._tokenizer, Tokenizer):
        return None
    if cls.__call__ is not PreTrainedTokenizerBase.__call__ or cls._encode_plus is not TokenizersBackend._encode_plus:
        return None
    if hasattr(tokenizer, "_switch_to_input_mode"):  # tokenizers with input and target modes
        return None
    return tokenizer._tokenizer
