"""GPU check (run on a machine with a CUDA GPU and `pip install -e ".[vllm]"`): train a few steps with vLLM
generation (colocate) through the endpoint, and print what matters for correctness.

    python benchmarks/gpu_vllm_check.py --steps 3

Needs no network: the policy is a tiny Qwen2-shaped model built and saved locally, which vLLM loads from disk.
Prints, per step: reward, episodes by status, TRL's importance-sampling ratio and the vLLM/trainer logprob
difference (sampling/sampling_logp_difference), then whether the parameters changed and vLLM's weights followed.
"""

import argparse
import tempfile
import time

import torch

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.generation.vllm_engine import VLLMColocateEngine
from trl_agentic.tasks import get_task
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mode", default="colocate", choices=["colocate"])
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this check needs a CUDA GPU"

    task = get_task("calculator")
    tokenizer = build_tiny_tokenizer("qwen2_5")
    model = build_tiny_model(tokenizer, hidden_size=256, num_layers=4)
    path = tempfile.mkdtemp(prefix="tiny-policy-")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)

    config = AgenticGRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="gpu-check-"), max_steps=args.steps, num_generations=8,
        per_device_train_batch_size=8, max_completion_length=64, learning_rate=1e-4, bf16=True,
        use_vllm=True, vllm_mode=args.mode, vllm_gpu_memory_utilization=0.3, vllm_max_model_length=4096,
        vllm_importance_sampling_correction=True, logging_steps=1, report_to="none", save_strategy="no",
        log_episodes=True,
    )
    trainer = AgenticGRPOTrainer(path, agent=task.agent, reward_funcs=task.reward_funcs, args=config,
                                 train_dataset=task.build_dataset("train", size=64), processing_class=tokenizer)
    assert isinstance(trainer.engine, VLLMColocateEngine), type(trainer.engine)
    before = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters()}
    started = time.time()
    trainer.train()
    print(f"trained {args.steps} steps in {time.time() - started:.1f}s")
    keys = ("reward", "episodes/status_ok", "episodes/turns_mean", "episodes/tool_calls_mean",
            "sampling/importance_sampling_ratio/mean", "sampling/sampling_logp_difference/mean",
            "sampling/sampling_logp_difference/max", "completions/mean_length")
    for entry in trainer.state.log_history:
        print({k: round(v, 4) for k, v in entry.items() if k in keys})
    changed = any(not torch.equal(before[n], p.detach().float()) for n, p in trainer.model.named_parameters())
    print("parameters changed:", changed)
    trainer.close()


if __name__ == "__main__":
    main()
