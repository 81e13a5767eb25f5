"""Trajectory viewer: a real episode log (a 2-step tiny run: tool calls, a fork, hostile text) becomes one HTML file
that a headless Chromium renders from disk, with the opened episode's sampled tokens apart from the masked context."""

import json
import re
import shutil
import subprocess
import tempfile

import pytest
from datasets import Dataset

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.cli import main as cli_main
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer
from trl_agentic.viewer import build_viewer_data, find_episode_files, load_records, render_html


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
HOSTILE = "</script><script>document.title='pwned'</script> & <b>42</b>"  # a tool result must stay text


async def forking_agent(client, task):
    """Two continued calls with a tool result, then a rewritten history (a fork: a second row)."""
    messages = list(task["prompt"])
    for _ in range(2):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=6)
        messages.append(response.choices[0].message.model_dump(exclude_none=True))
        messages.append(
            {"role": "tool", "tool_call_id": "call_0", "content": HOSTILE}
            if messages[-1].get("tool_calls")
            else {"role": "user", "content": HOSTILE}
        )
    summary = [*task["prompt"], {"role": "user", "content": "Summary so far: 42. Answer."}]
    response = await client.chat.completions.create(model="policy", messages=summary, max_tokens=6)
    return response.choices[0].message.content


def length_reward(prompts, completions, **kwargs):
    return [float(sum(len(m.get("content") or "") for m in c) % 3) for c in completions]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real episode log: 2 steps x 2 tasks x 2 episodes, with the tokenizer saved beside it (as a saved run has)."""
    tmp_path = tmp_path_factory.mktemp("run")
    tokenizer = build_tiny_tokenizer("qwen2_5")
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        num_generations=2,
        per_device_train_batch_size=4,  # 2 tasks x 2
        max_completion_length=6,
        use_cpu=True,
        bf16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        log_episodes=True,
        seed=0,
        disable_tqdm=True,
    )
    # A difficulty column: each record logs its task's level.
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"Add {i} and {i + 1}."}], "difficulty": i % 2 + 1} for i in range(4)]
    )
    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=forking_agent,
        reward_funcs=length_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


def test_viewer_data_keeps_every_token_mask_and_logprob(run_dir):
    records = load_records([run_dir / "episodes" / "episodes-rank0.jsonl"])
    tokenizer = build_tiny_tokenizer("qwen2_5")
    summary, details = build_viewer_data(records, tokenizer)
    assert len(summary["episodes"]) == len(details) == len(records) == 8
    for record, entry, detail in zip(records, summary["episodes"], details, strict=True):
        assert entry["id"] == record["episode"]["id"] and entry["advantage"] == pytest.approx(record["advantage"], 1e-3)
        assert entry["group"] == record["episode"]["task_index"] // 2 and entry["forks"] == 1
        assert entry["difficulty"] == record["difficulty"] in (1, 2) and entry["target"] is False
        assert [r["kind"] for r in detail["rows"]] == [r["kind"] for r in record["rows"]] == ["main", "fork"]
        for row, original in zip(detail["rows"], record["rows"], strict=True):
            assert summary["prompts"][row["prompt"]] == original["prompt_ids"]
            assert row["ids"] == original["completion_ids"]
            assert row["mask"] == "".join(map(str, original["env_mask"]))
            assert row["lp"] == [round(lp, 4) for lp, m in zip(original["logprobs"], original["env_mask"]) if m]
    # The 4 episodes of a step share 2 prompts (one per group) and the fork rows share theirs.
    assert len(summary["prompts"]) <= 4 * 2
    assert all(summary["vocab"][str(i)] == tokenizer.decode([i]) for i in summary["prompts"][0])


def test_evaluation_logs_are_read_too_rows_rebuilt_from_turns(run_dir):
    """`Evaluator.evaluate(episodes_path=...)` writes no rows: the viewer rebuilds them from the turns, as training
    would have."""
    records = load_records([run_dir / "episodes" / "episodes-rank0.jsonl"])
    evaluation = [
        {
            "task_index": i // 2,
            "sample": i % 2,
            "reward": 1.0,
            "rewards": {"f": 1.0},
            "episode": r["episode"],
            "rank": 0,
        }
        for i, r in enumerate(records[:4])
    ]
    summary, details = build_viewer_data(evaluation)
    assert [e["mode"] for e in summary["episodes"]] == ["eval"] * 4 and summary["vocab"] is None
    assert [e["group"] for e in summary["episodes"]] == [0, 0, 1, 1]
    for record, detail in zip(records, details):
        assert [r["ids"] for r in detail["rows"]] == [r["completion_ids"] for r in record["rows"]]


def test_hostile_text_cannot_end_the_data_block():
    html = render_html(
        {
            "episodes": [],
            "prompts": [],
            "vocab": None,
            "alarms": [],
            "source": HOSTILE,
            "generated": "now",
            "tokenizer": None,
        },
        [{"messages": [{"role": "tool", "content": HOSTILE}]}],
    )
    assert HOSTILE not in html and html.count("</script>") == html.count("<script") == 3


def chromium(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """Headless Chromium with a fresh profile and nothing that reaches the network."""
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [
                "chromium",
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                "--window-size=1400,1000",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )


@pytest.mark.skipif(
    shutil.which("chromium") is None,
    reason="needs Debian's chromium for a real browser (`apt-get install -y chromium`; .ci/run does)",
)
def test_inspect_renders_an_episode_in_a_real_browser(run_dir, tmp_path):
    html_path = tmp_path / "episodes.html"
    assert cli_main(["inspect", str(run_dir), "-o", str(html_path)]) == 0  # finds the tokenizer in the output dir
    record = [json.loads(line) for line in (run_dir / "episodes" / "episodes-rank0.jsonl").read_text().splitlines()][5]
    url = f"{html_path.as_uri()}#episode={record['episode']['id']}"

    dom = chromium("--dump-dom", url).stdout
    detail = dom[dom.index('<section id="detail">') : dom.index('<div id="tokinfo">')]
    assert f'<h2 id="episode-title">{record["episode"]["id"]}</h2>' in detail
    # Every sampled (trained) token of the episode's rows is rendered as such, and only those; the rest is context.
    sampled = re.findall(r'<span class="t s[^"]*" data-id="(\d+)" title="id \d+ · logprob (-?[\d.]+)', detail)
    expected = [
        (tok, lp)
        for row in record["rows"]
        for tok, m, lp in zip(row["completion_ids"], row["env_mask"], row["logprobs"])
        if m
    ]
    assert [int(t) for t, _ in sampled] == [t for t, _ in expected]
    assert [float(lp) for _, lp in sampled] == pytest.approx([lp for _, lp in expected], abs=1e-4)
    context = len(re.findall(r'<span class="t c[^"]*"', detail))
    assert context == sum(len(r["prompt_ids"]) + len(r["env_mask"]) - sum(r["env_mask"]) for r in record["rows"])
    assert "row 1 · fork" in detail and "history_rewritten" in detail  # the fork is shown, with its reason
    # The hostile tool result is text in the page, not markup; the step list shows the episode's step and group.
    assert "&lt;/script&gt;&lt;script&gt;document.title='pwned'" in detail and "<title>pwned" not in dom
    assert f'data-step="train:{record["step"]}"' in dom and 'class="ep selected"' in dom
    selected_group = dom[: dom.index('class="ep selected"')].rsplit('<div class="ghead">', 1)[1]
    assert f" · difficulty {record['difficulty']} · " in selected_group  # the group's level, in its header

    shot = tmp_path / "viewer.png"
    chromium(f"--screenshot={shot}", url)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_inspect_takes_the_demos_output_folder_and_finds_its_tokenizer(tmp_path):
    # `trl-agentic demo` prints outputs/demo: its run is outputs/demo/grpo, its tokenizer outputs/demo/model
    from trl_agentic.tiny_models import build_tiny_tokenizer
    from trl_agentic.viewer import find_tokenizer

    demo = tmp_path / "demo"
    (demo / "grpo" / "episodes").mkdir(parents=True)
    (demo / "grpo" / "episodes" / "episodes-rank0.jsonl").write_text("{}\n")
    (demo / "plots").mkdir()
    build_tiny_tokenizer("qwen2_5").save_pretrained(demo / "model")
    files, output_dir = find_episode_files(demo)
    assert files == [demo / "grpo" / "episodes" / "episodes-rank0.jsonl"] and output_dir == demo / "grpo"
    assert find_tokenizer(output_dir).chat_template  # the sibling model/ folder's
