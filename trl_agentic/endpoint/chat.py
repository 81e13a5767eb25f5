"""Messages ⇄ token ids: chat template rendering, token-in continuation, tool-call parsing.

The rule (REFERENCES: rllm#272, verl#6501): never rebuild the ids of earlier turns from text. When a request is the
previous request + the assistant message we returned + new messages, its prompt is the previous prompt ids + the
sampled ids + the ids of the newly rendered messages. Only the new messages are rendered, by slicing a render of
the whole conversation at the end-of-turn token that closes our assistant message.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase


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
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template_kwargs: dict[str, Any] | None = None):
        if tokenizer.chat_template is None:
            raise ValueError("The tokenizer has no chat template; set `tokenizer.chat_template` before serving it.")
        self.tokenizer = tokenizer
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.can_parse_tools = (
            getattr(tokenizer, "response_template", None) is not None
            or getattr(tokenizer, "response_schema", None) is not None
        )
        # Tokens that end an assistant turn: generation stops on them and the continuation splice aligns on them.
        self.end_of_turn_ids = {tokenizer.eos_token_id}
        for token in ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>"):
            token_id = tokenizer.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token in tokenizer.get_vocab():
                self.end_of_turn_ids.add(token_id)
        self.end_of_turn_ids.discard(None)

    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = True) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
                **self.chat_template_kwargs,
            )
        )

    def continuation(
        self,
        history: list[dict],
        new_messages: list[dict],
        tools: list[dict] | None,
        completion_ids: list[int],
    ) -> Continuation | None:
        """Ids that extend `history` (ending with the assistant message we returned) by `new_messages`.

        Returns `None` when the template does not render `history` as a prefix of `history + new_messages` (it is
        not append-only here, e.g. Qwen3 dropping earlier reasoning): the caller must render fresh.
        """
        base = self.render(history, tools, add_generation_prompt=False)
        full = self.render(history + new_messages, tools, add_generation_prompt=True)
        # Align on the last end-of-turn token of the base render: what follows it there (e.g. Qwen's "\n") is glue
        # the template adds between turns and belongs to the suffix, since the model stopped at the end-of-turn.
        cut = max((i for i, t in enumerate(base) if t in self.end_of_turn_ids), default=None)
        if cut is None:
            return None
        cut += 1
        if full[:cut] != base[:cut]:
            return None
        ended = bool(completion_ids) and completion_ids[-1] in self.end_of_turn_ids
        glue = [] if ended else [base[cut - 1]]
        return Continuation(glue=glue, suffix=full[cut:])

    def parse(
        self, completion_ids: list[int], prompt_ids: list[int], tools: list[dict] | None, parse_tools: bool = True
    ) -> tuple[dict[str, Any], bool]:
        """Parse sampled ids into an OpenAI assistant message. Returns `(message, malformed_tool_call)`.

        A completion that cannot be parsed (e.g. a broken tool call) is returned as plain text, never an error.
        """
        text = self.tokenizer.decode(completion_ids, skip_special_tokens=True)
        if not (parse_tools and tools and self.can_parse_tools):
            return {"role": "assistant", "content": text}, False
        try:
            parsed = self.tokenizer.parse_response(completion_ids, prefix=prompt_ids, tools=tools)
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
            return {"role": "assistant", "content": text}, True
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


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
