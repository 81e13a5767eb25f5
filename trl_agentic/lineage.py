"""Lineage: which conversation each model call of an episode belongs to, and what each conversation is.

An agent's calls form conversations: a call continues a conversation when its prompt extends that conversation's last
prompt + completion (the endpoint's token-in continuation). Which conversation is the episode's main line is decided
when the episode closes, from lineage, never from call order (issue 31: opencode and Claude Code ask for a title
first, and that 5-token call became the main line while the real conversation was filed as a side call).

Rules, applied to the turns in the order they were recorded (the same turns always give the same answer). Prefix
relations (token ids, messages, tool-call ids) decide, with one other relation: a tool call handing its task to a new
conversation, narrowly (a whole user message that is the call's task, one conversation per call), and checked before the
message-prefix rules only because a sub-agent may share its parent's system prompt or history. Quoting alone and length
decide nothing, and call order only which conversation reaches the episode's end (issue 40: rules that took any quoted
tool argument for a handoff, and ranked the main line by length, filed compaction restarts and helper requests as
sub-agents, and made a compaction's summary request the main line):

1. A continuation (`prompt_source == "continued"`: its prompt extends its parent's exact ids, the parent found by its
   messages and the tool-call ids of its answer) belongs to its parent's conversation.
2. A request one of whose user messages after its last assistant message (all of them, in a conversation's first
   request) is, as a whole or as one of its text parts (`<system-reminder>` blocks set aside), a string argument of at
   least `MIN_HANDOFF_CHARS` characters of an earlier turn's tool call starts a sub-agent conversation, spawned by that
   turn: the harness handed the call's task to a new conversation (Claude Code's `Agent` prompt after its reminder,
   opencode's `task` prompt, Codex's `spawn_agent` message, fresh or after the parent's history with `fork_context`,
   whether the sub-agent's first request comes before or after its parent's next call). Each call spawns one
   conversation, the earliest call first: two calls with the same task spawn two sub-agents, however alike their
   requests. This comes before rules 3 and 4: opencode's and Codex's sub-agents keep the main line's system prompt, and
   parallel sub-agents send the same request.
3. A request rendered exactly as an earlier one (the same prompt ids: a second choice of `n > 1`, a retry) belongs to
   that one's conversation.
4. A request that shares a message prefix with an earlier turn (`Turn.forked_from`: a rewritten history, a compaction
   restart that keeps the system prompt, changed tools) belongs to that turn's conversation: a fork of it. Unless that
   is a sub-agent's and the request does not hold the sub-agent's task: then it shares only what the sub-agent
   shares with its parent (opencode's sub-agents keep the main line's system prompt) and belongs to the latest
   conversation no tool call spawned with the same system prompt (a compaction restart right after a sub-agent ran).
5. Anything else starts a conversation of its own (the first call; a title, summary or commit-message request).

6. When all turns are in: a conversation of its own (rule 5) whose first request quotes such an argument of an
   earlier tool call that spawned nothing else, and whose last answer comes back as that call's result (the tool
   message with the call's id holds it), was spawned by the call (a harness that wraps the task in text of its own).
   Quoting alone is not a handoff: a commit-message request quotes the file path of an `edit` call, a summary the
   paths the session touched.

Roles:

- `main`: among the conversations no tool call spawned, the one that holds the task's prompt (when it is known), then
  the one with tools, then the one that reaches the episode's end (its last call is the latest): a compaction
  restart continues the main line (rule 4), and a summary request, although it carries the task, the tools and the
  whole history, ends before the restart.
- `sub_agent`: a conversation a tool call spawned, at any depth.
- `side_call`: every other one (title, summary and commit-message requests, ...).

On the real harnesses, Claude Code 2.1.197 (tests/test_lineage.py) and opencode 1.18.33
(tests/test_harness_opencode.py), each with its title request first and a sub-agent, give one main line with 0 forks,
one side call and one sub-agent; Codex 0.171.0's `spawn_agent` sub-agents, with and without `fork_context`
(tests/test_harness_codex.py), one main line with 0 forks and one sub-agent (all re-run with the real programs under
these rules). opencode's and Codex's sub-agents get their task as a whole user message; Claude Code's as one string, a
`<system-reminder>` block then the `Agent` prompt (rule 2; rule 6 alone finds it too: its `Agent` result is the
sub-agent's answer and an `agentId` line). Nothing here needs a harness's own hints (Claude Code's session metadata,
Codex's `client_metadata`).
What it does not see: a sub-agent handed a task shorter than `MIN_HANDOFF_CHARS`, or reworded and whose answer does
not come back as its call's result (a side call, or a fork of the conversation whose history it carries); a
compaction restart that keeps neither the system prompt nor any message of its conversation (a side call).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .trace import Episode, Turn


CONVERSATION_ROLES = ("main", "side_call", "sub_agent")
# Shortest tool-call argument taken for a sub-agent's task: a task handed to a sub-agent is a sentence, while a user
# message as short as "ls" or "yes" may repeat an unrelated argument.
MIN_HANDOFF_CHARS = 16
# Fork reasons (endpoint/sessions.py) of a request that shares a message prefix with an earlier turn: a trace recorded
# before `Turn.forked_from` existed says which turn only through them (the latest one is taken).
_FORK_REASONS = ("history_rewritten", "template_not_append_only", "tools_changed")
# Context a harness puts in a user message beside the task it hands a sub-agent (Claude Code's reminders): not the task.
_REMINDER = re.compile(r"<system-reminder>.*?</system-reminder>", re.DOTALL)


@dataclass
class Conversation:
    """One conversation of an episode.

    Args:
        index: the index of its first turn (what `Turn.conversation` holds).
        role: `"main"`, `"side_call"` or `"sub_agent"`.
        turns: indices of its turns, in call order (forks and branches included).
        spawned_by: for a sub-agent, the turn whose tool call handed it its task.
    """

    index: int
    role: str = "side_call"
    turns: list[int] = field(default_factory=list)
    spawned_by: int | None = None


def find_conversations(turns: list[Turn], task_prompt: str | list[dict] | None = None) -> list[Conversation]:
    """The conversations of an episode's turns and their roles (rules in the module docstring); cancelled turns belong
    to none. Pure: the turns are not changed.

    Args:
        turns: the episode's turns in call order.
        task_prompt: the task as the dataset gives it (a string, or messages: their first user message), when known.

    Example:

    ```python
    >>> title = Turn(0, [1, 2], [3], [-0.1], "stop", request_messages=[{"role": "user", "content": "Title: add"}])
    >>> task = Turn(1, [5, 6], [7], [-0.1], "stop", request_messages=[{"role": "user", "content": "Add 2 and 3."}],
    ...             request_tools=[{"type": "function", "function": {"name": "add"}}], fork_reason="side_call")
    >>> [(c.index, c.role) for c in find_conversations([title, task])]
    [(0, 'side_call'), (1, 'main')]
    ```
    """
    conversations: dict[int, Conversation] = {}
    conversation_of: dict[int, int] = {}  # turn index -> conversation index
    calls: list[_Call] = []  # every tool call so far that hands over a task-sized string, in call order
    calls_by_task: dict[str, list[_Call]] = {}  # the same, by each string they hand over
    spawned: set[tuple[int, int]] = set()  # (turn, position) of the calls that started a conversation
    rendered: dict[tuple[int, ...], int] = {}  # prompt ids of rendered turns -> the first such turn
    root_with_system: dict[tuple[str, ...], int] = {}  # system block -> its latest turn in a conversation not spawned
    task_of: dict[int, tuple[str, ...]] = {}  # sub-agent conversation -> the task strings of the call that spawned it
    previous = None  # the latest delivered turn (for traces without `forked_from`)
    for turn in turns:
        if turn.finish_reason == "cancelled":
            continue
        home, spawned_by = None, None
        if turn.prompt_source == "continued" and turn.parent_turn in conversation_of:
            home = conversation_of[turn.parent_turn]  # rule 1
        elif (call := _spawning_call(turn, calls_by_task, spawned)) is not None:
            spawned.add(call.key)  # rule 2
            spawned_by = call.turn
            task_of[turn.index] = call.tasks
        elif (same := rendered.get(tuple(turn.prompt_ids))) is not None:
            home = conversation_of[same]  # rule 3
        elif turn.forked_from in conversation_of:
            home = conversation_of[turn.forked_from]  # rule 4
            if home in task_of and not any(t in _request_text(turn) for t in task_of[home]):
                # A request without the sub-agent's task is no fork of it: it shares only what the sub-agent shares
                # with its parent (opencode's keep the main line's system prompt), e.g. a compaction restart sent
                # right after the sub-agent ran. It continues the latest conversation with that system prompt that
                # no tool call spawned.
                home = conversation_of.get(root_with_system.get(_system_block(turn)), home)
        elif turn.forked_from is None and turn.fork_reason in _FORK_REASONS and previous is not None:
            home = conversation_of[previous]  # rule 4, in a trace that did not record `forked_from`
        if turn.prompt_source == "rendered":
            rendered.setdefault(tuple(turn.prompt_ids), turn.index)
        if home is None:  # rules 2 and 5
            home = turn.index
            conversations[home] = Conversation(
                home, "sub_agent" if spawned_by is not None else "side_call", spawned_by=spawned_by
            )
        conversations[home].turns.append(turn.index)
        conversation_of[turn.index] = home
        if conversations[home].spawned_by is None:
            root_with_system[_system_block(turn)] = turn.index
        for call in _task_calls(turn):
            calls.append(call)
            for task in call.tasks:
                calls_by_task.setdefault(task, []).append(call)
        previous = turn.index

    by_index = {turn.index: turn for turn in turns}
    _find_answered_spawns(conversations, by_index, calls, spawned)
    task_text = _task_text(task_prompt)
    roots = [c for c in conversations.values() if c.spawned_by is None]
    if roots:

        def rank(conversation: Conversation) -> tuple:
            members = [by_index[i] for i in conversation.turns]
            holds_task = bool(task_text) and task_text in _request_text(members[0])
            has_tools = any(turn.request_tools for turn in members)
            return holds_task, has_tools, conversation.turns[-1]  # the last: the one that reaches the end

        max(roots, key=rank).role = "main"
    return list(conversations.values())


def label_conversations(episode: Episode, task_prompt: str | list[dict] | None = None) -> list[Conversation]:
    """Decide the episode's conversations (`find_conversations`), write them into its turns (`Turn.conversation`,
    `role`, `spawned_by`) and make `episode.messages` the main line's final messages: its last call's messages and
    the answer. What the endpoint does when an episode closes."""
    conversations = find_conversations(episode.turns, task_prompt)
    by_index = {turn.index: turn for turn in episode.turns}
    for conversation in conversations:
        for index in conversation.turns:
            turn = by_index[index]
            turn.conversation, turn.role = conversation.index, conversation.role
            turn.spawned_by = conversation.spawned_by
        if conversation.role == "main":
            last = by_index[conversation.turns[-1]]
            episode.messages = [*last.request_messages, last.response_message]
    return conversations


def turn_conversations(turns: list[Turn]) -> dict[int, tuple[int, str]]:
    """`{turn index: (conversation, role)}` for the delivered turns: as labelled when the episode closed, or decided
    now from the turns (a trace recorded before lineage, an episode still open)."""
    delivered = [turn for turn in turns if turn.finish_reason != "cancelled"]
    if all(turn.conversation is not None and turn.role is not None for turn in delivered):
        return {turn.index: (turn.conversation, turn.role) for turn in delivered}
    return {index: (c.index, c.role) for c in find_conversations(turns) for index in c.turns}


def _text(content: Any) -> str:
    """The text of a message's content: a string, or the `text` of its parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _request_text(turn: Turn) -> str:
    return "\n".join(
        _text(m.get("content")) for m in turn.request_messages if isinstance(m, dict) and m.get("role") != "assistant"
    )


