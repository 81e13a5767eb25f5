"""ChatRenderer: rendering, the continuation splice per template family, tool-call parsing, message normalization."""

import copy
import json
import re
from pathlib import Path

import pytest
import trl
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast
from trl.chat_template_utils import add_response_schema

from conftest import CALCULATOR_TOOL
from trl_agentic.endpoint.chat import ChatRenderer, RenderedContext, common_prefix_length
from trl_agentic.endpoint.protocol import comparable_message, template_message
from trl_agentic.tiny_models import build_tiny_tokenizer


@pytest.fixture(scope="module")
def renderers() -> dict[str, ChatRenderer]:
    return {family: ChatRenderer(build_tiny_tokenizer(family)) for family in ("qwen2_5", "llama3_2", "qwen3")}


def tool_call_text(family: str, expression: str = "2 + 3") -> str:
    if family == "llama3_2":
        return json.dumps({"name": "calculator", "parameters": {"expression": expression}})
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{call}\n</tool_call>"


def continue_with(renderer, history, answer_ids, answer_message, new_messages, tools):
    """The continuation of a turn whose request was `history` and whose answer was `answer_ids`."""
    parent_text = renderer.render_text(history, tools)
    parent = renderer.context_of(parent_text, history, tools)
    text = renderer.render_text(history + [answer_message] + new_messages, tools)
    return renderer.continuation(parent, text, answer_ids)


