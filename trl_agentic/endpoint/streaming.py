"""Live answer text for streamed responses (issue #12 item 4): sampled ids in, stable text deltas out.

The engine hands over each sampled chunk (`on_token`); an `AnswerStream` per choice turns them into `Delta`s of the
answer's content and reasoning, as the wire formats stream them, under three rules:

- Only stable text leaves: ids are detokenized incrementally (as vLLM does: each chunk decoded with one piece of left
  context), and text ending in an incomplete UTF-8 character waits for the ids that complete it.
- Tool-call markup never leaks as text: when tool calls (or reasoning) are parsed, the text goes through transformers'
  streaming `ResponseParser` with the template's `response_template`, which holds back anything that may be the
  beginning of a delimiter (`<tool_call>`, Llama's `{"name": ...`) and routes text to regions; only the content and
  reasoning regions stream, tool calls are sent once parsed, at the end. Leading and trailing whitespace of a region
  waits (the parsed value is stripped), and so does text that may begin a stop string or the end-of-sequence text.
- The stream ends on the parsed message, the same one a non-streamed call returns (`finish`): what the parser had not
  let through yet is sent then, so the deltas add up to the non-streamed answer. Text that may come out otherwise in
  the parsed message waits for it: the rest of an answer the parser cannot read (a broken tool call: its message
  keeps the reasoning and the text before the call as they streamed, `ChatRenderer.unreadable_message`), and what
  follows a special token the parser keeps and a plain decode drops.

Without tools, Responses, Messages and Gemini split out the reasoning only of an answer it opens
(`ChatRenderer.parse`): whitespace waits until text follows it (it may come before a `<think>`, and the parsed content
drops it), and text before a `<think>` makes the answer the text as decoded: what streamed of it has left, the rest
waits for `finish` (issue 40: the text after `</think>` was recorded, the text before it streamed, and the agent's
next call forked).

One case cannot add up: with tools, text the model writes after a tool call (or after its reasoning) replaces, in the
parsed message, the text it wrote before it (transformers' parser keeps the last region of a field), and a stream
cannot take back what it sent. Such an answer is counted in `AnswerStream.diverged`; the recorded turn is unaffected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers.utils.chat_parsing.response_parser import ResponseParser


CONTENT, REASONING = "content", "reasoning"


@dataclass
class Delta:
    """A piece of choice `index`'s answer: `kind` is `"content"` or `"reasoning"`."""

    index: int
    kind: str
    text: str


@dataclass
class _Region:
    raw: str = ""  # the region's text as the parser routed it
    closed: bool = False
    emitted: str = ""  # what left as deltas