def _is_fresh(turn: Turn) -> bool:
    """A conversation's first request: nothing the model said before is in it."""
    return turn.prompt_source == "rendered" and not any(
        isinstance(m, dict) and m.get("role") == "assistant" for m in turn.request_messages
    )


def _system_block(turn: Turn) -> tuple[str, ...]:
    """The texts of the system (or developer) messages a request starts with."""
    block = []
    for message in turn.request_messages:
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer"):
            break
        block.append(_text(message.get("content")))
    return tuple(block)


@dataclass(frozen=True)
class _Call:
    """A tool call that hands over task-sized strings: its turn, its position in the turn's answer, its id."""

    turn: int
    position: int
    id: str | None
    tasks: tuple[str, ...]

    @property
    def key(self) -> tuple[int, int]:
        return self.turn, self.position


def _task_calls(turn: Turn) -> list[_Call]:
    """The tool calls of a turn's answer that hand over a task: each call's top-level string arguments (or its raw
    input, for a tool whose input is not a JSON object), at least `MIN_HANDOFF_CHARS` long, stripped."""
    found = []
    for position, call in enumerate(turn.response_message.get("tool_calls") or []):
        if not isinstance(call, dict):
            continue
        arguments = (call.get("function") or {}).get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        values = arguments.values() if isinstance(arguments, dict) else [arguments]
        tasks = tuple(v.strip() for v in values if isinstance(v, str) and len(v.strip()) >= MIN_HANDOFF_CHARS)
        if tasks:
            call_id = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else None
            found.append(_Call(turn.index, position, call_id, tasks))
    return found