@pytest.mark.parametrize("family", ["qwen2_5", "llama3_2", "qwen3"])
def test_render_equals_apply_chat_template(renderers, family):
    renderer = renderers[family]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    expected = renderer.tokenizer.apply_chat_template(
        messages, tools=[CALCULATOR_TOOL], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert renderer.render(messages, [CALCULATOR_TOOL]) == list(expected)
    text = renderer.render_text(messages, [CALCULATOR_TOOL])
    without = renderer.render_text(messages, [CALCULATOR_TOOL], add_generation_prompt=False)
    assert renderer.context_of(text, messages, [CALCULATOR_TOOL]) == RenderedContext.of(without)


@pytest.mark.parametrize("family", ["qwen2_5", "llama3_2", "qwen3"])
def test_continuation_is_a_slice_of_the_full_render(renderers, family):
    """A tool loop: parent prompt + sampled ids + suffix spells the full render, and the suffix is its tail."""
    renderer, tokenizer = renderers[family], renderers[family].tokenizer
    tools = [CALCULATOR_TOOL]
    history = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = renderer.render(history, tools)
    answer_ids = tokenizer.encode(tool_call_text(family), add_special_tokens=False) + [tokenizer.eos_token_id]
    message, malformed = renderer.parse(answer_ids, prompt, tools)
    assert not malformed and message["tool_calls"]
    new = [{"role": "tool", "tool_call_id": "call_0", "content": "5"}]
    continuation = continue_with(renderer, history, answer_ids, template_message(message), new, tools)
    assert continuation is not None and continuation.glue == []
    full = renderer.render(history + [template_message(message)] + new, tools)
    # The suffix is exactly the tail of the full tokenization (tokenization restarts after the end-of-turn token)...
    assert full[len(full) - len(continuation.suffix) :] == continuation.suffix
    # ...and the spliced prompt spells the full render. (The ids before the suffix may differ: for these tiny
    # tokenizers a prompt ending in "\n\n" is one BPE token, "\n\n{" two; the model sampled after the former.)
    assert tokenizer.decode(prompt + answer_ids + continuation.suffix) == tokenizer.decode(full)


def test_junction_tokens_per_family(renderers):
    """Qwen puts "\\n" after <|im_end|> (it belongs to the suffix: the model stopped at <|im_end|>); Llama puts nothing
    after <|eot_id|>, the suffix starts at the next header (verl#6501)."""
    history = [{"role": "user", "content": "hi"}]
    new = [{"role": "user", "content": "again"}]
    qwen = renderers["qwen2_5"]
    ids = qwen.tokenizer.encode("hello", add_special_tokens=False) + [qwen.tokenizer.eos_token_id]  # <|im_end|>
    continuation = continue_with(qwen, history, ids, {"role": "assistant", "content": "hello"}, new, None)
    assert continuation.glue == []
    assert qwen.tokenizer.decode(continuation.suffix[:2]) == "\n<|im_start|>"

    llama = renderers["llama3_2"]
    ids = llama.tokenizer.encode("hello", add_special_tokens=False) + [llama.tokenizer.eos_token_id]  # <|eot_id|>
    continuation = continue_with(llama, history, ids, {"role": "assistant", "content": "hello"}, new, None)
    assert continuation.glue == []
    assert continuation.suffix[0] == llama.tokenizer.convert_tokens_to_ids("<|start_header_id|>")
    assert "<|begin_of_text|>" not in llama.tokenizer.decode(continuation.suffix)


@pytest.mark.parametrize("family,end_of_turn", [("qwen2_5", "<|im_end|>"), ("llama3_2", "<|eot_id|>")])
def test_truncated_completion_gets_the_end_of_turn_as_glue(renderers, family, end_of_turn):
    renderer = renderers[family]
    ids = renderer.tokenizer.encode("hello wor", add_special_tokens=False)  # cut by max_tokens: no end-of-turn
    answer = {"role": "assistant", "content": "hello wor"}
    continuation = continue_with(
        renderer, [{"role": "user", "content": "hi"}], ids, answer, [{"role": "user", "content": "go"}], None
    )
    assert continuation.glue == [renderer.tokenizer.convert_tokens_to_ids(end_of_turn)]


def test_qwen3_forks_only_when_a_new_user_message_follows_reasoning(renderers):
    """Qwen3 drops the reasoning of assistant turns before the last user message: a tool loop is append-only, a new
    user query after reasoning is not (the earlier turn renders differently), so the caller must render fresh."""
    renderer = renderers["qwen3"]
    tools = [CALCULATOR_TOOL]
    think = "<think>\nAdd them.\n</think>\n\n"
    ids = renderer.tokenizer.encode(think + tool_call_text("qwen3"), add_special_tokens=False)
    ids.append(renderer.tokenizer.eos_token_id)
    message, malformed = renderer.parse(ids, [], tools)
    assert not malformed and message["reasoning_content"] == "Add them." and message["tool_calls"]
    answer = template_message(message)
    history = [{"role": "user", "content": "What is 2 + 3?"}]
    tool = {"role": "tool", "tool_call_id": "call_0", "content": "5"}
    assert continue_with(renderer, history, ids, answer, [tool], tools) is not None  # tool loop: append-only
    # One more assistant turn with reasoning, then a new user query: the first answer's reasoning is now dropped.
    history2 = history + [answer, tool]
    final_ids = renderer.tokenizer.encode(think + "It is 5.", add_special_tokens=False)
    final_ids.append(renderer.tokenizer.eos_token_id)
    final = template_message(renderer.parse(final_ids, [], tools)[0])
    assert continue_with(renderer, history2, final_ids, final, [tool], tools) is not None
    new_query = {"role": "user", "content": "And 3 + 4?"}
    assert continue_with(renderer, history2, final_ids, final, [new_query], tools) is None


def test_qwen3_without_thinking_still_continues(renderers):
    """With `enable_thinking=False` the generation prompt carries an empty think block that the template never
    renders for an earlier turn: what the model saw is kept (its exact ids), so the tool loop is no fork."""
    renderer = ChatRenderer(renderers["qwen3"].tokenizer, {"enable_thinking": False})
    history = [{"role": "user", "content": "What is 2 + 3?"}]
    assert renderer.render_text(history, None).endswith("<think>\n\n</think>\n\n")
    ids = renderer.tokenizer.encode(tool_call_text("qwen3"), add_special_tokens=False)
    ids.append(renderer.tokenizer.eos_token_id)
    answer = template_message(renderer.parse(ids, renderer.render(history, [CALCULATOR_TOOL]), [CALCULATOR_TOOL])[0])
    tool = {"role": "tool", "tool_call_id": "call_0", "content": "5"}
    continuation = continue_with(renderer, history, ids, answer, [tool], [CALCULATOR_TOOL])
    assert continuation is not None and continuation.glue == []
    assert renderer.tokenizer.decode(continuation.suffix).endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("family", ["qwen2_5", "llama3_2"])
def test_parse_tool_call(renderers, family):
    renderer = renderers[family]
    ids = renderer.tokenizer.encode(tool_call_text(family, "7 * 6"), add_special_tokens=False)
    ids.append(renderer.tokenizer.eos_token_id)
    message, malformed = renderer.parse(
        ids, renderer.render([{"role": "user", "content": "7*6?"}], [CALCULATOR_TOOL]), [CALCULATOR_TOOL]
    )
    assert not malformed
    assert message["content"] is None
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "7 * 6"}  # a JSON string, as OpenAI returns


