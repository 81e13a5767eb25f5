"""GPU check of the embedded engine's inference copy (issue 29, M1), ready to run in one command (~2 min on one GPU,
no network, no vLLM):

    python benchmarks/gpu_engine_check.py
    python benchmarks/gpu_engine_check.py --steps 4 --variants lora

The policy is the tiny Qwen2-shaped model of `gpu_vllm_check.py` (hidden 256, 4 layers), the agent the bundled
calculator agent behind the same forking wrapper (every episode forks: extra rows in every batch), the reward the same
splitting reward (an untrained model never solves the task). `AgenticGRPOTrainer` trains `--steps` steps with
`bf16=True` on the embedded `TransformersEngine` (`use_vllm=False`), once as a full fine-tune and once with LoRA.

What it proves, per variant (every line is an assertion; the figures are printed):

1. every step's loss is finite and extra rows existed (`episodes/rows_mean > 1`);
2. every forward of the trainer's module that builds a graph ran in training mode: the engine, which decodes in
   threads of its own beside the trainer, never flipped the module's `train()`/`eval()` flag (it generates with an
   inference copy of the weights, or a view for LoRA's frozen base);
3. the engine's copy follows the optimizer: after training, logprobs the engine reports for its own samples match a
   float32 recomputation with the trainer's current weights (mean |difference| under `--tolerance`), and the figure
   against the weights before training is printed beside it (the gap a stale copy would leave);
4. the trained parameters changed; the peak GPU memory is printed (the copy holds one more set of trainable weights).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

import torch


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_vllm_check import build_policy, forking, splitting_reward  # noqa: E402


def engine_logprob_gap(engine, model, prompts: list[list[int]], max_tokens: int = 48) -> float:
    """Mean |engine logprob - float32 recomputation by `model`| over the tokens the engine samples for `prompts`."""
    from trl_agentic.generation.engine import SamplingParams

    async def sample():
        return await asyncio.gather(
            *[
                engine.generate(p, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i))
                for i, p in enumerate(prompts)
            ]
        )

    outputs = asyncio.run(sample())
    diffs = []
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for prompt, out in zip(prompts, outputs):
            ids = torch.tensor([prompt + list(out.token_ids)], device=device)
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            logps = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None]).squeeze(1)
            diffs.append((logps - torch.tensor(out.logprobs, device=device, dtype=torch.float32)).abs())
    finally:
        model.train(was_training)
    return torch.cat(diffs).mean().item()


def train_and_check(variant: str, policy: str, tokenizer, steps: int, tolerance: float) -> None:
    from peft import LoraConfig

    from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
    from trl_agentic.tasks import get_task
    from trl_agentic.tiny_models import load_model_and_tokenizer

    task = get_task("calculator")
    cuda = torch.cuda.is_available()
    config = AgenticGRPOConfig(
        output_dir=tempfile.mkdtemp(prefix=f"gpu-engine-check-{variant}-"),
        max_steps=steps,
        num_generations=8,
        per_device_train_batch_size=16,
        max_completion_length=64,
        max_turns=5,
        learning_rate=1e-3,
        bf16=cuda,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )
    peft_config = (
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        if variant == "lora"
        else None
    )
    trainer = AgenticGRPOTrainer(
        policy,
        agent=forking(task.agent),
        reward_funcs=[*task.reward_funcs, splitting_reward],
        args=config,
        train_dataset=task.build_dataset("train", size=128),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    modes = []  # the `training` flag of every graph-building forward of the trainer's module

    def record_mode(module, args):
        if torch.is_grad_enabled():
            modes.append(module.training)

    hook = trainer.model.register_forward_pre_hook(record_mode)
    trained = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.time()
    try:
        trainer.train()
        seconds = time.time() - started
        hook.remove()
        logs = [e for e in trainer.state.log_history if "loss" in e]
        memory = f", peak GPU memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB" if cuda else ""
        print(f"\n[{variant}] {steps} steps in {seconds:.0f}s{memory}")
        for entry in logs:
            print(
                f"  loss {entry['loss']:+.4f}  reward {entry.get('reward', float('nan')):.3f}  "
                f"rows/episode {entry['episodes/rows_mean']:.2f}"
            )
        assert len(logs) == steps and all(torch.isfinite(torch.tensor(e["loss"])) for e in logs), "non-finite loss"
        assert max(e["episodes/rows_mean"] for e in logs) > 1.0, "no extra rows: the forking agent did not fork"
        assert modes and all(modes), f"{modes.count(False)} of {len(modes)} training forwards ran in eval mode"
        changed = [
            n for n, p in trainer.model.named_parameters() if n in trained and not torch.equal(trained[n], p.float())
        ]
        assert changed, "no trained parameter changed"

        prompts = [
            tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
            for row in task.build_dataset("eval", size=8)
        ]
        model = trainer.accelerator.unwrap_model(trainer.model)
        trainer.engine.sync_weights()
        gap = engine_logprob_gap(trainer.engine, model, prompts)
        before, _ = load_model_and_tokenizer(policy, dtype=torch.float32)
        stale = engine_logprob_gap(trainer.engine, before.to(model.device), prompts)
        print(
            f"  training forwards in training mode: {len(modes)}/{len(modes)}; {len(changed)}/{len(trained)} "
            f"trained tensors changed"
        )
        print(f"  |engine - trainer fp32| logprob mean {gap:.4f} (against the weights before training: {stale:.4f})")
        assert gap < tolerance, f"the engine's copy does not follow the trainer's weights: {gap:.4f}"
        print("  OK")
    finally:
        trainer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="Run on the CPU (float32): a smoke test of this script.")
    parser.add_argument("--tolerance", type=float, default=0.05, help="Largest mean |logprob difference| accepted.")
    args = parser.parse_args()
    assert args.cpu or torch.cuda.is_available(), "this check needs a CUDA GPU (or --cpu for a smoke test)"
    policy = tempfile.mkdtemp(prefix="tiny-policy-")
    tokenizer = build_policy(policy)
    device = "CPU" if args.cpu or not torch.cuda.is_available() else torch.cuda.get_device_name(0)
    print(f"policy: {policy}; device: {device}; torch {torch.__version__}")
    for variant in args.variants:
        train_and_check(variant, policy, tokenizer, args.steps, args.tolerance)
    print("\nall GPU engine checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
