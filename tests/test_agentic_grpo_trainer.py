"""AgenticGRPOTrainer end to end on a tiny model: rows, masks, advantages, failures, KL, LoRA."""

import asyncio
import json
import sys
import textwrap
import threading

import anthropic
import httpx
import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer, CommandAgent
from trl_agentic.agentic_grpo_trainer import split_rows
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


async def tool_agent(client, task):
    """A multi-turn tool-using agent: executes tool calls, otherwise nudges the model, three model calls."""
    messages = list(task["prompt"])
    for _ in range(3):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=6)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
        else:
            messages.append({"role": "user", "content": "Use the add tool."})
    return messages[-2].get("content")


def length_reward(prompts, completions, completion_ids=None, **kwargs):
    # Deterministic and varied: depends on what the model sampled.
    return [float(sum(len(m.get("content") or "") for m in c) % 5) for c in completions]


def dataset(n=4):
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"Add {i} and {i + 1}."}], "a": i} for i in range(n)]
    )


def config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path),
        num_generations=2,
        per_device_train_batch_size=2,  # 2 episodes per task
        max_steps=2,
        max_completion_length=6,  # short calls keep the test fast
        use_cpu=True,
        bf16=False,
        report_to="none",
        logging_steps=1,
        learning_rate=1e-2,  # big lr: params must move
        save_strategy="no",
        log_episodes=True,
        episode_timeout=30,
        seed=0,
    )
    values.update(overrides)
    return AgenticGRPOConfig(**values)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


