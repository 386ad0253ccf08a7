"""ToolAgent: internal tool loops within one turn, external routing, tool errors, caps."""

from __future__ import annotations

import asyncio

import pytest

from ludic.agents import ToolAgent
from ludic.inference.request import InferenceSpec
from ludic.inference.scripted_client import ScriptedChatClient


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first addend.
        b: second addend.
    """
    return a + b


def call(name: str, args: str = "{}") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


ADD_2_3 = call("add", '{"a": 2, "b": 3}')


def run_act(agent, turn_id: str = "t0"):
    return asyncio.run(agent.act(inference=InferenceSpec(), turn_id=turn_id))


@pytest.fixture
def make_agent(tiny_tokenizer, chat_template, context, answer_parser):
    def make(script, **kwargs) -> ToolAgent:
        agent = ToolAgent(
            client=ScriptedChatClient(tiny_tokenizer, script),
            context=context,
            parser=answer_parser,
            chat_template=chat_template,
            **kwargs,
        )
        agent.on_env_reset("What is 2+3?", {})
        return agent

    return make


def test_internal_tool_loop_continues_the_turn_on_the_same_token_sequence(
    make_agent, chat_template, context
) -> None:
    agent = make_agent([f"Let me add. {ADD_2_3}", "<answer>5</answer>"], tools=[add])
    act = run_act(agent)

    assert act.action == "5" and act.action_target == "env"
    first, second = act.steps
    assert first.action_target == "internal"
    assert [c.name for c in first.tool_calls] == ["add"]
    assert first.tool_results == [
        {"role": "tool", "tool_call_id": "call_0", "name": "add", "content": "5"}
    ]
    p1, c1 = first.trace.prompt_token_ids, first.trace.completion_token_ids
    assert second.trace.prompt_token_ids[: len(p1) + len(c1)] == p1 + c1
    assert second.prompt_messages[-1]["role"] == "tool"
    # the extension equals a fresh render of the same conversation (byte-level tokenizer)
    assert list(second.trace.prompt_token_ids) == chat_template.render(
        second.prompt_messages, tools=agent.tool_schemas()
    )
    assert context.messages[-2]["role"] == "tool"


def test_tool_schemas_are_rendered_into_the_prompt(make_agent, tiny_tokenizer) -> None:
    act = run_act(make_agent(["<answer>5</answer>"], tools=[add], external_tools=["ask_expert"]))
    prompt = tiny_tokenizer.decode(list(act.steps[0].trace.prompt_token_ids))
    assert '"name": "add"' in prompt and '"name": "ask_expert"' in prompt
    assert '"description": "Add two integers."' in prompt


def test_external_tool_calls_are_returned_to_the_protocol_and_the_turn_continues(
    make_agent,
) -> None:
    agent = make_agent(
        [call("ask_expert", '{"q": "2+3"}'), "<answer>5</answer>"], external_tools=["ask_expert"]
    )
    act = run_act(agent, turn_id="t1")
    assert act.action_target == "external" and act.action is None and not act.parse_error
    assert [(c.id, c.name, c.arguments) for c in act.tool_calls] == [
        ("call_0", "ask_expert", {"q": "2+3"})
    ]
    assert act.steps[0].action_target == "external"

    agent.on_tool_results([{"role": "tool", "tool_call_id": "call_0", "content": "5"}])
    final = run_act(agent, turn_id="t1")
    assert final.action == "5"
    before = act.steps[0].trace
    after = final.steps[0].trace.prompt_token_ids
    assert after[: len(before.prompt_token_ids) + len(before.completion_token_ids)] == (
        before.prompt_token_ids + before.completion_token_ids
    )


def test_mixed_internal_and_external_calls_run_internal_first(make_agent) -> None:
    agent = make_agent([ADD_2_3 + call("ask_expert")], tools=[add], external_tools=["ask_expert"])
    act = run_act(agent)
    assert act.action_target == "external"
    assert [c.name for c in act.tool_calls] == ["ask_expert"]
    assert act.steps[0].tool_results[0]["content"] == "5"


def test_unknown_tool_and_bad_arguments_are_fed_back_not_raised(make_agent) -> None:
    agent = make_agent(
        [call("mul", '{"a": 2}') + call("add", '{"x": 1}'), "<answer>?</answer>"], tools=[add]
    )
    act = run_act(agent)
    first = act.steps[0]
    contents = [m["content"] for m in first.tool_results]
    assert contents[0] == "Error: unknown tool 'mul'; available tools: add"
    assert contents[1].startswith("Error: bad arguments for add")
    assert [e["name"] for e in first.info["tool_errors"]] == ["mul", "add"]
    assert act.action == "?" and len(act.steps) == 2


def test_max_tool_calls_caps_internal_calls_per_act_as_a_parse_failure(make_agent) -> None:
    agent = make_agent(
        [ADD_2_3, ADD_2_3, ADD_2_3], tools=[add], max_tool_calls=2, tool_error_penalty=-0.3
    )
    act = run_act(agent)
    assert len(act.steps) == 3
    assert act.parse_error and act.action is None and act.action_target == "env"
    assert "max_tool_calls=2" in act.feedback_obs
    last = act.steps[-1]
    assert last.reward == -0.3 and last.parse_error and last.tool_results == []


def test_malformed_tool_call_is_a_parse_failure_with_the_tool_error_penalty(make_agent) -> None:
    agent = make_agent(
        ['<tool_call>{"name": add}</tool_call>'], tools=[add], tool_error_penalty=-1.0
    )
    act = run_act(agent)
    assert act.parse_error and act.steps[0].reward == -1.0
    assert act.feedback_obs.startswith("Malformed tool call: tool call #1 is not valid JSON")


def test_tool_names_must_be_unique_across_scopes(make_agent) -> None:
    with pytest.raises(ValueError, match="both in tools and external_tools"):
        make_agent([], tools=[add], external_tools=["add"])
