"""Trajectory viewer: a real episode log (a 2-step tiny run: tool calls, a fork, hostile text) becomes a folder
(index.html and one data file per step) that a headless Chromium renders from disk, loading a step's data only when
the step or one of its episodes is opened, with the opened episode's sampled tokens apart from the masked context."""

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from datasets import Dataset

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.cli import main as cli_main
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer
from trl_agentic.viewer import build_viewer_data, find_episode_files, load_records, split_by_step, write_pages


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


def test_each_step_file_holds_its_episodes_prompts_and_tokens(run_dir):
    """The index has a compact entry per episode (what the list and filters read); a step's file has its episodes,
    details, the prompts its rows start from (renumbered) and the decoded text of every id it shows."""
    records = load_records([run_dir / "episodes" / "episodes-rank0.jsonl"])
    summary, details = build_viewer_data(records, build_tiny_tokenizer("qwen2_5"))
    index, steps = split_by_step(summary, details)
    assert [(s["mode"], s["step"], s["file"]) for s in index["steps"]] == [
        ("train", 0, "steps/0.js"),
        ("train", 1, "steps/1.js"),
    ]
    assert index["episodes"] == 8 and "prompts" not in index and "vocab" not in index
    flat = [e for step in steps for e in step["episodes"]]
    assert flat == summary["episodes"]  # every episode once, in order
    for entry, step in zip(index["steps"], steps, strict=True):
        for compact, episode in zip(entry["episodes"], step["episodes"], strict=True):
            rank, group, status, reward, advantage, forks = compact
            assert (rank, group, index["statuses"][status], reward) == (
                episode["rank"],
                episode["group"],
                episode["status"],
                episode["reward"],
            )
            assert advantage == (episode["advantage"] > 0) - (episode["advantage"] < 0) and forks == 1
        for detail, original in zip(step["details"], [details[e["i"]] for e in step["episodes"]], strict=True):
            for row, original_row in zip(detail["rows"], original["rows"], strict=True):
                prompt = step["prompts"][row["prompt"]]
                assert prompt == summary["prompts"][original_row["prompt"]]
                assert {k: v for k, v in row.items() if k != "prompt"} == {
                    k: v for k, v in original_row.items() if k != "prompt"
                }
                assert all(step["vocab"][str(i)] == summary["vocab"][str(i)] for i in [*prompt, *row["ids"]])
        # A group's 2 episodes share their main rows' prompt and their forks': 4 distinct prompts for 8 rows.
        assert len(step["prompts"]) == len({tuple(p) for p in step["prompts"]}) == 4


def test_hostile_text_cannot_end_the_data_block(tmp_path):
    episode = {
        "i": 0, "id": HOSTILE, "step": 0, "mode": "train", "rank": 0, "group": 0, "sample": 0, "status": HOSTILE,
        "reward": None, "advantage": None, "forks": 0, "task": HOSTILE,
    }  # fmt: skip
    detail = {
        "rows": [],
        "untrained": [],
        "conversations": [{"label": "m", "messages": [{"role": "tool", "content": HOSTILE}]}],
    }
    summary = {"episodes": [episode], "prompts": [], "vocab": None, "alarms": [{"message": HOSTILE}], "source": HOSTILE}
    page = write_pages({**summary, "generated": "now", "tokenizer": None}, [detail], tmp_path / "viewer")
    html = page.read_text()
    assert HOSTILE not in html and html.count("</script>") == html.count("<script") == 2
    # The step file is one call whose argument is JSON: the text comes back exactly, as a string, never as code.
    script = (tmp_path / "viewer" / "steps" / "0.js").read_text()
    assert script.startswith("trlViewerStep(0,") and script.endswith(");\n")
    data = json.loads(script[len("trlViewerStep(0,") : -len(");\n")])
    assert data["episodes"][0]["task"] == HOSTILE and data["details"][0]["conversations"] == detail["conversations"]


def chromium(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """Headless Chromium with a fresh profile and nothing that reaches the network. `--virtual-time-budget` lets the
    page finish what it does after load (the step files it adds) before the DOM is dumped or the screenshot taken."""
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
                "--virtual-time-budget=10000",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )


needs_chromium = pytest.mark.skipif(
    shutil.which("chromium") is None,
    reason="needs Debian's chromium for a real browser (`apt-get install -y chromium`; .ci/run does)",
)


def loaded_step_files(dom: str) -> list[str]:
    """The step files the page added to its <head> (each one loaded)."""
    return re.findall(r'<script src="(steps/\d+\.js)"></script>', dom[: dom.index("</head>")])


def assert_episode_rendered(dom: str, record: dict) -> str:
    """The detail pane shows `record`'s episode: its title, every sampled (trained) token of its rows with its logprob,
    and only those; the rest is context. Returns the pane."""
    detail = dom[dom.index('<section id="detail">') : dom.index('<div id="tokinfo">')]
    assert f'<h2 id="episode-title">{record["episode"]["id"]}</h2>' in detail
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
    return detail


