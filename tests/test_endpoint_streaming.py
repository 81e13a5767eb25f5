"""Live streaming (issue #12 item 4) with the official clients against a real endpoint and a real tiny model: the first
text leaves while the model is still sampling, for Chat Completions, Responses and Anthropic Messages; the streamed
text and tool calls equal the non-streamed answer of the same seed; tool-call markup never leaks as text; a client
that hangs up mid-stream stops the sampling, and the call is recorded as cancelled.

"While still sampling" is an ordering, not a timing: a forward hook holds the model's worker thread at a decode step
until the client has seen text (`Gate`). Without live streaming no text could reach the client before the model
finishes, and the gate would give up.
"""

import json
import threading

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import types as genai_types

from conftest import CALCULATOR_TOOL, TOOL_SYSTEM_PROMPT, ScriptedEngine
from trl_agentic.endpoint.app import SamplingOverrides
from trl_agentic.endpoint.chat import ChatRenderer
from trl_agentic.endpoint.streaming import AnswerStream
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


pytestmark = pytest.mark.usefixtures("single_torch_thread")

FORMATS = ["chat_completions", "responses", "anthropic_messages"]
PROMPT = "Tell me a story."
GIVE_UP_S = 60  # the gate's deadlock guard, never an assertion on time


class Gate:
    """Counts the model's forward passes; when armed, holds the sampling thread at pass `at` until `open_` is called
    (from the client thread) or `GIVE_UP_S` passes."""

    def __init__(self, model, at: int = 12):
        self.at, self.calls, self.armed = at, 0, False
        self.opened_by_client = None
        self.calls_when_held = None
        self._event = threading.Event()
        model.register_forward_hook(self._hook)

    def arm(self):
        self.calls, self.armed, self.opened_by_client, self.calls_when_held = 0, True, None, None
        self._event.clear()

    def open_(self):
        self._event.set()

    def _hook(self, module, args, output):
        if not self.armed:
            return
        self.calls += 1
        if self.calls == self.at:
            self.calls_when_held = self.calls
            self.opened_by_client = self._event.wait(GIVE_UP_S)


@pytest.fixture(scope="module")
def random_policy():
    tokenizer = build_tiny_tokenizer("qwen2_5")
    model = build_tiny_model(tokenizer).eval()
    return model, tokenizer, Gate(model)


@pytest.fixture(scope="module")
def random_server(start_server, random_policy):
    model, tokenizer, _ = random_policy
    # Every call samples 64 tokens (the engine stops only at max_tokens or the end-of-turn token).
    return start_server(model, tokenizer, overrides=SamplingOverrides(max_tokens=64))


@pytest.fixture(scope="module")
def tool_server(start_server, tool_model):
    return start_server(tool_model.model, tool_model.tokenizer)


def client_for(server, session, wire_format):
    if wire_format == "anthropic_messages":
        return anthropic.Anthropic(base_url=server.url, api_key=session.key, max_retries=0, timeout=120)
    return openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=120)


