"""Agent: one model call per act, parse results and failures, token-in prompts."""

from __future__ import annotations

import asyncio

import pytest

from ludic.agents import Agent
from ludic.context.full_dialog import FullDialog
from ludic.inference.request import CompletionRequest, InferenceSpec, ReturnSpec, SamplingSpec
from ludic.inference.scripted_client import ScriptedChatClient
from ludic.interaction.base import ActingAgent
from ludic.parsers import ParseResult
from ludic.types import ChatResponse, TokenTrace


def run_act(agent, turn_id: str = "t0", inference: InferenceSpec | None = None):
    return asyncio.run(agent.act(inference=inference or InferenceSpec(), turn_id=turn_id))


@pytest.fixture
def make_agent(tiny_tokenizer, chat_template, context, answer_parser):
    """``make_agent(script_or_client, **kwargs)``: an Agent after ``on_env_reset``."""

    def make(script, *, ctx=None, **kwargs) -> Agent:
        client = (
            script if hasattr(script, "complete") else ScriptedChatClient(tiny_tokenizer, script)
        )
        agent = Agent(
            client=client,
            context=ctx or context,
            parser=kwargs.pop("parser", answer_parser),
            chat_template=chat_template,
            **kwargs,
        )
        agent.on_env_reset("What is 2+3?", {})
        return agent

    return make


def test_agent_satisfies_acting_agent_protocol(make_agent) -> None:
    assert isinstance(make_agent([]), ActingAgent)


def test_act_renders_the_context_and_returns_the_parsed_env_action(
    make_agent, chat_template, context
) -> None:
    act = run_act(make_agent(["<answer>5</answer>"]), turn_id="turn-1")

    assert act.action == "5" and act.action_target == "env" and not act.parse_error
    (step,) = act.steps
    expected_messages = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 2+3?"},
    ]
    assert step.index == -1 and step.turn_id == "turn-1"
    assert step.prompt_messages == expected_messages
    assert list(step.trace.prompt_token_ids) == chat_template.render(expected_messages)
    assert step.completion == "<answer>5</answer>"
    assert step.reward == 0.1 and step.action == "5" and not step.parse_error
    assert context.messages[-1] == {"role": "assistant", "content": "<answer>5</answer>"}


def test_parse_failure_carries_parser_penalty_and_feedback(make_agent) -> None:
    act = run_act(make_agent(["five"]))
    assert act.parse_error and act.action is None and act.action_target == "env"
    assert act.feedback_obs == "Use <answer>...</answer>."
    assert act.steps[0].reward == -1.0 and act.steps[0].parse_error


def test_parse_failure_without_parser_feedback_gets_default_feedback(make_agent) -> None:
    act = run_act(make_agent(["x"], parser=lambda text: ParseResult(None)))
    assert "could not be parsed" in act.feedback_obs


def test_truncated_completion_is_a_parse_failure_with_the_incomplete_penalty(make_agent) -> None:
    agent = make_agent(["<answer>5</answer> and a long tail"], incomplete_completion_penalty=-0.5)
    act = run_act(agent, inference=InferenceSpec(sampling=SamplingSpec(max_tokens=20)))
    step = act.steps[0]
    assert step.finish_reason == "length"
    assert act.parse_error and act.action is None  # the answer tag was complete, still rejected
    assert step.reward == -0.5 and step.info["incomplete_completion"]
    assert "cut off" in act.feedback_obs


def test_truncated_completion_is_parsed_when_no_incomplete_penalty_is_set(make_agent) -> None:
    agent = make_agent(["<answer>5</answer> and a long tail"])
    act = run_act(agent, inference=InferenceSpec(sampling=SamplingSpec(max_tokens=20)))
    assert act.steps[0].finish_reason == "length" and act.action == "5"


class _NoTraceClient:
    async def complete(self, request: CompletionRequest) -> ChatResponse:
        return ChatResponse(text="<answer>1</answer>", finish_reason="stop")

    def sync_weights(self, params, *, version: int) -> str:
        return "ok"


