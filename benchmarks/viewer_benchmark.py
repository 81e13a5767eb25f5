"""The trajectory viewer on a long run: write time, what the browser loads to open the page, and the total size.

```bash
python benchmarks/viewer_benchmark.py                          # this tree's viewer, 300 steps x 48 episodes
python benchmarks/viewer_benchmark.py --before /tmp/old-tree   # and an older checkout's, side by side
```

A synthetic 300-step run shaped like the CPU demo's episode log (`log_episodes=True`): 4 calculator tasks x 12
episodes a step, the demo's system prompt and tool schema rendered by a tiny Qwen2.5-template tokenizer (saved beside
the log, so the viewer decodes tokens as it does for a real run), and the episodes the demo produces: a tool call, its
result and an answer (one row of two turns merged), direct answers, a second tool call, malformed calls, a rewritten
history (a fork: a second row), timeouts and agent errors with no reward; rewards, group advantages, difficulty and
target as the trainer logs them. The turns, rows (`episode_to_rows`) and conversations (`label_conversations`) come
from the library, so the records are what the trainer writes.

Measured for each viewer: the time `write_viewer` takes (read, build, write; median of `--repeats`), what a browser
must load to open the page (a single-file viewer: the file; a folder: `index.html` and the first step's data file),
the total written, and, when Debian's `chromium` is installed, the wall time of headless Chromium loading the page and
dumping its DOM (browser start included). `--before <tree>` runs the same measurement in a subprocess importing
`trl_agentic` from `<tree>` (e.g. a `git worktree` of an older commit) on the same log, taking turns with this tree.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


# ---------------------------------------------------------------------------------------------------------------------
# A demo-shaped episode log


def make_run(
    run_dir: Path, steps: int = 300, tasks_per_step: int = 4, num_generations: int = 12, seed: int = 0
) -> Path:
    """Write `run_dir/episodes/episodes-rank0.jsonl` (`steps x tasks_per_step x num_generations` records) and the
    tokenizer beside it; returns the JSONL path."""
    from trl_agentic.lineage import label_conversations
    from trl_agentic.rollout.rows import episode_to_rows
    from trl_agentic.tasks.calculator import CALCULATOR_TOOLS, SYSTEM_PROMPT
    from trl_agentic.tiny_models import build_tiny_tokenizer
    from trl_agentic.trace import Episode, Turn, json_text

    rng = random.Random(seed)
    tokenizer = build_tiny_tokenizer("qwen2_5")
    tokenizer.save_pretrained(run_dir)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def render(messages: list[dict]) -> list[int]:
        return tokenizer.apply_chat_template(
            messages, tools=CALCULATOR_TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
        )

    def sample(text: str, step: int) -> tuple[list[int], list[float]]:
        ids = [*encode(text), end]
        confidence = 0.3 + 0.6 * step / steps  # the policy grows surer as it trains
        return ids, [round(-rng.expovariate(1 / (1.5 - confidence)), 6) for _ in ids]

    def call(expression: str) -> dict:
        return {
            "id": f"call_{rng.getrandbits(96):024x}",
            "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
        }

    def turn(index: int, prompt: list[int], text: str, step: int, request: list[dict], reply: dict, **kwargs) -> Turn:
        ids, logprobs = sample(text, step)
        return Turn(
            index,
            prompt,
            ids,
            logprobs,
            "tool_calls" if reply.get("tool_calls") else "stop",
            step,
            request_messages=request,
            request_tools=CALCULATOR_TOOLS,
            response_message=reply,
            sampling={"temperature": 1.0, "max_tokens": 48},
            wall_time=round(rng.uniform(0.05, 0.4), 3),
            **kwargs,
        )

    def episode_turns(question: str, a: int, b: int, op: str, answer: int, step: int) -> tuple[list[Turn], str, bool]:
        """The turns of one episode, its status and whether it answered right."""
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        prompt = render(messages)
        right = rng.random() < 0.35 + 0.5 * step / steps
        said = answer if right else answer + rng.choice([-10, -1, 1, 7, 100])
        final = {"role": "assistant", "content": f"The answer is {said}."}
        shape = rng.random()
        if shape < 0.15:  # answered without the tool
            return [turn(0, prompt, final["content"], step, messages, final)], "ok", right
        if shape < 0.20:  # a malformed call, returned as text; the agent gives up
            text = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a} {op} {b}"\n</tool_call>'
            reply = {"role": "assistant", "content": text}
            return [turn(0, prompt, text, step, messages, reply, malformed_tool_call=True)], "ok", False
        expression = f"{a} {op} {b}"
        tool_call = call(expression)
        text = (
            f"<tool_call>\n{json.dumps({'name': 'calculator', 'arguments': {'expression': expression}})}\n</tool_call>"
        )
        first = turn(0, prompt, text, step, messages, {"role": "assistant", "content": None, "tool_calls": [tool_call]})
        if shape < 0.25:  # the episode ran out of time while the tool ran
            return [first], rng.choice(["timeout", "agent_error"]), False
        history = [
            *messages,
            first.response_message,
            {"role": "tool", "tool_call_id": tool_call["id"], "content": str(answer)},
        ]
        glue = encode(
            f"\n<|im_start|>user\n<tool_response>\n{answer}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        )
        second_prompt = first.prompt_ids + first.completion_ids + glue
        if shape < 0.35:  # a second, checking call before answering
            check = call(f"{answer} + 0")
            text2 = f"<tool_call>\n{json.dumps({'name': 'calculator', 'arguments': {'expression': f'{answer} + 0'}})}\n</tool_call>"
            second = turn(
                1,
                second_prompt,
                text2,
                step,
                history,
                {"role": "assistant", "content": None, "tool_calls": [check]},
                prompt_source="continued",
                parent_turn=0,
            )
            history = [
                *history,
                second.response_message,
                {"role": "tool", "tool_call_id": check["id"], "content": str(answer)},
            ]
            last_prompt = second.prompt_ids + second.completion_ids + glue
            last = turn(
                2, last_prompt, final["content"], step, history, final, prompt_source="continued", parent_turn=1
            )
            return [first, second, last], "ok", right
        if shape < 0.40:  # the agent rewrote its history (a summary): a fork, a second row
            summary = [*messages[:1], {"role": "user", "content": f"{question} The calculator said {answer}."}]
            fork = turn(
                1,
                render(summary),
                final["content"],
                step,
                summary,
                final,
                prompt_source="rendered",
                fork_reason="history_rewritten",
                forked_from=0,
                drift=rng.randint(0, 6),
            )
            return [first, fork], "ok", right
        last = turn(1, second_prompt, final["content"], step, history, final, prompt_source="continued", parent_turn=0)
        return [first, last], "ok", right

    path = run_dir / "episodes" / "episodes-rank0.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for step in range(steps):
            for task in range(tasks_per_step):
                digits = rng.choice([1, 2, 2, 3])
                a, b = rng.randrange(10 ** (digits - 1), 10**digits), rng.randrange(10 ** (digits - 1), 10**digits)
                op = rng.choice("+-*")
                answer = {"+": a + b, "-": a - b, "*": a * b}[op]
                group = []
                for g in range(num_generations):
                    turns, status, right = episode_turns(f"What is {a} {op} {b}?", a, b, op, answer, step)
                    episode = Episode(
                        f"ep-{rng.getrandbits(128):032x}",
                        task_index=task * num_generations + g,
                        group_index=g,
                        turns=turns,
                        messages=[*turns[-1].request_messages, turns[-1].response_message],
                        result=turns[-1].response_message.get("content"),
                        status=status,
                        wall_time=round(sum(t.wall_time for t in turns) + rng.uniform(0.01, 0.1), 3),
                    )
                    if status != "ok":
                        episode.error = (
                            f"{status}: the episode ran past its 30 s limit"
                            if status == "timeout"
                            else ("agent_error: Traceback (most recent call last): ... KeyError: 'choices'")
                        )
                    label_conversations(episode)
                    reward = float(right) if status == "ok" else None
                    episode.metadata = {"rewards": {"exact_answer": reward}}
                    group.append((episode, reward))
                scored = [r for _, r in group if r is not None]
                mean = sum(scored) / len(scored) if scored else 0.0
                std = statistics.pstdev(scored) if len(scored) > 1 else 0.0
                for episode, reward in group:
                    rows = episode_to_rows(episode.turns)
                    record = {
                        "step": step,
                        "mode": "train",
                        "advantage": 0.0 if reward is None else (reward - mean) / (std + 1e-4),
                        "episode": episode.to_dict(),
                        "rows": [row.to_dict() for row in rows.rows],
                        "skipped_turns": rows.skipped_turns,
                        "capped_turns": rows.capped_turns,
                        "difficulty": digits,
                        "target": digits == 2,
                    }
                    f.write(json_text(record) + "\n")
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Measuring one viewer


def measure(run_dir: Path, out_dir: Path, repeats: int) -> dict:
    """Write the viewer of `run_dir` into `out_dir/viewer` `repeats` times (with whichever `trl_agentic` is imported)
    and measure it."""
    import warnings

    from trl_agentic.viewer import write_viewer

    warnings.simplefilter("ignore")
    output = out_dir / "viewer"
    times = []
    for _ in range(repeats):
        if output.is_dir():
            shutil.rmtree(output)
        started = time.perf_counter()
        page = Path(write_viewer(run_dir, output))
        times.append(time.perf_counter() - started)
    if output.is_file():  # one self-contained HTML file: the browser loads all of it
        files, opening = [output], [output]
    else:  # a folder: the page, then a step's data when the step is opened (steps/0.js: the first)
        files = sorted(p for p in output.rglob("*") if p.is_file())
        opening = [page, output / "steps" / "0.js"]
    return {
        "write_s": statistics.median(times),
        "open_bytes": sum(p.stat().st_size for p in opening),
        "total_bytes": sum(p.stat().st_size for p in files),
        "files": len(files),
        "page": str(page),
        "first_step": str(opening[-1]) if len(opening) > 1 else None,
    }


def browser_seconds(url: str, repeats: int = 2) -> float | None:
    """Median wall time of headless Chromium loading `url` and dumping its DOM (browser start included)."""
    if shutil.which("chromium") is None:
        return None
    times = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as profile:
            started = time.perf_counter()
            subprocess.run(
                [
                    "chromium",
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    f"--user-data-dir={profile}",
                    "--virtual-time-budget=5000",
                    "--dump-dom",
                    url,
                ],
                capture_output=True,
                timeout=300,
                check=True,
            )
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tasks-per-step", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1, help="writes per viewer (median reported)")
    parser.add_argument("--before", default=None, help="a source tree whose viewer to measure on the same log")
    parser.add_argument("--measure-only", nargs=2, metavar=("RUN_DIR", "OUT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_only:  # the --before subprocess
        print(json.dumps(measure(Path(args.measure_only[0]), Path(args.measure_only[1]), args.repeats)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        started = time.perf_counter()
        log = make_run(tmp / "run", args.steps, args.tasks_per_step, args.num_generations)
        episodes = args.steps * args.tasks_per_step * args.num_generations
        print(
            f"log: {episodes} episodes over {args.steps} steps, {log.stat().st_size / 1e6:.1f} MB "
            f"(built in {time.perf_counter() - started:.0f} s)"
        )
        results = {}
        if args.before:
            (tmp / "before").mkdir()
            env = {**os.environ, "PYTHONPATH": str(Path(args.before).resolve())}
            done = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--repeats",
                    str(args.repeats),
                    "--measure-only",
                    str(tmp / "run"),
                    str(tmp / "before"),
                ],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            results[f"before ({args.before})"] = json.loads(done.stdout.strip().splitlines()[-1])
        (tmp / "after").mkdir()
        results["this tree"] = measure(tmp / "run", tmp / "after", args.repeats)
        for result in results.values():
            result["browser_s"] = browser_seconds(Path(result["page"]).as_uri())

        print(f"\n{'viewer':<40} {'write s':>8} {'open MB':>8} {'total MB':>9} {'files':>6} {'browser s':>10}")
        for name, r in results.items():
            browser = f"{r['browser_s']:.1f}" if r["browser_s"] is not None else "-"
            print(
                f"{name:<40} {r['write_s']:>8.1f} {r['open_bytes'] / 1e6:>8.2f} {r['total_bytes'] / 1e6:>9.1f} "
                f"{r['files']:>6} {browser:>10}"
            )
        print(
            "\nopen MB: what the browser loads to show the page (a single file: all of it; a folder: index.html and "
            "the first step's data). browser s: headless Chromium loading the page and dumping its DOM, browser "
            "start included."
        )


if __name__ == "__main__":
    main()