def ask(client, wire_format, stream, on_text=lambda: None, tools=None, seed=3, system=None, question=PROMPT, **kwargs):
    """One call in `wire_format`: returns `(text, tool calls [(name, arguments dict)])`; when streaming, `on_text` runs
    at the first piece of text that arrives, and the text is what the deltas add up to."""
    text, calls = "", []
    if wire_format == "chat_completions":
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
        body = {"model": "policy", "messages": messages, "seed": seed, **kwargs}
        if tools:
            body["tools"] = tools
        if not stream:
            message = client.chat.completions.create(**body).choices[0].message
            return message.content or "", [
                (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []
            ]
        arguments = {}
        for chunk in client.chat.completions.create(**body, stream=True):
            for choice in chunk.choices:
                if choice.delta.content:
                    text += choice.delta.content
                    on_text()
                for call in choice.delta.tool_calls or []:
                    name, args = arguments.get(call.index, ("", ""))
                    arguments[call.index] = (name + (call.function.name or ""), args + (call.function.arguments or ""))
        return text, [(name, json.loads(args)) for name, args in arguments.values()]
    if wire_format == "responses":
        if "max_tokens" in kwargs:
            kwargs["max_output_tokens"] = kwargs.pop("max_tokens")
        body = {"model": "policy", "input": question, "extra_body": {"seed": seed}, **kwargs}
        if system:
            body["instructions"] = system
        if tools:
            body["tools"] = [{"type": "function", **t["function"]} for t in tools]
        if not stream:
            response = client.responses.create(**body)
        else:
            with client.responses.stream(**body) as events:
                for event in events:
                    if event.type == "response.output_text.delta":
                        text += event.delta
                        on_text()
                    elif event.type in ("response.completed", "response.incomplete"):
                        response = event.response
        calls = [(item.name, json.loads(item.arguments)) for item in response.output if item.type == "function_call"]
        return (text if stream else response.output_text), calls
    body = {
        "model": "policy",
        "max_tokens": kwargs.pop("max_tokens", 64),
        "messages": [{"role": "user", "content": question}],
        "extra_body": {"seed": seed, **kwargs},
    }  # this anthropic release takes no `temperature` argument
    if system:
        body["system"] = system
    if tools:
        body["tools"] = [
            {
                "name": t["function"]["name"],
                "description": t["function"]["description"],
                "input_schema": t["function"]["parameters"],
            }
            for t in tools
        ]
    if not stream:
        message = client.messages.create(**body)
    else:
        with client.messages.stream(**body) as events:
            for piece in events.text_stream:
                text += piece
                on_text()
            message = events.get_final_message()
    calls = [(block.name, block.input) for block in message.content if block.type == "tool_use"]
    return (text if stream else "".join(b.text for b in message.content if b.type == "text")), calls


@pytest.mark.parametrize("wire_format", FORMATS)
def test_text_streams_while_the_model_samples(random_server, random_policy, wire_format):
    _, _, gate = random_policy
    # Sampled, not greedy (this random model's greedy answer is all newlines, which Responses and Messages hold back:
    # whitespace may come before a `<think>`, issue 40), in two episodes of one seed: their first calls sample alike.
    plain_session, session = random_server.open_episode(seed=5), random_server.open_episode(seed=5)
    plain, _ = ask(client_for(random_server, plain_session, wire_format), wire_format, stream=False)

    gate.arm()
    client = client_for(random_server, session, wire_format)
    streamed, _ = ask(client, wire_format, stream=True, on_text=gate.open_)
    gate.armed = False
    assert gate.calls_when_held == gate.at and gate.opened_by_client  # the client saw text mid-sampling...
    assert gate.calls > gate.at  # ...and the model went on sampling after that
    assert streamed == plain and len(plain) > 20
    (first,) = random_server.close_episode(plain_session.episode.id).turns
    (second,) = random_server.close_episode(session.episode.id).turns
    assert len(first.completion_ids) > gate.at
    assert (second.prompt_ids, second.completion_ids) == (first.prompt_ids, first.completion_ids)
    assert second.logprobs == pytest.approx(first.logprobs, abs=1e-5)  # recorded alike, streamed or not
    assert second.wire_format == wire_format


@pytest.mark.parametrize("wire_format", FORMATS)
def test_streamed_tool_calls_equal_the_answer_and_no_markup_leaks(tool_server, wire_format):
    session = tool_server.open_episode()
    client = client_for(tool_server, session, wire_format)
    kwargs = {
        "temperature": 0.0,
        "tools": [CALCULATOR_TOOL],
        "system": TOOL_SYSTEM_PROMPT,
        "question": "What is 2 + 3?",
    }
    plain = ask(client, wire_format, stream=False, **kwargs)
    streamed = ask(client, wire_format, stream=True, **kwargs)
    assert streamed == plain
    text, calls = streamed
    assert calls == [("calculator", {"expression": "2 + 3"})]
    assert "<tool_call>" not in text and "</tool_call>" not in text and "{" not in text
    first, second = tool_server.close_episode(session.episode.id).turns
    assert second.completion_ids == first.completion_ids and second.finish_reason == "tool_calls"


def test_client_hanging_up_mid_stream_stops_sampling(random_server, random_policy):
    _, _, gate = random_policy
    session = random_server.open_episode()
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": PROMPT}],
        "seed": 3,
        "stream": True,
        "max_tokens": 64,
    }
    gate.arm()
    with httpx.stream(
        "POST",
        f"{random_server.base_url}/chat/completions",
        json=body,
        timeout=120,
        headers={"Authorization": f"Bearer {session.key}"},
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break  # the first text: hang up
    gate.open_()
    episode = random_server.call(_closed_when_idle(session))
    gate.armed = False
    (turn,) = episode.turns
    assert turn.finish_reason == "cancelled" and turn.completion_ids == []
    assert gate.calls < 64  # sampling stopped early
    assert episode.metadata.get("late_turns") is None


async def _closed_when_idle(session):
    import asyncio

    for _ in range(GIVE_UP_S * 20):
        if session.in_flight == 0:
            break
        await asyncio.sleep(0.05)
    return session.close()


def test_answer_stream_holds_partial_characters_markup_and_stop_strings(random_policy):
    """`AnswerStream` alone: UTF-8 split across tokens, a tool call after text, a stop string."""
    _, tokenizer, _ = random_policy
    deltas = []
    stream = AnswerStream(0, tokenizer, deltas.append)
    ids = tokenizer.encode("naïve 🙂 café", add_special_tokens=False)
    for token in ids:
        stream.feed([token])
        assert "\ufffd" not in "".join(d.text for d in deltas)
    stream.finish({"role": "assistant", "content": "naïve 🙂 café"})
    assert "".join(d.text for d in deltas) == "naïve 🙂 café" and len(deltas) > 3

    deltas.clear()
    stream = AnswerStream(
        0, tokenizer, deltas.append, response_template=tokenizer.response_template, tools=[CALCULATOR_TOOL]
    )
    text = 'Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
    for token in tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]:
        stream.feed([token])
    assert "".join(d.text for d in deltas) == "Let me compute."  # the markup never left
    stream.finish({"role": "assistant", "content": "Let me compute."})
    assert "".join(d.text for d in deltas) == "Let me compute." and not stream.diverged

    deltas.clear()
    stream = AnswerStream(0, tokenizer, deltas.append, stops=["STOP"])
    for token in tokenizer.encode("one two STOP three", add_special_tokens=False):
        stream.feed([token])
    assert "STOP" not in "".join(d.text for d in deltas)
    stream.finish({"role": "assistant", "content": "one two "})
    assert "".join(d.text for d in deltas) == "one two "