@needs_chromium
def test_inspect_renders_an_episode_in_a_real_browser(run_dir, tmp_path):
    folder = tmp_path / "viewer"
    assert cli_main(["inspect", str(run_dir), "-o", str(folder)]) == 0  # finds the tokenizer in the output dir
    assert sorted(p.name for p in (folder / "steps").iterdir()) == ["0.js", "1.js"]
    record = [json.loads(line) for line in (run_dir / "episodes" / "episodes-rank0.jsonl").read_text().splitlines()][5]
    # A link without its step (as the viewer wrote them before issue #33): the page searches the steps for it.
    url = f"{(folder / 'index.html').as_uri()}#episode={record['episode']['id']}"

    dom = chromium("--dump-dom", url).stdout
    detail = assert_episode_rendered(dom, record)
    assert "row 1 · fork" in detail and "history_rewritten" in detail  # the fork is shown, with its reason
    # The hostile tool result is text in the page, not markup; the step list shows the episode's step and group.
    assert "&lt;/script&gt;&lt;script&gt;document.title='pwned'" in detail and "<title>pwned" not in dom
    assert f'data-step="train:{record["step"]}"' in dom and 'class="ep selected"' in dom
    selected_group = dom[: dom.index('class="ep selected"')].rsplit('<div class="ghead">', 1)[1]
    assert f" · difficulty {record['difficulty']} · " in selected_group  # the group's level, in its header

    shot = tmp_path / "viewer.png"
    chromium(f"--screenshot={shot}", url)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


@pytest.fixture(scope="module")
def long_run(run_dir, tmp_path_factory):
    """A 30-step log: the real run's first step, its episodes renamed per step (the viewer's work grows with steps)."""
    tmp_path = tmp_path_factory.mktemp("long")
    lines = (run_dir / "episodes" / "episodes-rank0.jsonl").read_text().splitlines()
    first = [json.loads(line) for line in lines if json.loads(line)["step"] == 0]
    (tmp_path / "episodes").mkdir()
    with (tmp_path / "episodes" / "episodes-rank0.jsonl").open("w") as f:
        for step in range(30):
            for record in first:
                episode = {**record["episode"], "id": f"{record['episode']['id']}-{step}"}
                f.write(json.dumps({**record, "step": step, "episode": episode}) + "\n")
    build_tiny_tokenizer("qwen2_5").save_pretrained(tmp_path)
    assert cli_main(["inspect", str(tmp_path)]) == 0  # -> <output_dir>/viewer
    return tmp_path


@needs_chromium
def test_a_later_step_is_loaded_on_demand_from_disk(long_run):
    """Opened from disk (file://), the page loads no step until asked; `#step=25` loads that step's file alone and
    lists its groups and episodes, and an episode link loads only its own step."""
    page = long_run / "viewer" / "index.html"
    assert len(list((long_run / "viewer" / "steps").glob("*.js"))) == 30
    records = [json.loads(line) for line in (long_run / "episodes" / "episodes-rank0.jsonl").read_text().splitlines()]
    late = [r for r in records if r["step"] == 25]

    dom = chromium("--dump-dom", page.as_uri()).stdout
    headers = re.findall(
        r'<div class="step" data-step="train:(\d+)"><div class="head">[^<]*<b>\d+</b>[^<]*</div><div class="body"></div>',
        dom,
    )
    assert loaded_step_files(dom) == [] and headers == [str(s) for s in range(30)]  # headers only, from the index
    assert f"{len(records)} of {len(records)} episodes, 30 steps" in dom and len(records) == 30 * 4

    dom = chromium("--dump-dom", f"{page.as_uri()}#step=25").stdout
    assert loaded_step_files(dom) == ["steps/25.js"]
    opened = dom[dom.index('<div class="step open" data-step="train:25">') :]
    opened = opened[: opened.index('<div class="step" data-step="train:26">')]
    assert re.findall(r'class="ep" data-e="25\.\d+" title="([^"]+)"', opened) == [r["episode"]["id"] for r in late]
    assert f"· difficulty {late[0]['difficulty']} · Add 0 and 1." in opened  # the group header, from the step file

    dom = chromium("--dump-dom", f"{page.as_uri()}#episode={late[3]['episode']['id']}&step=train:25").stdout
    assert loaded_step_files(dom) == ["steps/25.js"]
    assert_episode_rendered(dom, late[3])


def test_inspect_takes_the_demos_output_folder_and_finds_its_tokenizer(run_dir, tmp_path, capsys):
    # `trl-agentic demo` prints outputs/demo: its run is outputs/demo/grpo, its tokenizer outputs/demo/model
    from trl_agentic.viewer import find_tokenizer

    demo = tmp_path / "demo"
    (demo / "grpo" / "episodes").mkdir(parents=True)
    shutil.copy(run_dir / "episodes" / "episodes-rank0.jsonl", demo / "grpo" / "episodes")
    (demo / "plots").mkdir()
    build_tiny_tokenizer("qwen2_5").save_pretrained(demo / "model")
    files, output_dir = find_episode_files(demo)
    assert files == [demo / "grpo" / "episodes" / "episodes-rank0.jsonl"] and output_dir == demo / "grpo"
    assert find_tokenizer(output_dir).chat_template  # the sibling model/ folder's

    assert cli_main(["inspect", str(demo)]) == 0
    page = demo / "grpo" / "viewer" / "index.html"
    assert page.as_uri() in capsys.readouterr().out
    index = json.loads(
        re.search(r'<script type="application/json" id="index-data">(.*?)</script>', page.read_text())[1]
    )
    assert index["tokenizer"] == str(demo / "model") and index["episodes"] == 8
    step = (demo / "grpo" / "viewer" / "steps" / "1.js").read_text()
    assert '"vocab":{' in step  # the ids are decoded

    # The viewer used to be one HTML file: a .html output now says what to pass instead.
    with pytest.raises(SystemExit, match="is a folder .* -o .*episodes"):
        cli_main(["inspect", str(demo), "-o", str(tmp_path / "episodes.html")])


