"""Order of operations after look-ups (issue 42's second learning study): the decision is call 3, after three
deterministic `read` calls; tools, reference solver, splits, demonstrations with decision noise."""

import pytest

from trl_agentic.tasks.calculator import calculator_correct
from trl_agentic.tasks.precedence import finishable
from trl_agentic.tasks.precedence_lookup import (
    DECISION_CALL,
    MAX_ROUNDS,
    PRECEDENCE_LOOKUP,
    TOOL_SCHEMAS,
    build_precedence_lookup_dataset,
    precedence_lookup_demonstrations,
    reference_calls,
    task_tools,
    wrong_order_calls,
)
from trl_agentic.tasks.splits import split_of
from trl_agentic.trace import Episode


def test_read_answers_from_the_tasks_operands_and_tells_the_model_what_was_wrong():
    tools = task_tools("x + y * z", [7, 3, 12])
    # The expression as far as it is read: each look-up substitutes its letter; the last one is the numeric expression
    assert [tools["read"]("x"), tools["read"]("y"), tools["read"]("Z "), tools["multiply"](3, 12)] == [
        "7 + y * z",
        "7 + 3 * z",
        "7 + 3 * 12",
        "36",
    ]
    assert tools["read"]("x") == "7 + 3 * 12"  # read again: nothing new
    out_of_order = task_tools("(x + y) * z", [7, 3, 12])
    assert [out_of_order["read"]("z"), out_of_order["read"]("x")] == ["(x + y) * 12", "(7 + y) * 12"]
    assert task_tools("x + y * z", [7, 3, 12])["read"]("y") == "x + 3 * z"  # a fresh episode: a fresh state
    with pytest.raises(ValueError, match="unknown letter 'a'; the letters are x, y and z"):
        tools["read"]("a")
    with pytest.raises(ValueError):
        task_tools("x + y * z", [1, 2])  # three operands, one per letter
    with pytest.raises(ValueError, match="shape must name each of the letters"):
        task_tools("x + x * z", [1, 2, 3])
    assert [s["function"]["name"] for s in TOOL_SCHEMAS] == ["read", "add", "multiply"] == list(tools)
    assert PRECEDENCE_LOOKUP.tools == TOOL_SCHEMAS
    assert TOOL_SCHEMAS[0]["function"]["parameters"]["required"] == ["name"]


def test_the_reference_solver_reads_a_b_c_then_evaluates_in_arithmetic_order():
    reads = [
        ("read", {"name": "x"}, "7 + y * z"),
        ("read", {"name": "y"}, "7 + 3 * z"),
        ("read", {"name": "z"}, "7 + 3 * 12"),
    ]
    assert reference_calls("7 + 3 * 12") == reads + [
        ("multiply", {"a": 3, "b": 12}, 36),
        ("add", {"a": 7, "b": 36}, 43),
    ]
    parenthesised = [(t, a, r.replace("7 + ", "(7 + ").replace(" * ", ") * ")) for t, a, r in reads]
    assert reference_calls("(7 + 3) * 12") == parenthesised + [
        ("add", {"a": 7, "b": 3}, 10),
        ("multiply", {"a": 10, "b": 12}, 120),
    ]
    assert wrong_order_calls("7 + 3 * 12") == reads + [
        ("add", {"a": 7, "b": 3}, 10),
        ("multiply", {"a": 10, "b": 12}, 120),
    ]
    assert wrong_order_calls("7 * (3 + 12)")[3:] == [
        ("multiply", {"a": 7, "b": 3}, 21),
        ("add", {"a": 21, "b": 12}, 33),
    ]
    # Call 3 is the decision: after the reference's first operation one call finishes, after the other none does.
    assert DECISION_CALL == 3 and MAX_ROUNDS == 6  # three reads, two operations, the answer
    for row in build_precedence_lookup_dataset("train", 200, seed=3):
        right, wrong = reference_calls(row["expression"]), wrong_order_calls(row["expression"])
        assert right[:3] == wrong[:3] and right[2][2] == row["expression"]  # the last look-up: the numbers
        tools = task_tools(row["shape"], row["operands"])
        assert [tools["read"](letter) for letter in "xyz"] == [c[2] for c in right[:3]]
        assert right[-1][-1] == eval(row["expression"]) == row["answer"] != wrong[-1][-1]
        tool, arguments, _ = wrong[DECISION_CALL]
        assert tool != right[DECISION_CALL][0]
        assert not finishable(row["expression"], (tool, arguments["a"], arguments["b"]))


