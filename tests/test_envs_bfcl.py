"""BFCL multi-turn entries as tasks (issue 45, item 3) with the real `bfcl-eval` package: its data, its executable
backends, its decoder and its multi-turn checker.

- One entry (multi_turn_base_12: cd, touch, echo, wc on BFCL's GorillaFileSystem) played through the real endpoint by
  a scripted engine that sends BFCL's ground-truth calls: the tool results the model reads are exactly those of the
  ground truth replayed on fresh backends (the demonstration), two concurrent episodes get the same ones (each has
  backends of its own: a shared file system would refuse the second `cd Documents`), and BFCL's checker scores the
  play 1.0; a wrong `echo` content, a skipped turn and a force-quit score 0.0.
- The episode is one token-exact row: the mask keeps every sampled token and nothing else.
- Splits by entry id (disjoint, stable), demonstrations from the training split only, the `bfcl:` task spec, the
  decoder's refusals (what BFCL would `eval`).
- 2 training steps of `AgenticGRPOTrainer` (slow).
"""

import json
import re

import pytest
import torch


pytest.importorskip(
    "bfcl_eval", reason="needs BFCL: pip install '.[bfcl]' && pip install --no-deps bfcl-eval==2026.3.23"
)

from conftest import ScriptedEngine  # noqa: E402
from test_agentic_grpo_trainer import config as grpo_config  # noqa: E402
from trl_agentic import AgenticGRPOTrainer
from trl_agentic.envs import from_bfcl
from trl_agentic.envs.bfcl import (
    _parse_call,
    check_entry,
    decode_step,
    multi_turn_utils,
    release_instances,
    split_of_entry,
)
from trl_agentic.evaluation import score_episodes
from trl_agentic.rollout.agents import resolve_agent
from trl_agentic.rollout.rows import episode_to_rows
from trl_agentic.rollout.runner import run_episodes, run_rollout
from trl_agentic.tasks import get_task
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


ENTRY = "multi_turn_base_12"
GROUND_TRUTH = [
    ["cd(folder='Documents')", "touch(file_name='summary.txt')"],
    ["echo(content='quantum computing',file_name='summary.txt')"],
    ["wc(file_name='summary.txt',mode='w')"],
]


@pytest.fixture(scope="module")
def suite():
    return from_bfcl("multi_turn_base", classes=("GorillaFileSystem",))


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer("qwen2_5")


def blocks(text):
    """The rendered conversation as (role, content) blocks; Qwen2.5 renders tool results as user blocks."""
    return re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", text, re.S)


def scripted_player(tokenizer, suite, plan=None):
    """Plays `plan` (default: the ground truth), one call per reply, then "Done." to end each user turn; the turn and
    step come from the rendered prompt (user questions so far, tool results since the last one)."""
    plan = GROUND_TRUTH if plan is None else plan

    def respond(prompt_ids):
        rendered = blocks(tokenizer.decode(prompt_ids))
        questions = [i for i, (role, content) in enumerate(rendered) if role == "user" and "<tool_response>" not in content]  # fmt: skip
        turn = len(questions) - 1
        step = sum(content.count("<tool_response>") for _, content in rendered[questions[-1] + 1 :])
        if step < len(plan[turn]):
            name, arguments = _parse_call(plan[turn][step], suite.entries[ENTRY])
            return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
        return "Done."

    return respond


def play(start_server, tokenizer, suite, plan=None, copies=1, **settings):
    engine = ScriptedEngine(tokenizer, scripted_player(tokenizer, suite, plan), max_context_length=32768)
    endpoint = start_server(engine, tokenizer, **settings)
    row = next(r for r in suite.build_dataset("train", size=len(suite.split_ids["train"])) if r["bfcl_id"] == ENTRY)
    rows = [row] * copies
    tasks = [{column: r[column] for column in suite.agent_columns} for r in rows]
    episodes = run_rollout(run_episodes(endpoint, resolve_agent(suite.agent), tasks, timeout=120))
    rewards, _, _ = score_episodes(suite.reward_funcs, rows, episodes)
    return episodes, rewards, engine


def tool_results(text):
    return re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)