def read_episode_log(tmp_path):
    lines = (tmp_path / "episodes" / "episodes-rank0.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def train_and_read_log(trainer, tmp_path):
    """Train, stop the trainer's endpoint whatever happens, and return the episode log."""
    try:
        trainer.train()
    finally:
        trainer.close()
    return read_episode_log(tmp_path)


def test_multi_turn_tool_agent_trains_on_exactly_the_sampled_tokens(tmp_path, tokenizer):
    model = build_tiny_model(tokenizer)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = AgenticGRPOTrainer(
        model,
        agent=tool_agent,
        reward_funcs=length_reward,
        args=config(tmp_path),
        train_dataset=dataset(),
        processing_class=tokenizer,
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters()), "parameters did not change"
    # The engine generates with an inference copy, synced by the trainer before each rollout (issue 29, M1): it never
    # reads every weight per call to look for edits.
    assert trainer.engine.inference_copy and not trainer.engine.watch_weights

    records = read_episode_log(tmp_path)
    assert len(records) == 4  # 2 steps x (1 task x 2 episodes)
    for record in records:
        turns = record["episode"]["turns"]
        assert record["episode"]["status"] == "ok" and len(turns) == 3
        sampled = [(t, tok, lp) for t in turns for tok, lp in zip(t["completion_ids"], t["logprobs"])]
        in_rows = []
        for row in record["rows"]:
            assert len(row["completion_ids"]) == len(row["env_mask"]) == len(row["logprobs"])
            for tok, mask, lp in zip(row["completion_ids"], row["env_mask"], row["logprobs"]):
                if mask:
                    in_rows.append((tok, lp))
                else:
                    assert lp == 0.0
        # Every mask-1 token is a sampled token with its recorded logprob, and every sampled token is in one row.
        assert in_rows == [(tok, lp) for _, tok, lp in sampled]
        # Continuations: one row holding all three turns, whose prompt is the first call's prompt.
        assert [t["prompt_source"] for t in turns] == ["rendered", "continued", "continued"]
        assert len(record["rows"]) == 1 and record["rows"][0]["prompt_ids"] == turns[0]["prompt_ids"]
        row = record["rows"][0]
        assert row["prompt_ids"] + row["completion_ids"] == turns[2]["prompt_ids"] + turns[2]["completion_ids"]
    metrics = trainer.state.log_history[0]
    assert metrics["episodes/turns_mean"] == 3.0 and metrics["episodes/status_ok"] == 1.0
    assert metrics["episodes/rows_mean"] == 1.0 and metrics["episodes/forks_mean"] == 0.0
    # TRL's length metric counts sampled tokens only (env_mask), and equals the episodes' sampled tokens.
    assert metrics["completions/mean_length"] == metrics["episodes/sampled_tokens_mean"]


def test_single_turn_parity_with_vanilla_grpo(tmp_path, tokenizer):
    """A one-call agent yields the rows, masks and advantages vanilla GRPOTrainer builds for the same completions."""
    model = build_tiny_model(tokenizer)

    async def one_call_agent(client, task):
        response = await client.chat.completions.create(model="policy", messages=task["prompt"], max_tokens=6)
        return response.choices[0].message.content

    def ids_reward(prompts, completions, completion_ids, **kwargs):
        return [float(sum(ids) % 7) for ids in completion_ids]

    train = dataset(2)
    agentic = AgenticGRPOTrainer(
        model,
        agent=one_call_agent,
        reward_funcs=ids_reward,
        args=config(tmp_path / "a", log_episodes=False),
        train_dataset=train,
        processing_class=tokenizer,
    )
    inputs = [dict(train[i]) for i in (0, 0, 1, 1)]  # RepeatSampler order: each task num_generations times
    agentic.model.train()
    try:
        ours = agentic._generate_and_score_completions([dict(x) for x in inputs])
    finally:
        agentic.close()
    width = ours["completion_mask"].size(1)
    completions = [ids[: int(m.sum())].tolist() for ids, m in zip(ours["completion_ids"], ours["completion_mask"])]
    logprobs = [lp[: len(c)].tolist() for lp, c in zip(ours["sampling_per_token_logps"], completions)]

    replay = iter(range(len(completions)))

    def replay_rollout(prompts, trainer):
        prompt_ids = [
            tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
            for p in prompts
        ]
        order = [next(replay) for _ in prompts]
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [completions[i] for i in order],
            "logprobs": [logprobs[i] for i in order],
        }

    vanilla = GRPOTrainer(
        model,
        reward_funcs=ids_reward,
        train_dataset=train,
        processing_class=tokenizer,
        rollout_func=replay_rollout,
        args=GRPOConfig(
            output_dir=str(tmp_path / "v"),
            num_generations=2,
            per_device_train_batch_size=2,
            max_completion_length=6,
            use_cpu=True,
            bf16=False,
            report_to="none",
        ),
    )
    vanilla.model.train()
    theirs = vanilla._generate_and_score_completions([dict(x) for x in inputs])
    # Our first-turn prompt is exactly TRL's own tokenization of the dataset prompt.
    vanilla_prompts = vanilla._tokenize_prompts([x["prompt"] for x in inputs])[0]
    assert [ids[m.bool()].tolist() for ids, m in zip(ours["prompt_ids"], ours["prompt_mask"])] == vanilla_prompts
    assert torch.equal(ours["prompt_ids"], theirs["prompt_ids"])
    assert torch.equal(ours["completion_ids"], theirs["completion_ids"][:, :width])
    assert torch.equal(ours["completion_mask"] * ours["tool_mask"], theirs["completion_mask"][:, :width])
    assert torch.allclose(ours["advantages"], theirs["advantages"])
    assert ours["advantages"].abs().sum() > 0  # the rewards did split


@pytest.mark.slow
def test_crashing_and_hanging_episodes_are_recorded_and_excluded(tmp_path, tokenizer):
    model = build_tiny_model(tokenizer)
    calls = {"n": 0}
    lock = threading.Lock()  # each agent runs on a thread of its own: count task a=0's episodes, not call order

    async def flaky_agent(client, task):
        if task["a"] == 0:
            with lock:
                calls["n"] += 1
                first = calls["n"] == 1
            if first:
                raise RuntimeError("agent bug")
            await client.chat.completions.create(model="policy", messages=task["prompt"], max_tokens=4)
            await asyncio.sleep(60)  # hangs: the episode times out
        return await tool_agent(client, task)

    def constant_reward(prompts, completions, **kwargs):
        return [1.0] * len(prompts)

    trainer = AgenticGRPOTrainer(
        model,
        agent=flaky_agent,
        reward_funcs=constant_reward,
        args=config(
            tmp_path,
            max_steps=1,
            episode_timeout=3,
            steps_per_generation=2,  # 2 tasks
            agent_columns=["prompt", "a"],
        ),  # the agent reads `a`
        train_dataset=dataset(2),
        processing_class=tokenizer,
    )
    records = train_and_read_log(trainer, tmp_path)
    by_status = sorted(r["episode"]["status"] for r in records)
    assert by_status == ["agent_error", "ok", "ok", "timeout"]
    for record in records:
        if record["episode"]["status"] != "ok":
            assert record["episode"]["metadata"]["rewards"] == {"constant_reward": None}  # unscorable, not 0
            assert record["advantage"] == 0.0
    crashed = next(r for r in records if r["episode"]["status"] == "agent_error")
    assert "agent bug" in crashed["episode"]["error"]
    timed_out = next(r for r in records if r["episode"]["status"] == "timeout")
    assert len(timed_out["episode"]["turns"]) == 1  # the call it made before hanging is kept
    metrics = trainer.state.log_history[0]
    assert metrics["episodes/status_agent_error"] == 0.25 and metrics["episodes/status_timeout"] == 0.25
    assert metrics["episodes/unscorable"] == 0.5  # the crash and the timeout