def test_parse_plain_malformed_and_tools_off(renderers):
    renderer = renderers["qwen2_5"]
    tools = [CALCULATOR_TOOL]
    eos = renderer.tokenizer.eos_token_id
    plain = renderer.tokenizer.encode("The answer is 5.", add_special_tokens=False) + [eos]
    assert renderer.parse(plain, [], tools) == ({"role": "assistant", "content": "The answer is 5."}, False)
    broken = renderer.tokenizer.encode('<tool_call>\n{"name": "calc', add_special_tokens=False)
    message, malformed = renderer.parse(broken, [], tools)
    assert malformed and message == {"role": "assistant", "content": '<tool_call>\n{"name": "calc'}
    call = renderer.tokenizer.encode(tool_call_text("qwen2_5"), add_special_tokens=False) + [eos]
    message, malformed = renderer.parse(call, [], tools, parse_tools=False)  # tool_choice="none"
    assert not malformed and "tool_calls" not in message and message["content"].startswith("<tool_call>")


def test_unreadable_tool_call_keeps_the_reasoning_split(renderers):
    """A reply whose tool call cannot be read is text, split as a readable reply is: the reasoning apart, the rest
    (the call's markup included) as content, stripped (issue #29: the whole text, `<think>` and all, was the content,
    so a stream that had sent the reasoning as reasoning did not add up to it)."""
    renderer = renderers["qwen3"]
    tokenizer, tools = renderer.tokenizer, [CALCULATOR_TOOL]
    prompt = renderer.render([{"role": "user", "content": "What is 2 + 3?"}], tools)
    broken = '<tool_call>\n{"name": "calculator"\n</tool_call>'
    reasoned = "<think>\nAdd them.\n</think>\n\nLet me. " + broken
    split = {"role": "assistant", "content": "Let me. " + broken, "reasoning_content": "Add them."}
    for text, with_tools, without_tools in [
        (reasoned, split, split),  # without tools, Responses and Messages split the reasoning alike
        (
            "  Let me. " + broken,
            {"role": "assistant", "content": "Let me. " + broken},
            {"role": "assistant", "content": "  Let me. " + broken},
        ),  # no reasoning: the text as decoded
    ]:
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        assert renderer.parse(ids, prompt, tools) == (with_tools, True)
        assert renderer.unreadable_message(ids, prompt) == with_tools
        assert renderer.parse(ids, prompt, None, split_reasoning=True) == (without_tools, False)
    # gpt-oss's template drops text outside its regions: an unreadable reply is the decoded text, none of it lost.
    harmony = ChatRenderer(harmony_tokenizer())
    ids = harmony.tokenizer.encode(
        "<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant to=functions.probe"
        '<|channel|>commentary json<|message|>{"x": 1<|call|>',
        add_special_tokens=False,
    )
    prompt = harmony.render([{"role": "user", "content": "Probe 1."}], [PROBE_TOOL])
    assert harmony.parse(ids, prompt, [PROBE_TOOL]) == (
        {"role": "assistant", "content": harmony.tokenizer.decode(ids, skip_special_tokens=True)},
        True,
    )


def test_reserialized_messages_compare_equal():
    """What agents send back (arguments as a JSON string with other key order and spacing, `null` fields, list
    content, regenerated ids, dropped reasoning) is the same message as the one we returned."""
    ours = {
        "role": "assistant",
        "content": None,
        "reasoning_content": "think",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": [1, 2]}'}}
        ],
    }
    theirs = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [
            {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"b":[1,2],"a":1}'}}
        ],
    }
    assert comparable_message(template_message(ours)) == comparable_message(template_message(theirs))
    # What templates read is kept: reasoning, ids, content joined from text parts.
    normalized = template_message(ours)
    assert normalized["reasoning_content"] == "think" and normalized["tool_calls"][0]["id"] == "call_1"
    assert normalized["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": [1, 2]}
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert template_message(parts) == {"role": "user", "content": "ab"}
    assert template_message({"role": "developer", "content": "x"})["role"] == "system"
    # A different argument value is a different message.
    edited = {"type": "function", "function": {"name": "f", "arguments": '{"a": 2, "b": [1, 2]}'}}
    other = {**theirs, "tool_calls": [edited]}
    assert comparable_message(template_message(ours)) != comparable_message(template_message(other))


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0


