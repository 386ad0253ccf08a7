"""ReActAgent: the per-turn final-answer shot clock."""

from __future__ import annotations

import asyncio

import pytest

from ludic.agents import ReActAgent
from ludic.agents.react_agent import FINAL_ANSWER_PROMPT
from ludic.inference.request import InferenceSpec
from ludic.inference.scripted_client import ScriptedChatClient

CALLS: list[int] = []


def add(a: int, b: int) -> int:
    """Add two integers."""
    CALLS.append(a + b)
    return a + b


ADD = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
ASK = '<tool_call>{"name": "ask", "arguments": {}}</tool_call>'


def run_act(agent, turn_id: str = "t0"):
    return asyncio.run(agent.act(inference=InferenceSpec(), turn_id=turn_id))


@pytest.fixture
def make_agent(tiny_tokenizer, chat_template, context, answer_parser):
    CALLS.clear()

    def make(script, **kwargs) -> ReActAgent:
        agent = ReActAgent(
            client=ScriptedChatClient(tiny_tokenizer, script),
            context=context,
            parser=answer_parser,
            chat_template=chat_template,
            tools=[add],
            **kwargs,
        )
        agent.on_env_reset("What is 2+3?", {})
        return agent

    return make


def test_answer_within_the_budget_needs_no_forcing(make_agent) -> None:
    act = run_act(make_agent([ADD, "<answer>5</answer>"], max_react_steps=2))
    assert act.action == "5"
    assert [s.action_target for s in act.steps] == ["internal", "env"]
    assert not any(s.info.get("forced_final_answer") for s in act.steps)


def test_shot_clock_forces_a_final_answer_after_max_react_steps(make_agent) -> None:
    agent = make_agent([ADD, ADD, "<answer>5</answer>"], max_react_steps=2)
    act = run_act(agent)
    assert act.action == "5" and len(act.steps) == 3
    forced = act.steps[-1]
    assert forced.info["forced_final_answer"] is True
    assert forced.prompt_messages[-1] == {"role": "user", "content": FINAL_ANSWER_PROMPT}
    assert forced.prompt_messages[-2]["role"] == "tool"
    prev = act.steps[1].trace
    assert forced.trace.prompt_token_ids[
        : len(prev.prompt_token_ids) + len(prev.completion_token_ids)
    ] == (prev.prompt_token_ids + prev.completion_token_ids)


def test_tool_calls_in_the_forced_call_are_not_run_and_fail_to_parse(make_agent) -> None:
    act = run_act(make_agent([ADD, ADD], max_react_steps=1))
    assert CALLS == [5]  # only the first call's tool ran
    assert act.parse_error and act.steps[-1].tool_results == []
    assert act.steps[-1].reward == -1.0  # the action parser's penalty


def test_shot_clock_counts_model_calls_across_external_round_trips(make_agent) -> None:
    agent = make_agent([ASK, ADD, "<answer>5</answer>"], external_tools=["ask"], max_react_steps=2)
    first = run_act(agent, turn_id="t1")
    assert first.action_target == "external"
    agent.on_tool_results([{"role": "tool", "tool_call_id": "call_0", "content": "use add"}])
    second = run_act(agent, turn_id="t1")
    assert second.action == "5"
    assert [s.info.get("forced_final_answer", False) for s in second.steps] == [False, True]


def test_new_turn_resets_the_shot_clock(make_agent) -> None:
    agent = make_agent([ADD, "<answer>5</answer>", ADD, "<answer>6</answer>"], max_react_steps=1)
    run_act(agent, turn_id="t1")
    agent.on_after_step("next question", {})
    second = run_act(agent, turn_id="t2")
    assert [s.action_target for s in second.steps] == ["internal", "env"]
    assert second.steps[-1].info["forced_final_answer"] is True
    assert agent.model_calls_in_turn("t2") == 2


def test_max_react_steps_below_one_is_rejected(make_agent) -> None:
    with pytest.raises(ValueError, match="max_react_steps must be >= 1"):
        make_agent([], max_react_steps=0)
