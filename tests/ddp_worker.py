"""Worker for tests/test_multiprocess.py: two gloo ranks train two steps with multi-turn agents whose episodes split
into different numbers of rows per rank (`async`: with asynchronous rollouts). Launched with `python -m torch.distributed.run --nproc_per_node 2`."""

import json
import os
import sys

import torch
from datasets import Dataset

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


async def agent(client, task):
    messages = list(task["prompt"])
    for turn in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        messages.append({"role": "user", "content": f"step {turn}"})
        if os.environ["RANK"] == "1" and turn == 0:
            messages = messages[:1] + messages[2:]  # rank 1 drops an earlier message: its next call forks a new row
    return len(messages)


def reward(prompts, completions, **kwargs):
    return [float(sum(len(m.get("content") or "") for m in c) % 4) for c in completions]


def main(out_dir, mode="sync"):
    rank = int(os.environ["RANK"])
    tokenizer = build_tiny_tokenizer("qwen2_5")
    model = build_tiny_model(tokenizer, seed=0)  # same initial weights on both ranks
    rows = [{"prompt": [{"role": "user", "content": f"task {i}"}]} for i in range(8)]
    args = AgenticGRPOConfig(
        output_dir=out_dir,
        num_generations=4,
        per_device_train_batch_size=2,
        max_steps=2,  # each rank: half a group
        max_completion_length=5,
        use_cpu=True,
        bf16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-2,
        log_episodes=True,
        seed=0,
        async_rollouts=mode == "async",
    )
    trainer = AgenticGRPOTrainer(
        model,
        agent=agent,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.close()
    state = {name: p.detach().clone() for name, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
    torch.save(state, os.path.join(out_dir, f"params-rank{rank}.pt"))
    with open(os.path.join(out_dir, f"steps-rank{rank}.json"), "w") as f:
        json.dump({"micro_steps": trainer._step, "global_step": trainer.state.global_step}, f)
    # Leave the process group before the interpreter exits (a rank with gloo's threads still up at exit can abort).
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.state.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