# Windows against whole renderings on adversarial conversations (issue #29 M3). Qwen3's templates pick the reasoning
# they keep from the "last query": the last user message that is not a tool result wrapped in <tool_response> tags. A
# user message with that text moves it, and a window that drops the real query renders differently.
TRL_TEMPLATES = sorted((Path(trl.__file__).parent / "chat_templates").glob("*.jinja"))
QWEN3_TEMPLATES = [p for p in TRL_TEMPLATES if p.name.startswith("qwen3")]
WRAPPED = "<tool_response>\n42\n</tool_response>"  # what Qwen3's templates take for a tool turn
ADVERSARIAL = [
    WRAPPED,
    "Is <tool_response> a tag? Close it with </tool_response>.",
    "<think>\nPlan first.\n</think>\n\nGo on.",
    "What is 6 * 7?",
]
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe",
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
    },
}


def adversarial_conversation(users, reasoning="Let me think.", system=False):
    """A tool loop with three user messages (`users`) and reasoning on every assistant turn. (A continuation whose new
    messages hold an assistant message, not ours, shows a moved "last query" in the reasoning it renders.)"""

    def call(k):
        return {
            "role": "assistant",
            "content": "",
            "reasoning_content": reasoning,
            "tool_calls": [
                {"type": "function", "id": f"call_{k}", "function": {"name": "probe", "arguments": {"x": k}}}
            ],
        }

    def tool(k):
        return {"role": "tool", "tool_call_id": f"call_{k}", "content": f"result {k}"}

    def answer(k):
        return {"role": "assistant", "content": f"answer {k}", "reasoning_content": reasoning}

    messages = [{"role": "system", "content": "Be brief."}] if system else []
    first, second, third = ({"role": "user", "content": content} for content in users)
    messages += [
        first,
        call(0),
        tool(0),
        answer(1),
        second,
        call(2),
        tool(2),
        call(3),
        tool(3),
        answer(4),
        third,
        call(5),
        tool(5),
        call(6),
        tool(6),
    ]
    return messages


def assert_windows_equal_whole_renders(tokenizer, conversations):
    """Every continuation (each assistant message as the parent's answer, the rest of the conversation or one more
    message as the new messages) is the same, id for id, windowed as rendered whole. Returns the windowed renderer."""
    windowed, whole = ChatRenderer(tokenizer), ChatRenderer(tokenizer, incremental=False)
    eot = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    for messages in conversations:
        for answer in range(1, len(messages) - 1):
            if messages[answer]["role"] != "assistant":
                continue
            for end in sorted({answer + 2, len(messages)}):
                request = messages[:end]
                if ChatRenderer.window(request, answer) is None:  # nothing to window: both render whole
                    continue
                try:
                    expected = whole.continue_from(messages[:answer], request, [PROBE_TOOL], [eot])
                except Exception:  # noqa: BLE001 - the template refuses this conversation
                    continue
                got = windowed.continue_from(messages[:answer], request, [PROBE_TOOL], [eot])
                assert (got is None) == (expected is None), (messages, answer, end)
                if got is not None:
                    assert (got.glue, got.suffix) == (expected.glue, expected.suffix), (messages, answer, end)
    return windowed, whole


@pytest.mark.parametrize("template", QWEN3_TEMPLATES, ids=lambda p: p.stem)
def test_windows_equal_whole_renders_when_user_messages_hold_template_tags(template):
    tokenizer = copy.deepcopy(build_tiny_tokenizer("qwen3"))
    tokenizer.chat_template = template.read_text(encoding="utf-8")
    conversations = [
        adversarial_conversation(users)
        for users in [
            (WRAPPED, ADVERSARIAL[3], WRAPPED),
            (WRAPPED, WRAPPED, ADVERSARIAL[3]),
            (WRAPPED, ADVERSARIAL[2], WRAPPED),
            (ADVERSARIAL[1], ADVERSARIAL[3], WRAPPED),
            (ADVERSARIAL[2], WRAPPED, ADVERSARIAL[1]),
            (ADVERSARIAL[3], WRAPPED, WRAPPED),
        ]
    ]
    conversations.append(adversarial_conversation((WRAPPED, ADVERSARIAL[3], WRAPPED), system=True))
    windowed, whole = assert_windows_equal_whole_renders(tokenizer, conversations)
    assert windowed.incremental  # the windows were used (the probe kept them on)...
    assert windowed.rendered_messages < whole.rendered_messages  # ...and rendered less than whole conversations