def test_agent_sees_only_its_columns_and_whatever_it_returns_is_logged(tmp_path, tokenizer):
    """The agent's task holds `agent_columns` only: the checker's `answer` never reaches it, while every column reaches
    the reward functions. An episode without a model call is flagged (`episodes/no_model_calls`), and whatever the
    agent returns (NaN, a lone surrogate, a cycle, 5,000-deep nesting) is written to the episode log as valid JSON
    instead of crashing training (issue #9)."""
    deep = []
    for _ in range(5000):
        deep = [deep]
    cycle = {}
    cycle["self"] = cycle

    async def answer_stealing_agent(client, task):
        return {
            "keys": sorted(task),
            "answer": task.get("answer"),
            "nan": float("nan"),
            "text": "\ud800",
            "cycle": cycle,
            "deep": deep,
        }

    columns_seen = []

    def answer_reward(prompts, completions, answer, episodes, **kwargs):
        columns_seen.extend(answer)
        return [1.0 if ep.result["answer"] == a else 0.0 for ep, a in zip(episodes, answer, strict=True)]

    train = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)} for i in range(2)]
    )
    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=answer_stealing_agent,
        reward_funcs=answer_reward,
        args=config(tmp_path, max_steps=1, steps_per_generation=2),
        train_dataset=train,
        processing_class=tokenizer,
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    assert sorted(set(columns_seen)) == ["0", "2"]
    lines = (tmp_path / "episodes" / "episodes-rank0.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=pytest.fail) for line in lines]  # strict JSON
    assert len(records) == 4
    for record in records:
        result = record["episode"]["result"]
        assert result["keys"] == ["prompt"] and result["answer"] is None
        assert result["nan"] == "nan" and result["text"] == "?" and isinstance(result["deep"], list)
        assert record["episode"]["metadata"]["rewards"] == {"answer_reward": 0.0}
    assert trainer.state.log_history[0]["episodes/no_model_calls"] == 1.0


@pytest.mark.parametrize("kind", ["kl", "lora"])
def test_kl_and_lora_runs(tmp_path, tokenizer, kind):
    model = build_tiny_model(tokenizer)
    peft_config = None
    overrides = {"max_steps": 1}
    if kind == "kl":
        # TRL loads the reference model from the policy's path, as a user's run would.
        model.save_pretrained(tmp_path / "policy")
        model = str(tmp_path / "policy")
        overrides["beta"] = 0.1
    else:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        overrides["beta"] = 0.1  # reference = the base model with the adapter disabled
    trainer = AgenticGRPOTrainer(
        model,
        agent=tool_agent,
        reward_funcs=length_reward,
        args=config(tmp_path, **overrides),
        train_dataset=dataset(2),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    metrics = trainer.state.log_history[0]
    assert "kl" in metrics and metrics["kl"] == metrics["kl"]  # logged, not NaN
    if kind == "lora":
        assert any("lora" in name for name, _ in trainer.model.named_parameters())


def test_episode_key_cannot_reach_admin_routes(tmp_path, tokenizer):
    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=tool_agent,
        reward_funcs=length_reward,
        args=config(tmp_path),
        train_dataset=dataset(2),
        processing_class=tokenizer,
    )
    try:
        session = trainer.endpoint.open_episode()
        headers = {"Authorization": f"Bearer {session.key}"}
        url = trainer.endpoint.url
        assert httpx.post(f"{url}/admin/episodes", headers=headers, json={}).status_code == 401
        assert httpx.get(f"{url}/admin/episodes/{session.episode.id}", headers=headers).status_code == 401
        closed = httpx.post(
            f"{url}/admin/episodes/{session.episode.id}/close",
            headers=headers,
            json={"status": "ok", "result": {"reward": 1.0}},
        )
        assert closed.status_code == 401
        assert trainer.endpoint.registry.by_id(session.episode.id) is not None  # still open, untouched
        # There is no route that accepts a reward at all.
        assert httpx.post(f"{url}/v1/rewards", headers=headers, json={"reward": 1}).status_code == 404
    finally:
        trainer.close()


@pytest.mark.slow
def test_sync_and_command_agents(tmp_path, tokenizer):
    script = tmp_path / "agent.py"
    script.write_text(
        textwrap.dedent("""
        import json, os, sys
        from openai import OpenAI
        task = json.load(sys.stdin)
        client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
        messages = task["prompt"]
        for _ in range(2):
            reply = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages, max_tokens=4)
            messages = messages + [{"role": "assistant", "content": reply.choices[0].message.content},
                                   {"role": "user", "content": "more"}]
        print(json.dumps({"turns": 2}))
    """)
    )

    def sync_agent(client, task):
        return client.chat.completions.create(model="policy", messages=task["prompt"], max_tokens=4).id

    for name, agent in (("sync", sync_agent), ("command", CommandAgent(f"{sys.executable} {script}"))):
        trainer = AgenticGRPOTrainer(
            build_tiny_model(tokenizer),
            agent=agent,
            reward_funcs=length_reward,
            args=config(tmp_path / name, max_steps=1, steps_per_generation=2),
            train_dataset=dataset(2),
            processing_class=tokenizer,
        )
        try:
            trainer.train()
        finally:
            trainer.close()
        records = read_episode_log(tmp_path / name)
        assert [r["episode"]["status"] for r in records] == ["ok"] * 4, [r["episode"]["error"] for r in records]
        if name == "command":
            assert all(r["episode"]["result"]["result"] == {"turns": 2} for r in records)
            assert all(len(r["episode"]["turns"]) == 2 for r in records)
            assert all(r["episode"]["turns"][1]["prompt_source"] == "continued" for r in records)


def test_split_rows_keeps_every_row():
    batch = {
        "prompt_ids": torch.arange(7).unsqueeze(1),
        "advantages": torch.arange(7.0),
        "num_items_in_batch": torch.tensor(3),
    }
    chunks = split_rows(batch, 3)
    assert [c["prompt_ids"].flatten().tolist() for c in chunks] == [[0, 1], [2, 3, 4], [5, 6]]
    assert all(c["num_items_in_batch"].item() == 3 for c in chunks)


def test_config_errors_say_how_to_fix(tmp_path):
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        config(tmp_path, max_turns=0)
    with pytest.raises(ValueError, match="forks must be one of"):
        config(tmp_path, forks="sometimes")


ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]


