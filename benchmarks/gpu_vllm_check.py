"""GPU check of the vLLM paths, ready to run in one command (<= 10 min on one GPU, no network):

    pip install -e ".[vllm]" && python benchmarks/gpu_vllm_check.py            # both modes
    python benchmarks/gpu_vllm_check.py --modes colocate --steps 4

The policy is a tiny Qwen2-shaped model (hidden 256, 4 layers) built and saved locally, which vLLM loads from disk.
The agent is the bundled calculator agent behind a wrapper that, once it returns, makes one more call with its last
request's first user message rewritten: every episode forks, so extra rows exist in every batch, the case where
importance-sampling ratios used to be merged wrongly (issue 10).

What it proves, per mode (every line is an assertion; the figures are printed):

- `colocate`: `AgenticGRPOTrainer` with `use_vllm=True, vllm_mode="colocate"`, LoRA (peft), TRL's default
  `vllm_importance_sampling_mode="sequence_mask"` (then `token_truncate` for a second run), trains `--steps` steps:
  1. every step's loss is finite;
  2. extra rows existed (`episodes/rows_mean > 1`);
  3. the importance-sampling ratio has TRL's shape for the mode ((R, 1) per sequence, (R, T) per token) over all R
     rows, and main rows keep non-zero IS weights past their first sampled token (the old merge zeroed them);
  4. the logprobs vLLM returned for the sampled tokens match the trainer's recomputation (`old_per_token_logps`):
     mean and max absolute difference over sampled tokens are printed, and the mean must be under `--tolerance`;
  5. the LoRA parameters changed.
- `server`: a `vllm serve` process (TRL's `trl vllm-serve` command line: processed logprobs) on the same GPU with a
  small memory share; the endpoint runs the same agent through `VLLMServerEngine` (TRL's `VLLMClient` wire protocol);
  every recorded turn's logprobs are compared with the HF model's recomputation (same tolerance), and the recorded
  prompt of each continued turn is checked to extend its parent's prompt + sampled ids token for token. Training in
  server mode needs a second GPU for the NCCL weight sync (TRL's rule: server and trainer on different devices); with
  two or more GPUs the script also trains `--steps` steps in server mode and checks 1-3 above, then again with
  `async_rollouts=True, max_staleness=1` (episodes run ahead while the trainer trains; the logged staleness stays
  within the bound and no group is dropped).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import torch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def forking(agent_run):
    """Wrap an `async def agent(client, task)`: once it returns, one more call replays its last request with the first
    user message rewritten, plus the reply it got. A history rewrite, so every episode forks (an extra row), whatever
    the model does (a random one never calls the calculator, so the agent alone makes one call)."""

    async def agent(client, task):
        original_create = client.chat.completions.create
        last = {}

        async def create(*args, messages, **kwargs):
            response = await original_create(*args, messages=messages, **kwargs)
            last.update(messages=messages, kwargs=kwargs, reply=response.choices[0].message)
            return response

        client.chat.completions.create = create
        result = await agent_run(client, task)
        if last:
            messages = [dict(m) for m in last["messages"]]
            first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
            messages[first_user]["content"] = str(messages[first_user]["content"]) + " Show your work."
            reply = last["reply"].model_dump(exclude_none=True)
            await original_create(
                messages=messages + [reply, {"role": "user", "content": "Check it."}], **last["kwargs"]
            )
        return result

    return agent


def splitting_reward(prompts, completions, episodes=None, **kwargs):
    """A reward that differs between the episodes of a group whatever the model samples (an untrained model never
    solves the calculator task, so its checker alone would give zero advantages and zero gradients)."""
    return [float(sum(sum(turn.completion_ids) for turn in episode.turns) % 7) for episode in episodes]


def build_policy(directory: str):
    from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer("qwen2_5")
    model = build_tiny_model(tokenizer, hidden_size=256, num_layers=4)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return tokenizer


class BatchProbe:
    """Records, for every generation batch the trainer scores, what the loss will multiply rows by."""

    def __init__(self, trainer):
        self.records = []
        original = trainer._generate_and_score_completions

        def probe(inputs):
            output = original(inputs)
            num_main = len(inputs)
            mask = (output["completion_mask"] * output["tool_mask"]).bool()
            ratio = output["importance_sampling_ratio"]
            weights = torch.broadcast_to(ratio, mask.shape)
            past_first = mask.clone()
            past_first[torch.arange(mask.size(0)), mask.float().argmax(1)] = False  # drop each row's first token
            diff = (output["sampling_per_token_logps"] - output["old_per_token_logps"]).abs()[mask]
            diff = diff[~torch.isnan(diff)]
            self.records.append(
                {
                    "rows": mask.size(0),
                    "main_rows": num_main,
                    "ratio_shape": tuple(ratio.shape),
                    "width": mask.size(1),
                    "main_nonzero_past_first": (weights[:num_main][past_first[:num_main]] != 0).float().mean().item(),
                    "logp_diff_mean": diff.mean().item(),
                    "logp_diff_max": diff.max().item(),
                }
            )
            return output

        trainer._generate_and_score_completions = probe


def train_and_check(mode: str, policy: str, tokenizer, steps: int, tolerance: float, is_mode: str, **vllm_kwargs):
    from peft import LoraConfig

    from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
    from trl_agentic.tasks import get_task

    task = get_task("calculator")
    config = AgenticGRPOConfig(
        output_dir=tempfile.mkdtemp(prefix=f"gpu-check-{mode}-"),
        max_steps=steps,
        num_generations=8,
        per_device_train_batch_size=16,
        max_completion_length=64,
        max_turns=5,
        learning_rate=1e-3,
        bf16=True,
        use_vllm=True,
        vllm_mode=mode,
        vllm_max_model_length=4096,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=is_mode,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        **vllm_kwargs,
    )
    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = AgenticGRPOTrainer(
        policy,
        agent=forking(task.agent),
        reward_funcs=[*task.reward_funcs, splitting_reward],
        args=config,
        train_dataset=task.build_dataset("train", size=128),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    probe = BatchProbe(trainer)
    lora = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters() if "lora" in n}
    started = time.time()
    try:
        trainer.train()
    finally:
        trainer.close()
    seconds = time.time() - started
    logs = [e for e in trainer.state.log_history if "loss" in e]
    print(f"\n[{mode}, {is_mode}{', async' if config.async_rollouts else ''}] {steps} steps in {seconds:.0f}s")
    for entry, record in zip(logs, probe.records):
        print(
            f"  loss {entry['loss']:+.4f}  reward {entry.get('reward', float('nan')):.3f}  "
            f"rows {record['rows']} ({record['main_rows']} main)  IS ratio {record['ratio_shape']}  "
            f"main-row IS weights non-zero past the first token {record['main_nonzero_past_first']:.1%}  "
            f"|vLLM - trainer| logprob mean {record['logp_diff_mean']:.4f} max {record['logp_diff_max']:.4f}"
        )
    assert len(logs) == steps and all(torch.isfinite(torch.tensor(e["loss"])) for e in logs), "non-finite loss"
    assert max(e["episodes/rows_mean"] for e in logs) > 1.0, "no extra rows: the forking agent did not fork"
    for record in probe.records:
        expected = (record["rows"], 1) if is_mode.startswith("sequence") else (record["rows"], record["width"])
        assert record["ratio_shape"] == expected, (record["ratio_shape"], expected)
        assert record["rows"] > record["main_rows"], "a batch without extra rows proves nothing here"
        assert record["main_nonzero_past_first"] > 0.5, "main rows lost their IS weight past the first token"
        assert record["logp_diff_mean"] < tolerance, f"vLLM and trainer logprobs differ: {record['logp_diff_mean']}"
    changed = [n for n, p in trainer.model.named_parameters() if n in lora and not torch.equal(lora[n], p.float())]
    assert changed, "LoRA parameters did not change"
    if config.async_rollouts:  # the producer ran ahead: within the bound, nothing dropped
        stale = [e for e in logs if "async/staleness_max" in e]
        assert len(stale) == steps and all(e["async/staleness_max"] <= config.max_staleness for e in stale), stale
        assert sum(e["async/dropped_groups"] for e in stale) == 0, "groups dropped"
        print(
            f"  OK (async): staleness max {max(e['async/staleness_max'] for e in stale):.0f} "
            f"(bound {config.max_staleness}), trainer waited {sum(e['async/trainer_wait_s'] for e in stale):.1f}s"
        )
    print(
        f"  OK: finite loss, extra rows, TRL-shaped IS ratio {probe.records[-1]['ratio_shape']}, main rows keep "
        f"their IS weights, logprobs agree, {len(changed)}/{len(lora)} LoRA tensors changed"
    )


def start_vllm_server(policy: str, port: int, device: int, memory: float) -> subprocess.Popen:
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    command = build_command(
        ScriptArguments(model=policy, port=port, gpu_memory_utilization=memory, max_model_len=4096, enforce_eager=True)
    )
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": str(device)}
    process = subprocess.Popen(command, env=env, stdout=sys.stdout, stderr=sys.stderr)
    deadline = time.time() + 300
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(2)
    process.kill()
    raise RuntimeError("vllm serve did not become healthy in 300 s")


def server_engine_check(policy: str, tokenizer, port: int, tolerance: float) -> None:
    from trl_agentic.endpoint.launch import launch_endpoint
    from trl_agentic.generation.vllm_engine import VLLMServerEngine
    from trl_agentic.rollout.agents import resolve_agent
    from trl_agentic.rollout.runner import run_episodes
    from trl_agentic.tasks import get_task
    from trl_agentic.tiny_models import load_model_and_tokenizer

    task = get_task("calculator")
    engine = VLLMServerEngine(f"http://127.0.0.1:{port}", max_context_length=4096)
    server = launch_endpoint(engine, tokenizer, temperature=1.0, max_tokens=64, max_turns=5)
    tasks = [dict(row) for row in task.build_dataset("train", size=16)]
    try:
        episodes = asyncio.run(run_episodes(server, resolve_agent(forking(task.agent)), tasks, timeout=120))
    finally:
        server.stop()
    model, _ = load_model_and_tokenizer(policy, dtype=torch.float32)
    model = model.cuda().eval()
    diffs, turns, continued = [], 0, 0
    for episode in episodes:
        assert episode.status == "ok", (episode.status, episode.error)
        by_index = {t.index: t for t in episode.turns}
        for turn in episode.turns:
            turns += 1
            if turn.prompt_source == "continued":
                parent = by_index[turn.parent_turn]
                assert turn.prompt_ids[: len(parent.prompt_ids) + len(parent.completion_ids)] == (
                    parent.prompt_ids + parent.completion_ids
                ), "a continued prompt does not extend its parent"
                continued += 1
            ids = torch.tensor([turn.prompt_ids + turn.completion_ids], device="cuda")
            with torch.no_grad():
                logits = model(ids).logits[0, len(turn.prompt_ids) - 1 : -1].float()  # temperature 1.0
            logps = torch.log_softmax(logits, -1).gather(1, ids[0, len(turn.prompt_ids) :, None]).squeeze(1)
            recorded = torch.tensor(turn.logprobs, device="cuda")
            keep = ~torch.isnan(recorded)
            diffs.append((logps[keep] - recorded[keep]).abs())
    diff = torch.cat(diffs)
    print(
        f"\n[server, engine level] {len(episodes)} episodes, {turns} turns ({continued} continued), "
        f"|vLLM - HF fp32| logprob mean {diff.mean():.4f} max {diff.max():.4f} over {diff.numel()} tokens"
    )
    assert diff.mean() < tolerance, f"vLLM server logprobs differ from the model's: {diff.mean():.4f}"
    print("  OK: token-exact continuation through the vLLM server, logprobs agree")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["colocate", "server"], choices=["colocate", "server"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=0.05, help="Largest mean |logprob difference| accepted.")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    policy = tempfile.mkdtemp(prefix="tiny-policy-")
    tokenizer = build_policy(policy)
    print(f"policy: {policy}; GPUs: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")

    if "colocate" in args.modes:
        for is_mode in ("sequence_mask", "token_truncate"):
            train_and_check(
                "colocate",
                policy,
                tokenizer,
                args.steps,
                args.tolerance,
                is_mode,
                vllm_gpu_memory_utilization=0.25,
                vllm_enable_sleep_mode=False,
            )
    if "server" in args.modes:
        port = free_port()
        two_gpus = torch.cuda.device_count() >= 2
        server = start_vllm_server(policy, port, device=1 if two_gpus else 0, memory=0.25)
        try:
            server_engine_check(policy, tokenizer, port, args.tolerance)
            if two_gpus:
                train_and_check(
                    "server",
                    policy,
                    tokenizer,
                    args.steps,
                    args.tolerance,
                    "sequence_mask",
                    vllm_server_base_url=f"http://127.0.0.1:{port}",
                )
                # Asynchronous rollouts (issue 30): episodes run ahead on the server while the trainer trains, the
                # weights pushed after every optimizer step with episodes in flight
                train_and_check(
                    "server",
                    policy,
                    tokenizer,
                    args.steps + 1,
                    args.tolerance,
                    "token_truncate",
                    vllm_server_base_url=f"http://127.0.0.1:{port}",
                    async_rollouts=True,
                    max_staleness=1,
                )
            else:
                print("  (one GPU: server-mode training needs a second GPU for TRL's NCCL weight sync; skipped)")
        finally:
            server.terminate()
            server.wait(timeout=60)
    print("\nall GPU checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