@dataclass
class AnswerStream:
    """Turns one choice's sampled chunks into `Delta`s handed to `emit`.

    Args:
        index: the choice.
        tokenizer: the served tokenizer.
        emit: receives each `Delta`.
        response_template: the tokenizer's `response_template` when the answer is parsed (tool calls or reasoning);
            `None` for plain text.
        prefix_ids: the prompt's tail (`ChatRenderer.prompt_tail`), what the parser reads of the prompt.
        tools: the request's tools (the parser casts arguments with them).
        stops: the request's stop strings.
        strip_content: whether the parsed content is stripped (tools parsed); without tools a reasoning split keeps
            the text as it is unless the model reasoned.
        pieces: `(token_ids, content) -> list[str]`, how to split text that leaves only at the end (per token).
        hold_ids: special tokens a plain decode drops (`ChatRenderer.end_of_turn_ids` aside). The parser keeps their
            text, an answer it cannot read comes back as the plain decode: once one is sampled, the text waits for
            `finish`, which sends what the parsed message holds (issue 29: `Hello<|im_start|> world` streamed,
            `Hello world` recorded, and the agent's next call forked).

    Example:

    ```python
    >>> stream = AnswerStream(0, tokenizer, deltas.append)
    >>> stream.feed(tokenizer.encode("Hello world"))
    >>> stream.finish({"role": "assistant", "content": "Hello world"})
    >>> "".join(d.text for d in deltas)
    'Hello world'
    ```
    """

    index: int
    tokenizer: Any
    emit: Callable[[Delta], None]
    response_template: dict | None = None
    prefix_ids: list[int] = field(default_factory=list)
    tools: list[dict] | None = None
    stops: list[str] = field(default_factory=list)
    pieces: Callable[[list[int], str], list[str]] | None = None
    strip_content: bool = True
    hold_ids: frozenset[int] = frozenset()
    diverged: bool = False

    def __post_init__(self):
        self._ids: list[int] = []
        self._prefix_start = self._read_start = 0
        self._plain = ""  # everything decoded, special tokens skipped (what stop strings are searched in)
        self._plain_ids: list[int] = []
        self._stopped = False
        self._held = False  # nothing more streams before `finish` (an unreadable answer, a special token)
        self._regions = {CONTENT: _Region(), REASONING: _Region()}
        self._parser = None
        self._reasoned = False
        if self.response_template is not None:
            prefix = self.tokenizer.decode(self.prefix_ids) if self.prefix_ids else ""
            self._parser = ResponseParser(self.response_template, prefix=prefix, tools=self.tools)
        self._eos = (self.tokenizer.eos_token or "") if self._parser is not None else ""
        self._hold = max([len(s) - 1 for s in self.stops] + [0])

    def feed(self, token_ids: list[int], logprobs: list[float] | None = None) -> None:
        """Take newly sampled ids (the engine's `on_token`). Never raises: an answer the streaming parser cannot read
        (a tool call closed on broken JSON, an integer past Python's 4300-digit limit) stops the live text, and
        `finish` sends the rest of the parsed message, as a non-streamed call returns it (the call is recorded as
        malformed, issue 29: the parser's error escaped to the engine, and the turn was lost)."""
        self._ids.extend(token_ids)
        if self._parser is not None and not self._held and not self.hold_ids.isdisjoint(token_ids):
            self._held = True
        if self._held:
            return
        try:
            self._feed(token_ids)
        except Exception:  # noqa: BLE001 - whatever the model wrote, the answer is the parsed message at `finish`
            self._held = True

    def _feed(self, token_ids: list[int]) -> None:
        text = self._decode_new()
        if not text:
            return
        if self.stops and not self._stopped:
            self._plain += self.tokenizer.decode(token_ids, skip_special_tokens=True) if self._parser else text
            self._stopped = any(stop in self._plain for stop in self.stops)
        if self._parser is None:
            self._regions[CONTENT].raw += text
        else:
            for event in self._parser.feed(text):
                self._route(event)
        if not self._stopped and not self._held:
            self._flush()

    def finish(self, message: dict[str, Any], ids: list[int] = ()) -> None:
        """End on the parsed `message` (what the non-streamed call returns): send what it holds beyond what was sent.
        `ids` (the sampled ids) split text that was not streamed at all into per-token pieces."""
        for kind, key in ((REASONING, "reasoning_content"), (CONTENT, "content")):
            final = message.get(key) or ""
            region = self._regions[kind]
            if not final.startswith(region.emitted):
                self.diverged = True
                continue
            rest = final[len(region.emitted) :]
            if not rest:
                continue
            if not region.emitted and kind == CONTENT and self.pieces is not None:
                for piece in self.pieces(self._ids or ids, rest):
                    self._send(kind, piece)
            else:
                self._send(kind, rest)

    # Internals

    def _decode_new(self) -> str:
        """The stable text the new ids add (vLLM's incremental detokenization)."""
        skip = self._parser is None
        prefix = self.tokenizer.decode(self._ids[self._prefix_start : self._read_start], skip_special_tokens=skip)
        text = self.tokenizer.decode(self._ids[self._prefix_start :], skip_special_tokens=skip)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self._prefix_start, self._read_start = self._read_start, len(self._ids)
        return text[len(prefix) :]

    def _route(self, event: dict) -> None:
        kind = {"content": CONTENT, "reasoning_content": REASONING}.get(event.get("field"))
        if kind is None:
            return
        region = self._regions[kind]
        if kind == REASONING and not self._reasoned and not self.strip_content and self._regions[CONTENT].raw.strip():
            # Text before the reasoning: no reasoned answer in the template's format, the answer is the text as
            # decoded (`ChatRenderer.parse`, issue 40: the text after `</think>` was recorded, the text before it
            # streamed). The text before `<think>` has left; the rest waits for `finish`.
            self._held = True
            return
        if event["type"] == "region_open" and region.closed and not region.emitted:
            region = self._regions[kind] = _Region()  # nothing of the earlier region left: the later one streams
        if kind == REASONING:
            self._reasoned = True
        if event["type"] == "region_chunk" and not region.closed:
            region.raw += event["text"]
        elif event["type"] == "region_close":
            region.closed = True  # a later region of this field replaces it: it does not stream (see module doc)

    def _flush(self) -> None:
        for kind in (REASONING, CONTENT):
            region = self._regions[kind]
            if kind == CONTENT and self._parser is not None and not (self.strip_content or self._reasoned):
                safe = region.raw[: len(region.raw) - max(self._hold, _overlap(region.raw, self._eos))]
                if not safe.strip():  # whitespace alone may come before `<think>`: the parsed content drops it
                    safe = ""
            elif region.closed:
                safe = region.raw.strip()
                if kind == CONTENT and self._eos:
                    safe = safe.removesuffix(self._eos)
            else:
                safe = region.raw.strip()
                safe = safe[: max(0, len(safe) - self._hold)] if self._hold else safe
                if kind == CONTENT and self._eos:  # the parsed content drops a trailing end-of-sequence text
                    safe = safe[: len(safe) - _overlap(safe, self._eos)]
            if self._parser is None:  # plain text is returned as decoded, whitespace included
                safe = region.raw[: max(0, len(region.raw) - self._hold)]
            if len(safe) > len(region.emitted) and safe.startswith(region.emitted):
                self._send(kind, safe[len(region.emitted) :])

    def _send(self, kind: str, text: str) -> None:
        self._regions[kind].emitted += text
        self.emit(Delta(self.index, kind, text))


def _overlap(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a prefix of `marker` (or `marker` itself)."""
    if text.endswith(marker):
        return len(marker)
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)