async def anthropic_tool_agent(client: anthropic.AsyncAnthropic, task):
    """`tool_agent` written with the anthropic SDK: the annotation is what gets it an anthropic client."""
    messages = list(task["prompt"])
    for _ in range(3):
        reply = await client.messages.create(model="policy", max_tokens=6, messages=messages, tools=ANTHROPIC_TOOLS)
        messages.append({"role": "assistant", "content": reply.content})
        calls = [block for block in reply.content if block.type == "tool_use"]
        messages.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "42"} for b in calls]
                or "Use the add tool.",
            }
        )
    return reply.stop_reason


def sampled_token_reward(prompts, completions, episodes, **kwargs):
    # Varied whatever the wire format: the sampled ids themselves (Anthropic-shaped content is a list of blocks, whose
    # length in `length_reward` hardly depends on what was sampled).
    return [float(sum(tok for t in ep.turns for tok in t.completion_ids) % 5) for ep in episodes]


def test_anthropic_sdk_agent_trains_on_exactly_the_sampled_tokens(tmp_path, tokenizer):
    model = build_tiny_model(tokenizer)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = AgenticGRPOTrainer(
        model,
        agent=anthropic_tool_agent,
        reward_funcs=sampled_token_reward,
        args=config(tmp_path),
        train_dataset=dataset(),
        processing_class=tokenizer,
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters()), "parameters did not change"

    records = read_episode_log(tmp_path)
    assert len(records) == 4  # 2 steps x (1 task x 2 episodes)
    for record in records:
        turns = record["episode"]["turns"]
        assert record["episode"]["status"] == "ok", record["episode"]["error"]
        assert [t["wire_format"] for t in turns] == ["anthropic_messages"] * 3
        assert [t["prompt_source"] for t in turns] == ["rendered", "continued", "continued"]
        (row,) = record["rows"]
        assert row["prompt_ids"] + row["completion_ids"] == turns[2]["prompt_ids"] + turns[2]["completion_ids"]
        sampled = [(tok, lp) for t in turns for tok, lp in zip(t["completion_ids"], t["logprobs"])]
        assert [
            (tok, lp) for tok, mask, lp in zip(row["completion_ids"], row["env_mask"], row["logprobs"]) if mask
        ] == sampled
    assert trainer.state.log_history[0]["episodes/forks_mean"] == 0.0


