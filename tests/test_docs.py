"""The docs: the site builds strict, what the pages name exists, and README's Python example runs as written.

What the pages name is checked against the code, not against a list kept by hand:
- every flag of a `trl-agentic <command> ...` line (or `-m trl_agentic.scripts.<command>`) against the parser that
  command really builds (captured from its `main`, so a parser that moves or is rebuilt is still the one checked);
- every `AgenticGRPOConfig(...)` keyword, every `key: value` of a recipe (a YAML block, an inline span) and every
  `AgenticGRPOConfig.field` against the config's and the recipe's fields;
- the config reference (docs/config.md) against `AgenticGRPOConfig`: every field of its own listed, with its default.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from trl import GRPOConfig, TrlParser

from trl_agentic import AgenticGRPOConfig
from trl_agentic.cli import COMMANDS
from trl_agentic.recipes import recipe_keys


REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
# Every page a user reads: the site's pages, README, CONTRIBUTING and the jobs guide.
PAGES = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "jobs" / "README.md", *DOCS.rglob("*.md")])
CONFIG_FIELDS = {f.name for f in dataclasses.fields(AgenticGRPOConfig) if f.init}
OWN_CONFIG_FIELDS = [f.name for f in dataclasses.fields(AgenticGRPOConfig) if f.init and f.name not in
                     {g.name for g in dataclasses.fields(GRPOConfig)}]  # fmt: skip
RECIPE_KEYS = recipe_keys() | {"env"}
# Flags of other programs a page may name on their own (`--no-deps`), outside a `trl-agentic` command line.
OTHER_PROGRAMS_FLAGS = {
    "--no-deps",  # pip
    "--index-url",  # pip
    "--config_file",  # accelerate launch
    "--num_processes",  # accelerate launch, jobs/train.py
    "--accelerate_config",  # jobs/train.py
    "--network-alias",  # hf jobs
    "--dangerously-skip-permissions",  # Claude Code
    "--info-fd",  # bubblewrap
    "--block-fd",  # bubblewrap
}


# ---------------------------------------------------------------------------------------------------------------------
# What the pages hold


def read(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced code block."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.M | re.S)]


def inline_spans(text: str) -> list[str]:
    """The inline code spans of the prose (fenced blocks left out)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.findall(r"(?<!`)`([^`\n]+)`(?!`)", prose)


class _Captured(Exception):
    pass


def command_parser(command: str) -> argparse.ArgumentParser:
    """The parser `trl-agentic <command>` builds, caught as its `main` starts parsing (nothing else runs)."""
    module = importlib.import_module(COMMANDS[command][0])
    caught = []

    def catch(parser, *args, **kwargs):
        caught.append(parser)
        raise _Captured

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", catch):
        with pytest.raises(_Captured):
            module.main([])
    return caught[0]


def valid_flags(command: str) -> set[str]:
    parser = command_parser(command)
    flags = set(parser._option_string_actions)
    if isinstance(parser, TrlParser):
        flags.add("--config")  # TrlParser reads it before argparse sees the rest
    for action in parser._actions:  # `jobs submit`: the subcommand's flags
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= set(sub._option_string_actions)
    if command == "serve":  # `serve --train`'s training flags (trl_agentic/scripts/serve_train.py)
        from trl_agentic.scripts.serve_train import make_parser

        flags |= set(make_parser()._option_string_actions)
    return flags


SCRIPT_COMMANDS = {"train": "train", "eval": "eval", "demo": "demo", "inspect_episodes": "inspect"}
COMMAND_LINE = re.compile(
    r"(?:trl-agentic\s+(?P<cmd>" + "|".join(COMMANDS) + r")\b|-m\s+trl_agentic\.scripts\.(?P<script>\w+)\b)"
    r"(?P<rest>[^\n|;&#`]*)"
)


def command_lines(text: str) -> list[tuple[str, str]]:
    """(command, the rest of its line) of each `trl-agentic <command> ...` in code blocks and inline spans."""
    sources = [body.replace("\\\n", " ") for _, body in code_blocks(text)] + inline_spans(text)
    found = []
    for source in sources:
        for match in COMMAND_LINE.finditer(source):
            command = match.group("cmd") or SCRIPT_COMMANDS.get(match.group("script"))
            if command is not None:
                found.append((command, match.group("rest")))
    return found


def unknown_flags(text: str, flags_of=None) -> list[str]:
    """`trl-agentic <command> --flag` where the command's parser has no `--flag` (after `jobs submit ... --`, the
    training flags the job passes on to `trl-agentic train`)."""
    flags_of = flags_of or _flags_of
    unknown = []
    for command, rest in command_lines(text):
        try:
            words = shlex.split(rest, comments=True)
        except ValueError:  # an unclosed quote in a shortened example
            words = rest.split()
        owner = command
        for word in words:
            if word == "--" and command == "jobs":
                owner = "train"
            elif word.startswith("-") and len(word) > 1 and not re.fullmatch(r"-[\d.e-]+", word):
                flag = word.split("=")[0]
                if flag not in flags_of(owner):
                    unknown.append(f"trl-agentic {command}: {flag}")
    for span in inline_spans(text):  # a flag named on its own: some command of ours, or a listed other program's
        if re.fullmatch(r"--[a-z][\w-]*", span) and span not in OTHER_PROGRAMS_FLAGS:
            if not any(span in flags_of(command) for command in COMMANDS):
                unknown.append(f"(any command): {span}")
    return unknown


