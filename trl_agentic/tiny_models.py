"""Tiny causal LMs with real chat templates, built locally (no hub access), for tests, benchmarks and the CPU demo.

The tokenizer is a byte-level BPE trained in-process (digits split one by one, so arithmetic is learnable), with the
control tokens of a real chat template shipped by TRL (`trl/chat_templates/`) and tool-call parsing enabled through
`trl.chat_template_utils.add_response_schema`.

Example:

```python
>>> from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer
>>> tokenizer = build_tiny_tokenizer("qwen2_5")
>>> model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2)
```
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import trl
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl.chat_template_utils import add_response_schema


_TEMPLATES_DIR = Path(trl.__file__).parent / "chat_templates"


@dataclass(frozen=True)
class TemplateFamily:
    template_file: str
    control_tokens: tuple[str, ...]  # special: never produced by the BPE merges, skipped when decoding
    text_tokens: tuple[str, ...]  # added but not special (kept when decoding), e.g. Qwen's <tool_call>
    eos_token: str
    pad_token: str
    bos_token: str | None = None


TEMPLATE_FAMILIES: dict[str, TemplateFamily] = {
    # Append-only for tool loops; `<|im_end|>\n` junction between turns.
    "qwen2_5": TemplateFamily(
        template_file="qwen2_5.jinja",
        control_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        text_tokens=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    ),
    # Tool calls as a bare JSON object, tools in the first user message, BOS rendered by the template.
    "llama3_2": TemplateFamily(
        template_file="llama3_2.jinja",
        control_tokens=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
            "<|finetune_right_pad_id|>",
        ),
        text_tokens=(),
        eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>",
        bos_token="<|begin_of_text|>",
    ),
    # Not append-only: reasoning of assistant turns before the last user query is stripped when re-rendered.
    "qwen3": TemplateFamily(
        template_file="qwen3.jinja",
        control_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        text_tokens=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    ),
}


def _template_literals(template: str) -> list[str]:
    # The prose a chat template writes (system boilerplate, tool instructions): merging it keeps prompts short.
    literals = re.findall(r"'((?:[^'\\\n]|\\.){4,})'|\"((?:[^\"\\\n]|\\.){4,})\"", template)
    return [(a or b).encode().decode("unicode_escape") for a, b in literals]


def _training_corpus(seed: int = 0, template: str = "") -> list[str]:
    # Enough varied text for the BPE merges to cover English, JSON tool calls and the template's own prose.
    rng = random.Random(seed)
    words = (
        "the a an is are was of to in and or for with on at by from you your we our it this that what which how "
        "answer question compute calculate result final number value tool call function arguments name expression "
        "file files read write list directory content path text line lines done task user assistant system "
        "please use tools help helpful Qwen created Alibaba Cloud provided signatures within XML tags return json "
        "object Given following functions respond format dictionary argument Do not variables Environment ipython "
        "Cutting Knowledge Date December Today Jul weather city Paris London temperature add multiply subtract "
        "calculator hello hi dummy error true false null type string integer properties required description"
    ).split()
    corpus = []
    for _ in range(400):
        corpus.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 14))) + rng.choice([".", "?", "!"]))
    for _ in range(300):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        corpus.append(f"What is {a} {op} {b}? The answer is {eval(f'{a}{op}{b}')}.")
        call = {
            "name": rng.choice(["calculator", "read_file", "write_file", "add"]),
            "arguments": {"expression": f"{a} {op} {b}"},
        }
        corpus.append(json.dumps(call))
        corpus.append(json.dumps({"name": call["name"], "parameters": call["arguments"]}))
    schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "The expression."}},
                "required": ["expression"],
            },
        },
    }
    corpus.extend([json.dumps(schema), json.dumps(schema, indent=4)] * 20)
    corpus.extend(_template_literals(template) * 30)
    return corpus


def build_tiny_tokenizer(family: str = "qwen2_5", vocab_size: int = 1500, seed: int = 0) -> PreTrainedTokenizerFast:
    """Build a byte-level BPE tokenizer carrying the chat template of `family` (see `TEMPLATE_FAMILIES`).

    Args:
        family: `"qwen2_5"`, `"llama3_2"` or `"qwen3"`.
        vocab_size: BPE vocabulary size (including the 256 byte tokens and the added tokens).
        seed: seed of the synthetic training corpus.
    """
    if family not in TEMPLATE_FAMILIES:
        raise ValueError(f"Unknown template family {family!r}; choose one of {sorted(TEMPLATE_FAMILIES)}.")
    spec = TEMPLATE_FAMILIES[family]
    template = (_TEMPLATES_DIR / spec.template_file).read_text(encoding="utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(spec.control_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(seed, template), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.text_tokens])

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=spec.eos_token,
        pad_token=spec.pad_token,
        bos_token=spec.bos_token,
        clean_up_tokenization_spaces=False,
    )
    hf_tokenizer.chat_template = template
    add_response_schema(hf_tokenizer)
    return hf_tokenizer


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_position_embeddings: int = 4096,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """Build a randomly initialised Qwen2-shaped causal LM sized for `tokenizer` (fp32)."""
    import torch

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tiny_model(path: str | Path, family: str = "qwen2_5", **model_kwargs) -> Path:
    """Build a tiny tokenizer + model and save both to `path` (loadable with `from_pretrained`)."""
    path = Path(path)
    tokenizer = build_tiny_tokenizer(family)
    model = build_tiny_model(tokenizer, **model_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_model_and_tokenizer(model_name_or_path: str, **model_init_kwargs):
    """Load a policy and its tokenizer, with tool-call parsing enabled.

    `model_name_or_path` is a Hub id or local path (loaded with `from_pretrained`), or `tiny:<family>` (optionally
    `tiny:<family>:<hidden_size>x<num_layers>`) for a randomly initialised tiny model built locally, e.g.
    `tiny:qwen2_5:128x4`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_name_or_path.startswith("tiny:"):
        parts = model_name_or_path.split(":")
        family = parts[1] if len(parts) > 1 and parts[1] else "qwen2_5"
        tokenizer = build_tiny_tokenizer(family)
        sizes = {}
        if len(parts) > 2:
            try:
                hidden, layers = (int(v) for v in parts[2].lower().split("x"))
            except ValueError:
                raise ValueError(
                    f"Bad tiny model spec {model_name_or_path!r}: expected 'tiny:<family>:<hidden>x<layers>', "
                    "e.g. 'tiny:qwen2_5:128x4'."
                ) from None
            sizes = {"hidden_size": hidden, "num_layers": layers}
        return build_tiny_model(tokenizer, **sizes), tokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        try:
            add_response_schema(tokenizer)
        except ValueError:
            pass  # unknown template: tool calls are returned as text (the endpoint warns)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_name_or_path, **model_init_kwargs)
    return model, tokenizer
