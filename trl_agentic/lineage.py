"""Lineage: which conversation each model call of an episode belongs to, and what each conversation is.

An agent's calls form conversations: a call continues a conversation when its prompt extends that conversation's last
prompt + completion (the endpoint's token-in continuation). Which conversation is the episode's main line is decided
when the episode closes, from lineage, never from call order (issue 31: opencode and Claude Code ask for a title
first, and that 5-token call became the main line while the real conversation was filed as a side call).

Rules, applied to the turns in the order they were recorded (the same turns always give the same answer):

1. A continuation (`prompt_source == "continued"`) belongs to its parent's conversation.
2. A request rendered exactly as an earlier one (the same prompt ids: a second choice of `n > 1`, a retry) belongs to
   that one's conversation.
3. A fresh request (no assistant message in it: the first call of a conversation) that quotes a string argument of at
   least `MIN_HANDOFF_CHARS` characters of a tool call of the latest turn of an existing conversation starts a
   sub-agent conversation, spawned by that turn: the harness handed the call's task (Claude Code's `Agent` prompt,
   opencode's `task` prompt) to a new conversation. So does a request whose last message is a user message that is,
   as a whole, such an argument of any earlier turn (spawned by the latest such turn): a sub-agent started in the
   background, after its parent went on (Codex's `spawn_agent` answers at once, and the sub-agent's first request
   often comes after the parent's next call; with `fork_context` it also carries the parent's history). Both come before
   rule 4: opencode's and Codex's sub-agents keep the main line's system prompt.
4. A request that shares a message prefix with an earlier turn (`Turn.forked_from`: a rewritten history, a compaction
   restart that keeps the system prompt, changed tools) belongs to that turn's conversation: a fork of it.
5. Anything else starts a conversation of its own (the first call; a title or summary request sharing nothing).

Roles:

- `main`: among the conversations no tool call spawned, the one that holds the task's prompt (when it is known), then
  the one with tools, then the longest (most tokens in one call, prompt + completion), then the first.
- `sub_agent`: a conversation a tool call spawned (rule 3), at any depth.
- `side_call`: every other one (title and summary requests, ...).

On the real harnesses, Claude Code 2.1.197 (tests/test_lineage.py) and opencode 1.18.33 (by hand), each with its title
request first and a sub-agent, give one main line with 0 forks, one side call and one sub-agent; Codex 0.171.0's
`spawn_agent` sub-agents, with and without `fork_context` (tests/test_harness_codex.py), one main line with 0 forks and
one sub-agent. Nothing here needs a harness's own hints (Claude Code's session metadata, Codex's `client_metadata`).
What it does not see: a sub-agent handed a task shorter than `MIN_HANDOFF_CHARS`, or rewritten before it reaches the
sub-agent and started after its parent's conversation went on, counts as a side call (a fork, if it carries the
parent's history).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .trace import Episode, Turn


CONVERSATION_ROLES = ("main", "side_call", "sub_agent")
# Shortest tool-call argument taken for a sub-agent's task: shorter strings ("ls", a file name) turn up in unrelated
# requests, a task handed to a sub-agent is a sentence.
MIN_HANDOFF_CHARS = 16
# Fork reasons (endpoint/sessions.py) of a request that shares a message prefix with an earlier turn: a trace recorded
# before `Turn.forked_from` existed says which turn only through them (the latest one is taken).
_FORK_REASONS = ("history_rewritten", "template_not_append_only", "tools_changed")


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
    latest_calls: dict[int, tuple[int, list[str]]] = {}  # conversation -> (its latest turn, that turn's handoffs)
    all_calls: list[tuple[int, list[str]]] = []  # (turn, its handoffs) of every turn so far
    rendered: dict[tuple[int, ...], int] = {}  # prompt ids of rendered turns -> the first such turn
    previous = None  # the latest delivered turn (for traces without `forked_from`)
    for turn in turns:
        if turn.finish_reason == "cancelled":
            continue
        home, spawned_by = None, None
        if turn.prompt_source == "continued" and turn.parent_turn in conversation_of:
            home = conversation_of[turn.parent_turn]  # rule 1
        elif (same := rendered.get(tuple(turn.prompt_ids))) is not None:
            home = conversation_of[same]  # rule 2
        else:
            spawned_by = _spawning_turn(turn, latest_calls) if _is_fresh(turn) else None  # rule 3
            if spawned_by is None:
                # rule 3: a sub-agent started after its parent went on
                spawned_by = _background_spawner(turn, all_calls)
            if spawned_by is None:
                if turn.forked_from in conversation_of:
                    home = conversation_of[turn.forked_from]  # rule 4
                elif turn.forked_from is None and turn.fork_reason in _FORK_REASONS and previous is not None:
                    home = conversation_of[previous]  # rule 4, in a trace that did not record `forked_from`
        if turn.prompt_source == "rendered":
            rendered.setdefault(tuple(turn.prompt_ids), turn.index)
        if home is None:  # rules 3 and 5
            home = turn.index
            conversations[home] = Conversation(
                home, "sub_agent" if spawned_by is not None else "side_call", spawned_by=spawned_by
            )
        conversations[home].turns.append(turn.index)
        conversation_of[turn.index] = home
        latest_calls[home] = (turn.index, _handoffs(turn))
        all_calls.append(latest_calls[home])
        previous = turn.index

    by_index = {turn.index: turn for turn in turns}
    task_text = _task_text(task_prompt)
    roots = [c for c in conversations.values() if c.spawned_by is None]
    if roots:

        def rank(conversation: Conversation) -> tuple:
            members = [by_index[i] for i in conversation.turns]
            holds_task = bool(task_text) and task_text in _request_text(members[0])
            has_tools = any(turn.request_tools for turn in members)
            length = max(len(turn.prompt_ids) + len(turn.completion_ids) for turn in members)
            return holds_task, has_tools, length, -conversation.index

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


def _handoffs(turn: Turn) -> list[str]:
    """The strings a turn's tool calls hand over: each call's top-level string arguments (or its raw input, for a
    tool whose input is not a JSON object), at least `MIN_HANDOFF_CHARS` long."""
    found = []
    for call in turn.response_message.get("tool_calls") or []:
        arguments = (call.get("function") or {}).get("arguments") if isinstance(call, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        values = arguments.values() if isinstance(arguments, dict) else [arguments]
        found += [v for v in values if isinstance(v, str) and len(v.strip()) >= MIN_HANDOFF_CHARS]
    return [v.strip() for v in found]


def _spawning_turn(turn: Turn, latest_calls: dict[int, tuple[int, list[str]]]) -> int | None:
    """The latest turn, among the conversations' latest turns, one of whose tool calls' arguments `turn` quotes."""
    text = _request_text(turn)
    spawners = [index for index, handoffs in latest_calls.values() if any(h in text for h in handoffs)]
    return max(spawners, default=None)


def _background_spawner(turn: Turn, calls: list[tuple[int, list[str]]]) -> int | None:
    """The latest turn one of whose tool calls' arguments is, as a whole, the last message of `turn`'s request (a
    user message), if any."""
    last = turn.request_messages[-1] if turn.request_messages else None
    if not isinstance(last, dict) or last.get("role") != "user":
        return None
    text = _text(last.get("content")).strip()
    if len(text) < MIN_HANDOFF_CHARS:
        return None
    return max((index for index, handoffs in calls if text in handoffs), default=None)


def _task_text(task_prompt: str | list[dict] | None) -> str:
    if isinstance(task_prompt, list):
        task_prompt = next(
            (_text(m.get("content")) for m in task_prompt if isinstance(m, dict) and m.get("role") == "user"), None
        )
    return task_prompt.strip() if isinstance(task_prompt, str) else ""
