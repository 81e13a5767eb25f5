"""The warm start's supervised rows: token ids and a mask on exactly the assistant messages' text."""

import pytest

from trl_agentic.scripts.demo import DemoSettings, short_form_rows, warm_start_demonstrations
from trl_agentic.tasks.calculator import make_calculator_suite
from trl_agentic.tiny_models import build_tiny_tokenizer
from trl_agentic.warm_start import _assistant_masked_ids_by_prefixes as masked_ids_by_prefixes  # the fallback
from trl_agentic.warm_start import assistant_masked_ids


def assistant_texts(tokenizer, messages, tools):
    """Each assistant message's rendered text: between the conversation before it (with the generation prompt) and
    the conversation through it."""
    render = lambda part, **kw: tokenizer.apply_chat_template(part, tools=tools, tokenize=False, **kw)  # noqa: E731
    return [render(messages[: k + 1])[len(render(messages[:k], add_generation_prompt=True)):]
            for k, message in enumerate(messages) if message["role"] == "assistant"]


@pytest.mark.parametrize("template", ["qwen2_5", "qwen3", "llama3_2"])
def test_assistant_masked_ids_mark_exactly_the_assistant_text(template):
    settings = DemoSettings(num_demonstrations=40)
    suite = make_calculator_suite(digits=2, ops=("*",))
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
