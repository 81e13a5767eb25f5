"""Prefix-tree training: the rows of a chunk packed into one sequence (shared tokens once, a tree attention mask) give
TRL's loss, log-probabilities, entropies and every parameter's gradient, for every template family, with fewer tokens
through the model."""

import pytest
import torch
from datasets import Dataset

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer, agentic_grpo_trainer
from trl_agentic.prefix_tree import packed_prefix_tree, split_prefix_tree
from trl_agentic.tiny_models import TEMPLATE_FAMILIES, build_tiny_model, build_tiny_tokenizer


def never_called_agent(client, task):
    raise AssertionError("no rollout here")


def reward(prompts, completions, **kwargs):
    return [0.0] * len(prompts)


def make_trainer(tmp_path, family: str, attn_implementation: str = "sdpa", loss_type: str = "dapo"):
    tokenizer = build_tiny_tokenizer(family)
    model = build_tiny_model(tokenizer)
    model.config._attn_implementation = attn_implementation
    trainer = AgenticGRPOTrainer(
        model,
        agent=never_called_agent,
        reward_funcs=reward,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}]}] * 2),
        args=AgenticGRPOConfig(
            output_dir=str(tmp_path),
            num_generations=2,
            per_device_train_batch_size=4,
            max_completion_length=8,
            use_cpu=True,
            bf16=False,
            report_to="none",
            seed=0,
            loss_type=loss_type,
            epsilon=0.05,  # old logps are perturbed below: some tokens clip
        ),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # (set by `train()`; the loss normalizer reads it)
    return trainer, tokenizer


def tree_rows(tokenizer, seed: int = 0):
    """TRL's layout of a tree of rows: two questions, each with branches that share their first turn (a tool call
    and its result), ragged lengths, plus a row that shares nothing with the others (its first token differs) and a
    row whose completion is masked as truncated, and a fork (its prompt holds the first turn's tokens). Returns
    `(input_ids, attention_mask, width, completion_mask)`."""
    generator = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(20, 300, (n,), generator=generator).tolist()

    system = {"role": "system", "content": "You are a careful assistant. Use the tools. " * 3}
    prompt_a, prompt_b = (
        tokenizer.apply_chat_template(
            [system, {"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in ("What is 12 * 34?", "Name a prime, then add 7 to it.")
    )
    turn_a, turn_b = rand(9), rand(5)  # each question's shared first turn (the trunk of its tree)
    mid_a = rand(4)  # a second shared level under question a
    rows = [
        (prompt_a, turn_a + mid_a + rand(6)),
        (prompt_a, turn_a + mid_a + rand(2)),
        (prompt_a, turn_a + rand(7)),
        (prompt_a, turn_a[:3]),  # a prefix of the others: ends inside the trunk
        (prompt_b, turn_b + rand(8)),
        (prompt_b, turn_b + rand(3)),
        (rand(11), rand(5)),  # shares nothing, not even the first token
        (prompt_a + turn_a[:6], rand(4)),  # a fork: its prompt holds the others' completion tokens (scored there)
        (prompt_b, rand(6)),  # masked as truncated below
    ]
    rows[6][0][0] = 301  # (the others draw from 20..299 and start with a template token)
    prompt_width = max(len(p) for p, _ in rows)
    width = max(len(c) for _, c in rows)
    pad = tokenizer.pad_token_id
    ids = [[pad] * (prompt_width - len(p)) + p + c + [pad] * (width - len(c)) for p, c in rows]
    mask = [[0] * (prompt_width - len(p)) + [1] * (len(p) + len(c)) + [0] * (width - len(c)) for p, c in rows]
    input_ids, attention_mask = torch.tensor(ids), torch.tensor(mask)
    attention_mask[-1, prompt_width:] = 0
    return input_ids, attention_mask, width, attention_mask[:, prompt_width:].clone()


def test_packed_tree_counts_each_shared_token_once():
    # Two rows share [5, 6]; they branch after it; a third shares nothing. Prompt: 2 columns, completion: 3.
    input_ids = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 9, 0, 0], [0, 4, 5, 6, 7]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    tree = packed_prefix_tree(input_ids, attention_mask, 3)
    # Rows in sorted order (4 5 6 7 | 5 6 7 8 | 5 6 9), a node per distinct prefix: 4 5 6 7 | 5 6 7 8 | 9, then a copy
    # of the branch point 6 (position 5 scores 7 for row 0, the copy at position 9 scores 9 for row 1).
    assert tree.input_ids.tolist() == [[4, 5, 6, 7, 5, 6, 7, 8, 9, 6]]
    assert tree.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 2, 1]]
    assert tree.shift_labels.tolist() == [[5, 6, 7, -100, -100, 7, 8, -100, -100, 9]]
    assert tree.index.tolist() == [[5, 6, 0], [9, 0, 0], [0, 1, 2]]
    assert tree.scored.tolist() == [[True, True, False], [True, False, False], [True, True, True]]
    assert tree.real_tokens == 11 and tree.length == 10
    attends = [row.nonzero().flatten().tolist() for row in tree.allowed]
    assert attends == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [4], [4, 5], [4, 5, 6], [4, 5, 6, 7], [4, 5, 8], [4, 9]]


