"""`TextEncoder`: the ids of `tokenizer(text, add_special_tokens=False)`, exactly, through the backend and a cache."""

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from trl_agentic.endpoint.chat import ChatRenderer
from trl_agentic.endpoint.encoding import TextEncoder
from trl_agentic.tiny_models import build_tiny_tokenizer


TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def conversations():
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}],
    }
    yield [{"role": "user", "content": "Hi"}]
    yield [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "2 + 3?"},
        call,
        {"role": "tool", "content": "5"},
        {"role": "user", "content": "  é e\u0301 ﬁ\n\n\t<tool_call> 12 34"},
    ]
    yield [
        {"role": "user", "content": "<|im_end|><|eot_id|> typed by the agent"},
        {"role": "assistant", "content": " spaced <|im_start|>", "reasoning_content": "thought"},
    ]


@pytest.mark.parametrize("family", ["qwen2_5", "llama3_2", "qwen3"])
def test_ids_equal_the_tokenizers_call_first_time_and_cached(family):
    tokenizer = build_tiny_tokenizer(family)
    encode = TextEncoder(tokenizer)
    assert encode._cut is not None  # byte-level BPE: the pieces between special tokens add up
    renderer = ChatRenderer(tokenizer)
    for messages in conversations():
        for tools in (None, [TOOL]):
            text = renderer.render_text(messages, tools)
            expected = tokenizer(text, add_special_tokens=False)["input_ids"]
            first, again = encode(text), encode(text)
            assert first == expected and again == expected
            again.append(-1)  # callers own what they get: the cache is not theirs to change
            assert encode(text) == expected


def small_tokenizer(pre_tokenizer, normalizer=None):
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        backend.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    backend.train_from_iterator(["hello world this is text", "x y z é e\u0301 12 34"] * 50, trainer=trainer)
    backend.add_tokens([AddedToken("<tool>", normalized=False), AddedToken("<eat>", normalized=False, rstrip=True)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")


@pytest.mark.parametrize(
    "pre_tokenizer,normalizer,cut",
    [
        (
            pre_tokenizers.Metaspace(prepend_scheme="first"),
            None,
            False,
        ),  # only the input's start is marked: whole texts
        (pre_tokenizers.Metaspace(prepend_scheme="always"), None, True),
        (pre_tokenizers.ByteLevel(add_prefix_space=True), None, True),
        (pre_tokenizers.ByteLevel(add_prefix_space=False), normalizers.NFC(), True),
    ],
)
def test_pieces_are_cut_only_where_they_add_up(pre_tokenizer, normalizer, cut):
    tokenizer = small_tokenizer(pre_tokenizer, normalizer)
    encode = TextEncoder(tokenizer)
    assert (encode._cut is not None) == cut
    assert "<eat>" not in encode._cut_after  # strips the whitespace after it: never a cut
    for text in [
        "<s>hello world</s> x<tool>  é e\u0301</s>\n<s>y",
        "x<eat>  hello</s>  world",
        " ",
        "",
        "hello</s>",
        "</s></s>hello",
    ]:
        expected = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert encode(text) == expected and encode(text) == expected, text


def test_tokenizer_state_set_by_another_call_is_honoured_as_the_call_does():
    tokenizer = build_tiny_tokenizer("qwen2_5")
    encode = TextEncoder(tokenizer)
    text = "<|im_start|>user\nHello there, a longer text<|im_end|>\n"
    tokenizer(text, truncation=True, max_length=3)  # leaves truncation set on the backend
    assert encode(text) == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(encode(text)) > 3
    tokenizer.split_special_tokens = True
    assert encode(text) == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert 151644 not in encode(text) and tokenizer.convert_tokens_to_ids("<|im_start|>") not in encode(text)


def test_cache_stays_within_its_bound():
    tokenizer = build_tiny_tokenizer("qwen2_5")
    encode = TextEncoder(tokenizer, max_cached_chars=200)
    for k in range(50):
        text = f"<|im_start|>user\nmessage number {k} with some words<|im_end|>\n"
        assert encode(text) == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert encode._cached_chars <= 200 and sum(map(len, encode._cache)) == encode._cached_chars
