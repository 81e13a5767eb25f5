"""The order-of-operations task (issue 42's learning study): its tools, reference solver, checker and splits."""

import pytest

from trl_agentic.tasks.calculator import calculator_correct
from trl_agentic.tasks.precedence import (
    AGENT,
    MAX_ROUNDS,
    PRECEDENCE,
    SHAPES,
    add,
    build_precedence_dataset,
    decisive,
    finishable,
    multiply,
    precedence_demonstrations,
    reference_calls,
)
from trl_agentic.tasks.splits import split_of
from trl_agentic.trace import Episode


def test_tools_compute_on_integers_and_tell_the_model_what_was_wrong():
    assert [add(2, 3), multiply(4, 5), add("7", 8.0), multiply(-3, 6)] == ["5", "20", "15", "-18"]
    with pytest.raises(ValueError, match="a must be an integer, got 'x'"):
        add("x", 1)
    with pytest.raises(ValueError, match="b must be an integer"):
        multiply(2, 2.5)
    with pytest.raises(ValueError, match="a must be an integer"):
        add(True, 1)


def test_the_reference_solver_evaluates_each_shape_in_arithmetic_order():
    assert reference_calls("7 + 3 * 12") == [("multiply", 3, 12, 36), ("add", 7, 36, 43)]
    assert reference_calls("7 * 3 + 12") == [("multiply", 7, 3, 21), ("add", 21, 12, 33)]
    assert reference_calls("(7 + 3) * 12") == [("add", 7, 3, 10), ("multiply", 10, 12, 120)]
    assert reference_calls("7 * (3 + 12)") == [("add", 3, 12, 15), ("multiply", 7, 15, 105)]
    for row in build_precedence_dataset("train", 200, seed=3):
        assert reference_calls(row["expression"])[-1][-1] == eval(row["expression"]) == row["answer"]
    with pytest.raises(ValueError, match="is not one of the shapes"):
        reference_calls("7 - 3 * 12")


def test_a_wrong_first_operation_leaves_the_end_unreachable():
    # The decision: the first call. After the reference's, one call finishes; after the precedence mistake, none.
    assert finishable("7 + 3 * 12", ("multiply", 3, 12))
    assert not finishable("7 + 3 * 12", ("add", 7, 3))
    assert not finishable("(7 + 3) * 12", ("multiply", 3, 12))
    assert not finishable("7 * (3 + 12)", ("multiply", 7, 3))
    assert not finishable("7 * 3 + 12", ("add", 3, 12))
    # Every question drawn is decisive: a first call with the wrong tool, on any two of its numbers, leaves no way to
    # the answer (questions where a number coincides with the first step's result are redrawn).
    rows = build_precedence_dataset("train", 300, seed=0)
    finishes, tried = 0, 0
    for row in rows:
        (tool, _, _, _), _ = reference_calls(row["expression"])
        numbers = [int(n) for n in row["expression"].replace("(", " ").replace(")", " ").split() if n.isdigit()]
        other = {"add": "multiply", "multiply": "add"}[tool]
        for x in numbers:
            for y in numbers:
                finishes += finishable(row["expression"], (other, x, y))
                tried += 1
    assert tried == 300 * 9
    assert finishes == 0
    assert not decisive("19 * (11 + 8)") and decisive("7 + 3 * 12")
    assert MAX_ROUNDS == AGENT.max_rounds == 3  # two tool calls and the answer


def test_splits_share_no_expression_and_cover_the_four_shapes():
    train = build_precedence_dataset("train", 300, seed=0)
    evaluation = build_precedence_dataset("eval", 100, seed=0)
    assert not set(train["expression"]) & set(evaluation["expression"])
    assert {split_of(e) for e in train["expression"]} == {"train"}
    assert {split_of(e) for e in evaluation["expression"]} == {"eval"}
    shapes = {(e.startswith("("), "(" in e, e.index("*") < e.index("+")) for e in evaluation["expression"]}
    assert len(shapes) == len(SHAPES) == 4
    assert (
        build_precedence_dataset("eval", 5, seed=1)["expression"]
        == build_precedence_dataset("eval", 5, seed=1)["expression"]
    )
    with pytest.raises(ValueError, match="max_operand must be >= 4"):
        build_precedence_dataset("train", 2, max_operand=3)


def test_demonstrations_are_what_the_agent_sends_and_the_checker_scores_them_1():
    demonstrations = precedence_demonstrations(20, seed=0)
    assert all(
        split_of(d["messages"][1]["content"].removeprefix("What is ").removesuffix("?")) == "train"
        for d in demonstrations
    )
    first = demonstrations[0]
    assert first["tools"] == AGENT.tool_schemas == PRECEDENCE.tools
    assert [m["role"] for m in first["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    expression = first["messages"][1]["content"].removeprefix("What is ").removesuffix("?")
    calls = [m["tool_calls"][0]["function"] for m in first["messages"] if m.get("tool_calls")]
    assert [(c["name"], c["arguments"]["a"], c["arguments"]["b"]) for c in calls] == [
        (tool, a, b) for tool, a, b, _ in reference_calls(expression)
    ]
    answers = [eval(d["messages"][1]["content"].removeprefix("What is ").removesuffix("?")) for d in demonstrations]
    completions = [d["messages"][2:] for d in demonstrations]
    episodes = [
        Episode(id=str(i), status="ok", result=d["messages"][-1]["content"]) for i, d in enumerate(demonstrations)
    ]
    rewards = calculator_correct([None] * 20, completions, answers, episodes=episodes)
    assert rewards == [1.0] * 20
    # The precedence mistake's answer scores 0.
    wrong = [Episode(id="w", status="ok", result="The answer is 120.")]
    assert calculator_correct([None], [[]], [43], episodes=wrong) == [0.0]
