"""Messages ⇄ token ids: chat template rendering, token-in continuation, tool-call parsing.

The rule (REFERENCES: rllm#272, verl#6501): never rebuild the ids of earlier turns from text. When a request is the
previous request + the assistant message we returned + new messages, its prompt is the previous prompt ids + the
sampled ids + the ids of the newly rendered messages. Only the new messages are tokenized: the request is rendered to
text, the template's rendering of everything up to and including our assistant message is cut off at the
end-of-turn token that closes that message, and the rest is tokenized on its own. The cut lands right after a special
token, where tokenization restarts, so the ids equal a slice of the full tokenization.

Per call, only a window of the conversation is rendered (issue #12: rendering the whole history each turn made an
episode O(T²)): the head (leading system messages and the first user message: the system block, the tools, the
"first user message" some templates decorate) plus the tail from the parent's last message on (from its last query
when the new messages hold more than tool results: Qwen3 drops earlier reasoning, Mistral moves the tools, when a new
user query arrives; a user message the template takes for a tool turn is no query, issue 40). The parent's window is
rendered beside the new one, so the append-only check runs on them exactly as on whole renderings.
`ChatRenderer(incremental=False)` renders whole conversations (the reference path), and a renderer whose template
gives a different answer on probe conversations falls back to it. A window is also declined when its first user
message is not a plain query to the template (Qwen3 takes a user message wrapped in `<tool_response>` tags for a tool
turn: issue #29), since the probes ran with plain ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig, PreTrainedTokenizerBase
from transformers.utils.chat_parsing.response_templates import load_response_template

from .encoding import TextEncoder


logger = logging.getLogger(__name__)

_WINDOWS_ARE_EXACT: dict[tuple, bool] = {}  # (template, template kwargs, end-of-turn tokens) -> probe result


@dataclass(frozen=True)
class RenderedContext:
    """A fingerprint of a rendered conversation (without the generation prompt): its length and digest.

    Kept per turn instead of the text itself, so long episodes do not hold every rendering in memory.
    """

    length: int
    digest: bytes

    @classmethod
    def of(cls, text: str) -> RenderedContext:
        return cls(len(text), _digest(text))

    def is_prefix_of(self, text: str) -> bool:
        return len(text) >= self.length and _digest(text[: self.length]) == self.digest


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass
class Continuation:
    """How to extend a previous turn: prompt = parent prompt + parent completion + `glue` + `suffix`."""

    glue: list[int]  # template tokens the model did not sample (e.g. the end-of-turn of a truncated completion)
    suffix: list[int]  # the newly rendered messages + the generation prompt


class ChatRenderer:
    """Renders messages with the tokenizer's chat template and parses sampled ids back into an assistant message.

    Args:
        tokenizer: a tokenizer with a chat template (and, for tool calls, a `response_template`/`response_schema`,
            see `trl.chat_template_utils.add_response_schema`).
        chat_template_kwargs: extra variables for the template (e.g. `{"enable_thinking": False}`).
        incremental: render only a window of the conversation per continued call (see the module docstring); off,
            every call renders the whole conversation. A template that renders a probe conversation differently in a
            window turns it off, with a warning.

    Example:

    ```python
    >>> renderer = ChatRenderer(tokenizer)
    >>> text = renderer.render_text([{"role": "user", "content": "Hi"}], tools=None)
    >>> prompt_ids = renderer.encode(text)
    ```
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        chat_template_kwargs: dict[str, Any] | None = None,
        incremental: bool = True,
    ):
        if tokenizer.chat_template is None:
            raise ValueError("The tokenizer has no chat template; set `tokenizer.chat_template` before serving it.")
        self.tokenizer = tokenizer
        self._encode = TextEncoder(tokenizer)  # the backend directly, pieces of text seen before from a cache
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.can_parse_tools = (
            getattr(tokenizer, "response_template", None) is not None
            or getattr(tokenizer, "response_schema", None) is not None
        )
        # Compiled once: `parse_response` compiles a template given as a dict on every call (~150 us).
        template = getattr(tokenizer, "response_template", None)
        self._response_template = load_response_template(template) if template is not None else None
        # The same without its tool-call field, so that tool-call markup is content: what a reply is parsed with when
        # its tool calls are not read (`unreadable_message`). Only where text outside every region is content, so
        # that none is lost (gpt-oss's template has no such region: such a reply is the decoded text).
        self._text_template = None
        if self._response_template is not None and self._response_template.implicit == "content":
            fields = {k: v for k, v in self._response_template.fields.items() if k != "tool_calls"}
            self._text_template = dataclasses.replace(self._response_template, fields=fields)
        self._tool_prefix_cache: dict[tuple, list[int]] = {}
        self._plain_queries: dict[str, bool] = {}  # first user message's content (sha256) -> `_is_plain_query`
        # Work counters (read by tests and benchmarks): messages rendered, and characters tokenized, so far.
        self.rendered_messages = 0
        self.encoded_chars = 0
        # Tokens that end an assistant turn when sampled: generation stops on them. The continuation splice aligns on
        # the token that closes the same message in a history: the same one, or (gpt-oss) the one the template writes
        # in its place (`_history_end`); all of them close a turn in a prompt (`prompt_tail`).
        self.end_of_turn_ids, self._history_end = self._turn_ends()
        self._end_of_turn_by_text = {tokenizer.convert_ids_to_tokens(i): i for i in self.end_of_turn_ids}
        for text in self._history_end.values():
            self._end_of_turn_by_text[text] = tokenizer.convert_tokens_to_ids(text)
        self._closing_ids = set(self._end_of_turn_by_text.values())
        self._end_of_turn_pattern = _alternatives(self._end_of_turn_by_text)
        self._history_end_pattern = {i: _alternatives([text]) for i, text in self._history_end.items()}
        # The text `add_generation_prompt=True` appends (e.g. "<|im_start|>assistant\n"), to get the rendering of a
        # request without it for free; `None` when it depends on the conversation (then it is rendered).
        probe = [{"role": "user", "content": "x"}]
        with_prompt = self.render_text(probe, None, add_generation_prompt=True)
        without = self.render_text(probe, None, add_generation_prompt=False)
        self._generation_prompt = with_prompt[len(without) :] if with_prompt.startswith(without) else None
        self._plain_tail = self._tail_after({"role": "user", "content": "question"})  # see `_is_plain_query`
        if incremental:
            key = (
                str(tokenizer.chat_template),
                json.dumps(self.chat_template_kwargs, sort_keys=True, default=str),
                tuple(sorted(self._end_of_turn_by_text)),
            )
            if key not in _WINDOWS_ARE_EXACT:  # probing costs ~50 ms: once per template and process
                _WINDOWS_ARE_EXACT[key] = self._windows_are_exact()
            incremental = _WINDOWS_ARE_EXACT[key]
        self.incremental = incremental

    # Tokens that commonly end a turn, kept where the template never writes them inside an assistant turn (gpt-oss
    # closes its analysis message with <|end|> and goes on; Phi-3 ends its turns with it).
    _COMMON_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

    def _turn_ends(self) -> tuple[set[int], dict[int, str]]:
        """`(stop ids, {stop id: the token closing that message in a history})`, from the tokenizer and the template.

        The stop ids: the eos token, the model's `generation_config.json` eos ids when it lies beside the tokenizer,
        the special token the template ends an answer and a tool call with when they are the last message (what a
        model is trained to emit last: gpt-oss `<|return|>` and `<|call|>`, Gemma 4 `<turn|>` and `<|tool_response>`),
        and the common end-of-turn tokens the template does not write inside an assistant turn.
        """
        tokenizer = self.tokenizer
        stops = {tokenizer.eos_token_id, *_generation_config_eos_ids(tokenizer)}
        history_end: dict[int, str] = {}
        specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
        special = _alternatives(specials) if specials else None
        inside: set[str] = set()
        if special is not None:
            user = {"role": "user", "content": "zzquestionzz"}
            call = {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "id": "call_0", "function": {"name": "probe", "arguments": {"x": "zzvaluezz"}}}
                ],
            }
            tool = {
                "type": "function",
                "function": {
                    "name": "probe",
                    "description": "A probe.",
                    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
                },
            }
            probes = [
                ({"role": "assistant", "content": "zzanswerzz"}, {"role": "user", "content": "again"}),
                (call, {"role": "tool", "tool_call_id": "call_0", "content": "result"}),
            ]
            for (message, after), marker in zip(probes, ("zzanswerzz", "zzvaluezz"), strict=True):
                try:
                    last = self.render_text([user, message], [tool], add_generation_prompt=False)
                    history = self.render_text([user, message, after], [tool], add_generation_prompt=False)
                except Exception:  # noqa: BLE001 - a template without tool calls (or that refuses this probe)
                    continue
                if marker not in last or marker not in history:
                    continue
                end = last.index(marker) + len(marker)
                closers = list(special.finditer(last, end))
                if not closers:  # the template leaves a last message open (GLM: the next header closes it)
                    continue
                closer = closers[-1]
                stop = tokenizer.convert_tokens_to_ids(closer.group())
                stops.add(stop)
                # In a history the same message is closed at the same place: by the same token, or by another that
                # stands in for it there (gpt-oss writes <|end|> for <|return|>, which a history never holds).
                between, at = last[end : closer.start()], history.index(marker) + len(marker)
                if not history.startswith(between, at):
                    continue
                at += len(between)
                if history.startswith(closer.group(), at):
                    history_end[stop] = closer.group()
                elif closer.group() not in history and (rendered := special.match(history, at)) is not None:
                    history_end[stop] = rendered.group()
            try:  # the special tokens of an answer with reasoning, before its text: inside the turn
                thought = {
                    "role": "assistant",
                    "content": "zzanswerzz",
                    "reasoning_content": "zzthoughtzz",
                    "thinking": "zzthoughtzz",
                }
                before = self.render_text([user], None, add_generation_prompt=False)
                turn = self.render_text([user, thought], None, add_generation_prompt=False)
                start = len(os.path.commonprefix([before, turn]))
                inside = set(special.findall(turn, start, max(turn.rfind("zzanswerzz"), start)))
            except Exception:  # noqa: BLE001 - no such answer: nothing known to be inside
                pass
        vocab = tokenizer.get_vocab()
        stops.update(vocab[t] for t in self._COMMON_END_OF_TURN if t in vocab and t not in inside)
        stops.discard(None)
        return stops, history_end

    def render_text(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = True) -> str:
        self.rendered_messages += len(messages)
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.chat_template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text (what `apply_chat_template(tokenize=True)` returns for it)."""
        self.encoded_chars += len(text)
        return self._encode(text)

    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_text(messages, tools, add_generation_prompt))

    def context_of(self, text: str, messages: list[dict], tools: list[dict] | None) -> RenderedContext:
        """Fingerprint of `messages` rendered without the generation prompt, given `text` (rendered with it)."""
        if self._generation_prompt is not None and text.endswith(self._generation_prompt):
            return RenderedContext.of(text[: len(text) - len(self._generation_prompt)])
        return RenderedContext.of(self.render_text(messages, tools, add_generation_prompt=False))

    def tool_call_prefix(self, tools: list[dict], name: str | None) -> list[int]:
        """Ids an assistant turn starts with when it calls `name` (or, with `None`, any tool, up to its name),
        derived from the chat template by rendering a probe call. Used to enforce `tool_choice`: these tokens are
        appended to the prompt (not sampled, never trained) and the model completes the call. Empty when the template
        does not render a probe call as a plain continuation of the generation prompt.

        The ids are cut where the tokenization of a whole rendered call agrees, so that no BPE merge across the cut
        (e.g. `": {"`) gives the model a split it never saw.
        """
        key = (name, json.dumps(tools, sort_keys=True))
        if key not in self._tool_prefix_cache:
            self._tool_prefix_cache[key] = self._probe_tool_call_prefix(tools, name)
        return self._tool_prefix_cache[key]

    def _probe_tool_call_prefix(self, tools: list[dict], name: str | None) -> list[int]:
        probe_name, probe_key = name or "zzprobefunctionzz", "zzprobeargumentzz"
        user = [{"role": "user", "content": "probe"}]
        call = {"type": "function", "function": {"name": probe_name, "arguments": {probe_key: 1}}}
        try:
            start = self.render_text(user, tools, add_generation_prompt=True)
            full = self.render_text(user + [{"role": "assistant", "content": "", "tool_calls": [call]}], tools, False)
        except Exception:  # noqa: BLE001 - a template that cannot render tool calls cannot enforce tool_choice
            return []
        if not full.startswith(start) or probe_name not in full[len(start) :]:
            return []
        turn = full[len(start) :]
        if name is None:
            cut = turn.index(probe_name)
        else:
            cut = turn.find("{", turn.index(probe_name))
            if cut < 0 or probe_key not in turn[cut:]:
                return []
        ids = self.encode(turn)
        kept = []
        for token in ids:
            text = self.tokenizer.decode(kept + [token])
            if len(text) > cut or not turn.startswith(text):
                break
            kept.append(token)
        return kept

    def continuation(self, parent: RenderedContext, text: str, completion_ids: list[int]) -> Continuation | None:
        """Ids that extend a parent turn to the request rendered as `text`.

        `parent` fingerprints the parent's request rendered without the generation prompt; `text` is this request
        (parent request + the assistant message we returned + new messages) rendered with it. What the template
        renders for our assistant message is replaced by the ids the model saw and sampled; the cut is the first
        end-of-turn token after the parent's context, the one that closes that message (for a completion that ended
        on a stop token, the token the template closes it with in a history: gpt-oss's <|return|> becomes <|end|>).

        Returns `None` when the template renders the parent's messages differently once more messages follow (it is
        not append-only here, e.g. Qwen3 dropping the reasoning of earlier turns after a new user message): the caller
        must render fresh.
        """
        if not parent.is_prefix_of(text):
            return None
        ended = bool(completion_ids) and completion_ids[-1] in self.end_of_turn_ids
        pattern = self._history_end_pattern.get(completion_ids[-1]) if ended else None
        match = (pattern or self._end_of_turn_pattern).search(text, parent.length)
        if match is None:
            return None
        glue = [] if ended else [self._end_of_turn_by_text[match.group()]]
        return Continuation(glue=glue, suffix=self.encode(text[match.end() :]))

    def continue_from(
        self,
        parent_messages: list[dict],
        messages: list[dict],
        tools: list[dict] | None,
        completion_ids: list[int],
        same_prefix: bool = True,
    ) -> Continuation | None:
        """Ids that extend a parent turn (request `parent_messages`, sampled `completion_ids`) to the request
        `messages` = parent request + the parent's answer + new messages; `None` when the template is not
        append-only there (see `continuation`).

        With `same_prefix` (the caller checked that `messages` starts with `parent_messages`, template fields and
        all) and `incremental`, only windows are rendered: the cost is that of the new messages, not of the history.
        Raises what the template raises on the request.

        Example:

        ```python
        >>> history = [{"role": "user", "content": "What is 2 + 3?"}]
        >>> answer = {"role": "assistant", "content": "5"}
        >>> new = [{"role": "user", "content": "And 3 + 4?"}]
        >>> continuation = renderer.continue_from(history, history + [answer] + new, None, answer_ids)
        >>> prompt_ids = parent_prompt_ids + answer_ids + continuation.glue + continuation.suffix
        ```
        """
        if same_prefix and self.incremental:
            window = self._exact_window(messages, len(parent_messages))
            if window is not None:
                head, start = window
                try:
                    return self._continue(
                        messages[:head] + messages[start : len(parent_messages)],
                        messages[:head] + messages[start:],
                        tools,
                        completion_ids,
                    )
                except Exception:  # noqa: BLE001 - a template may refuse a window (e.g. roles must alternate):
                    pass  # render the whole conversation, which raises only if the request itself is bad
        return self._continue(parent_messages, messages, tools, completion_ids)

    def _continue(self, parent_messages, messages, tools, completion_ids) -> Continuation | None:
        parent = RenderedContext.of(self.render_text(parent_messages, tools, add_generation_prompt=False))
        return self.continuation(parent, self.render_text(messages, tools), completion_ids)

    @staticmethod
    def window(
        messages: list[dict], parent_length: int, is_query: Callable[[dict], bool] = lambda message: True
    ) -> tuple[int, int] | None:
        """`(head, start)`: a continued call renders `messages[:head] + messages[start:]` (`None`: no window
        shorter than the conversation).

        The head ends after the first user message (templates render the system block and tools around the first
        messages, and Llama 3 puts the tools into the first user message); the tail starts at the parent's last
        message, or at its last query (a user message `is_query` takes for one) when the new messages hold anything
        but tool results (a new query is where templates re-render earlier turns: those after the last query). The
        tail keeps each message's index parity, for templates that check that roles alternate.
        """
        head = next((i + 1 for i, m in enumerate(messages[:parent_length]) if m["role"] == "user"), None)
        if head is None or head >= parent_length:
            return None
        start = parent_length - 1
        if any(m["role"] != "tool" for m in messages[parent_length + 1 :]):
            while start > head and not (messages[start]["role"] == "user" and is_query(messages[start])):
                start -= 1
        start = max(start, head)
        if (start - head) % 2:
            start -= 1
        return (head, start) if start > head else None

    def _exact_window(self, messages: list[dict], parent_length: int) -> tuple[int, int] | None:
        """`window`, unless its head's user message is not a plain query to the template: the probes that found
        windows exact had plain ones. A new query walks the tail back to the last plain query, past user messages
        the template takes for tool turns (issue 40: the tail began at Qwen3's `<tool_response>` user message, the
        real last query lay before it, and the window continued a context the whole request never renders)."""
        window = self.window(messages, parent_length, self._is_plain_query)
        if window is None or not self._is_plain_query(messages[window[0] - 1]):
            return None
        return window

    def _is_plain_query(self, message: dict) -> bool:
        """Whether the template renders what follows this user message as it renders what follows a plain question.

        Qwen3's templates take a user message wrapped in `<tool_response>` tags for a tool turn and look further back
        for the "last query", whose position decides which reasoning they render (issue #29). A window whose head is
        such a message but that drops the real query behind it renders the new messages differently. With a plain
        head, the last query a window sees is the whole conversation's, or both lie before the window's tail. Probed
        once per distinct content: an episode's head is the same on every call.
        """
        content = message.get("content")
        text = content if isinstance(content, str) else json.dumps(content, sort_keys=True, default=str)
        key = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()  # a task may be a megabyte
        plain = self._plain_queries.get(key)  # one lookup: a worker thread planning a large call may clear the dict
        if plain is None:
            if len(self._plain_queries) >= 4096:  # a bound, for servers that see many distinct prompts
                self._plain_queries.clear()
            plain = self._plain_queries[key] = self._tail_after(message) == self._plain_tail
        return plain

    def _tail_after(self, user: dict) -> str | None:
        # What the template renders for an answer with reasoning after `user` (`None`: it refuses `user` alone).
        answer = {"role": "assistant", "content": "answer", "reasoning_content": "thinking"}
        try:
            head = self.render_text([user], None, add_generation_prompt=False)
            return self.render_text([user, answer], None, add_generation_prompt=False)[len(head) :]
        except Exception:  # noqa: BLE001 - refused: plain only if a plain question is refused too
            return None

    def _windows_are_exact(self) -> bool:
        """Whether windows give this template's whole-conversation answer on probe conversations (tool loops, new
        queries, reasoning, with and without a system message and tools)."""
        eot = next(iter(self.end_of_turn_ids))
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "probe",
                    "description": "A probe.",
                    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
                },
            }
        ]

        def call(k, reasoning=None):
            message = {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "id": f"call_{k}", "function": {"name": "probe", "arguments": {"x": k}}}
                ],
            }
            if reasoning:
                message["reasoning_content"] = reasoning
            return message

        def tool(k):
            return {"role": "tool", "tool_call_id": f"call_{k}", "content": f"result {k}"}

        def text(k, reasoning=None):
            message = {"role": "assistant", "content": f"answer {k}"}
            if reasoning:
                message["reasoning_content"] = reasoning
            return message

        # (conversation, index of the parent's answer, tools): a tool loop, a new query, parallel tool results, chat,
        # and user messages that look like tool results to Qwen3 (in the middle, and at the head, where the window is
        # declined) with an assistant message, not ours, among the new messages.
        wrapped = {"role": "user", "content": "<tool_response>\nresult\n</tool_response>"}
        cases = []
        for reasoning in (None, "thinking"):
            loop = [
                {"role": "user", "content": "question"},
                call(0, reasoning),
                tool(0),
                call(1, reasoning),
                tool(1),
                call(2, reasoning),
                tool(2),
                text(3, reasoning),
                {"role": "user", "content": "again"},
                call(4, reasoning),
                tool(4),
                tool(5),
            ]
            chat = [{"role": "user", "content": "hi"}]
            for k in range(3):
                chat += [text(k, reasoning), {"role": "user", "content": f"more {k}"}]
            for system in ([], [{"role": "system", "content": "be brief"}]):
                cases += [
                    (system + loop[:7], len(system) + 5, tools),
                    (system + loop[:9], len(system) + 7, tools),
                    (system + loop, len(system) + 9, tools),
                    (system + chat[:5], len(system) + 3, None),
                    (system + chat, len(system) + 5, None),
                ]
            if reasoning:
                for first in ({"role": "user", "content": "question"}, wrapped):
                    tagged = [
                        first,
                        text(0, reasoning),
                        {"role": "user", "content": "again"},
                        text(1, reasoning),
                        wrapped,
                        call(2, reasoning),
                        tool(2),
                        call(3, reasoning),
                        tool(3),
                    ]
                    cases += [(tagged, 5, tools), ([{"role": "system", "content": "be brief"}] + tagged, 6, tools)]
        try:
            for messages, answer, tools_ in cases:
                window = self._exact_window(messages, answer)
                if window is None:
                    continue
                head, start = window
                try:
                    whole = self._continue(messages[:answer], messages, tools_, [eot])
                    windowed = self._continue(
                        messages[:head] + messages[start:answer], messages[:head] + messages[start:], tools_, [eot]
                    )
                except Exception:  # noqa: BLE001 - a probe this template cannot render tells nothing
                    continue
                if whole != windowed:
                    raise ValueError(
                        f"a window of {len(messages) - start + head} of {len(messages)} messages "
                        f"continues differently after message {answer}"
                    )
        except ValueError as error:
            logger.warning("Rendering whole conversations per call (the chat template is not window-local: %s).", error)
            return False
        finally:
            self.rendered_messages = self.encoded_chars = 0
        return True

    def parse(
        self,
        completion_ids: list[int],
        prompt_ids: list[int],
        tools: list[dict] | None,
        parse_tools: bool = True,
        split_reasoning: bool = False,
    ) -> tuple[dict[str, Any], bool]:
        """Parse sampled ids into an OpenAI assistant message. Returns `(message, malformed_tool_call)`.

        A completion whose tool calls cannot be read (e.g. broken JSON) is returned as text (`unreadable_message`),
        never an error. With `split_reasoning`, a thinking model's reasoning becomes `reasoning_content` even when no
        tools are parsed (the Responses, Anthropic and Gemini formats return it as an item / block / part of its own).
        """
        text = self.tokenizer.decode(completion_ids, skip_special_tokens=True)
        if not (parse_tools and tools and self.can_parse_tools):
            if split_reasoning and self.can_parse_tools:
                return self._parse_reasoning(completion_ids, prompt_ids, text), False
            return {"role": "assistant", "content": text}, False
        try:
            parsed = self.tokenizer.parse_response(
                completion_ids, prefix=self.prompt_tail(prompt_ids), tools=tools, schema=self._response_template
            )
            if not isinstance(parsed, dict):
                raise ValueError("parse_response returned no message")
            calls = parsed.get("tool_calls") or []
            for call in calls:  # validate the shape before handing it to the agent
                function = call["function"]
                if not isinstance(function.get("name"), str):
                    raise ValueError("tool call without a name")
                if function.get("arguments") is None:
                    function["arguments"] = {}
                if not isinstance(function["arguments"], dict):
                    raise ValueError("tool call arguments are not an object")
        except Exception:  # noqa: BLE001 - any parser failure means "malformed", the text goes back as content
            return self.unreadable_message(completion_ids, prompt_ids), True
        content = parsed.get("content") or ""
        if isinstance(content, str) and self.tokenizer.eos_token:
            content = content.removesuffix(self.tokenizer.eos_token)
        message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
        if parsed.get("reasoning_content"):
            message["reasoning_content"] = parsed["reasoning_content"]
        if calls:
            message["tool_calls"] = [
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])},
                }
                for c in calls
            ]
        return message, False

    def prompt_tail(self, prompt_ids: list[int]) -> list[int]:
        """The prompt after its last end-of-turn token: the generation prompt, all the parser reads of a prompt (it
        starts at the template's last assistant header), without decoding the whole history."""
        for i in range(len(prompt_ids) - 1, -1, -1):
            if prompt_ids[i] in self._closing_ids:
                return prompt_ids[i + 1 :]
        return prompt_ids

    def unreadable_message(self, completion_ids: list[int], prompt_ids: list[int]) -> dict[str, Any]:
        """The assistant message of a reply whose tool calls cannot be read (broken JSON, numbers JSON has not): its
        reasoning split out as in a readable reply, the rest, tool-call markup included, as content (stripped, as
        parsed content is).

        A streamed answer has sent its reasoning, and the text before the call, by the time the call turns out
        unreadable; this message starts with what it sent (issue #29: the whole text as content, reasoning markup
        included, made what streamed differ from what was recorded, and the agent's next call forked).
        """
        return self._parse_text(completion_ids, prompt_ids, reasoned_only=False)

    def _parse_reasoning(self, completion_ids: list[int], prompt_ids: list[int], text: str) -> dict[str, Any]:
        # Reasoning only: a tool call (the request offered none) is text. Without reasoning, the text as decoded.
        return self._parse_text(completion_ids, prompt_ids, reasoned_only=True, text=text)

    def _parse_text(
        self, completion_ids: list[int], prompt_ids: list[int], reasoned_only: bool, text: str | None = None
    ) -> dict[str, Any]:
        """The reply parsed with the template's text fields (`_text_template`): `{content, reasoning_content}`.
        The decoded text as content when that fails, or, with `reasoned_only`, when the model did not reason."""
        parsed = None
        if self._text_template is not None:
            try:
                parsed = self.tokenizer.parse_response(
                    completion_ids, prefix=self.prompt_tail(prompt_ids), tools=None, schema=self._text_template
                )
            except Exception:  # noqa: BLE001 - unparseable: the text as it is
                pass
        content = (parsed.get("content") or "") if isinstance(parsed, dict) else None
        reasoning = (parsed.get("reasoning_content") or "") if isinstance(parsed, dict) else None
        if (
            not isinstance(content, str)
            or not isinstance(reasoning, str)
            or (reasoned_only and not (reasoning and self._reasoning_opens(completion_ids)))
        ):
            if text is None:
                text = self.tokenizer.decode(completion_ids, skip_special_tokens=True)
            return {"role": "assistant", "content": text}
        if self.tokenizer.eos_token:
            content = content.removesuffix(self.tokenizer.eos_token)
        message = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        return message

    def _reasoning_opens(self, completion_ids: list[int]) -> bool:
        """Whether the reply's reasoning opens it (only whitespace before the first reasoning region). Text before
        `<think>` is no reasoned answer in the template's format: the parser would keep only the text after
        `</think>`, while a stream has sent the text before `<think>` (issue 40: the agent sent back what streamed, and
        its next call forked); such a reply is the text as decoded, streamed or not (`streaming.AnswerStream`)."""
        field = self._text_template.fields.get("reasoning_content")
        if field is None or field.open_re is None:
            return True
        text = self.tokenizer.decode(completion_ids)  # special tokens kept, as the parser reads them
        opened = field.open_re.search(text)
        if opened is None:  # the reasoning opened in the prompt (a generation prompt ending in `<think>`)
            return True
        before = text[: opened.start()]
        # A reasoning region closed before it: the reply began inside reasoning (the prompt opened it).
        return not before.strip() or (field.close_re is not None and field.close_re.search(before) is not None)


def _alternatives(tokens) -> re.Pattern:
    # Longest first: a token that is a prefix of another must not shadow it.
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=lambda t: (-len(t), t))))


def _generation_config_eos_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The eos ids of the `generation_config.json` beside a tokenizer loaded from a directory or the local Hub cache
    (never downloaded); none when there is none. gpt-oss lists <|call|> there, Llama 3.1 <|eom_id|>."""
    if not tokenizer.name_or_path:
        return []
    try:
        config = GenerationConfig.from_pretrained(tokenizer.name_or_path, local_files_only=True)
    except Exception:  # noqa: BLE001 - no generation config: the tokenizer and the template say it all
        return []
    eos = config.eos_token_id
    return [eos] if isinstance(eos, int) else [i for i in eos or () if isinstance(i, int)]


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