_FLAGS: dict[str, set[str]] = {}


def _flags_of(command: str) -> set[str]:
    if command not in _FLAGS:
        _FLAGS[command] = valid_flags(command)
    return _FLAGS[command]


def config_keywords(source: str) -> list[str]:
    """The keywords of every `AgenticGRPOConfig(...)` call in a Python block."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a fragment: fall back to the keywords written inside the call's parentheses
        names = []
        for start in re.finditer(r"AgenticGRPOConfig\(", source):
            depth, end = 1, start.end()
            while depth and end < len(source):
                depth += {"(": 1, ")": -1}.get(source[end], 0)
                end += 1
            names += re.findall(r"(?<![\w.])(\w+)\s*=(?!=)", source[start.end() : end])
        return names
    return [
        keyword.arg
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None)) == "AgenticGRPOConfig"
        for keyword in node.keywords
        if keyword.arg is not None
    ]


def unknown_config_names(text: str) -> list[str]:
    """Config fields and recipe keys a page names that do not exist."""
    unknown = []
    for language, body in code_blocks(text):
        if language == "python":
            unknown += [f"AgenticGRPOConfig({name}=...)" for name in config_keywords(body) if name not in CONFIG_FIELDS]
        if language == "yaml":  # a recipe
            for key in re.findall(r"^([A-Za-z_]\w*):", body, re.M):
                if key not in RECIPE_KEYS:
                    unknown.append(f"recipe key {key}:")
    for span in inline_spans(text):
        match = re.fullmatch(r"([a-z][a-z0-9]*_[a-z0-9_]+): .+", span)  # a recipe line: `task_sampling: adaptive`
        if match and match.group(1) not in RECIPE_KEYS:
            unknown.append(f"recipe key {match.group(1)}:")
        match = re.fullmatch(r"(?:AgenticGRPOConfig|GRPOConfig|training_args|trainer\.args)\.(\w+)", span)
        if match and match.group(1) not in CONFIG_FIELDS:
            unknown.append(span)
    return unknown


# ---------------------------------------------------------------------------------------------------------------------
# The site


def test_the_docs_site_builds_strict_outside_the_repository(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("needs mkdocs: pip install -e '.[dev]' (or pip install mkdocs==1.6.1)")
    before = set(REPO.iterdir())
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"), "-d", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "index.html").exists() and (tmp_path / "config" / "index.html").exists()
    assert set(REPO.iterdir()) == before  # nothing written into the repository (no site/)


def test_every_page_under_docs_is_in_the_nav():
    nav = read(REPO / "mkdocs.yml").split("\nnav:", 1)[1]
    listed = set(re.findall(r"([\w/.-]+\.md)\s*$", nav, re.M))
    pages = {page.relative_to(DOCS).as_posix() for page in DOCS.rglob("*.md")}
    assert pages - listed == set(), "add these pages to the nav of mkdocs.yml"
    assert listed - pages == set(), "the nav of mkdocs.yml lists pages that do not exist"


@pytest.mark.parametrize("page", [REPO / "README.md", REPO / "CONTRIBUTING.md"], ids=lambda p: p.name)
def test_relative_links_of_the_repository_pages_point_at_files(page):
    text = read(page)
    broken = []
    for url in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^([a-z][a-z0-9+.-]*:|#)", url):
            continue
        path, _, anchor = url.partition("#")
        target = (page.parent / path).resolve()
        if not target.exists():
            broken.append(url)
        elif anchor and target.suffix == ".md" and anchor not in heading_slugs(read(target)):
            broken.append(url)
    assert broken == []


def heading_slugs(text: str) -> set[str]:
    from markdown.extensions.toc import slugify

    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return {slugify(re.sub(r"[`*]", "", heading), "-") for heading in re.findall(r"^#+ (.+)$", prose, re.M)}


# ---------------------------------------------------------------------------------------------------------------------
# What the pages name


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_cli_flag_the_page_names_exists(page):
    assert unknown_flags(read(page)) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_config_field_and_recipe_key_the_page_names_exists(page):
    assert unknown_config_names(read(page)) == []


def test_the_checks_catch_an_invented_flag_or_field():
    # What the two tests above run on every page, on text that names things that do not exist.
    page = """
```bash
trl-agentic train --config recipes/calculator/tiny/config_cpu.yaml --learning_rate 1e-5 --lerning_rate 1e-5
trl-agentic eval --task calculator --num-samples 4 --learning_rate 1e-5
trl-agentic demo --seed 1 --fast-mode
trl-agentic jobs submit --config r.yaml --dry-run -- --max_steps 5 --max_stepz 5
accelerate launch --config_file zero2.yaml -m trl_agentic.scripts.train --config r.yaml --gradient_acumulation 2
```

