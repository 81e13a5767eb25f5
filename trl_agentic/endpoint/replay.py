"""Replay at the endpoint: a branch episode's first calls answered from its parent's record (`trace.ReplaySpec`).

Which call is replayed is decided by `EpisodeSession.replay_call` (the request must render to the recorded prompt,
token for token); `CompletionService` then answers it with `replay_output` in place of the engine, and records
`replayed_turn`. Everything after (parsing aside: the recorded answer is returned as it was, tool-call ids included,
streaming, every wire format's shaping) is the path of a sampled call. See `docs/tree_rollouts.md`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

from ..generation.engine import GenerationOutput
from ..trace import Turn
from .chat import common_prefix_length


def divergence_context(tokenizer, prompt_ids: list[int], recorded: list[int], around: int = 12) -> dict[str, str]:
    """A short decoded context of where a branch's request left the recorded prompt (`around` tokens each side)."""
    at = common_prefix_length(prompt_ids, recorded)
    start = max(0, at - around)
    return {
        "recorded_context": tokenizer.decode(recorded[start : at + around]),
        "request_context": tokenizer.decode(prompt_ids[start : at + around]),
    }


async def replay_output(recorded: Turn, on_token: Callable[[list[int], list[float]], None] | None) -> GenerationOutput:
    """A recorded completion as an engine would return it (one chunk to `on_token`, as a non-streaming engine)."""
    ids, logprobs = list(recorded.completion_ids), list(recorded.logprobs)
    if on_token is not None:
        on_token(ids, logprobs)
    finish = "length" if recorded.finish_reason == "length" else "stop"
    return GenerationOutput(ids, logprobs, finish, None, recorded.token_versions)


def replayed_turn(recorded: Turn, call: Any, wall_time: float) -> Turn:
    """The turn of a replayed call: the parent's record (completion ids, logprobs, answer, policy versions, sampling)
    with this call's request and prompt plan (its prompt ids equal the parent's), marked `replayed`."""
    conversation, plan = call.conversation, call.plan
    return dataclasses.replace(
        recorded,
        prompt_ids=call.prompt_ids,
        completion_ids=list(recorded.completion_ids),
        logprobs=list(recorded.logprobs),
        token_versions=list(recorded.token_versions) if recorded.token_versions is not None else None,
        response_message=copy.deepcopy(recorded.response_message),
        request_messages=conversation.messages,
        request_tools=conversation.tools,
        requested_sampling=conversation.requested,
        wire_format=conversation.wire_format,
        prompt_source=plan.source,
        parent_turn=plan.parent,
        drift=plan.drift,
        fork_reason=plan.fork_reason,
        wall_time=wall_time,
        forked_from=None,
        conversation=None,
        role=None,
        spawned_by=None,
        replayed=True,
        replay_divergence=None,
    )
