"""Order of operations after a plan (issue 42's third learning study): the decision is call 1, after a `plan` call
whose steps are the same for every question; the tools, the reference solver, the splits, the demonstrations with
decision noise."""

import random

import pytest

from trl_agentic.tasks.calculator import calculator_correct
from trl_agentic.tasks.precedence import build_precedence_dataset, finishable
from trl_agentic.tasks.precedence_plan import (
    AGENT,
    DECISION_CALL,
    MAX_ROUNDS,
    PLAN,
    PRECEDENCE_PLAN,
    SYSTEM_PROMPT,
    build_precedence_plan_dataset,
    plan,
    precedence_plan_demonstrations,
    reference_calls,
    wrong_order_calls,
)
from trl_agentic.trace import Episode


def test_the_plan_tool_takes_any_steps_but_none():
    assert plan(PLAN) == plan("add, then multiply") == "Noted."
    with pytest.raises(ValueError, match="the plan is empty; write the steps"):
        plan("  ")
    assert [s["function"]["name"] for s in PRECEDENCE_PLAN.tools] == ["plan", "add", "multiply"]
    assert PRECEDENCE_PLAN.tools[0]["function"]["parameters"]["required"] == ["steps"]
    assert AGENT.max_rounds == MAX_ROUNDS == 4 and DECISION_CALL == 1  # the plan, two operations, the answer


def test_the_reference_solver_plans_then_evaluates_in_arithmetic_order():
    planned = ("plan", {"steps": PLAN}, "Noted.")
    assert reference_calls("7 + 3 * 12") == [
        planned,
        ("multiply", {"a": 3, "b": 12}, 36),
        ("add", {"a": 7, "b": 36}, 43),
    ]
    assert wrong_order_calls("7 + 3 * 12") == [
        planned,
        ("add", {"a": 7, "b": 3}, 10),
        ("multiply", {"a": 10, "b": 12}, 120),
    ]
    assert reference_calls("(7 + 3) * 12")[1:] == [("add", {"a": 7, "b": 3}, 10), ("multiply", {"a": 10, "b": 12}, 120)]
    # Call 1 is the decision: after the reference's first operation one call finishes, after the other none does.
    for row in build_precedence_plan_dataset("train", 200, seed=3):
        right, wrong = reference_calls(row["expression"]), wrong_order_calls(row["expression"])
        assert right[0] == wrong[0] == planned
        assert right[-1][-1] == eval(row["expression"]) == row["answer"] != wrong[-1][-1]
        tool, arguments, _ = wrong[DECISION_CALL]
        assert tool != right[DECISION_CALL][0]
        assert not finishable(row["expression"], (tool, arguments["a"], arguments["b"]))


def test_the_questions_are_the_precedence_tasks_with_the_plan_in_the_system_prompt():
    plain = build_precedence_dataset("eval", 50, seed=0)
    planned = build_precedence_plan_dataset("eval", 50, seed=0)
    assert planned["expression"] == plain["expression"] and planned["answer"] == plain["answer"]
    assert [row["prompt"] for row in planned] == [
        [{"role": "system", "content": SYSTEM_PROMPT}, row["prompt"][1]] for row in plain
    ]
    assert planned[0]["prompt"][1]["content"] == "What is 4 * 4 + 4?"
    assert PRECEDENCE_PLAN.agent_columns == ("prompt",)  # the expression and answer stay the checker's
    with pytest.raises(ValueError, match="max_operand must be >= 4"):
        build_precedence_plan_dataset("train", 2, max_operand=3)


def _calls(demonstration):
    return [
        (m["tool_calls"][0]["function"]["name"], m["tool_calls"][0]["function"]["arguments"])
        for m in demonstration["messages"]
        if m.get("tool_calls")
    ]


def test_demonstrations_plan_then_operate_and_decision_noise_flips_the_order_only():
    clean = precedence_plan_demonstrations(20, seed=0)
    noisy = precedence_plan_demonstrations(20, seed=0, decision_noise=0.5)
    wrong = [int(_calls(n)[1][0] != _calls(c)[1][0]) for n, c in zip(noisy, clean, strict=True)]
    stream = random.Random("precedence-plan-decision-noise-0")  # its own stream, seeded by the seed
    assert (
        wrong
        == [int(stream.random() < 0.5) for _ in range(20)]
        == [1, 0, 1, 1, 0, 0, 1, 0, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1]
    )
    train = build_precedence_plan_dataset("train", 20, seed=0)
    for demonstration, is_wrong, row in zip(noisy, wrong, train, strict=True):
        messages = demonstration["messages"]
        assert demonstration["tools"] == PRECEDENCE_PLAN.tools and messages[:2] == row["prompt"]
        assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "tool"] * 3 + ["assistant"]
        expected = (wrong_order_calls if is_wrong else reference_calls)(row["expression"])
        assert _calls(demonstration) == [(tool, arguments) for tool, arguments, _ in expected]
        assert [m["content"] for m in messages if m["role"] == "tool"] == [str(r) for *_, r in expected]
        episode = Episode(id="d", status="ok", result=messages[-1]["content"])
        assert calculator_correct([None], [messages[2:]], [row["answer"]], episodes=[episode]) == [1.0 - is_wrong]
