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
    """Token ids of a conversation and a mask that is 1 on assistant tokens (found by rendering prefixes)."""
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
    mask = [0] * len(ids)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(tokenizer.apply_chat_template(messages[:k], tools=tools, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
        end = len(tokenizer.apply_chat_template(messages[: k + 1], tools=tools, tokenize=True, return_dict=False))
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
