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
    wrong_order_calls,
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


def _calls(demonstration):
    return [
        (m["tool_calls"][0]["function"]["name"], m["tool_calls"][0]["function"]["arguments"], m["tool_calls"][0]["id"])
        for m in demonstration["messages"]
        if m.get("tool_calls")
    ]


def test_the_wrong_order_evaluates_the_other_operation_first_with_its_results_copied_right():
    assert wrong_order_calls("7 + 3 * 12") == [("add", 7, 3, 10), ("multiply", 10, 12, 120)]
    assert wrong_order_calls("7 * 3 + 12") == [("add", 3, 12, 15), ("multiply", 7, 15, 105)]
    assert wrong_order_calls("(7 + 3) * 12") == [("multiply", 3, 12, 36), ("add", 7, 36, 43)]
    assert wrong_order_calls("7 * (3 + 12)") == [("multiply", 7, 3, 21), ("add", 21, 12, 33)]
    for row in build_precedence_dataset("train", 100, seed=3):
        (right, _), (wrong, _) = reference_calls(row["expression"]), wrong_order_calls(row["expression"])
        assert right[0] != wrong[0] and not finishable(row["expression"], wrong[:3])
        assert wrong_order_calls(row["expression"])[-1][-1] != row["answer"]  # decisive: the mistake never wins


def test_decision_noise_makes_the_first_operation_wrong_at_its_rate_and_keeps_the_mechanics_right():
    clean = precedence_demonstrations(20, seed=0)
    assert precedence_demonstrations(20, seed=0, decision_noise=0.0) == clean  # noise 0: unchanged
    noisy = precedence_demonstrations(20, seed=0, decision_noise=0.5)
    # The same questions, system prompt and tools; only the order of some demonstrations' calls differs.
    assert [d["messages"][:2] for d in noisy] == [d["messages"][:2] for d in clean]
    assert all(d["tools"] == AGENT.tool_schemas for d in noisy)
    wrong = [int(_calls(n)[0][0] != _calls(c)[0][0]) for n, c in zip(noisy, clean, strict=True)]
    assert wrong == [0, 1, 0, 1, 1, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0]  # the stream of seed 0
    assert (
        sum(
            _calls(n)[0][0] != _calls(c)[0][0]
            for n, c in zip(
                precedence_demonstrations(400, seed=0, decision_noise=0.5), precedence_demonstrations(400), strict=True
            )
        )
        == 214
    )  # 53.5% of 400
    for demonstration, is_wrong in zip(noisy, wrong, strict=True):
        messages = demonstration["messages"]
        expression = messages[1]["content"].removeprefix("What is ").removesuffix("?")
        expected = (wrong_order_calls if is_wrong else reference_calls)(expression)
        assert [m["role"] for m in messages] == [
            "system",
            "user",
            "assistant",
            "tool",
            "assistant",
            "tool",
            "assistant",
        ]
        # Well-formed calls with the operands and results copied right, and the last result as the answer.
        assert _calls(demonstration) == [
            (tool, {"a": a, "b": b}, f"call_{i}") for i, (tool, a, b, _) in enumerate(expected)
        ]
        assert [m["content"] for m in messages if m["role"] == "tool"] == [str(r) for *_, r in expected]
        assert [m["name"] for m in messages if m["role"] == "tool"] == [t for t, *_ in expected]
        assert messages[-1]["content"] == f"The answer is {expected[-1][-1]}."
        episode = Episode(id="d", status="ok", result=messages[-1]["content"])
        assert calculator_correct([None], [messages[2:]], [eval(expression)], episodes=[episode]) == [1.0 - is_wrong]
    everything_wrong = precedence_demonstrations(5, seed=1, decision_noise=1.0)
    assert [_calls(d)[0][0] for d in everything_wrong] == [
        wrong_order_calls(d["messages"][1]["content"].removeprefix("What is ").removesuffix("?"))[0][0]
        for d in everything_wrong
    ]
    with pytest.raises(ValueError, match=r"decision_noise must be a probability in \[0, 1\], got 1.5"):
        precedence_demonstrations(2, decision_noise=1.5)
