"""Order of operations after a plan (issue 42's third learning study): the decision is call 1, after a `plan` call
whose steps are the same for every question; the tools, the reference solver, the splits, the demonstrations with
decision noise."""

import json
import random

import pytest

from trl_agentic.tasks.calculator import calculator_correct
from trl_agentic.tasks.precedence import build_precedence_dataset, finishable
from trl_agentic.tasks.precedence_plan import (
    DECISION_CALL,
    MAX_ROUNDS,
    PLAN,
    PRECEDENCE_PLAN,
    SYSTEM_PROMPT,
    TOOL_SCHEMAS,
    build_precedence_plan_dataset,
    precedence_plan_demonstrations,
    question_expression,
    reference_calls,
    task_tools,
    wrong_order_calls,
)
from trl_agentic.trace import Episode


def test_the_plan_tool_takes_any_steps_but_none_and_restates_the_expression():
    tools = task_tools("(7 + 3) * 12")
    assert tools["plan"](PLAN) == tools["plan"]("add, then multiply") == "Noted. Evaluate (7 + 3) * 12."
    assert [tools["add"](7, 3), tools["multiply"](10, 12)] == ["10", "120"]
    with pytest.raises(ValueError, match="the plan is empty; write the steps"):
        tools["plan"]("  ")
    assert [s["function"]["name"] for s in TOOL_SCHEMAS] == ["plan", "add", "multiply"] == list(tools)
    assert PRECEDENCE_PLAN.tools == TOOL_SCHEMAS and TOOL_SCHEMAS[0]["function"]["parameters"]["required"] == ["steps"]
    assert MAX_ROUNDS == 4 and DECISION_CALL == 1  # the plan, two operations, the answer
    prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "What is 7 * (3 + 12)?"}]
    assert question_expression(prompt) == "7 * (3 + 12)"


def test_the_reference_solver_plans_then_evaluates_in_arithmetic_order():
    planned = ("plan", {"steps": PLAN}, "Noted. Evaluate 7 + 3 * 12.")
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
        assert right[0] == wrong[0] == ("plan", {"steps": PLAN}, f"Noted. Evaluate {row['expression']}.")
        assert question_expression(row["prompt"]) == row["expression"]  # what the agent's plan tool restates
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


def test_the_agent_plays_a_demonstration_through_a_real_endpoint(start_server):
    """A model scripted to send a demonstration's calls, through the endpoint and the agent: the conversation the agent
    records is the demonstration (the plan tool's answer included), and the checker scores it 1."""
    from conftest import ScriptedEngine
    from trl_agentic.rollout.agents import resolve_agent
    from trl_agentic.rollout.runner import run_episodes, run_rollout
    from trl_agentic.tiny_models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer("qwen2_5")
    row = build_precedence_plan_dataset("train", 1, seed=0)[0]
    demonstration = precedence_plan_demonstrations(1, seed=0)[0]["messages"]
    sent = [m for m in demonstration if m["role"] == "assistant"]

    def respond(prompt_ids):  # the demonstration's next assistant message, by the tool results already in the prompt
        message = sent[tokenizer.decode(prompt_ids).count("<tool_response>")]
        if not message.get("tool_calls"):
            return message["content"]
        function = message["tool_calls"][0]["function"]
        return (
            f"<tool_call>\n{json.dumps({'name': function['name'], 'arguments': function['arguments']})}\n</tool_call>"
        )

    server = start_server(ScriptedEngine(tokenizer, respond), tokenizer)
    (episode,) = run_rollout(
        run_episodes(server, resolve_agent(PRECEDENCE_PLAN.agent), [{"prompt": row["prompt"]}], timeout=60)
    )
    assert episode.status == "ok", episode.error
    assert [m["content"] for m in episode.messages if m["role"] == "tool"] == [
        str(result) for *_, result in reference_calls(row["expression"])
    ]
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for m in episode.messages
        for c in m.get("tool_calls") or []
    ] == [(tool, arguments) for tool, arguments, _ in reference_calls(row["expression"])]
    assert episode.result == demonstration[-1]["content"] == f"The answer is {row['answer']}."
    assert calculator_correct([None], [episode.messages], [row["answer"]], episodes=[episode]) == [1.0]
