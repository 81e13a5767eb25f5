"""Warm start: a short supervised fine-tune on synthetic demonstrations, so a tiny model *sometimes* succeeds.

GRPO amplifies successes the model can already produce; a random tiny model produces none. The demonstrations are
rendered with the same chat template (and the same tool schemas) the agent will send through the endpoint, and the
loss covers the assistant tokens only.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


def assistant_masked_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None):
    """Token ids of a conversation and a mask that is 1 on assistant tokens.

    Each assistant message spans from the end of the conversation before it (with the generation prompt) to the end
    of the conversation through it. Those prefixes are rendered as text and the whole conversation is tokenized once:
    a message's tokens are the ones between its two prefixes' ends. Where a prefix is not a prefix of the whole text
    (a template that rewrites earlier turns), or a token straddles its end, every prefix is tokenized instead (as
    many tokenizer calls as messages, several times slower).
    """
    render = lambda part, **kw: tokenizer.apply_chat_template(part, tools=tools, tokenize=False, **kw)  # noqa: E731
    text = render(messages)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoding["input_ids"])
    ends = {end: i + 1 for i, (_, end) in enumerate(encoding["offset_mapping"])}  # char offset -> tokens before it
    ends[0] = 0
    mask = [0] * len(ids)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:k], add_generation_prompt=True), render(messages[: k + 1])
        if not (text.startswith(before) and text.startswith(through)) or len(before) not in ends or (
                len(through) not in ends):
            return _assistant_masked_ids_by_prefixes(tokenizer, messages, tools)
        for i in range(ends[len(before)], ends[len(through)]):
            mask[i] = 1
    return ids, mask


def _assistant_masked_ids_by_prefixes(tokenizer, messages: list[dict], tools: list[dict] | None):
    tokenize = lambda part, **kw: tokenizer.apply_chat_template(part, tools=tools, tokenize=True,  # noqa: E731
                                                                return_dict=False, **kw)
    ids = tokenize(messages)
    mask = [0] * len(ids)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(tokenize(messages[:k], add_generation_prompt=True))
        end = len(tokenize(messages[: k + 1]))
        for i in range(start, min(end, len(ids))):
            mask[i] = 1
    return list(ids), mask


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    demonstrations: list[dict],
    steps: int = 300,
    batch_size: int = 16,
    learning_rate: float = 3e-3,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Fine-tune `model` in place on `demonstrations` (`[{"messages": [...], "tools": [...]}]`). Returns the losses.

    Example:

    ```python
    >>> losses = warm_start(model, tokenizer, get_task("calculator").demonstrations(512), steps=200)
    ```
    """
    examples = [assistant_masked_ids(tokenizer, d["messages"], d.get("tools")) for d in demonstrations]
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
    pad = tokenizer.pad_token_id
    model.train()
    losses = []
    for step in range(steps):
        batch = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in batch])
        attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([[t if m else -100 for t, m in zip(ids, mask)] + [-100] * (width - len(ids))
                               for ids, mask in batch])
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, loss.item())
    model.eval()
    return losses