def test_rows_out_of_trls_layout_are_not_packed():
    input_ids = torch.tensor([[5, 6, 7, 8]])
    assert packed_prefix_tree(input_ids, torch.tensor([[1, 0, 1, 1]]), 2) is None  # a hole in the prompt
    assert packed_prefix_tree(input_ids, torch.tensor([[1, 1, 0, 1]]), 2) is None  # a hole in the completion


def loss_and_grads(trainer, inputs, tree: bool, calls: list):
    trainer.args.prefix_tree_training = tree
    trainer.args.shared_prefix_scoring = False
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    loss_tokens = sum(calls)  # what the loss's forward ran
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():  # as the old/reference passes: in chunks (of 3: some packed, some too small to pay)
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            input_ids,
            attention_mask,
            inputs["completion_ids"].size(1),
            batch_size=3,
            compute_entropy=True,
        )
    return loss.detach(), grads, logps, entropies, loss_tokens


@pytest.mark.parametrize(
    "family, attn_implementation, loss_type, mode",
    [(family, "sdpa", "dapo", "split") for family in TEMPLATE_FAMILIES]
    + [
        ("qwen2_5", "eager", "grpo", "split"),
        ("qwen2_5", "sdpa", "dapo", "packed"),
        ("llama3_2", "eager", "grpo", "packed"),
    ],
)
def test_prefix_tree_loss_and_gradients_equal_trls(tmp_path, monkeypatch, family, attn_implementation, loss_type, mode):
    """`split` (trunk, then tails on its key/value states: one process, no checkpointing) and `packed` (one forward:
    what runs under DDP, DeepSpeed, FSDP or gradient checkpointing)."""
    chosen = []
    original = agentic_grpo_trainer.prefix_tree_mode

    def forced_mode(*args, **kwargs):
        chosen.append(original(*args, **kwargs))
        return mode if chosen[-1] else None

    monkeypatch.setattr(agentic_grpo_trainer, "prefix_tree_mode", forced_mode)
    trainer, tokenizer = make_trainer(tmp_path, family, attn_implementation, loss_type)
    try:
        input_ids, attention_mask, width, completion_mask = tree_rows(tokenizer)
        rows = input_ids.size(0)
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            trainer.args.prefix_tree_training = False
            flat_logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, input_ids, attention_mask, width
            )
        inputs = {
            "prompt_ids": input_ids[:, :-width],
            "prompt_mask": attention_mask[:, :-width],
            "completion_ids": input_ids[:, -width:],
            "completion_mask": completion_mask,
            "advantages": torch.randn(rows, width, generator=generator),  # per-token, as turn rewards give them
            "old_per_token_logps": flat_logps + 0.1 * torch.randn(rows, width, generator=generator),
            "num_items_in_batch": completion_mask.sum(),
        }
        calls = []
        handle = trainer.model.model.register_forward_hook(
            lambda m, args, kwargs, out: calls.append(kwargs["input_ids"].numel()), with_kwargs=True
        )
        try:
            loss, grads, logps, entropies, tree_tokens = loss_and_grads(trainer, inputs, True, calls)
            calls[:] = []
            flat_loss, flat_grads, flat_logps, flat_entropies, flat_tokens = loss_and_grads(
                trainer, inputs, False, calls
            )
        finally:
            handle.remove()
    finally:
        trainer.close()
    assert "split" in chosen  # the default here: one process, no checkpointing
    assert logps.shape == flat_logps.shape == (rows, width)
    torch.testing.assert_close(logps, flat_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropies, flat_entropies, atol=1e-5, rtol=1e-5)
    assert (logps[completion_mask == 0] == 0).all()  # TRL's padding columns: zeros in both
    assert loss != 0
    torch.testing.assert_close(loss, flat_loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == flat_grads.keys() and len(grads) == len(list(trainer.model.parameters()))
    for name in grads:
        assert flat_grads[name].abs().max() > 0, name
        torch.testing.assert_close(grads[name], flat_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    # Shared tokens went through the model once: the packed sequence is the trie's nodes plus one copy per extra branch.
    real = [input_ids[b][attention_mask[b].bool()].tolist() for b in range(rows)]
    prefixes = {tuple(r[: i + 1]) for r in real for i in range(len(r))}
    assert flat_tokens == input_ids.numel()
    build = split_prefix_tree if mode == "split" else packed_prefix_tree
    assert tree_tokens == build(input_ids, attention_mask, width).length
    assert len(prefixes) <= tree_tokens < 0.6 * sum(map(len, real))


def test_split_tree_runs_the_trunk_once_and_each_tail_on_it():
    # Rows 5 6 7 8 and 5 6 9 share 5 6 (the trunk); 4 5 6 7 shares nothing (a whole tail). Prompt: 2 columns.
    input_ids = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 9, 0, 0], [0, 4, 5, 6, 7]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    tree = split_prefix_tree(input_ids, attention_mask, 3)
    assert tree.trunk.input_ids.tolist() == [[5, 6]] and tree.trunk.shift_labels.tolist() == [[-100, -100]]
    # Tails in row order: [copy of 6] 7 8, [copy of 6] 9, 4 5 6 7 (no branch point); right-padded to 4.
    assert tree.tail_ids[:, :4].tolist() == [[6, 7, 8, 0], [6, 9, 0, 0], [4, 5, 6, 7]]
    assert tree.tail_positions.tolist() == [[1, 2, 3, 4], [1, 2, 3, 3], [0, 1, 2, 3]]
    assert tree.tail_labels.tolist() == [[7, 8, -100, -100], [9, -100, -100, -100], [5, 6, 7, -100]]
    # Keys: [trunk 5, trunk 6 | own 0..3]. The copy of 6 sees trunk 5 and itself; 7 sees the trunk's 6, not the copy.
    assert tree.tail_allowed[0, 0].int().tolist() == [
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],  # padding: itself only (no query without a key)
    ]
    assert tree.tail_allowed[2, 0, :, :2].sum() == 0  # the row that shares nothing never sees the trunk
    trunk, tails = 2, 4  # flattened scores: [trunk 0, 1 | tail r at trunk + 4 r + j]
    assert tree.index.tolist() == [[trunk + 0, trunk + 1, 0], [trunk + 4, 0, 0], [trunk + 8, trunk + 9, trunk + 10]]
    assert tree.length == trunk + 3 * tails and tree.real_tokens == 11


