"""The black-box path learns exactly like TRL's own loop (issue 13).

- Multi-turn gradient parity: the same multi-turn tool episodes (recorded by a real agent through the endpoint) go
  once through `AgenticGRPOTrainer` and once through TRL's own `GRPOTrainer` with a `rollout_func` that replays them
  (prompt ids, completion ids with the tool-output tokens, `env_mask`, sampling logprobs). Rows, masks, advantages,
  old/ref logps, the micro-batches, the per-token loss gradients, the loss and every parameter gradient must agree.
- Row weighting: with episodes that fork (several rows), every sampled token gets the gradient TRL's loss gives a
  token of a one-sequence episode, for `dapo`, `dr_grpo` and `grpo`.
"""

import copy

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.rollout.rows import episode_to_rows
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


async def three_turn_agent(client, task):
    """Append-only multi-turn agent: every call continues the previous one (tool results or a user nudge between)."""
    messages = list(task["prompt"])
    for _ in range(3):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=5)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "42"} for c in message.tool_calls]
        else:
            messages.append({"role": "user", "content": "Use the add tool."})
    return messages[-2].get("content")


async def rewriting_agent(client, task):
    """Forks on task 0: its second call rewrites the first user message (a history rewrite: a new row)."""
    first = await client.chat.completions.create(model="policy", messages=task["prompt"], max_tokens=5)
    reply = {"role": "assistant", "content": first.choices[0].message.content or ""}
    history = list(task["prompt"])
    if task["a"] == 0:
        history = [{"role": "user", "content": history[0]["content"] + " (summarised)"}]
    await client.chat.completions.create(
        model="policy", messages=history + [reply, {"role": "user", "content": "Again."}], max_tokens=5
    )
    return None


def ids_reward(prompts, completions, completion_ids, **kwargs):
    # Deterministic in the sampled ids, and varied: groups split.
    return [float(sum(ids) % 7) for ids in completion_ids]


def episode_reward(prompts, completions, episodes=None, **kwargs):
    # Sum of every sampled id of the episode: two episodes of a group tie only if they sampled the same ids.
    return [float(sum(sum(t.completion_ids) for t in ep.turns)) for ep in episodes]


def dataset():
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"Add {i} and {i + 1}."}], "a": i} for i in range(2)]
    )


KNOBS = dict(
    num_generations=2,
    per_device_train_batch_size=2,
    max_completion_length=5,
    use_cpu=True,
    bf16=False,
    report_to="none",
    save_strategy="no",
    seed=0,
)


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory):
    tokenizer = build_tiny_tokenizer("qwen2_5")
    path = tmp_path_factory.mktemp("policy")
    build_tiny_model(tokenizer).save_pretrained(path)  # both arms (and the KL reference) load these weights
    tokenizer.save_pretrained(path)
    return str(path)


def capture_per_token_logps(trainer) -> list[torch.Tensor]:
    """Keep the graph's per-token logps of every loss forward, so their gradients (the per-token loss weights,
    d loss / d logp) can be read after `backward()`."""
    captured = []
    original = trainer._get_per_token_logps_and_entropies

    def wrapped(*args, **kwargs):
        logps, entropies, aux = original(*args, **kwargs)
        if torch.is_grad_enabled() and logps.requires_grad:
            logps.retain_grad()
            captured.append(logps)
        return logps, entropies, aux

    trainer._get_per_token_logps_and_entropies = wrapped
    return captured


def micro_batches(trainer, generation_output, inputs, steps_per_generation):
    """The trainer's own `_prepare_inputs` (shuffle, split, our weighting), fed a fixed generation output."""
    trainer._generate_and_score_completions = lambda batch: copy.copy(generation_output)
    trainer._step, trainer._buffered_inputs = 0, None
    chunks = []
    torch.manual_seed(1234)  # the same shuffle in both trainers
    for step in range(steps_per_generation):
        trainer._step = step
        chunks.append(trainer._prepare_inputs([dict(x) for x in inputs]))
    return chunks