def test_questions_name_letters_and_splits_share_no_expression():
    train = build_precedence_lookup_dataset("train", 300, seed=0)
    evaluation = build_precedence_lookup_dataset("eval", 100, seed=0)
    assert not set(train["expression"]) & set(evaluation["expression"])
    assert {split_of(e) for e in evaluation["expression"]} == {"eval"}
    assert {row["prompt"][-1]["content"] for row in evaluation} == {
        "What is x + y * z?",
        "What is x * y + z?",
        "What is (x + y) * z?",
        "What is x * (y + z)?",
    }
    row = evaluation[0]
    assert (row["prompt"][-1]["content"], row["shape"], row["operands"], row["expression"], row["answer"]) == (
        "What is x * y + z?",
        "x * y + z",
        [4, 4, 4],
        "4 * 4 + 4",
        20,
    )
    assert PRECEDENCE_LOOKUP.agent_columns == (
        "prompt",
        "shape",
        "operands",
    )  # the expression and answer stay the checker's
    with pytest.raises(ValueError, match="max_operand must be >= 4"):
        build_precedence_lookup_dataset("train", 2, max_operand=3)


def _calls(demonstration):
    return [
        (m["tool_calls"][0]["function"]["name"], m["tool_calls"][0]["function"]["arguments"], m["tool_calls"][0]["id"])
        for m in demonstration["messages"]
        if m.get("tool_calls")
    ]


def test_demonstrations_read_then_operate_and_decision_noise_flips_the_order_only():
    clean = precedence_lookup_demonstrations(20, seed=0)
    assert precedence_lookup_demonstrations(20, seed=0, decision_noise=0.0) == clean
    noisy = precedence_lookup_demonstrations(20, seed=0, decision_noise=0.5)
    assert [d["messages"][:2] for d in noisy] == [d["messages"][:2] for d in clean]
    wrong = [int(_calls(n)[3][0] != _calls(c)[3][0]) for n, c in zip(noisy, clean, strict=True)]
    assert wrong == [0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1]  # the stream of seed 0
    many = zip(
        precedence_lookup_demonstrations(400, seed=0, decision_noise=0.5),
        precedence_lookup_demonstrations(400, seed=0),
        strict=True,
    )
    assert sum(_calls(n)[3][0] != _calls(c)[3][0] for n, c in many) == 191  # 47.8% of 400
    train = build_precedence_lookup_dataset("train", 20, seed=0)
    for demonstration, is_wrong, row in zip(noisy, wrong, train, strict=True):
        messages = demonstration["messages"]
        assert demonstration["tools"] == TOOL_SCHEMAS and messages[:2] == row["prompt"]
        assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "tool"] * 5 + ["assistant"]
        expected = (wrong_order_calls if is_wrong else reference_calls)(row["expression"])
        assert _calls(demonstration) == [
            (tool, arguments, f"call_{i}") for i, (tool, arguments, _) in enumerate(expected)
        ]
        assert [m["content"] for m in messages if m["role"] == "tool"] == [str(r) for *_, r in expected]
        assert messages[-1]["content"] == f"The answer is {expected[-1][-1]}."
        episode = Episode(id="d", status="ok", result=messages[-1]["content"])
        assert calculator_correct([None], [messages[2:]], [row["answer"]], episodes=[episode]) == [1.0 - is_wrong]
    with pytest.raises(ValueError, match=r"decision_noise must be a probability in \[0, 1\], got -0.1"):
        precedence_lookup_demonstrations(2, decision_noise=-0.1)
