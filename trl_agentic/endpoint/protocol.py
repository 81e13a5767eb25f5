"""Pydantic models of the subset of the OpenAI chat-completions schema that agents actually send, and the strict JSON
reader every request body goes through.

What an agent sends is recorded in the episode's trace and rendered by the chat template, so the boundary only lets
through JSON that can be written back out: no NaN/Infinity, no lone UTF-16 surrogates, bounded nesting, and sampling
fields in the ranges the engines accept (a seed outside int64 used to fail every request of the engine batch it landed
in, issue #9).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """A chat message. Content may be a string, a list of text parts (several frameworks send lists) or `null`."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _check_role_fields(self) -> Message:
        if self.role == "tool" and self.content is None:
            raise ValueError("a 'tool' message needs 'content'")
        if self.role in ("system", "developer", "user") and self.content is None:
            raise ValueError(f"a '{self.role}' message needs 'content'")
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an 'assistant' message needs 'content' or 'tool_calls'")
        return self


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


# Seeds are int64, as in OpenAI's API; choice i of a request with `n > 1` samples with `seed + i`.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_JSON_DEPTH = 64  # nesting levels of a request body (tool schemas need ~10; 1,000 crashed the JSON encoder)


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: the model must call this function."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(BaseModel):
    """The request body of `POST /v1/chat/completions`. Unknown fields are accepted and ignored (recorded)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences")
        return value

    @model_validator(mode="after")
    def _check_tool_choice(self) -> ChatCompletionRequest:
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools or []}:
                raise ValueError(f"tool_choice names function {name!r}, which is not in 'tools'")
        elif self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs 'tools'")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.seed is not None and self.seed + self.n - 1 > INT64_MAX:
            raise ValueError(
                f"seed + n - 1 must fit in int64 (choice i samples with seed + i); use a seed <= "
                f"{INT64_MAX - self.n + 1}"
            )
        return self

    @property
    def forced_tool_name(self) -> str | None:
        """The function a named `tool_choice` forces, if any."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def stop_sequences(self) -> list[str]:
        """The stop strings; an empty string stops nothing, whether sent as `""` or in a list (`[""]`)."""
        if self.stop is None:
            return []
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s]


