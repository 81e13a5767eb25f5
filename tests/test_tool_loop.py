"""The one tool loop (`rollout/tool_loop.py`): its stop conditions and what it sends, with a scripted client."""

import asyncio
import copy

from openai.types.chat import ChatCompletion

from trl_agentic.rollout.tool_loop import ToolLoop


def reply(content=None, *calls):
    """A completion whose message has `content` and tool calls `(name, arguments)`."""
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in enumerate(calls)
        ]
    return ChatCompletion.model_validate(
        {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": "policy",
            "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
        }
    )


class ScriptedClient:
    """An `AsyncOpenAI` stand-in: answers each `chat.completions.create` with the next reply, keeps the requests."""

    def __init__(self, replies):
        self.replies, self.requests = list(replies), []
        self.chat = self.completions = self

    async def create(self, **request):
        self.requests.append(copy.deepcopy(request))
        return self.replies.pop(0)


class Echo(ToolLoop):
    """Tools that echo their arguments; stops as the defaults say, or as the test sets."""

    def __init__(self, max_turns=None, stop_after=None, done_after=None):
        self.max_turns, self.stop_after, self.done_after, self.answered = max_turns, stop_after, done_after, 0

    def request(self):
        return {"model": "policy", "tools": [], "max_tokens": 8 + self.answered}

    def is_completed(self):
        return self.done_after is not None and self.answered >= self.done_after

    async def env_response(self, message, response):
        if self.stop_after is not None and self.answered >= self.stop_after:
            return None
        self.answered += 1
        return [{"role": "tool", "tool_call_id": c.id, "content": c.function.arguments} for c in message.tool_calls]


def run(hooks, replies):
    client = ScriptedClient(replies)
    messages = [{"role": "user", "content": "Echo."}]
    end = asyncio.run(hooks.run(client, messages))
    return end, messages, client.requests


def test_the_loop_answers_each_tool_call_until_the_model_answers():
    end, messages, requests = run(Echo(), [reply(None, ("echo", '"a"'), ("echo", '"b"')), reply("done")])
    assert (end.finish, end.turns, end.text) == ("answered", 2, "done")
    # The reply is sent back as returned (`content: null` kept), then one tool message per call, in call order
    assert messages[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "echo", "arguments": '"a"'}},
            {"id": "call_1", "type": "function", "function": {"name": "echo", "arguments": '"b"'}},
        ],
    }
    assert messages[2:4] == [
        {"role": "tool", "tool_call_id": "call_0", "content": '"a"'},
        {"role": "tool", "tool_call_id": "call_1", "content": '"b"'},
    ]
    assert messages[4] == {"role": "assistant", "content": "done"}
    # Each request is `request()` at that moment, with the conversation so far
    assert [r["max_tokens"] for r in requests] == [8, 9]
    assert [len(r["messages"]) for r in requests] == [1, 4]


def test_max_turns_stops_before_a_further_model_call():
    end, messages, requests = run(Echo(max_turns=2), [reply("", ("echo", "1"))] * 3)
    assert (end.finish, end.turns, len(requests)) == ("max_turns", 2, 2)
    assert messages[-1]["role"] == "tool"  # the last call's answer is kept
    end, messages, requests = run(Echo(max_turns=0), [])
    assert (end.finish, end.turns, end.message, end.text, requests) == ("max_turns", 0, None, "", [])


def test_env_response_none_stops_with_nothing_appended():
    end, messages, requests = run(Echo(stop_after=1), [reply("", ("echo", "1")), reply("x", ("echo", "2"))])
    assert (end.finish, end.turns, end.text) == ("stopped", 2, "x")
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]


def test_is_completed_is_checked_before_each_model_call():
    end, _, requests = run(Echo(done_after=1), [reply("", ("echo", "1"))])
    assert (end.finish, end.turns, len(requests)) == ("done", 1, 1)
    end, _, requests = run(Echo(done_after=0), [])
    assert (end.finish, end.turns, requests) == ("done", 0, [])
