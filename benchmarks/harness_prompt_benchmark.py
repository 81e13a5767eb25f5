"""The endpoint's own cost per call on a Claude Code episode: a ~45k-token first prompt (24 tools) and tens of turns.

```bash
python benchmarks/harness_prompt_benchmark.py                 # 40 turns, 3 episodes: ~1 min on 2 cores
python benchmarks/harness_prompt_benchmark.py --turns 60 --episodes 5
```

The episode is Claude Code 2.1.197's, as recorded (`tests/data/harness_requests/claude_code/`): the first call's body
(system blocks, the system message at `messages[1]`, 24 tools, thinking and context-management fields, streamed) with
the strings the fixture trimmed padded back to their recorded lengths (the fixture says how many characters it cut),
so the prompt is as long as the real one. Each turn appends what Claude Code appends: the assistant's `tool_use` of
`Bash` and a user message with its `tool_result` (`--output-chars` of command output), with `cache_control` moved to
the newest block as the harness does. A zero-cost engine answers every call instantly with the same `Bash` call, so
what is timed is the endpoint's own work: parsing and validating the body, rendering and tokenizing what is new,
continuing the previous turn's ids, recording, streaming the answer back (raw httpx, SSE read to the end).

Goal (issue 31, item 5): the per-call cost must not grow with the history. Printed: median ms per call at turns 1, 10,
20, ... and the ratio of the last turn to turn 1, with the prompt's length in tokens at each.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import time
from pathlib import Path

import httpx

from endpoint_benchmark import ZeroCostEngine
from trl_agentic.endpoint.app import create_app
from trl_agentic.endpoint.chat import ChatRenderer
from trl_agentic.endpoint.server import EndpointServer
from trl_agentic.tiny_models import build_tiny_tokenizer


RECORDED = Path(__file__).resolve().parents[1] / "tests" / "data" / "harness_requests" / "claude_code"
TRIMMED = re.compile(r"\[\.\.\. (\d+) more characters trimmed from the fixture\]")
FILLER = (
    "When you run a command, explain what it does and why. Prefer editing existing files to creating new ones. "
    "Keep answers short and to the point; use the tools to read files before changing them. "
)


def restore(value):
    """The recorded body with each trimmed string padded back to its recorded length (filler prose)."""
    if isinstance(value, dict):
        return {k: restore(v) for k, v in value.items()}
    if isinstance(value, list):
        return [restore(v) for v in value]
    if isinstance(value, str) and (match := TRIMMED.search(value)):
        missing = int(match.group(1))
        return value[: match.start()] + (FILLER * (missing // len(FILLER) + 1))[:missing]
    return value


BASH_CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls", "description": "List files"}}\n</tool_call>'


def read_stream(response: httpx.Response) -> dict:
    """The streamed answer's `tool_use` block (the SSE events read to the end, as the harness reads them)."""
    block, arguments = None, ""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        event = json.loads(line[6:])
        if event["type"] == "content_block_start" and event["content_block"]["type"] == "tool_use":
            block = dict(event["content_block"])
        elif event["type"] == "content_block_delta" and event["delta"]["type"] == "input_json_delta":
            arguments += event["delta"]["partial_json"]
    block["input"] = json.loads(arguments)
    return block


def drop_cache_control(messages: list[dict]) -> None:
    for message in messages:
        if isinstance(message["content"], list):
            for part in message["content"]:
                part.pop("cache_control", None)


def episode(server: EndpointServer, http: httpx.Client, first: dict, turns: int, output_chars: int):
    """One episode: `turns` calls; returns [(ms, prompt tokens)] per call and the number of forks."""
    session = server.open_episode()
    headers = {**first["headers"], "x-api-key": session.key}
    headers = {k: v for k, v in headers.items() if k.lower() not in ("authorization", "host", "content-length")}
    body = copy.deepcopy(first["body"])
    timings = []
    for turn in range(turns):
        started = time.perf_counter()
        with http.stream(
            "POST", f"{server.url}/v1/messages", params={"beta": "true"}, headers=headers, content=json.dumps(body)
        ) as response:
            if response.status_code != 200:
                raise RuntimeError(f"turn {turn}: {response.status_code} {response.read()[:500]!r}")
            tool_use = read_stream(response)
        timings.append((time.perf_counter() - started) * 1000)
        drop_cache_control(body["messages"])
        output = (f"turn {turn}: " + "drwxr-xr-x 2 root root 4096 Dec  5 08:00 src\n" * 200)[:output_chars]
        body["messages"] += [
            {"role": "assistant", "content": [tool_use]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": tool_use["id"],
                        "content": output,
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            },
        ]
    recorded = server.close_episode(session.episode.id)
    lengths = [len(turn.prompt_ids) for turn in recorded.turns]
    return list(zip(timings, lengths, strict=True)), recorded.num_forks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--episodes", type=int, default=3)
    parser.add_argument("--output-chars", type=int, default=2000, help="Characters of each tool result.")
    args = parser.parse_args()
    first = json.loads((RECORDED / "01_first_call.json").read_text())
    first["body"] = restore(first["body"])
    tokenizer = build_tiny_tokenizer("qwen2_5")
    server = EndpointServer(create_app(ZeroCostEngine(tokenizer, BASH_CALL), ChatRenderer(tokenizer))).start()
    runs, forks = [], 0
    try:
        with httpx.Client(timeout=120) as http:
            episode(server, http, first, 3, args.output_chars)  # warm-up
            for _ in range(args.episodes):
                timings, episode_forks = episode(server, http, first, args.turns, args.output_chars)
                runs.append(timings)
                forks += episode_forks
    finally:
        server.stop()
    print(
        f"Claude Code 2.1.197 episode shape: first body {len(json.dumps(first['body'])) / 1000:.1f} kB, "
        f"{len(first['body']['tools'])} tools; {args.episodes} episodes x {args.turns} turns, tool results of "
        f"{args.output_chars} chars; zero-cost engine, tiny qwen2_5 tokenizer; forks: {forks}"
    )
    print(f"{'turn':>6}{'prompt tokens':>15}{'ms per call (median)':>22}")
    marks = sorted({0, *range(9, args.turns, 10), args.turns - 1})
    medians = {}
    for turn in marks:
        medians[turn] = statistics.median(run[turn][0] for run in runs)
        print(f"{turn + 1:>6}{runs[0][turn][1]:>15}{medians[turn]:>22.1f}")
    last = args.turns - 1
    print(
        f"turn {args.turns} / turn 1: {medians[last] / medians[0]:.2f}x per call, with "
        f"{runs[0][last][1] / runs[0][0][1]:.2f}x the prompt tokens"
    )


if __name__ == "__main__":
    main()