def parse_json_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a request body as strict JSON; `ValueError` says what is wrong and where.

    Rejected: invalid JSON or UTF-8, `NaN`/`Infinity` (and numbers too large for a float), integers past Python's
    digit limit, lone UTF-16 surrogates (`"\\ud800"`: valid JSON, but no UTF-8 encoding exists, so the trace could not
    be written), and nesting deeper than `max_depth`. What passes can always be serialised back to JSON.

    Example:

    ```python
    >>> parse_json_body(b'{"seed": 1}')
    {'seed': 1}
    >>> parse_json_body(b'{"temperature": NaN}')
    Traceback (most recent call last):
    ValueError: NaN is not a JSON number; send a finite number
    ```
    """
    try:
        value = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError(f"the body is nested deeper than {max_depth} levels") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"the body is not UTF-8: {error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON: {error}") from None
    # Checking every string costs a long conversation more than parsing it (issue #12): lone surrogates can only come
    # from an escape or from their (invalid) UTF-8 bytes, so the per-string walk runs only when the raw text holds
    # one of those, or when the body nests too deep, to name the problem (or clear a false alarm).
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    if (
        b"\\ud" in data
        or b"\\uD" in data
        or (b"\xed" in data and _SURROGATE_BYTES.search(data))
        or _nests_deeper_than(data, max_depth)
    ):
        _check_json_value(value, max_depth)
    return value


_SURROGATE_BYTES = re.compile(rb"\xed[\xa0-\xbf]")  # U+D800..U+DFFF encoded as UTF-8 (which forbids them)
_BRACKETS = bytes.maketrans(b"[{]}", b"\x01\x01\x02\x02")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _nests_deeper_than(data: bytes, max_depth: int) -> bool:
    """Whether valid JSON text `data` nests deeper than `max_depth` (strings skipped), at C speed: escapes dropped,
    the text between quotes dropped, then each pass over the brackets left drops the innermost pairs, one level.

    Summing the brackets one by one in Python cost a 64-turn request more than parsing it (issue 29).
    """
    if data.count(b"[") + data.count(b"{") <= max_depth:  # no more levels than opening brackets
        return False
    if b"\\" in data:
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(data.split(b'"')[0::2]).translate(_BRACKETS, _NOT_BRACKETS)
    for _ in range(max_depth):
        if not brackets:
            return False
        brackets = brackets.replace(b"\x01\x02", b"")
    return bool(brackets)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number; send a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} does not fit in a float")
    return value


def _check_json_value(value: Any, max_depth: int) -> None:
    stack: list[tuple[Any, int, tuple]] = [(value, 1, ())]
    while stack:  # iterative: the depth check must not itself recurse
        item, depth, path = stack.pop()
        if isinstance(item, str):
            _check_text(item, path)
            continue
        if not isinstance(item, dict | list):
            continue
        if depth > max_depth:
            raise ValueError(f"the body is nested deeper than {max_depth} levels (at {_path_text(path)})")
        if isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, path)
                stack.append((child, depth + 1, path + (key,)))
        else:
            stack.extend((child, depth + 1, path + (i,)) for i, child in enumerate(item))


def _check_text(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"a string at {_path_text(path)} holds a lone UTF-16 surrogate (e.g. '\\ud800'), which has "
            "no UTF-8 encoding; send valid Unicode"
        ) from None


def _path_text(path: tuple) -> str:
    return ".".join(str(p) for p in path[:8]) or "the top level"


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    """OpenAI's error format."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def content_text(content: str | list | None) -> str:
    """Join a message's content into one string (list-of-parts content is concatenated)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] if isinstance(part, dict) else part.text for part in content)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """Normalize an OpenAI message (as a dict) into what chat templates read.

    Content becomes a string, tool-call arguments become objects (transformers' convention: templates `tojson`
    them), `null` fields and fields no template reads (`refusal`, `audio`, ...) are dropped.
    """
    role = "system" if message["role"] == "developer" else message["role"]  # templates know no 'developer'
    out: dict[str, Any] = {"role": role, "content": content_text(message.get("content"))}
    if isinstance(message.get("reasoning_content"), str) and message["reasoning_content"]:
        out["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            function = call["function"]
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError:
                    pass  # keep the raw string: the template renders it as the agent sent it
            normalized = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
            if call.get("id"):
                normalized["id"] = call["id"]
            calls.append(normalized)
        out["tool_calls"] = calls
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    if message.get("name"):
        out["name"] = message["name"]
    return out


def comparable_message(message: dict[str, Any]) -> dict[str, Any]:
    """What must match for a message of a request to count as the same message as one of the history.

    A normalized message (`template_message`) without the fields agents commonly drop or regenerate when they send
    our answer back: `reasoning_content` (not part of OpenAI's schema) and tool-call ids. Key order, `null` fields and
    the JSON spelling of arguments are already normalized away.
    """
    out = {k: v for k, v in message.items() if k not in ("reasoning_content", "tool_call_id")}
    if "tool_calls" in out:
        out["tool_calls"] = [{k: v for k, v in call.items() if k != "id"} for call in out["tool_calls"]]
    return out


class OpenEpisodeRequest(BaseModel):
    """The body of `POST /admin/episodes` (all optional)."""

    model_config = ConfigDict(extra="forbid")
    task_index: int = 0
    group_index: int = 0
    metadata: dict[str, Any] | None = None
    max_turns: int | None = Field(default=None, ge=1)
    max_episode_tokens: int | None = Field(default=None, ge=1)
    # The episode's seed: its calls that bring none sample from seeds derived from it and their index in the episode.
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    # A branch episode: `trl_agentic.trace.ReplaySpec.to_dict()` (the parent's calls and the branch point).
    replay: dict[str, Any] | None = None


class CloseEpisodeRequest(BaseModel):
    """The body of `POST /admin/episodes/{id}/close` (all optional)."""

    model_config = ConfigDict(extra="forbid")
    status: str | None = None
    result: Any = None
    error: str | None = None


class AddUserRequest(BaseModel):
    """The body of `POST /admin/users`."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)


class FeedbackRequest(BaseModel):
    """The body of `POST /v1/feedback` (a user key's): a reward for one of its episodes (default: its latest)."""

    model_config = ConfigDict(extra="forbid")
    episode_id: str | None = Field(default=None, max_length=100)
    value: float = Field(allow_inf_nan=False)
    note: str | None = Field(default=None, max_length=2000)


class EndEpisodeRequest(BaseModel):
    """The optional body of `POST /v1/episodes/end` (a user key's): the task the episode did, when the client names
    it (stored as its fingerprint; episodes of one task form GRPO groups in online training)."""

    model_config = ConfigDict(extra="forbid")
    task: str | None = Field(default=None, min_length=1, max_length=10_000)


class AdminRewardRequest(BaseModel):
    """The body of `POST /admin/rewards`: a reward from where production has them (CI results, a business metric)."""

    model_config = ConfigDict(extra="forbid")
    episode_id: str = Field(max_length=100)
    value: float = Field(allow_inf_nan=False)
    source: str = Field(default="admin", min_length=1, max_length=100)
    note: str | None = Field(default=None, max_length=2000)