class FeedingEngine(ScriptedEngine):
    """A scripted engine of the streaming contract that hands each token to `on_token` itself, before it returns (as
    the vLLM server engine does): an exception in the stream's feed escapes its `generate`."""

    async def generate(self, prompt_ids, sampling, on_token=None):
        out = await super().generate(prompt_ids, sampling)
        for token, logprob in zip(out.token_ids, out.logprobs):
            if on_token is not None:
                on_token([token], [logprob])
        return out


# Tool calls the model closes with arguments that are no JSON: broken, with an integer past Python's 4300-digit limit,
# or with what Python's parser takes but JSON has not (NaN, a number past float range, a lone UTF-16 surrogate: the
# Messages answer could not be written, a 500 after the turn was recorded).
BROKEN_CALLS = {
    "nan": '<tool_call>\n{"name": "calculator", "arguments": {"expression": NaN}}\n</tool_call>',
    "infinity": '<tool_call>\n{"name": "calculator", "arguments": {"expression": 1e999}}\n</tool_call>',
    "lone_surrogate": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "\\ud800"}}\n</tool_call>',
    "broken_json": 'Let me. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}\n</tool_call>',
    "huge_integer": '<tool_call>\n{"name": "calculator", "arguments": {"expression": '
    + "7" * 4301
    + "}}\n</tool_call>",
}