def test_checkpointed_models_run_one_packed_forward_with_trls_gradients(tmp_path):
    """Checkpointed layers recompute their forward in the backward, where kept key/value states would be appended to
    twice: the one-forward mode runs instead, with the same gradients."""
    trainer, tokenizer = make_trainer(tmp_path, "qwen2_5")
    try:
        input_ids, attention_mask, width, completion_mask = tree_rows(tokenizer, seed=4)
        trainer.model.gradient_checkpointing_enable()
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        args = dict(enabled=True, compute_aux_loss=False, model_inputs={}, distributed=False)
        assert agentic_grpo_trainer.prefix_tree_mode(unwrapped, **args) == "packed"
        weights = torch.linspace(-1.0, 1.0, input_ids.size(0) * width).view(-1, width) * completion_mask

        def grads(tree: bool):
            trainer.args.prefix_tree_training, trainer.args.shared_prefix_scoring = tree, False
            trainer.model.zero_grad()
            logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, width)
            (logps * weights).sum().backward()
            return {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}

        tree_grads, flat_grads = grads(True), grads(False)
        trainer.model.gradient_checkpointing_disable()
        assert agentic_grpo_trainer.prefix_tree_mode(unwrapped, **args) == "split"
        assert agentic_grpo_trainer.prefix_tree_mode(unwrapped, **{**args, "distributed": True}) == "packed"
        unwrapped.config._attn_implementation = "flash_attention_2"  # takes no custom 4D mask
        assert agentic_grpo_trainer.prefix_tree_mode(unwrapped, **args) is None
        unwrapped.config._attn_implementation = "sdpa"
    finally:
        trainer.close()
    assert tree_grads.keys() == flat_grads.keys()
    for name in flat_grads:
        torch.testing.assert_close(tree_grads[name], flat_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_a_training_step_with_prefix_tree_training_matches_the_flat_one(tmp_path, monkeypatch):
    """End to end: the multi-turn tool agent's episodes (rows sharing their prompts), one step, the loss and the
    gradient norm TRL logs, with and without `prefix_tree_training` (the same episodes: same seed, same model)."""
    from test_agentic_grpo_trainer import config, dataset, length_reward, tool_agent

    stats = {}  # what every prefix-tree scoring of the run counted (the trainer resets its own when it logs)
    original = agentic_grpo_trainer.chunked_prefix_tree_logps

    def counted(*args, stats_of_trainer=None, **kwargs):
        counts = {}
        result = original(*args, **kwargs, stats=counts)
        for target in (stats, stats_of_trainer):
            for key, value in counts.items():
                if target is not None:
                    target[key] = target.get(key, 0) + value
        return result

    monkeypatch.setattr(
        agentic_grpo_trainer,
        "chunked_prefix_tree_logps",
        lambda *args, stats=None, **kwargs: counted(*args, stats_of_trainer=stats, **kwargs),
    )
    tokenizer = build_tiny_tokenizer("qwen2_5")
    logged = {}
    for tree in (True, False):
        trainer = AgenticGRPOTrainer(
            build_tiny_model(tokenizer),
            agent=tool_agent,
            reward_funcs=length_reward,
            args=config(
                tmp_path / str(tree),
                max_steps=1,
                per_device_train_batch_size=4,
                num_generations=4,
                prefix_tree_training=tree,
                shared_prefix_scoring=False,
                log_episodes=False,
            ),
            train_dataset=dataset(2),
            processing_class=tokenizer,
        )
        try:
            trainer.train()
        finally:
            trainer.close()
        logged[tree] = trainer.state.log_history[0]
    assert logged[True]["grad_norm"] > 0
    assert 0 < stats["forward_tokens"] < 0.8 * stats["flat_tokens"]  # the loss's forward ran as trees
    for key in ("loss", "grad_norm", "entropy", "completions/mean_length"):
        assert logged[True][key] == pytest.approx(logged[False][key], rel=1e-4, abs=1e-6), key


def test_random_trees_score_like_flat_rows():
    """Random chunks (duplicate rows, rows that are prefixes of others, forks, truncated rows, rows sharing nothing):
    both modes give TRL's flat log-probabilities and entropies (its fused head on the padded rows)."""
    from trl.trainer.utils import add_fused_lm_head

    from trl_agentic.prefix_tree import prefix_tree_logps, split_tree_logps

    tokenizer = build_tiny_tokenizer("qwen2_5")
    model = build_tiny_model(tokenizer).eval()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    generator = torch.Generator().manual_seed(5)

    def draw(n):
        return torch.randint(3, 60, (n,), generator=generator).tolist()

    checked = 0
    for _ in range(12):
        trunk = draw(int(torch.randint(1, 12, (1,), generator=generator)))
        rows = []
        for _ in range(int(torch.randint(2, 7, (1,), generator=generator))):
            kind = int(torch.randint(0, 5, (1,), generator=generator))
            if kind == 0 and rows:
                rows.append(list(rows[-1]))  # a duplicate
            elif kind == 1:
                rows.append(draw(int(torch.randint(2, 10, (1,), generator=generator))))  # shares nothing (probably)
            else:
                cut = int(torch.randint(1, len(trunk) + 1, (1,), generator=generator))
                rows.append(trunk[:cut] + draw(int(torch.randint(0, 8, (1,), generator=generator))))
        splits = [int(torch.randint(1, len(r) + 1, (1,), generator=generator)) for r in rows]  # prompt | completion
        prompts, completions = [r[:s] for r, s in zip(rows, splits)], [r[s:] for r, s in zip(rows, splits)]
        prompt_width, width = max(map(len, prompts)), max(1, max(map(len, completions)))
        ids = [[0] * (prompt_width - len(p)) + p + c + [0] * (width - len(c)) for p, c in zip(prompts, completions)]
        mask = [
            [0] * (prompt_width - len(p)) + [1] * (len(p) + len(c)) + [0] * (width - len(c))
            for p, c in zip(prompts, completions)
        ]
        input_ids, attention_mask = torch.tensor(ids), torch.tensor(mask)
        if torch.rand(1, generator=generator) < 0.3:
            attention_mask[0, prompt_width:] = 0  # truncated
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :-width] = -100
        with torch.no_grad():
            flat = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
            flat_logps, flat_entropy = flat.log_probs[:, -width:], flat.entropy[:, -width:]
            for build, score in ((packed_prefix_tree, prefix_tree_logps), (split_prefix_tree, split_tree_logps)):
                tree = build(input_ids, attention_mask, width)
                if tree is None:
                    continue
                logps, entropies = score(model, tree, compute_entropy=True)
                torch.testing.assert_close(logps, flat_logps, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(entropies, flat_entropy, atol=1e-5, rtol=1e-5)
                checked += 1
    assert checked >= 16