async def stopping_agent(client, task):
    """One call; even tasks ask for stop strings (so some calls end before `max_tokens`), odd ones do not."""
    stop = ["e", "a", "o", "i"] if int(task["prompt"][0]["content"].split()[1]) % 2 == 0 else None
    response = await client.chat.completions.create(model="policy", messages=task["prompt"], max_tokens=6, stop=stop)
    return response.choices[0].message.content


def test_cut_off_penalty_scores_each_episode_by_its_last_calls_finish_reason(tmp_path, tokenizer):
    """`cut_off_penalty` next to a checker: -1 for the episodes whose last call was cut at `max_tokens`, 0 for the
    others, and TRL adds it to the checker's score (its own `rewards/<name>/mean` metric)."""
    from trl_agentic.rewards import cut_off_penalty

    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=stopping_agent,
        reward_funcs=[length_reward, cut_off_penalty],
        args=config(tmp_path, max_steps=1, per_device_train_batch_size=4),
        train_dataset=dataset(2),
        processing_class=tokenizer,
    )
    records = train_and_read_log(trainer, tmp_path)
    assert len(records) == 4
    finishes = [record["episode"]["turns"][-1]["finish_reason"] for record in records]
    penalties = [record["episode"]["metadata"]["rewards"]["cut_off_penalty"] for record in records]
    assert penalties == [-1.0 if finish == "length" else 0.0 for finish in finishes]
    assert set(penalties) == {-1.0, 0.0}, finishes  # both kinds occur: the test can tell them apart
    logged = trainer.state.log_history[0]
    assert logged["rewards/cut_off_penalty/mean"] == pytest.approx(sum(penalties) / 4)
    totals = [sum(record["episode"]["metadata"]["rewards"].values()) for record in records]
    assert logged["reward"] == pytest.approx(sum(totals) / 4)


def test_mask_truncated_completions_masks_every_row_cut_at_max_tokens(tmp_path, tokenizer):
    """TRL's `mask_truncated_completions` (DAPO's overlong filtering) on every row: the main rows TRL builds and the
    fork rows the trainer appends. A row whose last token is not a stop token was cut at `max_tokens`: no loss."""
    from trl_agentic.rollout.rows import Row

    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=tool_agent,
        reward_funcs=length_reward,
        args=config(tmp_path, mask_truncated_completions=True, log_episodes=False),
        train_dataset=dataset(2),
        processing_class=tokenizer,
    )
    trainer.model.train()
    try:
        output = trainer._generate_and_score_completions([dict(dataset(2)[i]) for i in (0, 0)])
        ends = {*trainer.eos_token_ids, tokenizer.pad_token_id}
        lengths = (output["completion_ids"] != tokenizer.pad_token_id).sum(1)  # rows end in a sampled token or pad
        for ids, mask, n in zip(output["completion_ids"].tolist(), output["completion_mask"].tolist(), lengths):
            last = ids[int(n) - 1]
            assert (sum(mask) == 0) == (last not in ends), (ids, mask)
        eos, prompt = trainer.eos_token_ids[0], output["prompt_ids"][0][output["prompt_mask"][0].bool()].tolist()
        rows = [
            Row(prompt, [11, 12, 13, eos], [1, 1, 1, 1], [-0.5] * 4, [0], "fork"),  # ended: trained
            Row(prompt, [11, 12, 13, 14], [1, 1, 1, 1], [-0.5] * 4, [1], "fork"),
        ]  # cut at max_tokens: masked
        merged = trainer._append_rows(output, rows, torch.ones(2))
        assert merged["completion_mask"][-2:, :4].tolist() == [[1, 1, 1, 1], [0, 0, 0, 0]]
        kept = merged["completion_mask"] * merged["tool_mask"]
        assert merged["num_items_in_batch"] == kept.sum()
        trainer.mask_truncated_completions = False  # TRL's default: both trained
        assert trainer._append_rows(output, rows, torch.ones(2))["completion_mask"][-2:, :4].tolist() == [[1] * 4] * 2
    finally:
        trainer.close()