@pytest.mark.parametrize("case", BROKEN_CALLS)
@pytest.mark.parametrize("wire_format", FORMATS)
def test_broken_tool_call_is_answered_and_recorded_alike_streamed_or_not(
    start_server, random_policy, wire_format, case
):
    # The streaming parser's error escaped the stream's feed: an internal error, and no turn recorded.
    _, tokenizer, _ = random_policy
    engine = FeedingEngine(tokenizer, lambda prompt: BROKEN_CALLS[case], max_context_length=16384)
    server = start_server(engine, tokenizer)
    session = server.open_episode()
    client = client_for(server, session, wire_format)
    kwargs = {"tools": [CALCULATOR_TOOL], "system": TOOL_SYSTEM_PROMPT, "max_tokens": 8192}
    plain = ask(client, wire_format, stream=False, **kwargs)
    streamed = ask(client, wire_format, stream=True, **kwargs)
    assert streamed == plain == (BROKEN_CALLS[case], [])  # the raw text, as the model wrote it
    first, second = server.close_episode(session.episode.id).turns
    assert first.malformed_tool_call and second.malformed_tool_call
    assert (
        (second.completion_ids, second.finish_reason)
        == (first.completion_ids, first.finish_reason)
        == (tokenizer.encode(BROKEN_CALLS[case], add_special_tokens=False) + [tokenizer.eos_token_id], "stop")
    )
    assert second.response_message == first.response_message


# A special token sampled mid-answer (a plain decode drops its text; the template's parser keeps it), with and without
# reasoning, tools offered or not.
SPECIAL_TOKEN_ANSWERS = {
    "text": "Hello<|im_start|> world",
    "text_then_call": 'Hi<|im_start|> there <tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}\n'
    "</tool_call>",
    "broken_call": 'Hi<|im_start|> there <tool_call>\n{"name": "calculator"\n</tool_call>',
}


@pytest.mark.parametrize("tools", [None, [CALCULATOR_TOOL]], ids=["no_tools", "tools"])
@pytest.mark.parametrize("case", SPECIAL_TOKEN_ANSWERS)
@pytest.mark.parametrize("wire_format", FORMATS)
def test_special_token_in_the_answer_streams_what_is_recorded(start_server, random_policy, wire_format, case, tools):
    # Streamed Responses / Messages text was "Hello<|im_start|> world", the recorded answer "Hello world": the agent's
    # next call did not match the history and forked.
    _, tokenizer, _ = random_policy
    assert tokenizer.decode(tokenizer.encode("<|im_start|>", add_special_tokens=False), skip_special_tokens=True) == ""
    server = start_server(FeedingEngine(tokenizer, lambda prompt: SPECIAL_TOKEN_ANSWERS[case]), tokenizer)
    session = server.open_episode()
    client = client_for(server, session, wire_format)
    plain = ask(client, wire_format, stream=False, tools=tools, max_tokens=200)
    streamed = ask(client, wire_format, stream=True, tools=tools, max_tokens=200)
    assert streamed == plain
    first, second = server.close_episode(session.episode.id).turns
    assert (
        first.response_message == {**second.response_message, "tool_calls": first.response_message.get("tool_calls")}
        if tools and case == "text_then_call"
        else second.response_message
    )
    assert streamed[0] == (second.response_message["content"] or "")


