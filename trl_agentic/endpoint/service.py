"""The format-neutral model call: a `ModelCall` in, recorded turns and the assistant messages out.

Every wire format (`chat_completions.py`, `responses.py`, `anthropic_messages.py`, `gemini.py`) converts its request
into a `ModelCall` (OpenAI chat messages + function tools + sampling, the lingua franca of chat templates) and shapes
the `Completion` it gets back into its own response or event stream. Everything that decides tokens happens here, once:
episode limits, prompt planning (token-in continuation or a recorded fork, `sessions.py`), `tool_choice` forcing,
sampling with the trainer's overrides, stop strings, parsing the reply, and recording the turn with the wire format
it came in. A format is an adapter, never a second copy of the pipeline (DESIGN.md), so token-exact continuation,
forks and masks hold whichever format an agent speaks.

Example:

```python
>>> service = CompletionService(engine, renderer, EndpointSettings())
>>> conversation = ModelCall(messages=[{"role": "user", "content": "Hi"}], wire_format="chat_completions")
>>> completion = await service.complete(session, conversation, request)
>>> completion.choices[0].message
{'role': 'assistant', 'content': 'Hello!'}
```
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from jinja2 import TemplateError
from pydantic import BaseModel, ValidationError

from ..generation.engine import GenerationEngine, GenerationOutput, SamplingParams
from ..trace import Turn
from . import SERVED_MODEL_NAME
from .chat import ChatRenderer
from .protocol import parse_json_body, template_message
from .replay import divergence_context, replay_output, replayed_turn
from .sessions import EpisodeClosedError, EpisodeLimitError, EpisodeLimits, EpisodeSession, PromptPlan
from .streaming import AnswerStream, Delta


# Requests with a body past this size are rendered and tokenized in a worker thread (issue 29: a 3.9 MB body held the
# event loop 4 s, and every episode's calls and /health waited). The tokenizer releases the GIL, the loop serves the
# others meanwhile. Smaller requests stay on the loop: a thread hop would cost more than their rendering.
OFFLOAD_BYTES = 256 * 1024

# The wire formats a turn can come in (`Turn.wire_format`).
CHAT_COMPLETIONS = "chat_completions"
RESPONSES = "responses"
ANTHROPIC_MESSAGES = "anthropic_messages"
GEMINI = "gemini"
WIRE_FORMATS = (CHAT_COMPLETIONS, RESPONSES, ANTHROPIC_MESSAGES, GEMINI)


@dataclass
class SamplingOverrides:
    """Sampling set by the server (the trainer), whatever the agent asks for. `None` = use the request's value."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None  # cap on tokens per call (the request may ask for fewer)
    # TRL's `min_p` and `repetition_penalty`: the trainer's alone (no wire format an agent speaks carries them)
    min_p: float | None = None
    repetition_penalty: float | None = None


@dataclass
class EndpointSettings:
    """How the endpoint serves: model names, admin token, defaults and caps.

    Args:
        served_model_names: values of `model` the endpoint answers to (others get 404 `model_not_found`).
        admin_token: bearer token of the `/admin` routes (episodes are opened and closed with it); never empty.
        default_max_tokens: `max_tokens` of a request that sets none.
        max_body_bytes: larger request bodies are answered 413.
        overrides: sampling the trainer imposes, whatever the request asks for.
        default_limits: limits of an episode opened without its own.
        max_open_episodes: most episodes open at once; opening one more is answered 429 (`None`: no cap).
        episode_idle_timeout: seconds without a call after which an episode is closed with status `cancelled`
            (`None`: never); its trace stays retrievable through the admin routes for a while.
        user_episode_idle_timeout: with a store (user keys), seconds without a call after which a user's episode
            ends and is stored (`users.py`).
        feedback_per_minute: with a store, most feedback calls (`POST /v1/feedback`) a user may make in any 60 s.
        hosted_tools: what the Responses route does with a tool only OpenAI's servers run (`web_search`,
            `file_search`, ...): `"drop"` it with a logged warning, listed on the turn as
            `requested_sampling["dropped_tools"]` (the default: harnesses such as Codex send `web_search` unasked),
            or `"reject"` the request with a 400.
    """

    served_model_names: list[str] = field(default_factory=lambda: [SERVED_MODEL_NAME])
    admin_token: str = field(default_factory=lambda: f"sk-admin-{secrets.token_urlsafe(32)}")
    default_max_tokens: int = 512
    max_body_bytes: int = 4 * 1024 * 1024
    overrides: SamplingOverrides = field(default_factory=SamplingOverrides)
    default_limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    max_open_episodes: int | None = None
    episode_idle_timeout: float | None = None
    hosted_tools: str = "drop"
    user_episode_idle_timeout: float = 300.0
    feedback_per_minute: int = 60

    def __post_init__(self):
        if self.hosted_tools not in ("drop", "reject"):
            raise ValueError(f"hosted_tools must be 'drop' or 'reject', not {self.hosted_tools!r}.")
        # An empty token matched a request that sends none: the admin routes were open to anyone (issue 29, N6).
        if not isinstance(self.admin_token, str) or not self.admin_token.strip():
            raise ValueError(
                f"admin_token is empty ({self.admin_token!r}): the admin routes would be open to any "
                "request. Pass a secret token (e.g. 'sk-admin-' + secrets.token_urlsafe(32)), or leave "
                "admin_token unset for a random one."
            )