Also `trl-agentic serve --model tiny:qwen2_5 --prot 8000`, and `--threads` but `--thread`.

```python
args = AgenticGRPOConfig(output_dir="out", max_turns=4, max_turnz=4)
```

```yaml
task: calculator
alarm_windw: 5
```

In a recipe, `task_sampling: adaptive` and `task_sampler: adaptive`; `AgenticGRPOConfig.max_staleness`,
`AgenticGRPOConfig.max_stalenes`.
"""
    assert unknown_flags(page) == [
        "trl-agentic train: --lerning_rate",
        "trl-agentic eval: --learning_rate",  # eval reads a recipe's keys from --config, not as flags
        "trl-agentic demo: --fast-mode",
        "trl-agentic jobs: --max_stepz",
        "trl-agentic train: --gradient_acumulation",
        "trl-agentic serve: --prot",
        "(any command): --thread",
    ]
    assert unknown_config_names(page) == [
        "AgenticGRPOConfig(max_turnz=...)",
        "recipe key alarm_windw:",
        "recipe key task_sampler:",
        "AgenticGRPOConfig.max_stalenes",
    ]


def config_reference() -> dict[str, str]:
    """field -> default as written, from the tables of docs/config.md (`| `field` | `default` | ... |`)."""
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", read(DOCS / "config.md"), re.M)
    return dict(rows)


def test_the_config_reference_lists_every_field_with_its_default():
    reference = config_reference()
    assert [name for name in OWN_CONFIG_FIELDS if name not in reference] == []
    assert [name for name in reference if name not in CONFIG_FIELDS] == []
    fields = {f.name: f for f in dataclasses.fields(AgenticGRPOConfig) if f.name in reference}
    defaults = {
        name: f.default_factory() if f.default is dataclasses.MISSING else f.default for name, f in fields.items()
    }
    wrong = {
        name: (reference[name], default)
        for name, default in defaults.items()
        if ast.literal_eval(reference[name]) != default
    }
    assert wrong == {}


# ---------------------------------------------------------------------------------------------------------------------
# README


def readme_example() -> str:
    """The Python block of README's "Train your own agent" section."""
    section = read(REPO / "README.md").split("## Train your own agent", 1)[1].split("\n## ", 1)[0]
    (body,) = [body for language, body in code_blocks(section) if language == "python"]
    return body


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_readme_example_trains_as_written_on_cpu(tmp_path):
    script = tmp_path / "train_my_agent.py"
    script.write_text(readme_example())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert re.search(r"step 2/2 +reward", done.stdout + done.stderr)  # the trainer's line per step
    log = (tmp_path / "outputs" / "convert" / "episodes" / "episodes-rank0.jsonl").read_text().splitlines()
    episodes = [json.loads(line)["episode"] for line in log]
    assert len(episodes) == 2 * 4  # 2 steps x 1 task x 4 episodes, each of which called the policy
    assert all(episode["turns"] for episode in episodes)


@pytest.mark.slow
def test_your_own_task_page_evaluates_as_written(tmp_path):
    # docs/your_task.md: the `my_task.py` it shows, run with the `trl-agentic eval` line it shows, from its folder.
    page = read(DOCS / "your_task.md")
    (module,) = [body for language, body in code_blocks(page) if language == "python" and "TASK = TaskSuite(" in body]
    (tmp_path / "my_task.py").write_text(module)
    lines = [line for _, body in code_blocks(page) for line in body.splitlines()]
    (command,) = [line for line in lines if line.startswith("trl-agentic eval --task my_task:TASK")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "trl_agentic.cli", *shlex.split(command)[1:], "--no-progress"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert summary["episodes"] == 4 * 2 and summary["status"]["agent_error"] == 0


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_your_own_task_page_runs_the_cpu_pipeline_as_written(tmp_path):
    # Issue 40: the page's TaskSuite had no demonstrations, so `trl-agentic demo --task` stopped at once; its --smoke
    # line, as written, runs every stage, and says that what falls short at toy sizes is expected.
    page = read(DOCS / "your_task.md")
    (module,) = [body for language, body in code_blocks(page) if language == "python" and "TASK = TaskSuite(" in body]
    (tmp_path / "my_task.py").write_text(module)
    lines = [line.split("  #")[0] for _, body in code_blocks(page) for line in body.splitlines()]
    (command,) = [line for line in lines if line.startswith("trl-agentic demo --task my_task.py:TASK --smoke")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "trl_agentic.cli", *shlex.split(command)[1:], "--cache-dir", str(tmp_path / "cache")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[5/5] Results" in done.stdout and "expected" in done.stdout
    notes = [line for line in done.stdout.splitlines() if line.strip().startswith("note:")]
    assert all("(expected with --smoke" in note for note in notes), notes
    summary = json.loads((tmp_path / "outputs" / "convert-smoke" / "summary.json").read_text())
    assert summary["task"] == "convert" and summary["smoke"] is True


def test_readme_stays_short():
    assert len(read(REPO / "README.md").splitlines()) <= 210