def loss_and_gradients(trainer, chunk, accumulation_steps):
    trainer.current_gradient_accumulation_steps = accumulation_steps
    trainer.model.zero_grad()
    captured = capture_per_token_logps(trainer)
    loss = trainer.compute_loss(trainer.model, chunk)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), captured[0].grad.clone(), grads


@pytest.mark.parametrize("loss_type,beta", [("dapo", 0.0), ("grpo", 0.0), ("dapo", 0.1), ("grpo", 0.1)])
def test_multi_turn_gradient_parity_with_trl(tmp_path, policy_path, loss_type, beta):
    steps_per_generation, accumulation = 2, 1  # two micro-batches per generation; TRL computes old logps here
    settings = dict(
        KNOBS,
        loss_type=loss_type,
        beta=beta,
        steps_per_generation=steps_per_generation,
        gradient_accumulation_steps=accumulation,
    )
    train = dataset()
    inputs = [dict(train[i]) for i in (0, 0, 1, 1)]  # RepeatSampler order: each task num_generations times

    agentic = AgenticGRPOTrainer(
        policy_path,
        agent=three_turn_agent,
        reward_funcs=ids_reward,
        args=AgenticGRPOConfig(output_dir=str(tmp_path / "a"), **settings),
        train_dataset=train,
    )
    try:
        agentic.model.train()
        ours = agentic._generate_and_score_completions([dict(x) for x in inputs])
    finally:
        agentic.close()
    assert ours["prompt_ids"].size(0) == 4  # append-only: one row per episode
    lengths = ours["completion_mask"].sum(1).tolist()
    rows = [
        {
            "prompt_ids": ids[mask.bool()].tolist(),
            "completion_ids": ours["completion_ids"][i, :n].tolist(),
            "env_mask": ours["tool_mask"][i, :n].tolist(),
            "logprobs": ours["sampling_per_token_logps"][i, :n].tolist(),
        }
        for i, (ids, mask, n) in enumerate(zip(ours["prompt_ids"], ours["prompt_mask"], lengths))
    ]
    for row in rows:  # multi-turn: sampled tokens with masked context (tool output, template glue) in between
        assert 0 in row["env_mask"] and row["env_mask"][0] == 1 and row["env_mask"][-1] == 1
    assert ours["advantages"].abs().sum() > 0, "the groups did not split: the comparison would be vacuous"

    def replay_rollout(prompts, trainer):
        assert len(prompts) == len(rows)
        return {key: [row[key] for row in rows] for key in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}

    vanilla = GRPOTrainer(
        policy_path,
        reward_funcs=ids_reward,
        train_dataset=train,
        rollout_func=replay_rollout,
        args=GRPOConfig(output_dir=str(tmp_path / "v"), **settings),
    )
    vanilla.model.train()
    theirs = vanilla._generate_and_score_completions([dict(x) for x in inputs])

    # The generation batch: identical rows, masks, advantages, logps.
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", "num_items_in_batch"):
        assert torch.equal(ours[key], theirs[key]), key
    for key in ("advantages", "sampling_per_token_logps", "old_per_token_logps", "ref_per_token_logps"):
        assert (key in ours) == (key in theirs), key
        if key in ours:
            torch.testing.assert_close(ours[key], theirs[key], msg=key)
    assert ("ref_per_token_logps" in ours) == (beta > 0) and "old_per_token_logps" in ours

    # The micro-batches, the per-token loss gradients, the loss and the parameter gradients.
    our_chunks = micro_batches(agentic, ours, inputs, steps_per_generation)
    their_chunks = micro_batches(vanilla, theirs, inputs, steps_per_generation)
    for our_chunk, their_chunk in zip(our_chunks, their_chunks, strict=True):
        for key, value in their_chunk.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(our_chunk[key], value, msg=key)
        our_loss, our_token_grads, our_grads = loss_and_gradients(agentic, our_chunk, accumulation)
        their_loss, their_token_grads, their_grads = loss_and_gradients(vanilla, their_chunk, accumulation)
        torch.testing.assert_close(our_loss, their_loss)
        torch.testing.assert_close(our_token_grads, their_token_grads)
        assert our_token_grads.abs().sum() > 0
        assert our_grads.keys() == their_grads.keys() and len(our_grads) > 0
        for name, grad in our_grads.items():
            torch.testing.assert_close(grad, their_grads[name], msg=name)


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "grpo"])
def test_forked_episodes_weigh_every_sampled_token_as_one_sequence(tmp_path, policy_path, loss_type):
    """Episode e with advantage A_e and T_e sampled tokens, B episodes in the micro-batch, N sampled tokens in the
    batch: TRL's loss gives each sampled token of a one-sequence episode d loss / d logp = -A_e / N (`dapo`),
    -A_e / (B * max_completion_length) (`dr_grpo`), -A_e / (T_e * B) (`grpo`). Forked episodes must get the same."""
    trainer = AgenticGRPOTrainer(
        policy_path,
        agent=rewriting_agent,
        reward_funcs=episode_reward,
        train_dataset=dataset(),
        args=AgenticGRPOConfig(
            output_dir=str(tmp_path),
            loss_type=loss_type,
            steps_per_generation=1,
            gradient_accumulation_steps=1,
            agent_columns=["prompt", "a"],  # the agent reads `a`
            **dict(KNOBS, per_device_train_batch_size=4),
        ),
    )
    train = dataset()
    inputs = [dict(train[i]) for i in (0, 0, 1, 1)]
    try:
        trainer.model.train()
        output = trainer._generate_and_score_completions(inputs)  # fills inputs[i]["episodes"]
    finally:
        trainer.close()
    episodes = [x["episodes"] for x in inputs]
    rows_per_episode = [episode_to_rows(ep.turns).rows for ep in episodes]
    assert [len(rows) for rows in rows_per_episode] == [2, 2, 1, 1]  # task 0 forks, task 1 continues
    # The episodes' advantages, TRL's group rule: (r - mean) / (std + 1e-4) within each group of 2.
    rewards = torch.tensor(episode_reward(None, None, episodes=episodes)).view(2, 2)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()
    assert (advantages[:2] != 0).all() and (advantages[2:] != 0).all(), "groups did not split; resample the test"

    # Row order in the batch: the 4 main rows, then each episode's extra rows in episode order.
    owner = list(range(4)) + [e for e, rows in enumerate(rows_per_episode) for _ in rows[1:]]
    row_tokens = [rows_per_episode[e][0] for e in range(4)] + [r for rows in rows_per_episode for r in rows[1:]]
    assert output["prompt_ids"].size(0) == len(owner) == 6
    output["row_id"] = torch.arange(len(owner))
    (chunk,) = micro_batches(trainer, output, inputs, 1)
    _, token_grads, _ = loss_and_gradients(trainer, chunk, 1)

    sampled_tokens = [sum(sum(r.env_mask) for r in rows) for rows in rows_per_episode]
    total = sum(sampled_tokens)
    for position, row_id in enumerate(chunk["row_id"].tolist()):
        e, row = owner[row_id], row_tokens[row_id]
        expected = {
            "dapo": -advantages[e] / total,
            "dr_grpo": -advantages[e] / (4 * KNOBS["max_completion_length"]),
            "grpo": -advantages[e] / (sampled_tokens[e] * 4),
        }[loss_type]
        grads = token_grads[position, : len(row.env_mask)]
        sampled = torch.tensor(row.env_mask, dtype=torch.bool)
        torch.testing.assert_close(grads[sampled], expected.expand(int(sampled.sum())), rtol=1e-4, atol=1e-7)
        assert (grads[~sampled] == 0).all()  # masked context carries no weight