class APIError(Exception):
    """A request the endpoint answers with an error; `app.py` writes it in the shape of the route's wire format.

    `type_`, `code` and `param` are OpenAI's fields; the Anthropic shape derives its `type` from `status`.
    """

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param


@dataclass
class ModelCall:
    """One model call in no particular wire format: what every adapter turns its request into.

    Args:
        messages: the conversation as OpenAI chat messages (dicts; recorded as the turn's `request_messages`).
        tools: function tools in the chat-completions shape (`{"type": "function", "function": {...}}`).
        tool_choice: `"auto"`, `"none"`, `"required"` or `None`.
        forced_tool_name: the function the model must call (a named tool choice), if any.
        max_tokens: tokens the request asks for at most (`None`: the endpoint's default).
        temperature, top_p, top_k, seed: the request's sampling (the trainer's overrides win).
        n: choices to sample.
        stop: stop strings (the returned text ends before the first one found).
        top_logprobs: most likely alternatives to report per sampled token.
        requested: what the agent asked for besides messages and tools (recorded as `requested_sampling`).
        wire_format: the format the request came in (`WIRE_FORMATS`), recorded on the turn.
        split_reasoning: parse a thinking model's reasoning out of the reply even without tools (formats with a
            reasoning item or block); Chat Completions only does so when tools are parsed, as it always has.
        messages_param: the request field holding the conversation, named in errors about it.
        size: bytes of the request body; past `OFFLOAD_BYTES` the prompt is planned off the event loop.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None
    forced_tool_name: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    top_logprobs: int = 0
    requested: dict[str, Any] = field(default_factory=dict)
    wire_format: str = CHAT_COMPLETIONS
    split_reasoning: bool = False
    messages_param: str = "messages"
    size: int = 0
    template_messages: list[dict[str, Any]] | None = None  # `messages` normalized already (`template_message`)


@dataclass
class Choice:
    """One sampled answer: the assistant message (chat shape), why it ended, and what was sampled.

    `finish_reason` is `"stop"`, `"length"` or `"tool_calls"`; `stop_sequence` is the stop string that ended it, if
    one did; `output` holds the sampled ids and logprobs (cut after a stop string).
    """

    message: dict[str, Any]
    finish_reason: str
    output: GenerationOutput
    stop_sequence: str | None = None


@dataclass
class PreparedCall:
    """A model call with everything decided but the sampling (`CompletionService.prepare`)."""

    session: EpisodeSession
    conversation: ModelCall
    messages: list[dict[str, Any]]  # normalized for the template
    plan: PromptPlan
    forced: list[int]  # the tool-call opening `tool_choice` forces (prompt tokens)
    prompt_ids: list[int]  # plan.prompt_ids + forced
    sampling: SamplingParams
    reserved: int  # tokens held against the episode's budget until the call finishes (`run`)
    finished: bool = False
    # A branch episode's replayed call: the parent's recorded turn that answers it (nothing is sampled); or, on the
    # call where replay ended early, why (`EpisodeSession.replay_call`), recorded as its turn's `replay_divergence`.
    replayed: Turn | None = None
    divergence: dict[str, Any] | None = None

    def finish(self, turns: list = ()) -> bool:
        """Release the call's admission and record `turns` (`EpisodeSession.finish_call`), once: a second finish does
        nothing. Returns False when the episode closed meanwhile (the turns are dropped)."""
        if self.finished:
            return False
        self.finished = True
        return self.session.finish_call(self.conversation.n, self.reserved, list(turns))


@dataclass
class Completion:
    """What a model call returned, for an adapter to shape: the choices and the token counts."""

    choices: list[Choice]
    prompt_tokens: int
    policy_version: int

    @property
    def completion_tokens(self) -> int:
        return sum(len(choice.output.token_ids) for choice in self.choices)


class CompletionService:
    """Serves model calls of episodes: plans the prompt, samples, parses and records. Format-neutral.

    Args:
        engine: the generation engine (shared by every route).
        renderer: the chat template renderer of the served tokenizer.
        settings: the endpoint's settings (overrides, defaults, caps).
    """

    def __init__(self, engine: GenerationEngine, renderer: ChatRenderer, settings: EndpointSettings):
        self.engine, self.renderer, self.settings = engine, renderer, settings
        self.tokenizer = renderer.tokenizer
        # Engines of the streaming contract take `on_token`; with others, a streamed answer leaves when it is sampled.
        self.engine_streams = "on_token" in inspect.signature(engine.generate).parameters
        self.hold_ids = _dropped_special_ids(self.tokenizer) - renderer.end_of_turn_ids  # `AnswerStream.hold_ids`

    # Request bodies

    async def read_body(self, request: Request) -> bytes:
        """The raw body, 413 past `max_body_bytes` (checked on the declared length and while reading)."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(
                413, f"Request body of {declared} bytes is over the limit of {limit}.", code="request_too_large"
            )
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"Request body is over the limit of {limit} bytes.", code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    def parse_json(raw: bytes, required: bool = True) -> Any:
        """Strict JSON (`protocol.parse_json_body`), 400 otherwise; an empty optional body is `None`."""
        if not raw.strip() and not required:
            return None
        try:
            return parse_json_body(raw)
        except ValueError as error:
            raise APIError(400, f"Request body is not valid JSON: {error}", code="invalid_json") from None

    @staticmethod
    def validate(model: type[BaseModel], body: Any, skipped: tuple[str, int] | None = None):
        """`model.model_validate(body)`, the first problem as a 400 naming the field. `skipped = (field, k)`: the
        body's list `field` lacks its first `k` items (validated before), its errors name their index in the whole."""
        try:
            return model.model_validate(body)
        except ValidationError as error:
            first = error.errors()[0]
            loc = first.get("loc", ())
            if skipped and len(loc) > 1 and loc[0] == skipped[0] and isinstance(loc[1], int):
                loc = (loc[0], loc[1] + skipped[1], *loc[2:])
            param = ".".join(str(p) for p in loc)
            raise APIError(
                400,
                f"Invalid request: {param or 'body'}: {first.get('msg')}",
                param=param or None,
                code="invalid_request",
            ) from None

    def check_model(self, model: str) -> None:
        if model not in self.settings.served_model_names:
            raise APIError(
                404,
                f"The model {model!r} does not exist; this endpoint serves {self.settings.served_model_names}.",
                code="model_not_found",
                param="model",
            )

    # Model calls

    async def count_prompt_tokens(self, messages: list[dict], tools: list[dict] | None, size: int = 0) -> int:
        """Tokens of the prompt these messages render to (without continuation: what a fresh call would cost);
        `size`, the request body's bytes, past `OFFLOAD_BYTES` moves the rendering off the event loop."""

        def count() -> int:
            try:
                return len(self.renderer.render([template_message(m) for m in messages], tools))
            except _TEMPLATE_ERRORS as error:
                raise APIError(
                    400,
                    f"The chat template rejected these messages: {type(error).__name__}: {error}",
                    code="template_error",
                ) from None

        return await asyncio.to_thread(count) if size > OFFLOAD_BYTES else count()

    async def complete(self, session: EpisodeSession, conversation: ModelCall, request: Request) -> Completion:
        """Sample `conversation.n` answers to `conversation` in `session` and record them as turns.

        Raises `APIError` for what the request did (limits, context overflow, a template that rejects it, a client
        that went away: 499) and when the episode closed meanwhile (409, the answer is not recorded).
        """
        return await self.run(await self.prepare(session, conversation), request)

    def stream(self, call: PreparedCall, request: Request) -> AsyncIterator[Delta | Completion]:
        """`run` a prepared call, yielding each choice's text as it is sampled (`Delta`s), then the `Completion`.

        The sampling starts now, not when the iterator is first read: the call is admitted already (`prepare`), and
        its reservation is released by `run` however the response ends, even one never read. The text adds up to the
        answers of the `Completion` (`streaming.AnswerStream`), and what is recorded is what a non-streamed call
        records. Raises, after the deltas, what `run` raises. A consumer that stops early (its client went away)
        cancels the sampling: the call is recorded as cancelled.
        """
        queue: asyncio.Queue[Delta | None] = asyncio.Queue()
        gone = asyncio.Event()
        task = asyncio.ensure_future(self.run(call, request, on_delta=queue.put_nowait, client_gone=gone))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        task.add_done_callback(lambda done: done.cancelled() or done.exception())  # a consumer gone: nobody to tell
        return _relay(task, queue, gone)

    async def prepare(self, session: EpisodeSession, conversation: ModelCall) -> PreparedCall:
        """Admit the call (`EpisodeSession.admit`: the episode's limits, counting calls in flight), then decide
        everything before sampling: the prompt (continued or rendered), `tool_choice` forcing, the sampling
        parameters. Raises `APIError` for what the request did (limits, context overflow, a template that rejects
        it): a streamed call raises it before its response starts.

        The returned call holds its admission until `run` (or `stream`) finishes it: hand it to one of them at once.
        A large request (`ModelCall.size` past `OFFLOAD_BYTES`) is planned in a worker thread, after its admission:
        the episode's limits count it from the start, and the other calls of the episode see it in flight.
        """
        n = conversation.n
        try:
            budget = session.admit(n)
        except EpisodeClosedError:
            raise APIError(401, "Unknown or closed episode key.", "authentication_error", "invalid_api_key") from None
        except EpisodeLimitError as error:
            raise APIError(400, str(error), code="episode_limit_exceeded") from None
        held = budget * n if budget is not None else 0
        try:
            if conversation.size > OFFLOAD_BYTES:
                call = await asyncio.to_thread(self._plan, session, conversation, budget)
            else:
                call = self._plan(session, conversation, budget)
        except BaseException:
            session.finish_call(n, held, [])
            raise
        session.shrink(held - call.reserved)
        return call

    def _plan(self, session: EpisodeSession, conversation: ModelCall, budget: int | None) -> PreparedCall:
        engine, renderer, settings = session.engine or self.engine, self.renderer, self.settings
        n = conversation.n
        messages = conversation.template_messages
        if messages is None:
            messages = [template_message(m) for m in conversation.messages]
        tools = conversation.tools
        try:
            plan = session.plan_prompt(renderer, messages, tools)
        except _TEMPLATE_ERRORS as error:
            # The template is code run on what the agent sent: any of these is the request's doing.
            raise APIError(
                400,
                f"The chat template rejected these messages: {type(error).__name__}: {error}",
                code="template_error",
            ) from None
        # tool_choice "required" / a named function: start the assistant turn with the template's tool-call opening
        # (prompt tokens, not sampled) so the model can only complete a call.
        forced: list[int] = []
        if (
            tools
            and (conversation.tool_choice == "required" or conversation.forced_tool_name)
            and (renderer.can_parse_tools)
        ):
            forced = renderer.tool_call_prefix(tools, conversation.forced_tool_name)
        prompt_ids = plan.prompt_ids + forced
        context = engine.max_context_length
        if len(prompt_ids) >= context:
            session.flags.add("context_overflow")
            raise APIError(
                400,
                f"This model's maximum context length is {context} tokens; the "
                f"{conversation.messages_param} take {len(prompt_ids)}.",
                code="context_length_exceeded",
                param=conversation.messages_param,
            )

        overrides = settings.overrides
        caps = [conversation.max_tokens or settings.default_max_tokens, context - len(prompt_ids)]
        caps += [c for c in (overrides.max_tokens, budget) if c is not None]
        sampling = SamplingParams(
            max_tokens=min(caps),
            temperature=_first(overrides.temperature, conversation.temperature, 1.0),
            top_p=_first(overrides.top_p, conversation.top_p, 1.0),
            top_k=_first(overrides.top_k, conversation.top_k, 0),
            min_p=_first(overrides.min_p, 0.0),
            repetition_penalty=_first(overrides.repetition_penalty, 1.0),
            # The request's seed, else one from the episode's seed and this call's index (taken by every call): not
            # from the order calls reach the engine, which concurrent episodes change from run to run (issue 29).
            seed=_first(conversation.seed, session.call_seed()),
            stop_token_ids=sorted(renderer.end_of_turn_ids),
            top_logprobs=conversation.top_logprobs,
        )
        reserved = sampling.max_tokens * n if budget is not None else 0
        replayed, divergence = session.replay_call(prompt_ids, n, sampling.max_tokens)
        if divergence is not None and "token_index" in divergence:
            recorded = session.replay.calls[divergence["call"]].prompt_ids
            divergence.update(divergence_context(self.tokenizer, prompt_ids, recorded))
        return PreparedCall(
            session, conversation, messages, plan, forced, prompt_ids, sampling, reserved, False, replayed, divergence
        )

    async def run(
        self,
        call: PreparedCall,
        request: Request,
        on_delta: Callable[[Delta], None] | None = None,
        client_gone: asyncio.Event | None = None,
    ) -> Completion:
        """Sample a prepared call and record its turns; `on_delta` receives each choice's text as it is sampled (when
        the engine streams, else at the end), `client_gone` set means the client went away (as a disconnect does).

        Finishes the call `prepare` admitted, however it ends. Raises `APIError` for a closed episode (409, the answer
        is not recorded) and a client that went away (499).
        """
        try:
            return await self._run(call, request, on_delta, client_gone)
        finally:
            call.finish()  # whatever ended the call early (an engine error, a bug): its admission is released

    async def _run(
        self,
        call: PreparedCall,
        request: Request,
        on_delta: Callable[[Delta], None] | None,
        client_gone: asyncio.Event | None,
    ) -> Completion:
        engine, renderer = call.session.engine or self.engine, self.renderer  # the episode's version's engine
        conversation, plan, forced = call.conversation, call.plan, call.forced
        messages, tools, prompt_ids, sampling = call.messages, conversation.tools, call.prompt_ids, call.sampling
        n = conversation.n
        started = time.monotonic()
        replayed = call.replayed

        def turn_of(out: GenerationOutput | None, message: dict, finish: str, malformed: bool = False) -> Turn:
            if replayed is not None and out is not None:
                return replayed_turn(replayed, call, time.monotonic() - started)
            return Turn(
                index=0,
                prompt_ids=prompt_ids,
                completion_ids=out.token_ids if out else [],
                logprobs=out.logprobs if out else [],
                finish_reason=finish,
                policy_version=out.versions[0] if out and out.versions else engine.policy_version,
                token_versions=out.versions if out and out.versions and out.versions[-1] != out.versions[0] else None,
                request_messages=conversation.messages,
                request_tools=tools,
                response_message=message,
                prompt_source=plan.source,
                parent_turn=plan.parent,
                drift=plan.drift,
                fork_reason=plan.fork_reason,
                malformed_tool_call=malformed,
                forced_tokens=len(forced),
                sampling=sampling.to_dict(),
                requested_sampling=conversation.requested,
                wall_time=time.monotonic() - started,
                wire_format=conversation.wire_format,
                replay_divergence=call.divergence,
            )

        parse_tools = conversation.tool_choice != "none"
        streams = [self._answer_stream(i, call, parse_tools, on_delta) for i in range(n)] if on_delta else None
        if replayed is not None:  # a branch's replayed call (n == 1): the parent's completion, nothing sampled
            samples = [replay_output(replayed, streams[0].feed if streams else None)]
        else:
            samples = [
                engine.generate(prompt_ids, _with_seed(sampling, sampling.seed, i), on_token=streams[i].feed)
                if streams and self.engine_streams
                else engine.generate(prompt_ids, _with_seed(sampling, sampling.seed, i))
                for i in range(n)
            ]
        generation = asyncio.ensure_future(asyncio.gather(*samples))
        generation.add_done_callback(lambda future: future.cancelled() or future.exception())  # cancelled: unread
        watchers = {asyncio.ensure_future(_wait_for_disconnect(request))}
        if client_gone is not None:
            watchers.add(asyncio.ensure_future(client_gone.wait()))
        try:
            await asyncio.wait({generation, *watchers}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            generation.cancel()
            raise
        finally:
            for watcher in watchers:
                watcher.cancel()
        if not generation.done():
            # The client went away: stop sampling, and record the call as cancelled (never trained, never a parent),
            # so that a retry of the same request continues from the last answer the agent actually received.
            generation.cancel()
            cancelled = [(turn_of(None, {}, "cancelled"), messages, tools, plan.keys) for _ in range(n)]
            call.finish(cancelled)
            raise APIError(
                499, "The client closed the connection before the answer was ready.", code="client_closed_request"
            )
        outputs = generation.result()
        choices, turns = [], []
        for out in outputs:
            if replayed is not None:  # the recorded answer as it was returned (its tool-call ids included)
                message = copy.deepcopy(replayed.response_message)
                turns.append((turn_of(out, message, replayed.finish_reason), messages, tools, plan.keys))
                choices.append(Choice(message, replayed.finish_reason, out, None))
                continue
            out, stopped_text, stop = apply_stop_strings(self.tokenizer, out, conversation.stop)
            message, malformed = renderer.parse(
                forced + out.token_ids,
                plan.prompt_ids,
                tools,
                parse_tools=parse_tools,
                split_reasoning=conversation.split_reasoning,
            )
            if message.get("tool_calls") and not _strict_json_arguments(message["tool_calls"]):
                # Python's parser takes NaN, 1e999 and lone surrogates; JSON has none of them, and the Messages
                # answer could not be written (a 500 after the turn was recorded). A broken tool call, as any other.
                message, malformed = renderer.unreadable_message(forced + out.token_ids, plan.prompt_ids), True
            if stopped_text is not None:
                message = {"role": "assistant", "content": stopped_text}
            finish = "tool_calls" if message.get("tool_calls") else out.finish_reason
            turns.append((turn_of(out, message, finish, malformed), messages, tools, plan.keys))
            choices.append(Choice(message, finish, out, stop))
        if not call.finish(turns):
            raise APIError(
                409,
                "The episode was closed while this call was running; its answer is not recorded.",
                code="episode_closed",
            )
        if streams:
            for stream, choice in zip(streams, choices, strict=True):
                stream.finish(choice.message, choice.output.token_ids)  # not streamed: split per token
        return Completion(choices, len(prompt_ids), engine.policy_version)

    def _answer_stream(
        self, index: int, call: PreparedCall, parse_tools: bool, on_delta: Callable[[Delta], None]
    ) -> AnswerStream:
        conversation, renderer = call.conversation, self.renderer
        tools = conversation.tools
        parsed = renderer.can_parse_tools and ((parse_tools and tools) or conversation.split_reasoning)
        stream = AnswerStream(
            index,
            self.tokenizer,
            on_delta,
            response_template=self.tokenizer.response_template if parsed else None,
            prefix_ids=renderer.prompt_tail(call.plan.prompt_ids),
            tools=tools if parse_tools else None,
            stops=conversation.stop,
            pieces=lambda ids, text: content_pieces(self.tokenizer, ids, text),
            strip_content=bool(parse_tools and tools),
            hold_ids=self.hold_ids,
        )
        if call.forced and (self.engine_streams or call.replayed is not None):
            stream.feed(call.forced)  # the tool-call opening the prompt ends with: what the parser reads first
        return stream


def _strict_json_arguments(tool_calls: list[dict]) -> bool:
    """Whether every call's arguments are strict JSON (`protocol.parse_json_body`: what any client can parse)."""
    try:
        for call in tool_calls:
            arguments = call["function"]["arguments"]
            # `json.dumps` wrote them: NaN, infinities and lone surrogates can only show as these (a few us saved).
            if "NaN" in arguments or "Infinity" in arguments or "\\ud" in arguments:
                parse_json_body(arguments)
    except ValueError:
        return False
    return True


def _dropped_special_ids(tokenizer) -> frozenset[int]:
    """Ids whose text `decode(..., skip_special_tokens=True)` drops (special added tokens)."""
    candidates = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return frozenset(
        i for i in candidates if tokenizer.decode([i]) and not tokenizer.decode([i], skip_special_tokens=True)
    )


_TEMPLATE_ERRORS = (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError)


async def _relay(task: asyncio.Future, queue: asyncio.Queue, gone: asyncio.Event) -> AsyncIterator[Delta | Completion]:
    # The deltas of a started call, then its Completion; a consumer that leaves early tells the call its client went.
    try:
        while (delta := await queue.get()) is not None:
            yield delta
        yield task.result()
    finally:
        if not task.done():
            gone.set()
            with contextlib.suppress(BaseException):
                await asyncio.shield(task)


async def _wait_for_disconnect(request: Request) -> None:
    # Once the body is read, the next ASGI message of a request is its client disconnecting.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _first(*values):
    return next((v for v in values if v is not None), None)


def _with_seed(sampling: SamplingParams, seed: int | None, i: int) -> SamplingParams:
    # Choice `i` of a seeded call samples from `seed + i` (the call's own seed or its episode's derived one).
    if seed is None or i == 0:
        return sampling
    return SamplingParams(**{**sampling.to_dict(), "seed": seed + i})


def apply_stop_strings(
    tokenizer, out: GenerationOutput, stops: list[str]
) -> tuple[GenerationOutput, str | None, str | None]:
    """Cut the sampled ids after the token that completes the first stop string (those tokens were sampled and are
    kept); the returned content ends before the stop string, as OpenAI does. Returns `(output, content, stop)`,
    `content` and `stop` `None` when no stop string was found."""
    if not stops:
        return out, None, None
    text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return out, None, None
    position, stop = min(hits)
    pieces = text_pieces(tokenizer, out.token_ids)
    if "".join(piece for _, piece in pieces) != text:  # the decoder is not incremental: decode prefixes instead
        ends = [
            (k, len(tokenizer.decode(out.token_ids[:k], skip_special_tokens=True)))
            for k in range(1, len(out.token_ids) + 1)
        ]
    else:
        ends, length = [], 0
        for k, piece in pieces:
            length += len(piece)
            ends.append((k, length))
    k = next((k for k, length in ends if length >= position + len(stop)), len(out.token_ids))
    top = out.top_logprobs[:k] if out.top_logprobs is not None else None
    versions = out.versions[:k] if out.versions is not None else None
    return GenerationOutput(out.token_ids[:k], out.logprobs[:k], "stop", top, versions), text[:position], stop


def text_pieces(tokenizer, token_ids: list[int]) -> list[tuple[int, str]]:
    """The decoded text as `(end, piece)` pairs, `piece` completed by `token_ids[:end]`, in linear time.

    Incremental detokenization (as vLLM does it): each step decodes only the tokens since the previous piece, with
    one piece of left context (so tokenizers that drop a leading space still add up), and holds back text that ends
    in an incomplete UTF-8 character.
    """
    pieces, prefix_start, read_start = [], 0, 0
    for k in range(len(token_ids)):
        prefix = tokenizer.decode(token_ids[prefix_start:read_start], skip_special_tokens=True)
        text = tokenizer.decode(token_ids[prefix_start : k + 1], skip_special_tokens=True)
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            pieces.append((k + 1, text[len(prefix) :]))
            prefix_start, read_start = read_start, k + 1
    return pieces


def content_pieces(tokenizer, token_ids: list[int], content: str) -> list[str]:
    """Split `content` into per-token pieces for streaming; one piece when they don't add up to it (e.g. content
    parsed out of a tool call, or after reasoning)."""
    if not content:
        return []
    pieces = [piece for _, piece in text_pieces(tokenizer, token_ids)]
    return pieces if "".join(pieces) == content else [content]
