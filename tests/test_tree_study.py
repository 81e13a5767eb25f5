"""benchmarks/tree_study.py's accounting: sampled tokens per step (a branch's replayed turns not counted), the success
vs sampled tokens curve, the tokens the tree arm needs to reach a success and the success at equal tokens."""

import gzip
import importlib.util
import json
from pathlib import Path

import pytest


STUDY = Path(__file__).resolve().parents[1] / "benchmarks" / "tree_study.py"


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("tree_study", STUDY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(step, turns, mode="train"):
    return {"step": step, "mode": mode, "episode": {"turns": turns}}


def _turn(n, replayed=False):
    return {"completion_ids": list(range(n)), "replayed": replayed}


@pytest.mark.parametrize("compressed", [False, True])
def test_sampled_tokens_leave_out_replayed_turns_and_other_modes(study, tmp_path, compressed):
    records = [
        _record(0, [_turn(5), _turn(7), _turn(3)]),  # a root: 15 sampled
        _record(0, [_turn(5, replayed=True), _turn(6), _turn(2)]),  # its branch at call 1: 8 sampled
        _record(1, [_turn(4), _turn(4)]),
        _record(1, [_turn(4, True), _turn(4, True), _turn(9)]),  # a branch at call 2: 9 sampled
        _record(1, [_turn(50)], mode="eval"),  # not training
        {"step": 2, "mode": "train", "episode": {"turns": [{"completion_ids": [1, 2, 3]}]}},  # no `replayed` key
    ]
    path = tmp_path / ("episodes-rank0.jsonl.gz" if compressed else "episodes-rank0.jsonl")
    text = "".join(json.dumps(r) + "\n" for r in records)
    if compressed:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    assert study.sampled_tokens_by_step(path) == {0: 23, 1: 17, 2: 3}


def test_curve_counts_the_tokens_of_the_steps_before_each_evaluation(study):
    # The log numbers steps from 0: held-out success after 2 updates follows the episodes of steps 0 and 1.
    points = study.curve({0: 0.2, 2: 0.4, 4: 0.5}, {0: 100, 1: 100, 2: 50, 3: 50})
    assert points == [(0, 0, 0.2), (2, 200, 0.4), (4, 300, 0.5)]
    assert study.interpolate(points, 100) == pytest.approx(0.3)
    assert study.interpolate(points, 250) == pytest.approx(0.45)
    assert study.interpolate(points, 300) == 0.5
    assert study.interpolate(points, 301) is None
    assert study.tokens_to_reach(points, 0.4) == 200
    assert study.tokens_to_reach(points, 0.45) == 300
    assert study.tokens_to_reach(points, 0.6) is None


def test_the_seed_line_compares_the_arms_at_the_flat_final_success_and_at_equal_tokens(study):
    flat = {"seed": 0, "curve": [[0, 0, 0.2], [10, 1000, 0.3], [20, 2000, 0.5]]}
    tree = {"seed": 0, "curve": [[0, 0, 0.2], [10, 600, 0.5], [20, 1200, 0.6]]}
    line = study.seed_line(flat, tree)
    # Tree reaches 50% at 600 tokens (0.30 of 2,000); at 1,200 tokens flat interpolates to 34%, tree has 60%.
    assert line.split() == ["0", "20.0%", "50.0%", "2,000", "60.0%", "1,200", "600", "0.30", "1,200", "34.0%",
                            "60.0%", "meets"]  # fmt: skip
    slow = {"seed": 0, "curve": [[0, 0, 0.2], [10, 1900, 0.3], [20, 3800, 0.4]]}
    assert study.seed_line(flat, slow).split()[-1] == "misses"
    assert "missing: tree" in study.seed_line(flat, None)
    fell = {"seed": 0, "curve": [[0, 0, 0.2], [10, 1000, 0.0]]}
    assert study.seed_line(fell, tree).endswith("n/a (the flat arm did not gain: no level to reach)")
    # With the held-out size known: 20% -> 50% on 200 episodes is beyond two standard errors (2 x 0.0458 = 9.2%)...
    assert study.two_standard_errors(0.2, 0.5, 200) == pytest.approx(2 * ((0.16 + 0.25) / 200) ** 0.5)
    sized = {**flat, "settings": {"eval_size": 200}}
    assert study.seed_line(sized, tree).split()[-1] == "meets"
    # ...20% -> 25% on 200 is not (8.3%): the flat arm's gain is noise, there is no level to reach.
    small = {"seed": 0, "curve": [[0, 0, 0.2], [10, 1000, 0.25]], "settings": {"eval_size": 200}}
    assert study.seed_line(small, tree).endswith(
        "n/a (the flat arm's gain, +5.0%, is within two standard errors, 8.3%, of 200 episodes)"
    )
    # At equal tokens a lead within two standard errors is not a win: 34% vs 40% at 1,200 tokens on 200 episodes.
    level = {"seed": 0, "curve": [[0, 0, 0.2], [10, 600, 0.25], [20, 1200, 0.40]]}
    assert study.seed_line(sized, level).split()[-1] == "misses"
    # "Beats it at equal tokens" is judged at the flat arm's budget: a tree run that stopped at 0.6x of it and leads a
    # flat run still mid-way there (40% vs 34% at 1,200 tokens) has not beaten the flat run, only been ahead of it.
    assert study.seed_line(flat, level).split()[-1] == "misses"
    # Run to (about) the flat arm's budget, a lead counts: 55% vs 48% at 1,900 of 2,000 tokens (without the size: any
    # lead; 5% short of the budget is close enough, the fifth study's tree arm spent 0.96-0.97x).
    longer = {"seed": 0, "curve": [[0, 0, 0.2], [10, 950, 0.25], [20, 1900, 0.55]]}
    assert study.seed_line(flat, longer).split()[-4:] == ["1,900", "48.0%", "55.0%", "meets"]
    shorter = {"seed": 0, "curve": [[0, 0, 0.2], [10, 900, 0.25], [20, 1800, 0.55]]}
    assert study.seed_line(flat, shorter).split()[-1] == "misses"


def test_the_decision_breakdown_counts_the_first_operation_and_success_given_it(study):
    from trl_agentic.trace import Episode, Turn

    def episode(*tools):
        calls = [{"function": {"name": name, "arguments": {"a": 1, "b": 2}}} for name in tools]
        turns = [Turn(i, [1], [2], [-0.5], "stop", response_message={"tool_calls": [c]}) for i, c in enumerate(calls)]
        return Episode(str(tools), status="ok", turns=turns + [Turn(len(calls), [1], [2], [-0.5], "stop")])

    tasks = [{"expression": e} for e in ("7 + 3 * 4", "(7 + 3) * 4", "7 * 3 + 4", "7 * (3 + 4)", "3 + 4 * 5")]
    episodes = [
        episode("multiply", "add"),  # right, won
        episode("add", "multiply"),  # right, copied wrong
        episode("add", "multiply"),  # the precedence mistake
        episode(),  # no call
        episode("multiply", "add"),  # right, unscorable
    ]
    result = study.decision_breakdown(tasks, episodes, [1.0, 0.0, 0.0, 0.0, None])
    assert result == {"first_op_right": 3 / 5, "success": 1 / 5, "success_given_right": 1 / 3}
    # precedence_lookup: the look-ups (`read`) come first; the first operation after them is the decision
    looked_up = [
        episode(
            "read",
            "read",
            "read",
            *[c["function"]["name"] for t in e.turns[:-1] for c in t.response_message["tool_calls"]],
        )
        for e in episodes
    ]
    assert study.decision_breakdown(tasks, looked_up, [1.0, 0.0, 0.0, 0.0, None]) == result
    assert study.decision_breakdown(tasks[:1], [episode("read", "add", "multiply")], [0.0])["first_op_right"] == 0.0


def test_the_study_suites_take_the_decision_noise_and_an_unknown_one_is_refused(study):
    from trl_agentic.tasks.precedence_lookup import PRECEDENCE_LOOKUP, precedence_lookup_demonstrations

    suite = study.study_suite(0.5, "precedence_lookup")
    assert (suite.name, suite.agent_columns, suite.tools) == (
        "precedence_lookup",
        PRECEDENCE_LOOKUP.agent_columns,
        PRECEDENCE_LOOKUP.tools,
    )
    assert suite.demonstrations(6, seed=0) == precedence_lookup_demonstrations(6, seed=0, decision_noise=0.5)
    assert study.study_suite(0.5).name == "precedence"
    assert study.SUITE_SETTINGS["precedence_lookup"]["max_turns"] > 6  # six model calls fit the episode limit
    with pytest.raises(ValueError, match="--suite must be one of"):
        study.study_suite(0.5, "calculator")


def test_the_plan_suite_fits_its_plan_call_in_one_completion(study):
    """The plan call is ~90 sampled tokens with the study's tokenizer: the suite's per-call completion limit must hold it
    (48, the other suites', would cut every plan off)."""
    from trl_agentic.tasks.precedence_plan import MAX_ROUNDS, PRECEDENCE_PLAN, precedence_plan_demonstrations
    from trl_agentic.tiny_models import build_tiny_tokenizer

    suite = study.study_suite(0.5, "precedence_plan")
    assert suite.demonstrations(4, seed=1) == precedence_plan_demonstrations(4, seed=1, decision_noise=0.5)
    assert (suite.name, suite.tools) == ("precedence_plan", PRECEDENCE_PLAN.tools)
    tokenizer = build_tiny_tokenizer("qwen2_5")
    messages, tools = suite.demonstrations(1, seed=0)[0]["messages"], PRECEDENCE_PLAN.tools
    before = tokenizer.apply_chat_template(messages[:2], tools=tools, add_generation_prompt=True, tokenize=False)
    after = tokenizer.apply_chat_template(messages[:3], tools=tools, tokenize=False)
    plan_tokens = len(tokenizer(after.removeprefix(before))["input_ids"])
    settings = study.SUITE_SETTINGS["precedence_plan"]
    assert 60 < plan_tokens < settings["max_completion_length"] and settings["max_turns"] > MAX_ROUNDS


def test_the_report_can_take_the_flat_runs_from_another_folder(study, tmp_path, capsys):
    ours, other = tmp_path / "ours", tmp_path / "other"
    for folder, arm, final in ((ours, "flat", 0.3), (ours, "tree", 0.5), (other, "flat", 0.6)):
        folder.mkdir(exist_ok=True)
        record = {"seed": 0, "arm": arm, "curve": [[0, 0, 0.2], [10, 1000, final]], "train_seconds": 60.0}
        (folder / f"{arm}-seed0.json").write_text(json.dumps(record))
    assert study.load_records(ours, [0])[("flat", 0)]["curve"][-1][2] == 0.3
    records = study.load_records(ours, [0], flat_dir=other)  # ours' tree runs against the other folder's flat runs
    assert [records[(arm, 0)]["curve"][-1][2] for arm in ("flat", "tree")] == [0.6, 0.5]
    assert study.main(["--report-only", "--seeds", "0", "--output-dir", str(ours), "--flat-from", str(other)]) == 0
    seed_row = capsys.readouterr().out.splitlines()[2].split()
    assert seed_row[:5] == ["0", "20.0%", "60.0%", "1,000", "50.0%"] and seed_row[-1] == "misses"


def test_grpo_tasks_leave_out_the_warm_starts_questions_not_the_run_seeds(study):
    """With one warm start for every seed (`--warm-start-seed 0`), a run of seed 1 must leave out the questions seed 0's
    demonstrations trained the model on. Until the seventh study it left out seed 1's: 93% of its training questions
    were ones the warm start had been trained on, none of seed 0's were."""
    import dataclasses

    from trl_agentic import pipeline
    from trl_agentic.pipeline.data import question_of, warm_start_demonstrations

    suite = study.study_suite(0.5, "precedence_plan")
    base = {**study.STUDY_SETTINGS, **study.SUITE_SETTINGS["precedence_plan"], "num_demonstrations": 300}
    settings = pipeline.PipelineConfig(seed=1, **{**base, "train_size": 400})
    demonstrated = {
        seed: {
            question_of(d["messages"])
            for d in warm_start_demonstrations(suite, dataclasses.replace(settings, seed=seed))
        }
        for seed in (0, 1)
    }
    questions = {
        kind: [question_of(p) for p in study.study_tasks(suite, settings, 0, kind)["prompt"]]
        for kind in ("unseen", "all")
    }
    assert questions["unseen"] and not set(questions["unseen"]) & demonstrated[0]
    assert set(questions["unseen"]) & demonstrated[1]  # the run seed's own demonstrations are not the model's
    assert set(questions["unseen"]) < set(questions["all"])
    assert len(questions["all"]) == 400 and set(questions["all"]) & demonstrated[0]
    with pytest.raises(ValueError, match="--grpo-questions must be one of"):
        study.study_tasks(suite, settings, 0, "seen")
