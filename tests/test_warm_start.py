"""The warm start's supervised rows: token ids and a mask on exactly the assistant messages' text."""

import pytest

from trl_agentic.pipeline import CalculatorDemoConfig, short_form_rows, warm_start_demonstrations
from trl_agentic.tiny_models import build_tiny_tokenizer
from trl_agentic.warm_start import _assistant_masked_ids_by_prefixes as masked_ids_by_prefixes  # the fallback
from trl_agentic.warm_start import assistant_masked_ids


def assistant_texts(tokenizer, messages, tools):
    """Each assistant message's rendered text: between the conversation before it (with the generation prompt) and
    the conversation through it."""
    render = lambda part, **kw: tokenizer.apply_chat_template(part, tools=tools, tokenize=False, **kw)  # noqa: E731
    return [
        render(messages[: k + 1])[len(render(messages[:k], add_generation_prompt=True)) :]
        for k, message in enumerate(messages)
        if message["role"] == "assistant"
    ]


@pytest.mark.parametrize("template", ["qwen2_5", "qwen3", "llama3_2"])
def test_assistant_masked_ids_mark_exactly_the_assistant_text(template):
    settings = CalculatorDemoConfig(num_demonstrations=40)
    suite = settings.suite()
    tokenizer = build_tiny_tokenizer(template, vocab_size=settings.vocab_size)
    demonstrations = warm_start_demonstrations(suite, settings)
    rows = demonstrations + short_form_rows(demonstrations, seed=0)  # with system prompt and tools, and without
    for row in rows:
        messages, tools = row["messages"], row.get("tools")
        ids, mask = assistant_masked_ids(tokenizer, messages, tools)
        assert ids == tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
        if template == "qwen3":  # renders the last assistant turn with an empty think block, earlier ones without:
            # a prefix is not a prefix of the whole text, so each prefix's tokens are counted instead
            assert (ids, mask) == masked_ids_by_prefixes(tokenizer, messages, tools)
            continue
        # The masked runs of tokens decode to the assistant messages' text, one run per message.
        runs, current = [], []
        for token, masked in zip(ids, mask, strict=True):
            if masked:
                current.append(token)
            elif current:
                runs.append(current)
                current = []
        runs += [current] if current else []
        assert [tokenizer.decode(run) for run in runs] == assistant_texts(tokenizer, messages, tools)
        if template == "qwen2_5":  # the demo's: its tokenization is stable at every prefix, so counting the tokens
            # of each prefix gives the same mask (the warm start it cached before is unchanged)
            assert (ids, mask) == masked_ids_by_prefixes(tokenizer, messages, tools)


def test_length_chunks_cut_padding_and_keep_every_row():
    from trl_agentic.warm_start import length_chunks

    lengths = [81, 233, 90, 150, 85, 230, 152, 88]
    batch = [([7] * n, [1] * n) for n in lengths]
    chunks = length_chunks(batch, max_chunks=4)
    assert sorted(len(ids) for chunk in chunks for ids, _ in chunk) == sorted(lengths)
    padded = sum(len(chunk) * max(len(ids) for ids, _ in chunk) for chunk in chunks)
    assert len(chunks) > 1 and padded < len(lengths) * max(lengths)
    # rows of one length: no padding to save, one chunk
    assert length_chunks([([7] * 50, [1] * 50)] * 6, max_chunks=4) == [[([7] * 50, [1] * 50)] * 6]
    assert length_chunks(batch, max_chunks=1) == [batch]


def test_a_length_chunked_step_has_the_gradient_of_the_whole_batch():
    """Splitting a batch by length (less padding) and summing token losses over the whole batch's label count gives the
    gradient of the one padded batch: the same step, cheaper."""
    import torch

    from trl_agentic.tiny_models import build_tiny_model
    from trl_agentic.warm_start import batch_loss, length_chunks

    settings = CalculatorDemoConfig(num_demonstrations=24)
    suite = settings.suite()
    tokenizer = build_tiny_tokenizer("qwen2_5", vocab_size=settings.vocab_size)
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=4, seed=0)
    rows = short_form_rows(warm_start_demonstrations(suite, settings), seed=0)
    batch = [assistant_masked_ids(tokenizer, row["messages"], None) for row in rows[:12]]
    assert len({len(ids) for ids, _ in batch}) > 3  # 1-3 exchanges per row: lengths differ

    def gradient(chunks):
        model.zero_grad()
        loss = batch_loss(model, chunks, tokenizer.pad_token_id)
        return loss, [p.grad.clone() for p in model.parameters()]

    whole_loss, whole = gradient([batch])
    chunks = length_chunks(batch, max_chunks=4)
    assert len(chunks) > 1
    chunked_loss, chunked = gradient(chunks)
    assert chunked_loss == pytest.approx(whole_loss, rel=1e-5)
    # the one-batch reference: the model's own mean loss over the padded batch
    width = max(len(ids) for ids, _ in batch)
    pad = tokenizer.pad_token_id
    reference = model(
        input_ids=torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in batch]),
        attention_mask=torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch]),
        labels=torch.tensor(
            [[t if m else -100 for t, m in zip(ids, mask)] + [-100] * (width - len(ids)) for ids, mask in batch]
        ),
    ).loss
    assert whole_loss == pytest.approx(reference.item(), rel=1e-5)
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_chunks_run_at_once_give_the_same_steps_bit_for_bit():
    """`workers=2` runs a batch's chunks in two threads (one torch thread each) and adds their gradients in chunk
    order: the losses and the weights after every step equal, bit for bit, those of one chunk after the other on one
    torch thread, so the demo's warm start (and where its phases stop) does not change."""
    import copy

    import torch

    from conftest import torch_threads
    from trl_agentic.tiny_models import build_tiny_model
    from trl_agentic.warm_start import warm_start

    settings = CalculatorDemoConfig(num_demonstrations=48)
    suite = settings.suite()
    tokenizer = build_tiny_tokenizer("qwen2_5", vocab_size=settings.vocab_size)
    rows = short_form_rows(warm_start_demonstrations(suite, settings), seed=0)
    start = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=4, seed=0)
    runs = {}
    with torch_threads(1):
        for workers in (1, 2):
            model = copy.deepcopy(start)
            seen = []
            losses = warm_start(
                model,
                tokenizer,
                rows,
                steps=6,
                batch_size=12,
                seed=0,
                workers=workers,
                on_step=lambda step, loss: seen.append([p.detach().clone() for p in model.parameters()]),
            )
            runs[workers] = losses, seen
    (one_losses, one_weights), (two_losses, two_weights) = runs[1], runs[2]
    assert two_losses == one_losses
    assert len(two_weights) == 6
    for one, two in zip(one_weights, two_weights, strict=True):  # every step
        assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(one_weights[-1], start.parameters()))  # it did train
