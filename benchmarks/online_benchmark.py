"""Online RL from live traffic on CPU (issue 43): simulated users run the calculator agent against `serve --train`'s
endpoint and server (in this process: the endpoint on a loopback port, `OnlineGRPOTrainer` in the main thread), each
through a plain `openai` client with its own user key, and give feedback from the checker with noise. Printed with
the goals:

- held-out success of the promoted versions rises (goal: >= +20 points within 20 minutes from the demo's warm start);
- 0 failed requests, and p99 latency of calls that overlapped a weight swap <= 2x the p99 of the others;
- no episode ran on two versions;
- a deliberately harmful update (`--harmful-step K`: that step's learning rate x`--harmful-factor`) is rolled back
  before it serves more than its canary share, and the incumbent keeps serving.

```bash
python benchmarks/online_benchmark.py --minutes 20 --users 4 --eval-size 200      # the learning measurement
python benchmarks/online_benchmark.py --minutes 4 --users 4 --harmful-step 5      # the harmful update (its own run)
python benchmarks/online_benchmark.py --minutes 3 --users 2 --eval-size 40        # a quick look
```

The learning run and the harmful-update run are separate: in one run, a harmful step that got through would decide
the learning figure, and the learning figure would hide whether it got through. The defaults are the demo's GRPO
settings (groups of 12, sampled at 1.2) with 8 tasks a step at a learning rate of 3e-4 after 10 warm-up steps (what
met the learning goal, docs/benchmarks.md "Online RL"), every update vetted before the next builds on it
(`--wait-for-verdict`, serve --train's default), verdicts at margin 0.1 with the length and malformed-call guards.

Traffic repeats tasks, as real traffic does: the users draw from a pool of `--task-pool` popular tasks, each asked
`--task-repeats` times (by any user) before a fresh task replaces it, and name the task when they end the episode
(`{"task": ...}` on `/v1/episodes/end`), so that training forms same-task groups (docs/online.md). `--task-pool 0`:
every episode a fresh task, unnamed (the arrival-window groups of the earlier runs). Training uses the demo's reward
(the checker plus `cut_off_penalty`) and its learning-rate warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import transformers
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

from trl_agentic import AgenticGRPOConfig
from trl_agentic.endpoint.launch import build_engine, create_endpoint_app
from trl_agentic.endpoint.server import EndpointServer
from trl_agentic.endpoint.versions import RolloutPolicy, VersionManager
from trl_agentic.generation.weights import copy_model
from trl_agentic.online_trainer import OnlineGRPOTrainer
from trl_agentic.pipeline.calculator import CalculatorDemoConfig
from trl_agentic.pipeline.held_out import HeldOutEvaluator
from trl_agentic.pipeline.plan import make_plan
from trl_agentic.pipeline.warm_started_model import warm_start_model
from trl_agentic.rewards import cut_off_penalty
from trl_agentic.store import SQLiteEpisodeStore
from trl_agentic.tasks.calculator import calculator_correct
from trl_agentic.trace import Episode


class Traffic:
    """Users running the suite's agent through plain clients with user keys, feedback from the checker with noise."""

    def __init__(self, server, keys, tasks, agent, noise: float, seed: int, pool: int = 0, repeats: int = 1):
        self.server, self.keys, self.tasks, self.agent, self.noise = server, keys, tasks, agent, noise
        self.rng = random.Random(seed)
        self.pool, self.repeats = pool, repeats
        self._fresh = itertools.cycle(random.Random(seed + 1).sample(tasks, len(tasks)))
        self._popular: list[list] = []  # [task, times still to be asked]
        self.stop = threading.Event()
        self.calls: list[tuple[float, float, int]] = []  # (start, end, status)
        self.episodes: list[dict] = []
        self.lock = threading.Lock()

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._user, args=(k, i), daemon=True) for i, k in enumerate(self.keys)]
        for thread in threads:
            thread.start()
        return threads

    def draw(self, rng: random.Random) -> tuple[dict, str | None]:
        """A task, and its name when traffic repeats tasks (the pool's): each popular task is asked `repeats` times,
        then a fresh one takes its place."""
        if not self.pool:
            return rng.choice(self.tasks), None
        with self.lock:
            while len(self._popular) < self.pool:
                self._popular.append([next(self._fresh), self.repeats])
            slot = rng.randrange(len(self._popular))
            task = self._popular[slot][0]
            self._popular[slot][1] -= 1
            if self._popular[slot][1] == 0:
                del self._popular[slot]
        return task, json.dumps(task["prompt"], sort_keys=True)

    def _user(self, key: str, index: int) -> None:
        asyncio.run(self._run(key, random.Random(self.rng.random() + index)))

    async def _run(self, key: str, rng: random.Random) -> None:
        async def started(request):
            request.extensions["t0"] = time.monotonic()

        async def finished(response):
            with self.lock:
                self.calls.append((response.request.extensions["t0"], time.monotonic(), response.status_code))

        http = httpx.AsyncClient(event_hooks={"request": [started], "response": [finished]}, timeout=300)
        client = openai.AsyncOpenAI(base_url=self.server.base_url, api_key=key, http_client=http, max_retries=0)
        headers = {"Authorization": f"Bearer {key}"}
        while not self.stop.is_set():
            task, name = self.draw(rng)
            try:
                result = await self.agent(client, task)
                status = "ok"
            except Exception:  # noqa: BLE001 - an agent's failure is its episode's, counted below
                result, status = None, "agent_error"
            body = {"task": name} if name is not None else None
            ended = (await http.post(f"{self.server.base_url}/episodes/end", json=body, headers=headers)).json()
            episode_id = ended.get("episode_id")
            if episode_id is None:
                continue
            correct = calculator_correct(
                [None], [[]], [task["answer"]], episodes=[Episode(id=episode_id, status=status, result=result)]
            )[0]
            value = float(correct or 0.0)
            if rng.random() < self.noise:
                value = 1.0 - value
            answer = await http.post(
                f"{self.server.base_url}/feedback", json={"episode_id": episode_id, "value": value}, headers=headers
            )
            with self.lock:
                self.episodes.append(
                    {"id": episode_id, "correct": correct, "given": value, "feedback": answer.status_code}
                )
        await http.aclose()