def test_the_ground_truth_played_over_the_endpoint_executes_in_isolated_backends_and_scores_1(
    start_server, tokenizer, suite
):
    assert split_of_entry(ENTRY, 0.2) == "train"
    episodes, rewards, engine = play(start_server, tokenizer, suite, copies=2)
    assert [e.status for e in episodes] == ["ok", "ok"] and rewards == [1.0, 1.0]
    # What BFCL's backends returned, as the model read it: the ground truth replayed on fresh backends gives the same.
    (demonstration,) = [d for d in suite.demonstrations(len(suite.split_ids["train"])) if d["messages"][0]["content"] == suite.entries[ENTRY]["question"][0][0]["content"]][:1]  # fmt: skip
    expected = [m["content"] for m in demonstration["messages"] if m["role"] == "tool"]
    assert len(expected) == 4 and expected[0] == '{"current_working_directory": "Documents"}'
    assert json.loads(expected[3]) == {"count": 2, "type": "words"}
    last_prompts = [p for p in engine.prompts if len(tool_results(tokenizer.decode(p))) == 4]
    assert len(last_prompts) == 2  # each episode's closing call, after its 4 tool results
    for prompt in last_prompts:
        assert tool_results(tokenizer.decode(prompt)) == expected  # a shared file system would refuse the 2nd `cd`
    for episode in episodes:
        assert episode.result["turns"] == [
            [[{"cd": '{"folder": "Documents"}'}], [{"touch": '{"file_name": "summary.txt"}'}], "Done."],
            [[{"echo": '{"content": "quantum computing", "file_name": "summary.txt"}'}], "Done."],
            [[{"wc": '{"file_name": "summary.txt", "mode": "w"}'}], "Done."],
        ]
        assert episode.result["force_quit"] is False
        # User turns arrived in order, each after the model ended the previous one ("Done.")
        assert len(episode.turns) == 7
    # The episodes' and the checker's backend instances were released.
    assert not [key for key in vars(multi_turn_utils) if key.startswith("trl_agentic_")]


def test_an_episode_is_one_token_exact_row(start_server, tokenizer, suite):
    (episode,), _, _ = play(start_server, tokenizer, suite)
    turns = episode.turns
    (row,) = episode_to_rows(turns).rows
    assert row.prompt_ids == turns[0].prompt_ids
    assert row.prompt_ids + row.completion_ids == turns[-1].prompt_ids + turns[-1].completion_ids
    sampled = [(tok, lp) for t in turns for tok, lp in zip(t.completion_ids, t.logprobs, strict=True)]
    assert [
        (tok, lp) for tok, m, lp in zip(row.completion_ids, row.env_mask, row.logprobs, strict=True) if m
    ] == sampled
    masked = tokenizer.decode([tok for tok, m in zip(row.completion_ids, row.env_mask, strict=True) if not m])
    assert "quantum computing" in masked and suite.entries[ENTRY]["question"][2][0]["content"] in masked


@pytest.mark.parametrize(
    "plan, error_type",
    [
        # The file gets other content: BFCL's state check fails at turn 1.
        (
            [GROUND_TRUTH[0], ["echo(content='classical computing',file_name='summary.txt')"], GROUND_TRUTH[2]],
            "multi_turn:instance_state_mismatch",
        ),  # fmt: skip
        # Nothing done at turn 1: BFCL's empty-turn check.
        ([GROUND_TRUTH[0], [], GROUND_TRUTH[2]], "multi_turn:empty_turn_model_response"),
    ],
)
def test_a_wrong_play_scores_0_by_bfcls_checker(start_server, tokenizer, suite, plan, error_type):
    (episode,), rewards, _ = play(start_server, tokenizer, suite, plan=plan)
    assert episode.status == "ok" and rewards == [0.0]
    verdict = check_entry(suite.entries[ENTRY], GROUND_TRUTH, episode.result["turns"])
    assert verdict["valid"] is False and verdict["error_type"] == error_type


def test_a_force_quit_fails_the_entry_and_an_endpoint_limit_is_not_scored(start_server, tokenizer, suite):
    # 25 `pwd` calls in turn 0: past BFCL's 20-step limit the entry is force-quit (fewer turns than the ground truth).
    loop = [["pwd()"] * 25, [], []]
    (episode,), rewards, _ = play(start_server, tokenizer, suite, plan=loop)
    assert episode.result["force_quit"] is True and len(episode.result["turns"]) == 1 and rewards == [0.0]
    assert len(episode.result["turns"][0]) == 21
    # The endpoint refuses the 3rd model call: the episode failed, not the policy: no score.
    from trl_agentic.endpoint.sessions import EpisodeLimits

    (episode,), rewards, _ = play(start_server, tokenizer, suite, default_limits=EpisodeLimits(max_turns=2))
    assert episode.status == "limit_exceeded" and rewards == [None]
    assert not [key for key in vars(multi_turn_utils) if key.startswith("trl_agentic_")]


def test_checker_on_the_ground_truth_and_on_wrong_calls():
    suite = from_bfcl("multi_turn_base", classes=("GorillaFileSystem",))
    entry = suite.entries[ENTRY]
    as_steps = [[[{name: json.dumps(args)}] for name, args in (_parse_call(c, entry) for c in turn)] for turn in GROUND_TRUTH]  # fmt: skip
    assert check_entry(entry, GROUND_TRUTH, as_steps) == {"valid": True}
    wrong = [as_steps[0], [[{"echo": json.dumps({"content": "x", "file_name": "summary.txt"})}]], as_steps[2]]
    assert check_entry(entry, GROUND_TRUTH, wrong)["valid"] is False
    assert check_entry(entry, GROUND_TRUTH, as_steps[:2])["error_type"] == "multi_turn:force_terminated"
    release_instances("unused")  # a no-op for a name never used


