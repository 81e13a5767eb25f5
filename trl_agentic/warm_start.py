"""Warm start: a short supervised fine-tune on synthetic demonstrations, so a tiny model *sometimes* succeeds.

GRPO amplifies successes the model can already produce; a random tiny model produces none. The demonstrations are
rendered with the same chat template (and the same tool schemas) the agent will send through the endpoint, and the
loss covers the assistant tokens only.

These are the SFT steps, for any model; the CPU pipeline's warm-start stage around them (a tiny model built,
warm-started in two phases until it sometimes succeeds, cached) is `trl_agentic.pipeline.warm_started_model`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

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
        if (
            not (text.startswith(before) and text.startswith(through))
            or len(before) not in ends
            or (len(through) not in ends)
        ):
            return _assistant_masked_ids_by_prefixes(tokenizer, messages, tools)
        for i in range(ends[len(before)], ends[len(through)]):
            mask[i] = 1
    return ids, mask


def _assistant_masked_ids_by_prefixes(tokenizer, messages: list[dict], tools: list[dict] | None):
    def tokenize(part, **kw):
        return tokenizer.apply_chat_template(part, tools=tools, tokenize=True, return_dict=False, **kw)

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


# A model call's fixed cost (Python, kernel launches), in padded tokens relative to the whole batch's: a batch is split
# into k chunks only when that saves more than this share of its padded tokens per extra call.
CHUNK_OVERHEAD = 0.1


def length_chunks(batch: list[tuple[list[int], list[int]]], max_chunks: int = 4):
    """Split `batch` (`(ids, mask)` rows) into at most `max_chunks` chunks of similar lengths, so that less of each
    model call is padding: rows sorted by length, cut where the padded token count (a chunk's rows times its longest
    row) plus `CHUNK_OVERHEAD` per extra call is lowest. Returns `[batch]` when splitting saves nothing."""
    if max_chunks <= 1 or len(batch) <= 1:
        return [batch]
    rows = sorted(batch, key=lambda row: len(row[0]))
    lengths = [len(ids) for ids, _ in rows]
    n = len(rows)
    # best[k][j]: fewest padded tokens for rows[:j] in k chunks, cut[k][j]: where its last chunk starts
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(max_chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(max_chunks + 1)]
    best[0][0] = 0
    for k in range(1, max_chunks + 1):
        for j in range(1, n + 1):
            for i in range(k - 1, j):
                cost = best[k - 1][i] + (j - i) * lengths[j - 1]
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    whole = n * lengths[-1]
    k = min(range(1, min(max_chunks, n) + 1), key=lambda k: best[k][n] + CHUNK_OVERHEAD * whole * (k - 1))
    if k == 1:
        return [batch]
    chunks, j = [], n
    for level in range(k, 0, -1):
        i = cut[level][j]
        chunks.append(rows[i:j])
        j = i
    return chunks[::-1]


def _chunk_tensors(chunk, pad_token_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in chunk)
    return {
        "input_ids": torch.tensor([ids + [pad_token_id] * (width - len(ids)) for ids, _ in chunk]),
        "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in chunk]),
        "labels": torch.tensor(
            [[t if m else -100 for t, m in zip(ids, mask)] + [-100] * (width - len(ids)) for ids, mask in chunk]
        ),
    }


def batch_loss(model: PreTrainedModel, chunks, pad_token_id: int, pool: ThreadPoolExecutor | None = None) -> float:
    """Back-propagate the mean token loss of a batch given as `chunks` of `(ids, mask)` rows (`length_chunks`); each
    chunk's summed token losses are divided by the whole batch's label count, so the gradient is the one batch's.
    Returns the loss.

    With a `pool` (threads that each run torch with one thread, `chunk_pool`), the chunks run at once, one per
    thread, each computing its own gradients; they are then added to `.grad` in chunk order, which is what one
    `backward` after the other does: the same sums, the same bits as without a pool on one torch thread. A tiny
    model's ops are too small for two intra-op threads to speed up much (and their float rounding differs from one
    thread's); two chunks at once keep two cores busy.
    """
    num_labels = sum(sum(mask) for chunk in chunks for _, mask in chunk)
    if pool is None:
        total = 0.0
        for chunk in chunks:
            loss = model(**_chunk_tensors(chunk, pad_token_id), num_items_in_batch=num_labels).loss
            loss.backward()
            total += loss.item()
        return total
    params = [p for p in model.parameters() if p.requires_grad]

    def chunk_gradients(chunk):
        loss = model(**_chunk_tensors(chunk, pad_token_id), num_items_in_batch=num_labels).loss
        return loss.item(), torch.autograd.grad(loss, params, allow_unused=True)

    results = list(pool.map(chunk_gradients, chunks))
    with torch.no_grad():
        for i, param in enumerate(params):
            for _, grads in results:
                if grads[i] is None:
                    continue
                if param.grad is None:
                    param.grad = grads[i]
                else:
                    param.grad += grads[i]
    return sum(loss for loss, _ in results)


def chunk_pool(workers: int) -> ThreadPoolExecutor:
    """Threads for `batch_loss`'s chunks, each running torch with one intra-op thread."""
    return ThreadPoolExecutor(
        max_workers=workers,
        thread_name_prefix="trl-agentic-warm-start",
        initializer=torch.set_num_threads,
        initargs=(1,),
    )


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    demonstrations: list[dict],
    steps: int = 300,
    batch_size: int = 16,
    learning_rate: float = 3e-3,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
    max_chunks: int = 4,
    workers: int = 1,
) -> list[float]:
    """Fine-tune `model` in place on `demonstrations` (`[{"messages": [...], "tools": [...]}]`). Returns the losses.

    Each step's batch is run in up to `max_chunks` model calls of rows of similar lengths (`length_chunks`): the
    same loss and gradient as one padded call (the token losses are summed over the whole batch's label count), with
    less of the compute spent on padding (`max_chunks=1`: one call). With `workers > 1`, that many chunks run at
    once, in threads of one torch thread each, with the same losses and gradients, bit for bit, as one chunk after the
    other on one torch thread (`batch_loss`); a model with dropout draws its masks in an order that then depends on
    timing.

    Example:

    ```python
    >>> losses = warm_start(model, tokenizer, get_task("calculator").demonstrations(512), steps=200)
    ```
    """
    examples = [assistant_masked_ids(tokenizer, d["messages"], d.get("tools")) for d in demonstrations]
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps)
    )
    pad = tokenizer.pad_token_id
    threads = torch.get_num_threads()
    pool = chunk_pool(workers) if workers > 1 else None
    model.train()
    losses = []
    try:
        for step in range(steps):
            batch = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
            loss = batch_loss(model, length_chunks(batch, max_chunks), pad, pool=pool)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss)
            if on_step is not None:
                on_step(step, loss)
    finally:
        if pool is not None:
            pool.shutdown()
            # the workers' set_num_threads(1) is also torch's default for threads started later: the caller's again
            torch.set_num_threads(threads)
    model.eval()
    return losses