def test_the_demos_gzipped_log_reads_as_the_plain_one_and_inspect_finds_it(run_dir, tmp_path, capsys):
    """Issue 40: the demo keeps its episode log gzipped (145 MB plain for 300 steps); the viewer reads what it wrote,
    from the demo's folder as from the file."""
    import gzip

    from trl_agentic.pipeline.report import keep_episode_log

    plain = run_dir / "episodes" / "episodes-rank0.jsonl"
    demo = tmp_path / "demo"
    (demo / "grpo" / "episodes").mkdir(parents=True)
    copied = Path(shutil.copy(plain, demo / "grpo" / "episodes"))
    packed = keep_episode_log(demo / "grpo" / "episodes" / "episodes-rank0.jsonl", "gzip")
    assert packed == demo / "grpo" / "episodes" / "episodes-rank0.jsonl.gz" and not copied.exists()
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()  # every record kept
    assert packed.stat().st_size * 4 < plain.stat().st_size
    kept = tmp_path / "kept.jsonl"
    shutil.copy(plain, kept)
    assert (
        keep_episode_log(kept, "jsonl") == kept and kept.read_bytes() == plain.read_bytes()
    )  # --set episode_log=jsonl

    files, output_dir = find_episode_files(demo)
    assert files == [packed] and output_dir == demo / "grpo"
    assert load_records([packed]) == load_records([plain])
    build_tiny_tokenizer("qwen2_5").save_pretrained(demo / "model")
    assert cli_main(["inspect", str(demo)]) == 0
    assert sorted(p.name for p in (demo / "grpo" / "viewer" / "steps").iterdir()) == ["0.js", "1.js"]
    assert cli_main(["inspect", str(packed), "--no-tokenizer"]) == 0  # the file itself: a viewer beside it
    assert (demo / "grpo" / "episodes" / "episodes-rank0-viewer" / "index.html").is_file()


def test_a_long_logs_viewer_shows_50_evenly_spaced_steps_unless_asked_for_all(run_dir, tmp_path):
    """Issue 40: a viewer of every step of a 300-step demo was 37 MB. By default 50 steps (the first and the last
    among them); `--max-steps 0` keeps every one."""
    from trl_agentic.viewer import sample_steps

    first = [json.loads(line) for line in (run_dir / "episodes" / "episodes-rank0.jsonl").read_text().splitlines()]
    first = [r for r in first if r["step"] == 0]
    (tmp_path / "episodes").mkdir()
    with (tmp_path / "episodes" / "episodes-rank0.jsonl").open("w") as f:
        for step in range(1, 121):
            for record in first:
                episode = {**record["episode"], "id": f"{record['episode']['id']}-{step}"}
                f.write(json.dumps({**record, "step": step, "episode": episode}) + "\n")
    with pytest.warns(UserWarning, match="shows 50 of the log's 120 training steps.*--max-steps 0"):
        assert cli_main(["inspect", str(tmp_path), "--no-tokenizer", "-o", str(tmp_path / "sampled")]) == 0
    page = (tmp_path / "sampled" / "index.html").read_text()
    index = json.loads(re.search(r'<script type="application/json" id="index-data">(.*?)</script>', page)[1])
    shown = [entry["step"] for entry in index["steps"]]
    assert len(shown) == 50 and shown[0] == 1 and shown[-1] == 120
    assert len(list((tmp_path / "sampled" / "steps").glob("*.js"))) == 50
    gaps = {b - a for a, b in zip(shown, shown[1:])}
    assert gaps <= {2, 3}  # evenly spaced: 119 steps over 49 gaps
    assert cli_main(["inspect", str(tmp_path), "--no-tokenizer", "--max-steps", "0", "-o", str(tmp_path / "all")]) == 0
    assert len(list((tmp_path / "all" / "steps").glob("*.js"))) == 120

    evaluation = [{"step": 0, "mode": "eval", "episode": {}}]
    train = [{"step": s, "episode": {}} for s in range(10)]
    records, kept, total = sample_steps(evaluation + train, 3)
    assert [r["step"] for r in records] == [0, 0, 4, 9] and (kept, total) == (3, 10)  # evaluation records all kept
    assert sample_steps(train, 0) == (train, 10, 10) and sample_steps(train, 10) == (train, 10, 10)