class Clock(TrainerCallback):
    """Stops training when the time is up; injects the harmful update; records swap times."""

    def __init__(self, deadline: float, harmful_step: int | None, harmful_factor: float, swaps: list[float]):
        self.deadline, self.harmful_step, self.harmful_factor, self.swaps = (
            deadline,
            harmful_step,
            harmful_factor,
            swaps,
        )
        self.saved_lr = None

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None and self.harmful_step is not None and state.global_step + 1 == self.harmful_step:
            self.saved_lr = [group["lr"] for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] *= self.harmful_factor

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if self.saved_lr is not None and optimizer is not None:
            for group, lr in zip(optimizer.param_groups, self.saved_lr):
                group["lr"] = lr
            self.saved_lr = None
        self.swaps.append(time.monotonic())
        if time.monotonic() > self.deadline:
            control.should_training_stop = True


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--noise", type=float, default=0.1, help="Share of feedback flipped.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument(
        "--episodes-per-step",
        type=int,
        default=96,
        help="8 tasks x 12 (the demo's 4 x 12 used a third of the traffic).",
    )
    parser.add_argument("--num-generations", type=int, default=12, help="The demo's.")
    parser.add_argument(
        "--learning-rate", type=float, default=3e-4, help="The demo's 2e-4, raised with the batch (twice the demo's)."
    )
    parser.add_argument("--warmup-steps", type=int, default=10, help="Warm-up steps (then constant; the demo's: 30).")
    parser.add_argument(
        "--levels",
        default="target",
        help="Digits of the users' tasks: 'target' (the held-out's), 'all', or e.g. '1,2'.",
    )
    parser.add_argument(
        "--temperature", type=float, default=1.2, help="Serving's, and training's (the demo's GRPO temperature)."
    )
    parser.add_argument("--task-pool", type=int, default=4, help="Popular tasks at a time (0: every task fresh).")
    parser.add_argument("--task-repeats", type=int, default=None, help="Times each is asked (default: a group).")
    parser.add_argument(
        "--group-wait", type=float, default=600.0, help="Seconds a step waits for same-task groups (600: only those)."
    )
    parser.add_argument("--candidate-share", type=float, default=0.5)
    parser.add_argument("--min-episodes", type=int, default=48)
    parser.add_argument("--margin", type=float, default=0.1)
    parser.add_argument("--confidence", type=float, default=0.8)
    parser.add_argument("--eval-versions", type=int, default=4, help="Promoted versions evaluated (spread, last too).")
    parser.add_argument("--max-episodes", type=int, default=None)
    parser.add_argument("--length-guard", type=float, default=0.5, help="RolloutPolicy.length_guard (<= 0: off).")
    parser.add_argument(
        "--malformed-guard", type=float, default=0.15, help="RolloutPolicy.malformed_guard (<= 0: off)."
    )
    parser.add_argument(
        "--wait-for-verdict",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Each step waits for its candidate's verdict (serve --train's default); --no-wait-for-verdict: training "
        "goes on while a candidate is on trial.",
    )
    parser.add_argument(
        "--harmful-step", type=int, default=0, help="Make this step harmful (0: none; the learning run has none)."
    )
    parser.add_argument("--harmful-factor", type=float, default=300.0)
    parser.add_argument(
        "--feedback-per-minute",
        type=int,
        default=100_000,
        help="Serving's feedback rate limit per user key (the simulated users are checkers that rate every episode; at "
        "serve's default of 60 most of their feedback was refused, and the refusals went unseen).",
    )
    parser.add_argument("--output", default=None, help="JSON file for the figures.")
    args = parser.parse_args(argv)
    if not sys.stdout.isatty():  # a log file: no bars ("Writing model shards" at every publish, "Loading weights")
        transformers.utils.logging.disable_progress_bar()

    config = replace(CalculatorDemoConfig(), seed=args.seed, eval_size=args.eval_size)
    plan = make_plan("calculator", config)
    print("warm start (cached when the demo ran before) ...", flush=True)
    model, tokenizer, _ = warm_start_model(plan)
    evaluator = HeldOutEvaluator(
        model,
        tokenizer,
        plan.suite,
        plan.eval_tasks,
        config.temperature,
        config.max_completion_length,
        config.max_turns,
    )
    before = evaluator.evaluate(model, seed=args.seed)["success"]
    print(f"held-out success before: {before:.1%} ({len(plan.eval_tasks)} tasks)", flush=True)

    workdir = Path(tempfile.mkdtemp(prefix="online-benchmark-"))
    serving = copy_model(model).eval()
    # users are served at the demo's GRPO temperature, and training scores log-probabilities at the same one (run 1
    # served at 1.2 and scored at 1.0: the importance-sampling correction compared two distributions); held-out
    # success is measured at the held-out's 1.0
    temperature = args.temperature
    engine = build_engine(serving, tokenizer, max_batch_size=32, batch_wait_ms=5.0)
    policy = RolloutPolicy(
        args.candidate_share,
        args.min_episodes,
        args.margin,
        args.confidence,
        args.max_episodes,
        args.length_guard if args.length_guard > 0 else None,
        args.malformed_guard if args.malformed_guard > 0 else None,
    )
    versions = VersionManager(engine, policy, args.seed)
    store = SQLiteEpisodeStore(workdir / "store.db")
    app = create_endpoint_app(
        engine,
        tokenizer,
        temperature=temperature,
        max_tokens=config.max_completion_length,
        max_turns=config.max_turns,
        store=store,
        versions=versions,
        user_episode_idle_timeout=600.0,
        feedback_per_minute=args.feedback_per_minute,
    )
    server = EndpointServer(app).start()
    admin = {"Authorization": f"Bearer {server.admin_token}"}
    keys = [
        httpx.post(f"{server.url}/admin/users", json={"name": f"user{i}"}, headers=admin).json()["key"]
        for i in range(args.users)
    ]
    repeats = args.task_repeats or args.num_generations
    tasks = list(plan.grpo_tasks)
    if args.levels != "all":  # what users ask: by default the held-out's difficulty (from the training split)
        levels = (
            {plan.suite.target_difficulty} if args.levels == "target" else {float(v) for v in args.levels.split(",")}
        )
        tasks = [task for task in tasks if task["difficulty"] in levels]
    traffic = Traffic(server, keys, tasks, plan.suite.agent, args.noise, args.seed, args.task_pool, repeats)
    started = time.monotonic()
    threads = traffic.start()

    swaps: list[float] = []
    clock = Clock(started + args.minutes * 60, args.harmful_step or None, args.harmful_factor, swaps)
    training = AgenticGRPOConfig(
        output_dir=str(workdir / "run"),
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        lr_scheduler_type="constant_with_warmup",
        per_device_train_batch_size=args.episodes_per_step,
        num_generations=args.num_generations,
        max_steps=10_000,
        max_completion_length=config.max_completion_length,
        temperature=temperature,
        max_staleness=8,
        beta=0.0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=args.seed,
        disable_tqdm=not sys.stdout.isatty(),  # a log file gets the benchmark's own lines, not a bar redrawn per step
    )
    trainer = OnlineGRPOTrainer(
        model,
        store,
        training,
        processing_class=tokenizer,
        versions=versions,
        run_on_server=server.call,
        wait_for_verdict=args.wait_for_verdict,
        reward_funcs=[cut_off_penalty],  # the demo's: an answer cut at the token limit scores 1 less
        group_wait=args.group_wait,
    )
    trainer.add_callback(clock)
    trainer.remove_callback(PrinterCallback)  # (with disable_tqdm, transformers prints every log dict instead)
    try:
        trainer.train()
    finally:
        traffic.stop.set()
        for thread in threads:
            thread.join(timeout=120)
        trainer.close()
    wall = time.monotonic() - started

    # Held-out success of the versions that were promoted, as they were promoted
    promoted = [d.version for d in versions.decisions if d.action == "promoted"]
    rows = {row["version"]: row for row in versions.describe()}
    if len(promoted) > args.eval_versions:  # spread over the run, the last one always
        step = (len(promoted) - 1) / max(1, args.eval_versions - 1)
        promoted = sorted({promoted[round(i * step)] for i in range(args.eval_versions)})
    curve = []
    for version in promoted:
        weights = type(model).from_pretrained(rows[version]["path"]).eval()
        curve.append((version, evaluator.evaluate(weights, seed=args.seed)["success"]))
        print(f"  promoted version {version}: held-out {curve[-1][1]:.1%}", flush=True)
    after = curve[-1][1] if curve else before
    server.stop()

    # Requests: failures and latency around swaps (calls that overlapped the 2 s after a swap)
    failed = sum(1 for _, _, status in traffic.calls if status >= 500 or status == 0)
    near = [end - start for start, end, _ in traffic.calls if any(start <= s + 2.0 and end >= s for s in swaps)]
    far = [end - start for start, end, _ in traffic.calls if not any(start <= s + 2.0 and end >= s for s in swaps)]
    mixed = 0
    for episode_id in store.rewarded_episode_ids():
        episode = store.get_episode(episode_id)[0]
        mixed += len({turn.policy_version for turn in episode.turns}) > 1
    harmful = None
    if args.harmful_step:
        # the first version published from weights that hold the harmful update: training goes on while a candidate is
        # on trial, so the step's own weights may not be published, and a rollback in between sends training back to
        # the incumbent (`restored_at`: the update is then dropped before any version carries it)
        carrier = next(
            (
                v
                for v in sorted(rows)
                # a rollback acted on at global step s restores the weights before step s + 1 trains: versions up
                # to s may carry the update, later ones do not
                if v >= args.harmful_step and not any(args.harmful_step <= s < v for s in trainer.restored_at)
            ),
            None,
        )
        verdict = next((d for d in versions.decisions if d.version == carrier), None)
        served = rows.get(carrier, {}).get("episodes", 0)
        share = served / max(1, len(traffic.episodes))
        harmful = {
            "version": carrier,
            "verdict": verdict and verdict.action,
            "served_episodes": served,
            "share_of_all": share,
            "dropped_before_publication": carrier is None,
        }

    figures = {
        "minutes": wall / 60,
        "held_out_before": before,
        "held_out_after": after,
        "gain_points": 100 * (after - before),
        "curve": curve,
        "episodes": len(traffic.episodes),
        "feedback_refused": sum(1 for e in traffic.episodes if e["feedback"] != 200),
        "steps": trainer.state.global_step,
        "calls": len(traffic.calls),
        "failed_requests": failed,
        "p99_near_swaps_s": p99(near),
        "p99_otherwise_s": p99(far),
        "episodes_on_two_versions": mixed,
        "harmful": harmful,
        "decisions": [(d.action, d.version, d.reason) for d in versions.decisions],
        "online_reward": [e["online/reward"] for e in trainer.state.log_history if "online/reward" in e],
        "versions": list(rows.values()),
        "log_history": trainer.state.log_history,
        "fingerprint_groups": [
            e["online/fingerprint_groups"] for e in trainer.state.log_history if "online/fingerprint_groups" in e
        ],
    }
    ratio = figures["p99_near_swaps_s"] / figures["p99_otherwise_s"] if near and far else None
    print()
    print(
        f"online benchmark: {args.users} users, {wall / 60:.1f} min, {figures['steps']} steps, "
        f"{figures['episodes']} episodes, {figures['calls']} calls"
    )
    print(
        f"  held-out success {before:.1%} -> {after:.1%} ({figures['gain_points']:+.1f} points)   goal >= +20 in 20 min"
    )
    rewards, same = figures["online_reward"], figures["fingerprint_groups"]
    if rewards:
        tenth = max(1, len(rewards) // 10)
        print(
            f"  online reward per step: first {tenth} {sum(rewards[:tenth]) / tenth:.3f}, last {tenth} "
            f"{sum(rewards[-tenth:]) / tenth:.3f}; same-task groups {sum(same) / max(1, len(same)):.0%}; "
            f"{sum(d[0] == 'promoted' for d in figures['decisions'])} promoted, "
            f"{sum(d[0] == 'rolled_back' for d in figures['decisions'])} rolled back"
        )
    print(f"  failed requests {failed}   goal 0   (feedback refused: {figures['feedback_refused']})")
    print(
        f"  p99 latency near swaps / otherwise: {ratio and f'{ratio:.2f}x'} "
        f"({figures['p99_near_swaps_s']}, {figures['p99_otherwise_s']} s)   goal <= 2x"
    )
    print(f"  episodes on two versions {mixed}   goal 0")
    if harmful and harmful["dropped_before_publication"]:
        print(
            f"  harmful update (step {args.harmful_step}): dropped before any version carried it (training went back "
            f"to the incumbent after steps {trainer.restored_at})   goal: rolled back"
        )
    elif harmful:
        print(
            f"  harmful update (step {args.harmful_step}): {harmful['verdict']}, served {harmful['served_episodes']} "
            f"episodes ({harmful['share_of_all']:.1%} of all; canary share {args.candidate_share:.0%})   goal: rolled back"
        )
    if args.output:
        Path(args.output).write_text(json.dumps(figures, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
