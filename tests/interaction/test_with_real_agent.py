"""Protocols with the real ``Agent``/``ToolAgent`` and a ``ScriptedChatClient`` (token-in)."""

from __future__ import annotations

import re

from tests.interaction.fakes import run

from ludic.agents import Agent, ToolAgent
from ludic.context.full_dialog import FullDialog
from ludic.inference.chat_template import HFChatTemplate
from ludic.inference.scripted_client import ScriptedChatClient
from ludic.interaction import SingleAgentProtocol, TaskEnv, make_delegation_handler
from ludic.parsers import ParseResult

DELEGATE = '<tool_call>{"name": "delegate", "arguments": {"task": "2+3"}}</tool_call>'


def answer_parser(text: str) -> ParseResult:
    m = re.search(r"<answer>(.*?)</answer>", text)
    if m is None:
        return ParseResult(action=None, reward=-1.0, obs="Use <answer>...</answer>.")
    return ParseResult(action=m.group(1).strip(), reward=0.0)


def exact(task: str, action: str) -> float:
    return 1.0 if action == "5" else 0.0


def make_agent(tok, script, cls=Agent, **kw):
    return cls(
        client=ScriptedChatClient(tok, script),
        context=FullDialog(system_prompt="Answer in <answer></answer>."),
        parser=answer_parser,
        chat_template=HFChatTemplate(tok),
        **kw,
    )


def test_parse_failure_feedback_reaches_the_real_agents_next_prompt(tiny_tokenizer) -> None:
    agent = make_agent(tiny_tokenizer, ["five", "<answer>5</answer>"])
    env = TaskEnv("2+3?", scorer=exact)
    [rollout] = run(SingleAgentProtocol(agent).run(env=env, max_steps=3))
    synthetic, real = rollout.env_steps
    assert synthetic.synthetic and synthetic.next_obs == "Use <answer>...</answer>."
    assert real.reward == 1.0 and rollout.terminated
    second_prompt = rollout.agent_steps[1].prompt_messages
    assert second_prompt[-1] == {"role": "user", "content": "Use <answer>...</answer>."}
    assert [t.reward for t in rollout.turns()] == [-1.0, 1.0]


def test_delegating_tool_agent_trains_on_one_token_sequence_per_turn(tiny_tokenizer) -> None:
    parent = make_agent(
        tiny_tokenizer, [DELEGATE, "<answer>5</answer>"], cls=ToolAgent, external_tools=["delegate"]
    )
    handler = make_delegation_handler(
        tool_name="delegate",
        sub_agent_factory=lambda: make_agent(tiny_tokenizer, ["<answer>5</answer>"]),
        env_factory=lambda args: TaskEnv(args["task"], scorer=exact),
        max_steps=2,
    )
    protocol = SingleAgentProtocol(parent, external_tool_handler=handler)
    parent_rollout, sub = run(
        protocol.run(env=TaskEnv("2+3 via a helper", scorer=exact), max_steps=2)
    )

    [turn] = parent_rollout.turns()
    first, second = turn.agent_steps
    assert first.action_target == "external" and second.action == "5"
    assert first.tool_results[-1]["content"] == "5"
    # the in-turn prompt extends the previous prompt + completion tokens exactly
    assert first.trace is not None and second.trace is not None
    prefix = first.trace.prompt_token_ids + first.trace.completion_token_ids
    assert second.trace.prompt_token_ids[: len(prefix)] == prefix
    assert turn.env_step is not None and turn.env_step.reward == 1.0

    assert sub.meta["parent_rollout_id"] == parent_rollout.id and sub.terminated
    assert sub.total_reward == 1.0
    assert sub.agent_steps[0].trace is not None and sub.agent_steps[0].trace.has_logprobs