def ask_reasoned(client, wire_format, stream, question, tools=None):
    """One call: `(reasoning, text, tool calls [(name, arguments dict)])`; streamed, what the deltas add up to."""
    reasoning = text = ""
    if wire_format == "chat_completions":
        body = {"model": "policy", "messages": [{"role": "user", "content": question}]}
        if tools:
            body["tools"] = tools
        if not stream:
            message = client.chat.completions.create(**body).choices[0].message
            return (
                getattr(message, "reasoning_content", None) or "",
                message.content or "",
                [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []],
            )
        arguments = {}
        for chunk in client.chat.completions.create(**body, stream=True):
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                text += choice.delta.content or ""
                for call in choice.delta.tool_calls or []:
                    name, args = arguments.get(call.index, ("", ""))
                    arguments[call.index] = (name + (call.function.name or ""), args + (call.function.arguments or ""))
        return reasoning, text, [(name, json.loads(args)) for name, args in arguments.values()]
    if wire_format == "responses":
        body = {"model": "policy", "input": question}
        if tools:
            body["tools"] = [{"type": "function", **t["function"]} for t in tools]
        if not stream:
            response = client.responses.create(**body)
            reasoning = "".join(
                part.text for item in response.output if item.type == "reasoning" for part in item.content or []
            )
            text = response.output_text
        else:
            with client.responses.stream(**body) as events:
                for event in events:
                    if event.type == "response.output_text.delta":
                        text += event.delta
                    elif event.type == "response.reasoning_text.delta":
                        reasoning += event.delta
                    elif event.type in ("response.completed", "response.incomplete"):
                        response = event.response
        calls = [(item.name, json.loads(item.arguments)) for item in response.output if item.type == "function_call"]
        return reasoning, text, calls
    body = {"model": "policy", "max_tokens": 200, "messages": [{"role": "user", "content": question}]}
    if tools:
        body["tools"] = [
            {
                "name": t["function"]["name"],
                "description": t["function"]["description"],
                "input_schema": t["function"]["parameters"],
            }
            for t in tools
        ]
    if not stream:
        message = client.messages.create(**body)
        reasoning = "".join(b.thinking for b in message.content if b.type == "thinking")
        text = "".join(b.text for b in message.content if b.type == "text")
    else:
        with client.messages.stream(**body) as events:
            for event in events:
                if event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                    reasoning += event.delta.thinking
                elif event.type == "content_block_delta" and event.delta.type == "text_delta":
                    text += event.delta.text
            message = events.get_final_message()
    return reasoning, text, [(block.name, block.input) for block in message.content if block.type == "tool_use"]


# A thinking model's answers whose tool call cannot be read (or, without tools, is not offered): the reasoning has
# streamed by the time the call turns out unreadable, and so may the text before it.
BROKEN = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}\n</tool_call>'
REASONED_ANSWERS = {
    "broken_call": "<think>\nAdd them.\n</think>\n\n" + BROKEN,
    "text_then_broken_call": "<think>\nAdd them.\n</think>\n\nLet me. " + BROKEN,
    "whitespace_then_reasoning": "\n<think>\nAdd them.\n</think>\n\n" + BROKEN,
    "whitespace_then_text": "  Let me. " + BROKEN,
    "nan_call": '<think>\nAdd them.\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"expression": NaN}}'
    "\n</tool_call>",
    "call": '<think>\nAdd them.\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}'
    "\n</tool_call>",
    "text": "<think>\nAdd them.\n</think>\n\nIt is 5.",
}


@pytest.fixture(scope="module")
def thinking_tokenizer():
    return build_tiny_tokenizer("qwen3")


@pytest.fixture(scope="module")
def thinking_server(start_server, thinking_tokenizer):
    # Answers the case its question names.
    tokenizer = thinking_tokenizer

    def respond(prompt_ids):
        prompt = tokenizer.decode(prompt_ids)
        return next(answer for case, answer in REASONED_ANSWERS.items() if f"case {case}<" in prompt)

    return start_server(FeedingEngine(tokenizer, respond), tokenizer), tokenizer