def test_a_reward_function_that_raises_stops_training_after_its_episodes_are_logged(tmp_path, tokenizer):
    """A crash in the checker surfaces as in TRL (the run stops with its error), but the step's episodes, what one
    reads to fix it, are in the episode log first (issue 29, N4); they used to be lost."""

    def broken_checker(prompts, completions, **kwargs):
        raise RuntimeError("checker down")

    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=tool_agent,
        reward_funcs=broken_checker,
        args=config(tmp_path),
        train_dataset=dataset(),
        processing_class=tokenizer,
    )
    with pytest.raises(RuntimeError, match="checker down"):
        train_and_read_log(trainer, tmp_path)
    records = read_episode_log(tmp_path)
    assert len(records) == 2 and {r["step"] for r in records} == {0}  # the first step's group of 2
    for record in records:
        assert record["reward_error"] == "RuntimeError: checker down" and record["advantage"] is None
        assert record["episode"]["status"] == "ok" and len(record["episode"]["turns"]) == 3
        assert record["rows"][0]["completion_ids"]


def test_reward_values_trl_cannot_hold_stop_training_naming_the_function(tmp_path, tokenizer):
    """1e39 is inf in TRL's float32 rewards, and made the group's advantages silently zero (issue 29, N5); a wrong
    count failed in a bare zip() (N4)."""

    def overflowing(prompts, completions, **kwargs):
        return [1e39] + [0.0] * (len(prompts) - 1)

    def short(prompts, completions, **kwargs):
        return [0.0]

    for func, message in (
        (overflowing, r"'overflowing' returned 1e\+39 for episode 0"),
        (short, r"'short' returned 1 rewards for 2 episodes"),
    ):
        trainer = AgenticGRPOTrainer(
            build_tiny_model(tokenizer),
            agent=tool_agent,
            reward_funcs=func,
            args=config(tmp_path / func.__name__),
            train_dataset=dataset(),
            processing_class=tokenizer,
        )
        with pytest.raises(ValueError, match=message):
            train_and_read_log(trainer, tmp_path / func.__name__)
        assert len(read_episode_log(tmp_path / func.__name__)) == 2


# ---------------------------------------------------------------------------------------------------------------------
# Resume (issue 29, M4)