def test_splits_are_by_entry_id_and_demonstrations_come_from_the_training_split():
    suite = from_bfcl("multi_turn_base")
    train, held_out = set(suite.split_ids["train"]), set(suite.split_ids["eval"])
    assert len(train) + len(held_out) == 200 and not train & held_out and len(held_out) == 48
    assert set(suite.build_dataset("eval", size=500, seed=3)["bfcl_id"]) == held_out  # every pass: each entry once
    assert set(suite.build_dataset("train", size=64, seed=1)["bfcl_id"]) <= train
    eval_rows = suite.build_dataset("eval", size=48, seed=0)
    assert sorted(eval_rows["bfcl_id"]) == sorted(held_out)
    assert eval_rows["bfcl_id"] != suite.build_dataset("eval", size=48, seed=1)["bfcl_id"]  # shuffled by seed
    first_questions = {suite.entries[i]["question"][0][0]["content"]: i for i in suite.entries}
    for demonstration in suite.demonstrations(20, seed=0):
        assert first_questions[demonstration["messages"][0]["content"]] in train
        calls = [c for m in demonstration["messages"] for c in m.get("tool_calls") or []]
        assert calls and all(isinstance(c["function"]["arguments"], dict) for c in calls)
    # The checker's data never reaches the agent: its columns are the first question and the entry id.
    assert suite.agent_columns == ("prompt", "bfcl_id") and "ground_truth" not in json.dumps(suite.entries[ENTRY])


def test_the_bfcl_task_spec_and_its_errors():
    suite = get_task("bfcl:multi_turn_base?classes=GorillaFileSystem&schemas=compact&eval_fraction=0.5")
    assert suite.name == "bfcl-multi_turn_base-GorillaFileSystem" and len(suite.entries) == 13
    (tool, *_) = suite.agent.tools[ENTRY]
    assert set(tool["function"]) == {"name", "description", "parameters"}
    assert "description" not in json.dumps(tool["function"]["parameters"])
    full = from_bfcl("multi_turn_base", classes=("GorillaFileSystem",)).agent.tools[ENTRY]
    assert full[0]["function"]["description"].endswith("Note that the provided function is in Python 3 syntax.")
    with pytest.raises(ValueError, match="not a multi-turn category"):
        get_task("bfcl:simple_python")
    with pytest.raises(ValueError, match="Unknown option"):
        get_task("bfcl:multi_turn_base?class=GorillaFileSystem")
    with pytest.raises(ValueError, match="Unknown BFCL backends"):
        get_task("bfcl:multi_turn_base?classes=FileSystem")
    with pytest.raises(ValueError, match="warm-start on 'bfcl:multi_turn_base'"):
        get_task("bfcl:multi_turn_miss_func?classes=GorillaFileSystem").demonstrations(2)


def test_the_decoder_refuses_what_bfcl_would_eval_as_code():
    methods = {"cd", "ls"}
    assert decode_step([{"cd": '{"folder": "a"}'}, {"ls": "{}"}], methods) == ["cd(folder='a')", "ls()"]
    assert decode_step([{"nope": "{}"}], methods) == ["nope()"]  # BFCL's executor: a NameError, as text
    for bad in (
        [{"__import__('os').system": '{"command": "true"}'}],
        [{"open": '{"file": "x", "mode": "w"}'}],  # a builtin
        [{"execute_multi_turn_func_call": "{}"}],  # the executor's own globals
        [{"cd": '{"folder=1)or(1": 2}'}],  # an argument name that is code
        [{"cd": "[1]"}],
        "Plain text.",
    ):
        with pytest.raises(ValueError):
            decode_step(bad, methods)