@pytest.mark.parametrize("tools", [None, [CALCULATOR_TOOL]], ids=["no_tools", "tools"])
@pytest.mark.parametrize("wire_format", FORMATS)
def test_reasoning_then_unreadable_tool_call_streams_what_is_recorded(thinking_server, wire_format, tools):
    # The reasoning (and the text before the call) streamed, then the unreadable call made the answer the whole text
    # as content, reasoning markup included: the streamed reasoning was no part of the answer, its content not what
    # streamed, and the agent's next call forked.
    server, tokenizer = thinking_server
    session = server.open_episode()
    client = client_for(server, session, wire_format)
    answers = {}
    for case, answer in REASONED_ANSWERS.items():
        question = f"case {case}"
        plain = answers[case] = ask_reasoned(client, wire_format, stream=False, question=question, tools=tools)
        streamed = ask_reasoned(client, wire_format, stream=True, question=question, tools=tools)
        assert streamed == plain, case
        reasoning, text, calls = plain
        split = tools is not None or wire_format != "chat_completions"  # Chat Completions splits only with tools
        if split and "<think>" in answer:
            assert reasoning == "Add them." and "think>" not in text, case  # split as a readable answer is
        if not (tools and case == "call"):
            assert calls == [] and ("<tool_call>" in text or case == "text"), case
    turns = server.close_episode(session.episode.id).turns
    for k, (case, answer) in enumerate(REASONED_ANSWERS.items()):
        first, second = turns[2 * k : 2 * k + 2]
        assert (
            first.completion_ids
            == second.completion_ids
            == tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        )
        for turn in (first, second):  # the recorded answer, as the agent got it (and sends it back)
            message = turn.response_message
            assert (message.get("reasoning_content") or "", message["content"] or "") == answers[case][:2], case
        unreadable = tools is not None and case not in ("call", "text")
        assert first.malformed_tool_call == second.malformed_tool_call == unreadable, case


@pytest.mark.parametrize("tools", [None, [CALCULATOR_TOOL]], ids=["no_tools", "tools"])
@pytest.mark.parametrize("case", REASONED_ANSWERS)
def test_answer_stream_adds_up_to_the_parsed_reasoning_and_content(thinking_tokenizer, case, tools):
    """`AnswerStream` alone, fed token by token as the engine does and built as the service builds it (tools parsed,
    or only the reasoning split, as Responses and Messages do without tools): the deltas of each kind add up to the
    parsed message's, and the stream never `diverged`."""
    tokenizer = thinking_tokenizer
    renderer = ChatRenderer(tokenizer)
    prompt = renderer.render([{"role": "user", "content": "What is 2 + 3?"}], tools)
    ids = tokenizer.encode(REASONED_ANSWERS[case], add_special_tokens=False) + [tokenizer.eos_token_id]
    message, _ = renderer.parse(ids, prompt, tools, split_reasoning=True)
    deltas = []
    stream = AnswerStream(
        0,
        tokenizer,
        deltas.append,
        response_template=tokenizer.response_template,
        prefix_ids=renderer.prompt_tail(prompt),
        tools=tools,
        strip_content=tools is not None,
    )
    for token in ids:
        stream.feed([token])
    stream.finish(message, ids)
    streamed = {kind: "".join(d.text for d in deltas if d.kind == kind) for kind in ("reasoning", "content")}
    expected = {"reasoning": message.get("reasoning_content") or "", "content": message["content"] or ""}
    assert streamed == expected and not stream.diverged
    if "<think>" in REASONED_ANSWERS[case]:
        assert expected["reasoning"] == "Add them."


# Text before the reasoning (issue 40 item 5): the parser keeps the last content region, so the answer was the text
# after `</think>`, while the stream had sent the text before `<think>` and never the rest; the agent sent back what it
# got, and its next call forked. Such an answer is not reasoned in the template's format: it is the text as written.
TEXT_BEFORE_REASONING = "Hello <think>\nAdd them.\n</think>\n\nIt is 5."
REASONING_FORMATS = ["responses", "anthropic_messages", "gemini"]