def _new_user_texts(turn: Turn) -> set[str]:
    """The texts of the user messages after the request's last assistant message (all of them in a conversation's
    first request): each message's whole text and each of its text parts, stripped, each also without its
    `<system-reminder>` blocks (Claude Code 2.1.197 sends a sub-agent its `Agent` prompt after one, in one string)."""
    texts = set()
    for message in reversed(turn.request_messages):  # from the end: O(new messages), not O(history)
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            continue
        if message["role"] == "assistant":
            break
        content = message.get("content")
        found = [_text(content)] + ([_text([part]) for part in content] if isinstance(content, list) else [])
        texts.update(text.strip() for text in found)
        texts.update(_REMINDER.sub("", text).strip() for text in found if "<system-reminder>" in text)
    return texts


def _spawning_call(turn: Turn, calls_by_task: dict[str, list[_Call]], spawned: set[tuple[int, int]]) -> _Call | None:
    """The earliest call that has not spawned a conversation yet and whose task is, as a whole, one of the texts of
    the request's new user messages (rule 2). Looked up by text: a call's cost does not grow with the episode."""
    if turn.prompt_source != "rendered":
        return None
    found = [c for text in _new_user_texts(turn) for c in calls_by_task.get(text, ()) if c.key not in spawned]
    return min(found, key=lambda c: c.key, default=None)