@pytest.mark.parametrize("template", QWEN3_TEMPLATES, ids=lambda p: p.stem)
def test_window_reaches_the_last_query_past_tool_response_user_messages(template):
    # Issue 40: a new query walked the window's tail back to the parent's last user message, here one Qwen3 takes for a
    # tool turn. The real last query lay before it, outside the window: the window continued, while the whole request
    # drops the reasoning of the answers between the two queries (the template never renders the continued context).
    tokenizer = copy.deepcopy(build_tiny_tokenizer("qwen3"))
    tokenizer.chat_template = template.read_text(encoding="utf-8")
    full = adversarial_conversation((ADVERSARIAL[3], WRAPPED, "And 7 * 8?"))
    call, result, answer = full[1], full[2], full[3]
    query, wrapped, new_query = full[0], full[4], full[10]
    # Two tool results: the tail's parity then keeps it at the tool-response user message, past the answer before it.
    conversation = [query, call, result, {**result, "content": "result 0b"}, answer, wrapped, answer, new_query]
    windowed, _ = assert_windows_equal_whole_renders(tokenizer, [conversation])
    assert windowed.incremental


def byte_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """A tokenizer without merges whose added tokens are the template's tags: enough to compare renderings of any
    template token for token, built in milliseconds."""
    specials = set(
        re.findall(
            r"<\|[^|<>\s]{1,40}\|>|<｜[^｜<>]{1,40}｜>|<(?:start|end)_of_turn>|<\|[a-z_]{1,30}>"
            r"|<[a-z_]{1,30}\|>|<\|?[A-Z_]{3,40}\|?>|</s>",
            template,
        )
    )
    texts = set(re.findall(r"</?[a-z_]{2,30}>", template)) - specials
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in sorted(specials)]
        + [AddedToken("<bos>", special=True, normalized=False)]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in sorted(texts)])
    ends = [
        "<|im_end|>",
        "<|eot_id|>",
        "<|return|>",
        "<end_of_turn>",
        "<|END_OF_TURN_TOKEN|>",
        "<｜end▁of▁sentence｜>",
        "<turn|>",
        "<|end|>",
        "</s>",
        "<|eot|>",
        "<|user|>",
    ]
    eos = next((t for t in ends if t in specials), "<bos>")
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=eos, bos_token="<bos>", clean_up_tokenization_spaces=False
    )
    hf_tokenizer.chat_template = template
    return hf_tokenizer


def test_windows_equal_whole_renders_on_every_trl_template():
    """A small fuzz: every chat template TRL ships, adversarial user messages, with and without reasoning."""
    conversations = [
        adversarial_conversation(users, reasoning, system)
        for users, reasoning, system in [
            ((WRAPPED, ADVERSARIAL[3], WRAPPED), "Hmm.", False),
            ((ADVERSARIAL[2], WRAPPED, ADVERSARIAL[1]), None, True),
            ((ADVERSARIAL[3], ADVERSARIAL[0], ADVERSARIAL[2]), "Hmm.", True),
        ]
    ]
    windowed_templates = []
    for template in TRL_TEMPLATES:
        windowed, _ = assert_windows_equal_whole_renders(
            byte_tokenizer(template.read_text(encoding="utf-8")), conversations
        )
        if windowed.incremental:
            windowed_templates.append(template.stem)
    assert len(windowed_templates) >= len(TRL_TEMPLATES) // 2, windowed_templates


def harmony_tokenizer() -> PreTrainedTokenizerFast:
    """gpt-oss's template (harmony format) on a byte tokenizer, with TRL's response schema for it."""
    tokenizer = byte_tokenizer((Path(trl.__file__).parent / "chat_templates" / "gptoss.jinja").read_text("utf-8"))
    return add_response_schema(tokenizer)


@pytest.mark.parametrize(
    "family,stops", [("qwen2_5", {"<|im_end|>"}), ("qwen3", {"<|im_end|>"}), ("llama3_2", {"<|eot_id|>", "<|eom_id|>"})]
)
def test_stop_tokens_of_the_tiny_families(renderers, family, stops):
    tokenizer = renderers[family].tokenizer
    assert renderers[family].end_of_turn_ids == {tokenizer.convert_tokens_to_ids(t) for t in stops}