def ask_and_follow_up(server, session, wire_format, stream):
    """One call (streamed or not), then a second one that sends back the answer as the client assembled it, with a new
    user message. Returns the first answer as `(reasoning, text)`."""
    question, thanks = "What is 2 + 3?", "Thanks."
    if wire_format == "gemini":
        client = genai.Client(api_key=session.key, http_options=genai_types.HttpOptions(base_url=server.url))
        config = genai_types.GenerateContentConfig(
            thinking_config=genai_types.ThinkingConfig(include_thoughts=True), max_output_tokens=64
        )
        chat = client.chats.create(model="policy", config=config)  # keeps each streamed chunk in its history
        if stream:
            parts = [p for chunk in chat.send_message_stream(question) for p in chunk.candidates[0].content.parts]
        else:
            parts = chat.send_message(question).candidates[0].content.parts
        chat.send_message(thanks)
        return (
            "".join(p.text for p in parts if p.text and p.thought),
            "".join(p.text for p in parts if p.text and not p.thought),
        )
    client = client_for(server, session, wire_format)
    user = {"role": "user", "content": question}
    if wire_format == "anthropic_messages":
        body = {"model": "policy", "max_tokens": 64, "messages": [user]}
        if stream:
            with client.messages.stream(**body) as events:
                message = events.get_final_message()  # the SDK's message, assembled from the deltas
        else:
            message = client.messages.create(**body)
        blocks = [block.model_dump(exclude_none=True) for block in message.content]
        follow_up = [user, {"role": "assistant", "content": blocks}, {"role": "user", "content": thanks}]
        client.messages.create(model="policy", max_tokens=64, messages=follow_up)
        return (
            "".join(b.thinking for b in message.content if b.type == "thinking"),
            "".join(b.text for b in message.content if b.type == "text"),
        )
    reasoning = text = ""
    if stream:
        with client.responses.stream(model="policy", input=[user]) as events:
            for event in events:
                if event.type == "response.output_text.delta":
                    text += event.delta
                elif event.type == "response.reasoning_text.delta":
                    reasoning += event.delta
    else:
        response = client.responses.create(model="policy", input=[user])
        reasoning = "".join(p.text for item in response.output if item.type == "reasoning" for p in item.content or [])
        text = response.output_text
    items = [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": reasoning}]}]
    follow_up = [user, *(items if reasoning else []), {"role": "assistant", "content": text}]
    client.responses.create(model="policy", input=[*follow_up, {"role": "user", "content": thanks}])
    return reasoning, text


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3"])
@pytest.mark.parametrize("wire_format", REASONING_FORMATS)
def test_text_before_reasoning_streams_what_is_recorded_and_continues(start_server, wire_format, family):
    tokenizer = build_tiny_tokenizer(family)

    def respond(prompt_ids):  # the odd answer first, then a plain one
        return TEXT_BEFORE_REASONING if "Thanks." not in tokenizer.decode(prompt_ids) else "Bye."

    server = start_server(FeedingEngine(tokenizer, respond), tokenizer)
    answers, episodes = {}, {}
    for stream in (False, True):
        session = server.open_episode()
        answers[stream] = ask_and_follow_up(server, session, wire_format, stream)
        episodes[stream] = server.close_episode(session.episode.id)
    assert answers[True] == answers[False]
    for stream, episode in episodes.items():
        first, second = episode.turns
        assert first.completion_ids == tokenizer.encode(TEXT_BEFORE_REASONING, add_special_tokens=False) + [
            tokenizer.eos_token_id
        ]
        recorded = first.response_message
        assert (recorded.get("reasoning_content", ""), recorded["content"]) == answers[stream], stream
        assert episode.num_forks == 0 and second.prompt_source == "continued", stream
        assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == (
            first.prompt_ids + first.completion_ids
        )
    # The text as the model wrote it, no reasoning split out.
    assert answers[False] == ("", TEXT_BEFORE_REASONING)