class _RetokenizingClient(_NoTraceClient):
    async def complete(self, request: CompletionRequest) -> ChatResponse:
        trace = TokenTrace((1, 2), (3,), (-0.1,), finish_reason="stop")
        return ChatResponse(text="<answer>1</answer>", finish_reason="stop", trace=trace)


def test_missing_trace_when_token_ids_were_requested_raises(make_agent) -> None:
    with pytest.raises(RuntimeError, match="_NoTraceClient.complete returned no token trace"):
        run_act(make_agent(_NoTraceClient()))


def test_missing_trace_is_fine_for_an_eval_return_spec(make_agent) -> None:
    act = run_act(
        make_agent(_NoTraceClient()), inference=InferenceSpec(returns=ReturnSpec.for_eval())
    )
    assert act.action == "1" and act.steps[0].trace is None


def test_trace_with_different_prompt_ids_raises(make_agent) -> None:
    with pytest.raises(RuntimeError, match="not re-tokenize"):
        run_act(make_agent(_RetokenizingClient()))


class _RawLogprobClient(_NoTraceClient):
    """Samples at the request's temperature but labels its logprobs as the raw policy's
    (a client that does not know TokenTrace.logprob_temperature)."""

    async def complete(self, request: CompletionRequest) -> ChatResponse:
        trace = TokenTrace(request.prompt_token_ids, (3,), (-0.1,), finish_reason="stop")
        return ChatResponse(text="<answer>1</answer>", finish_reason="stop", trace=trace)


def test_a_trace_under_another_temperature_than_the_request_raises(make_agent) -> None:
    hot = InferenceSpec(sampling=SamplingSpec(temperature=1.3))
    with pytest.raises(RuntimeError, match=r"logprob_temperature=1.0 .* temperature 1.3.*1.3"):
        run_act(make_agent(_RawLogprobClient()), inference=hot)
    for temperature in (1.0, 0.0, 1e-6):  # greedy below 1e-5: the raw logits, 1.0
        spec = InferenceSpec(sampling=SamplingSpec(temperature=temperature))
        assert run_act(make_agent(_RawLogprobClient()), inference=spec).action == "1"


def test_env_system_prompt_is_used_only_when_the_context_has_none(make_agent) -> None:
    agent = make_agent(["<answer>1</answer>", "<answer>2</answer>"])
    own = agent.context.system_prompt
    agent.on_env_reset("q", {}, system_prompt="New rules.")
    first = run_act(agent).steps[0].prompt_messages[0]
    expected = own if own is not None else "New rules."
    assert first == {"role": "system", "content": expected}
    agent.context.system_prompt = None
    agent.on_env_reset("q", {}, system_prompt="New rules.")
    assert run_act(agent).steps[0].prompt_messages[0] == {"role": "system", "content": "New rules."}


def test_next_turn_after_on_after_step_renders_the_history_fresh(
    make_agent, chat_template, context
) -> None:
    agent = make_agent(["bad", "<answer>5</answer>"])
    first = run_act(agent, turn_id="t1")
    agent.on_after_step(first.feedback_obs, {})
    second = run_act(agent, turn_id="t2").steps[0]
    assert second.prompt_messages[-1] == {"role": "user", "content": "Use <answer>...</answer>."}
    assert list(second.trace.prompt_token_ids) == chat_template.render(context.messages[:-1])
    assert agent.model_calls_in_turn("t2") == 1 and agent.model_calls_in_turn("t1") == 0


def test_independent_agents_act_concurrently(make_agent) -> None:
    agents = [make_agent([f"<answer>{i}</answer>"], ctx=FullDialog()) for i in range(3)]

    async def go():
        return await asyncio.gather(
            *(a.act(inference=InferenceSpec(), turn_id="t") for a in agents)
        )

    assert [a.action for a in asyncio.run(go())] == ["0", "1", "2"]