@pytest.mark.parametrize(
    "template,stops",
    [
        ("gptoss", {"<|return|>", "<|call|>"}),  # harmony: <|end|> closes a message inside the turn (the analysis)
        ("phi3", {"<|end|>"}),  # ...and Phi-3's turn
        ("gemma4", {"<turn|>", "<|tool_response>"}),  # a Gemma 4 tool call stops where the response would begin
        ("deepseekv3", {"<｜end▁of▁sentence｜>"}),
    ],
)
def test_stop_tokens_come_from_the_template(template, stops):
    tokenizer = byte_tokenizer((Path(trl.__file__).parent / "chat_templates" / f"{template}.jinja").read_text("utf-8"))
    renderer = ChatRenderer(tokenizer)
    assert {tokenizer.convert_ids_to_tokens(i) for i in renderer.end_of_turn_ids} == stops


def test_harmony_continuation_splices_at_the_end_of_the_sampled_message():
    """gpt-oss samples an analysis message (closed by <|end|>) before its tool call (closed by <|call|>) or its final
    answer (closed by <|return|>, which a history renders as <|end|>): the splice lands after what was sampled."""
    tokenizer = harmony_tokenizer()
    renderer = ChatRenderer(tokenizer)
    tools = [PROBE_TOOL]
    history = [{"role": "user", "content": "Probe 1."}]
    prompt = renderer.render(history, tools)
    assert tokenizer.decode(prompt).endswith("<|start|>assistant")
    sampled = (
        "<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant to=functions.probe<|channel|>"
        'commentary json<|message|>{"x": 1}<|call|>'
    )
    ids = tokenizer.encode(sampled, add_special_tokens=False)
    message, malformed = renderer.parse(ids, prompt, tools)
    assert not malformed and json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"x": 1}
    tool = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "2"}
    history += [template_message(message), tool]
    continuation = continue_with(renderer, history[:1], ids, history[1], [tool], tools)
    full = renderer.render(history, tools)
    assert continuation.glue == []
    assert full[len(full) - len(continuation.suffix) :] == continuation.suffix
    assert tokenizer.decode(continuation.suffix) == (
        '<|start|>functions.probe to=assistant<|channel|>commentary<|message|>"2"<|end|><|start|>assistant'
    )
    # The final answer ends with <|return|>; the next request renders it closed by <|end|>.
    prompt = prompt + ids + continuation.suffix
    sampled = (
        "<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>final<|message|>It is 2.<|return|>"
    )
    ids = tokenizer.encode(sampled, add_special_tokens=False)
    message, malformed = renderer.parse(ids, prompt, tools)
    assert not malformed and message["content"] == "It is 2."
    new = [{"role": "user", "content": "Again."}]
    continuation = continue_with(renderer, history, ids, template_message(message), new, tools)
    full = renderer.render(history + [template_message(message)] + new, tools)
    assert continuation.glue == [] and full[len(full) - len(continuation.suffix) :] == continuation.suffix
    assert tokenizer.decode(continuation.suffix) == "<|start|>user<|message|>Again.<|end|><|start|>assistant"
    assert renderer.prompt_tail(prompt + ids + continuation.suffix) == tokenizer.encode("<|start|>assistant")


def test_stop_tokens_include_the_generation_config_eos_ids(renderers, tmp_path):
    """A tokenizer loaded from a model directory brings the model's `generation_config.json` eos ids along."""
    tokenizer = renderers["qwen2_5"].tokenizer
    tokenizer.save_pretrained(tmp_path)
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    GenerationConfig(eos_token_id=[tokenizer.eos_token_id, endoftext]).save_pretrained(tmp_path)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tmp_path))
    assert renderer.end_of_turn_ids == {tokenizer.eos_token_id, endoftext}


def test_the_plain_query_cache_holds_fingerprints_not_contents():
    """The renderer remembers, per distinct first user message, whether it is a plain query (up to 4096 of them): it
    keeps a fingerprint of each, not the message, which may be a task of a megabyte."""
    renderer = ChatRenderer(build_tiny_tokenizer("qwen3"))
    big = "task " * 200_000
    assert renderer._is_plain_query({"role": "user", "content": big})
    renderer._is_plain_query({"role": "user", "content": [{"type": "text", "text": big}]})
    assert len(renderer._plain_queries) == 2 and all(len(key) <= 64 for key in renderer._plain_queries)