def _find_answered_spawns(
    conversations: dict[int, Conversation], by_index: dict[int, Turn], calls: list[_Call], spawned: set
) -> None:
    """Mark as sub-agents the conversations of their own whose first request quotes the task of an earlier call that
    spawned nothing else, and whose last answer comes back as that call's result (rule 6)."""
    quoting = []  # (conversation, the calls whose task its first request quotes)
    for conversation in conversations.values():
        first = by_index[conversation.index]
        if conversation.spawned_by is None and _is_fresh(first):
            text = _request_text(first)
            quoted = [c for c in calls if c.turn < first.index and c.id and any(t in text for t in c.tasks)]
            if quoted:
                quoting.append((conversation, quoted))
    if not quoting:
        return
    results: dict[str, str] = {}  # call id -> the text of its result, as the agent sent it back
    wanted = {c.id for _, quoted in quoting for c in quoted}
    for turn in by_index.values():
        for message in turn.request_messages:
            if (
                isinstance(message, dict)
                and message.get("role") == "tool"
                and isinstance(message.get("tool_call_id"), str)
                and message["tool_call_id"] in wanted
            ):
                results[message["tool_call_id"]] = _text(message.get("content"))
    for conversation, quoted in quoting:
        answer = _text(by_index[conversation.turns[-1]].response_message.get("content")).strip()
        call = next((c for c in quoted if c.key not in spawned and answer and answer in results.get(c.id, "")), None)
        if call is not None:
            spawned.add(call.key)
            conversation.role, conversation.spawned_by = "sub_agent", call.turn


def _task_text(task_prompt: str | list[dict] | None) -> str:
    if isinstance(task_prompt, list):
        task_prompt = next(
            (_text(m.get("content")) for m in task_prompt if isinstance(m, dict) and m.get("role") == "user"), None
        )
    return task_prompt.strip() if isinstance(task_prompt, str) else ""