async def two_call_agent(client, task):
    messages = list(task["prompt"])
    for _ in range(2):
        response = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
        messages += [response.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
    return messages[-2].get("content")


def parity_reward(prompts, completions, episodes, **kwargs):
    # What the model sampled decides: groups split or not from step to step, and the alarms come and go with them.
    return [float(sum(t.completion_ids[0] for t in ep.turns) % 2) for ep in episodes]


class StopAfter:
    """Stops training at the end of a step, as a crash after it would (the last checkpoint is older)."""

    def __init__(self, step):
        from transformers import TrainerCallback

        class _Stop(TrainerCallback):
            def on_step_end(inner, args, state, control, **kwargs):
                if state.global_step == step:
                    control.should_training_stop = True

        self.callback = _Stop()


def resumable_trainer(output_dir, tokenizer, callbacks=None):
    leveled = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"Task {i}."}], "difficulty": 1 + i % 2} for i in range(8)]
    )
    args = config(
        output_dir,
        max_steps=5,
        save_strategy="steps",
        save_steps=3,  # checkpoints at steps 3 and 5
        per_device_train_batch_size=4,
        num_generations=2,  # 2 tasks x 2 episodes a step
        num_iterations=2,  # each generation trains 2 steps (at 0, 2, 4): the checkpoint at 3 is mid-way through one
        task_sampling="adaptive",
        target_difficulty=2,
        alarm_window=1,
        alarm_min_split_rate=0.75,  # low_split_rate holds at some steps and not at others
        held_out_eval_steps=2,
        held_out_num_samples=2,  # at steps 0, 2, 4 and 5: none at the checkpoint
        logging_steps=4,
        logging_first_step=True,  # logs at 1 and 4: steps 2-3's metrics wait across the checkpoint
        disable_tqdm=True,
        temperature=1.5,
    )
    return AgenticGRPOTrainer(
        build_tiny_model(tokenizer, hidden_size=32, num_layers=1),
        agent=two_call_agent,
        reward_funcs=parity_reward,
        args=args,
        train_dataset=leveled,
        eval_dataset=leveled.select(range(2)),
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def deterministic_part(record):
    episode = record["episode"]
    return {
        "step": record["step"],
        "mode": record["mode"],
        "advantage": record["advantage"],
        "difficulty": record.get("difficulty"),
        "task": episode["messages"][0]["content"],
        "task_index": episode["task_index"],
        "group_index": episode["group_index"],
        "status": episode["status"],
        "rewards": episode["metadata"]["rewards"],
        "turns": [(t["prompt_ids"], t["completion_ids"], t["sampling"]["seed"]) for t in episode["turns"]],
    }


def recorded_logprobs(record):
    return [lp for t in record["episode"]["turns"] for lp in t["logprobs"]]


@pytest.mark.slow
def test_a_resumed_run_is_the_run_that_was_never_interrupted(tmp_path, tokenizer):
    """Stopped after step 4 (last checkpoint: step 3) and resumed in the same output_dir, a run logs, samples, alarms
    and trains exactly as the run that was never stopped. It used to log step 4's episodes twice (the log is appended
    to), to start the adaptive sampler, the seen tasks and the alarms' history afresh, and to generate anew at step 3
    (TRL keeps no generation in a checkpoint)."""
    whole = resumable_trainer(tmp_path / "whole", tokenizer)
    train_and_read_log(whole, tmp_path / "whole")

    stopped = resumable_trainer(tmp_path / "resumed", tokenizer, callbacks=[StopAfter(4).callback])
    train_and_read_log(stopped, tmp_path / "resumed")
    assert stopped.state.global_step == 4 and (tmp_path / "resumed" / "checkpoint-3").is_dir()
    assert not (tmp_path / "resumed" / "checkpoint-4").exists()
    resumed = resumable_trainer(tmp_path / "resumed", tokenizer)
    try:
        resumed.train(resume_from_checkpoint=True)
    finally:
        resumed.close()

    logs = {name: read_episode_log(tmp_path / name) for name in ("whole", "resumed")}
    records = {name: [deterministic_part(r) for r in log] for name, log in logs.items()}
    assert [r["step"] for r in records["whole"] if r["mode"] == "train"] == [s for s in (0, 2, 4) for _ in range(4)]
    assert records["resumed"] == records["whole"]
    # The episodes' calls interleave freely (each samples from its own seed, whatever shares its batch), and what
    # shares a forward changes its float rounding: the recorded logprobs agree to ~5e-7, the sampled ids exactly.
    for resumed_record, whole_record in zip(logs["resumed"], logs["whole"], strict=True):
        assert recorded_logprobs(resumed_record) == pytest.approx(recorded_logprobs(whole_record), abs=1e-5)
    assert resumed.task_sampler.state_dict() == whole.task_sampler.state_dict()
    assert resumed._seen_tasks == whole._seen_tasks

    def timeless(metrics: dict) -> dict:
        # Left out: wall times, and transformers' own loss bookkeeping, which its checkpoints do not keep (the first
        # `loss` logged after a resume averages the steps since the resume; `train_loss`, those of one train() call).
        return {
            k: v
            for k, v in metrics.items()
            if k not in ("loss", "train_loss", "total_flos")
            and not any(word in k for word in ("time", "per_second", "engine/"))
        }

    callbacks = whole.alarms_callback, resumed.alarms_callback
    assert callbacks[1].alarms == callbacks[0].alarms and callbacks[0].alarms  # some alarm fired
    assert timeless(callbacks[1].history) == timeless(callbacks[0].history)
    assert [s for s, _ in callbacks[0].history["held_out/success"]] == [0, 2, 4, 5]
    assert (tmp_path / "resumed" / "alarms.json").read_text() == (tmp_path / "whole" / "alarms.json").read_text()
    assert [timeless(e) for e in resumed.state.log_history] == [timeless(e) for e in whole.state.log_history]
    assert [e["step"] for e in whole.state.log_history] == [1, 4, 5]
    for (name, p), q in zip(whole.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.slow
def test_a_checkpoint_without_the_trainers_state_resumes_with_a_warning(tmp_path, tokenizer, caplog):
    """A checkpoint saved before trl-agentic kept its state in checkpoints (no trl_agentic_state_*.json) still resumes:
    TRL's state and the weights are restored, the trainer's own state starts afresh, and a warning says so."""
    stopped = resumable_trainer(tmp_path, tokenizer, callbacks=[StopAfter(3).callback])
    train_and_read_log(stopped, tmp_path)
    checkpoint = tmp_path / "checkpoint-3"
    for path in checkpoint.glob("trl_agentic_*"):
        path.unlink()
    resumed = resumable_trainer(tmp_path, tokenizer)
    with caplog.at_level("WARNING", logger="trl_agentic"):
        try:
            resumed.train(resume_from_checkpoint=str(checkpoint))
        finally:
            resumed.close()
    assert resumed.state.global_step == 5
    assert any("trl_agentic_state_0.json" in r.getMessage() and "afresh" in r.getMessage() for r in caplog.records)


def test_a_checkpoint_of_another_process_count_is_refused_with_how_to_resume(tmp_path, tokenizer):
    """The trainer's state is per process, and every process must restore the same sampler and micro-step (or they
    draw different tasks, or one generates while another trains on its buffer and the collectives hang): a checkpoint
    saved by another number of processes is refused on every process, saying what to do."""
    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    for rank in range(2):  # saved by two processes; this run has one
        (checkpoint / f"trl_agentic_state_{rank}.json").write_text("{}")
    trainer = resumable_trainer(tmp_path, tokenizer)
    try:
        with pytest.raises(ValueError, match="2 processes.*1 process.*--num_processes 2"):
            trainer._load_optimizer_and_scheduler(str(checkpoint))
    finally:
        trainer.close()


@pytest.mark.slow
def test_resuming_into_a_dir_with_another_runs_episode_log_leaves_that_log_whole(tmp_path, tokenizer, caplog):
    """The log is cut back on resume only when it is the log the checkpoint counted (its start unchanged): resumed
    from another run's checkpoint into a folder holding a longer log of its own, the resumed run cut that log at the
    checkpoint's byte count, mid-record."""
    stopped = resumable_trainer(tmp_path / "a", tokenizer, callbacks=[StopAfter(3).callback])
    train_and_read_log(stopped, tmp_path / "a")
    other = tmp_path / "b" / "episodes" / "episodes-rank0.jsonl"
    other.parent.mkdir(parents=True)
    own = "".join(json.dumps({"step": i, "mode": "train", "note": "x" * 500}) + "\n" for i in range(400))
    other.write_text(own)
    assert (
        len(own)
        > json.loads((tmp_path / "a" / "checkpoint-3" / "trl_agentic_state_0.json").read_text())["episode_log_bytes"]
    )
    resumed = resumable_trainer(tmp_path / "b", tokenizer)
    with caplog.at_level("WARNING", logger="trl_agentic"):
        try:
            resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
        finally:
            resumed.close()
    assert other.read_text().startswith(own)
    assert any("not the log" in r.getMessage() for r in caplog.records)


def test_tiny_model_names_work_in_python_as_on_the_command_line(tmp_path):
    trainer = AgenticGRPOTrainer(
        "tiny:qwen2_5:32x1",
        agent=tool_agent,
        reward_funcs=length_reward,
        args=config(tmp_path),
        train_dataset=dataset(2),
    )
    try:
        assert trainer.model.config.hidden_size == 32 and trainer.model.config.num_hidden_layers == 1
        assert trainer.processing_class.chat_template  # its tokenizer, with a real chat template
    finally:
        trainer.close()