# --- training -------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_training_steps(tmp_path, tokenizer):
    suite = from_bfcl("multi_turn_base", classes=("GorillaFileSystem",), schemas="compact")  # shorter rows
    # Two episodes a step on ENTRY: the scripted policy plays the ground truth in one, a wrong echo in the other, so
    # each group's rewards differ (1.0, 0.0) and the parameters move.
    wrong = [GROUND_TRUTH[0], ["echo(content='classical computing',file_name='summary.txt')"], GROUND_TRUTH[2]]
    right_player, wrong_player = scripted_player(tokenizer, suite), scripted_player(tokenizer, suite, wrong)
    echoes = []  # the turn-1 call is asked once per episode: every other one is wrong

    def respond(prompt_ids):
        answer = right_player(prompt_ids)
        if answer.startswith("<tool_call>") and '"echo"' in answer:
            echoes.append(1)
            return answer if len(echoes) % 2 else wrong_player(prompt_ids)
        return answer

    model = build_tiny_model(tokenizer)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    row = next(r for r in suite.build_dataset("train", size=len(suite.split_ids["train"])) if r["bfcl_id"] == ENTRY)
    from datasets import Dataset

    config = grpo_config(
        tmp_path, max_completion_length=64, episode_timeout=120, agent_columns=list(suite.agent_columns), max_turns=12
    )
    trainer = AgenticGRPOTrainer(
        model,
        agent=suite.agent,
        reward_funcs=suite.reward_funcs,
        args=config,
        train_dataset=Dataset.from_list([row] * 2),
        processing_class=tokenizer,
        engine=ScriptedEngine(tokenizer, respond, max_context_length=32768),
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters()), "parameters did not change"
    records = [json.loads(line) for line in (tmp_path / "episodes" / "episodes-rank0.jsonl").open()]
    assert len(records) == 4 and all(r["episode"]["status"] == "ok" for r in records)
    for metrics in trainer.state.log_history[:2]:
        assert metrics["rewards/bfcl_multi_turn_accuracy/mean"] == 0.5


def test_trl_agentic_eval_reports_bfcls_accuracy(tmp_path, capsys):
    # The tiny model (random weights, real chat template) on 2 held-out entries, one episode each, greedy.
    from trl_agentic.scripts.eval import main

    output = tmp_path / "eval.json"
    spec = "bfcl:multi_turn_base?classes=GorillaFileSystem&schemas=compact&eval_fraction=0.5"
    argv = ["--task", spec, "--model", "tiny:qwen2_5:64x2", "--size", "2", "--num-samples", "1", "--temperature", "0"]
    assert main([*argv, "--max-tokens", "8", "--max-turns", "8", "--output", str(output), "--no-progress"]) == 0
    written = json.loads(output.read_text())
    assert written["episodes"] == 2 and set(written["scored_reward_funcs"]) == {"bfcl_multi_turn_accuracy"}
    assert written["bfcl"] == {
        "category": "multi_turn_base",
        "accuracy": written["success"],  # BFCL's: solved entries / entries, a failed episode counts as wrong
        "episodes": 2,
        "comparable_with_leaderboard": False,  # a subset, compact schemas
    }
    rewards = [reward for task in written["per_task"] for reward in task["rewards"]]
    assert written["success"] == sum(r == 1.0 for r in rewards) / 2


def test_miss_func_offers_the_held_out_functions_at_their_turn(start_server, tokenizer):
    # multi_turn_miss_func_3: `find` and `ls` are held out until turn 1, which has no user message of its own: BFCL
    # adds them to the tools and asks with its prompt for additional functions.
    from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC

    suite = from_bfcl("multi_turn_miss_func", classes=("GorillaFileSystem",), eval_fraction=0.5)
    entry_id = "multi_turn_miss_func_3"
    engine = ScriptedEngine(tokenizer, lambda prompt_ids: "Done.", max_context_length=32768)
    endpoint = start_server(engine, tokenizer)
    row = next(r for r in suite.build_dataset("all", size=len(suite.entries)) if r["bfcl_id"] == entry_id)
    tasks = [{column: row[column] for column in suite.agent_columns}]
    (episode,) = run_rollout(run_episodes(endpoint, resolve_agent(suite.agent), tasks, timeout=120))
    assert episode.status == "ok" and episode.result["turns"] == [["Done."]] * 3
    first, second, third = (tokenizer.decode(p) for p in engine.prompts)
    for name in ("find", "ls"):
        assert f'"name": "{name}"' not in first and f'"name": "{name}"' in second and f'"name": "{name}"' in third
    assert DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC not in first and DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC in second  # fmt: skip
    assert score_episodes(suite.reward_funcs, [row], [episode])[0] == [0.0]


def test_every_demonstration_of_a_category_is_a_play_bfcls_checker_accepts():
    # The ground truth of all 200 multi_turn_base entries (positional arguments named, one call per message), read
    # back from the demonstrations as the agent would have sent the calls: BFCL's checker says valid for each.
    suite = from_bfcl("multi_turn_base")
    from trl_agentic.envs.bfcl import _load_category, replay_ground_truth

    entries, ground_truth = _load_category("multi_turn_base")
    invalid = []
    for entry_id, entry in entries.items():
        turns = []
        for message in replay_ground_truth(entry, ground_truth[entry_id], [])["messages"]:
            if message["role"] == "user":
                turns.append([])
            elif message.get("tool_calls"):
                turns[-1].append([{c["function"]["name"]: json.dumps(c["function"]["arguments"])} for c in message["tool_calls"]])  # fmt: skip
        if not check_entry(entry, ground_truth[entry_id], turns)["valid"]:
            invalid.append(entry_id)
    assert len(suite.entries) == 200 and invalid == []
