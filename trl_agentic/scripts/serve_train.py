"""`trl-agentic serve --train`: serve users (user keys, `--store`) and learn from their rewarded episodes, in one
process: the endpoint in a background thread, `OnlineGRPOTrainer` in the main one, each optimizer step rolled out to a
share of new episodes and promoted or rolled back by its online reward (docs/online.md).

```bash
trl-agentic serve --train --model outputs/demo/model --store online/store.db --output-dir online/run \\
    --episodes-per-step 8 --num-generations 8 --candidate-share 0.1 --min-episodes 32 --margin 0.05
```
"""

from __future__ import annotations

import argparse
import sys


def make_parser() -> argparse.ArgumentParser:
    from ..endpoint.serve import make_parser as serve_parser

    parser = serve_parser()
    parser.prog = "trl-agentic serve --train"
    group = parser.add_argument_group("online training (--train)")
    group.add_argument("--output-dir", default="outputs/online", help="Checkpoints and each version's weights.")
    group.add_argument("--learning-rate", type=float, default=1e-6, help="AdamW learning rate.")
    group.add_argument("--episodes-per-step", type=int, default=8, help="Rewarded episodes each optimizer step trains.")
    group.add_argument("--num-generations", type=int, default=8, help="Episodes per GRPO group (the baseline window).")
    group.add_argument("--beta", type=float, default=0.0, help="KL coefficient against the reference (TRL's beta).")
    group.add_argument("--max-staleness", type=int, default=4, help="Most versions a trained token may lag.")
    group.add_argument("--max-steps", type=int, default=1000, help="Optimizer steps before training stops.")
    group.add_argument(
        "--wait-for-verdict",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Each step's weights go on trial and the next step waits for the verdict, so every update is vetted "
        "before the next builds on it and trained tokens are at most one version old (the default). "
        "--no-wait-for-verdict: training goes on, and the weights go on trial whenever no candidate is (faster steps, "
        "staler tokens: docs/online.md).",
    )
    group.add_argument(
        "--wait-timeout", type=float, default=3600.0, help="Seconds a step waits for episodes or a verdict."
    )
    group.add_argument(
        "--group-wait",
        type=float,
        default=0.0,
        help="Seconds a step waits for whole groups of one task (clients name tasks: docs/online.md) before it "
        "trains other episodes against a running per-task baseline.",
    )
    group.add_argument("--seed", type=int, default=0, help="Training seed.")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--train"]
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.store is None:
        parser.error("--train needs --store PATH: training reads the episodes and rewards serving stores there.")
    if args.episodes_per_step % args.num_generations:
        parser.error(
            f"--episodes-per-step ({args.episodes_per_step}) must be a multiple of --num-generations "
            f"({args.num_generations}): each step trains whole groups."
        )

    from ..agentic_grpo_config import AgenticGRPOConfig
    from ..endpoint.launch import build_engine
    from ..endpoint.serve import build_app, load_policy, print_banner, resolve_admin_token, rollout_policy
    from ..endpoint.server import EndpointServer
    from ..endpoint.versions import VersionManager
    from ..generation.weights import copy_model
    from ..online_trainer import OnlineGRPOTrainer
    from ..store import open_store

    model, tokenizer, device, dtype = load_policy(args)
    # The incumbent serves a copy: training changes `model`, and users see a change only once it is promoted.
    serving = copy_model(model).eval()
    engine = build_engine(
        serving,
        tokenizer,
        max_batch_size=args.max_batch_size,
        batch_wait_ms=args.batch_wait_ms,
        max_context_length=args.max_context_length,
    )
    policy = rollout_policy(args)
    versions = VersionManager(engine, policy, args.seed)
    store = open_store(args.store)
    admin_token, shown_token, origin = resolve_admin_token(args)
    app = build_app(args, engine, tokenizer, admin_token, store, versions)
    server = EndpointServer(app, host=args.host, port=args.port, log_level=args.log_level).start()
    print_banner(args, app, device, dtype, shown_token, origin)
    print(
        f"online training: {args.episodes_per_step} rewarded episodes a step, groups of {args.num_generations}; each "
        f"step a candidate on {args.candidate_share:.0%} of new episodes, promoted after {args.min_episodes} rewarded "
        f"episodes unless its mean reward is more than {args.margin:g} below the incumbent's "
        f"(GET /admin/versions).",
        flush=True,
    )
    config = AgenticGRPOConfig(
        output_dir=args.output_dir,
        learning_rate=args.learning_rate,
        per_device_train_batch_size=args.episodes_per_step,
        num_generations=args.num_generations,
        beta=args.beta,
        max_staleness=args.max_staleness,
        max_steps=args.max_steps,
        max_completion_length=args.max_tokens or args.default_max_tokens,
        # the trainer's log-probabilities at the temperature the episodes were sampled at (impose one: --temperature)
        temperature=1.0 if args.temperature is None else args.temperature,
        use_cpu=device == "cpu",
        bf16=str(dtype) == "torch.bfloat16",
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=args.seed,
    )
    trainer = OnlineGRPOTrainer(
        model.train(),
        store,
        config,
        processing_class=tokenizer,
        versions=versions,
        run_on_server=server.call,
        wait_timeout=args.wait_timeout,
        wait_for_verdict=args.wait_for_verdict,
        group_wait=args.group_wait,
    )
    try:
        trainer.train()
    except KeyboardInterrupt:
        print("stopped", flush=True)
    finally:
        trainer.close()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
