"""Seam: real agents -> SingleAgentProtocol -> rollouts_to_saw_items (token and retokenize).

One SAWItem per turn; its masked (non-action) gaps between completions are exactly the
template's wrapping of the tool results the agent or protocol fed back.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from ludic.agents import Agent, ReActAgent, ToolAgent
from ludic.context.full_dialog import FullDialog
from ludic.inference.chat_template import HFChatTemplate
from ludic.inference.request import InferenceSpec, ReturnSpec, SamplingSpec
from ludic.inference.scripted_client import ScriptedChatClient
from ludic.interaction import ExternalToolResult, SingleAgentProtocol, TaskEnv
from ludic.models.tiny import CHAT_TEMPLATE, build_tiny_tokenizer
from ludic.parsers import xml_tag_parser
from ludic.training.batching.saw import rollouts_to_saw_items
from ludic.training.credit_assignment import ConstantCredit
from ludic.training.filters import drop_incomplete_completions
from ludic.training.types import SAWItem


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def call(name: str, **args: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def segments(item: SAWItem, tokenizer) -> list[tuple[int, str]]:
    """``[(mask, text), ...]`` runs of equal action-mask value."""
    runs: list[tuple[int, list[int]]] = []
    for token, mask in zip(item.input_ids, item.action_mask):
        if not runs or runs[-1][0] != mask:
            runs.append((mask, []))
        runs[-1][1].append(token)
    return [(m, tokenizer.decode(ids, skip_special_tokens=False)) for m, ids in runs]


def run_episode(agent, *, handler=None, task: str = "compute", answer: str = "35"):
    env = TaskEnv(task, scorer=lambda t, a: float(a == answer))
    protocol = SingleAgentProtocol(agent, external_tool_handler=handler)
    return asyncio.run(protocol.run(env=env, max_steps=2))


def tool_agent(tokenizer, script, cls=ToolAgent, **kwargs):
    return cls(
        client=ScriptedChatClient(tokenizer, script),
        context=FullDialog("sys"),
        parser=xml_tag_parser("answer"),
        chat_template=HFChatTemplate(tokenizer),
        **kwargs,
    )


INTERNAL_SCRIPT = [
    f"think {call('add', a=2, b=3)}",
    f"{call('add', a=5, b=30)}{call('add', a=1, b=1)}",
    "<answer>35</answer>",
]


def test_internal_tool_turn_is_one_item_whose_masked_gaps_are_the_tool_outputs(
    tiny_tokenizer,
) -> None:
    rollouts = run_episode(tool_agent(tiny_tokenizer, INTERNAL_SCRIPT, tools=[add]))
    [item] = rollouts_to_saw_items(rollouts, ConstantCredit().compute(rollouts))

    runs = segments(item, tiny_tokenizer)
    assert [m for m, _ in runs] == [0, 1, 0, 1, 0, 1]
    actions = [text for m, text in runs if m == 1]
    assert actions == [f"{completion}<|im_end|>" for completion in INTERNAL_SCRIPT]
    gaps = [text for m, text in runs[1:] if m == 0]
    assert gaps == [
        "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>tool\n35<|im_end|>\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n",
    ]
    assert item.meta["num_agent_steps"] == 3 and item.meta["reward"] == 1.0


def test_react_external_tool_and_forced_answer_stay_masked_in_one_item(tiny_tokenizer) -> None:
    search = call("search", q="x")
    script = [search, call("add", a=1, b=2), search, "final <answer>3</answer>"]

    async def handler(tool_call):
        return ExternalToolResult(content=f"found {tool_call.arguments['q']}")

    agent = tool_agent(
        tiny_tokenizer,
        script,
        cls=ReActAgent,
        tools=[add],
        external_tools=["search"],
        max_react_steps=3,
    )
    [rollout] = run_episode(agent, handler=handler, answer="3")
    assert [s.action_target for s in rollout.agent_steps] == [
        "external",
        "internal",
        "external",
        "env",
    ]
    [item] = rollouts_to_saw_items([rollout], ConstantCredit().compute([rollout]))

    runs = segments(item, tiny_tokenizer)
    assert [text for m, text in runs if m == 1] == [f"{c}<|im_end|>" for c in script]
    gaps = [text for m, text in runs[1:] if m == 0]
    assert gaps[0] == "\n<|im_start|>tool\nfound x<|im_end|>\n<|im_start|>assistant\n"
    assert gaps[1] == "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"
    assert gaps[2].startswith("\n<|im_start|>tool\nfound x<|im_end|>\n<|im_start|>user\n")
    assert rollout.env_steps[0].reward == 1.0


def test_retokenized_tool_turn_rebuilds_the_sampled_tokens_tool_schemas_included(
    tiny_tokenizer,
) -> None:
    rollouts = run_episode(tool_agent(tiny_tokenizer, INTERNAL_SCRIPT, tools=[add]))
    weights = ConstantCredit().compute(rollouts)
    [token_item] = rollouts_to_saw_items(rollouts, weights)
    [retok_item] = rollouts_to_saw_items(
        rollouts, weights, retokenize=True, chat_template=HFChatTemplate(tiny_tokenizer)
    )
    # Same sequence (the tool list in the system turn included); retokenized action spans
    # also cover the template's "\n" after each <|im_end|>, the last one included.
    newline = tuple(tiny_tokenizer.encode("\n", add_special_tokens=False))
    assert retok_item.input_ids == token_item.input_ids + newline
    assert retok_item.num_action_tokens == token_item.num_action_tokens + 3


TOOL_CALL_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ m['content'] }}<|im_end|>",
    "{{ m['content'] }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function.name }}</tool_call>{% endfor %}{% endif %}<|im_end|>",
)


def test_retokenize_renders_the_assistant_message_as_the_agent_recorded_it() -> None:
    """A template that renders structured ``tool_calls`` (Qwen-style) must not get them:
    the completion text already holds the tool-call markup the model wrote."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = TOOL_CALL_TEMPLATE
    rollouts = run_episode(tool_agent(tokenizer, INTERNAL_SCRIPT, tools=[add]))
    weights = ConstantCredit().compute(rollouts)
    [token_item] = rollouts_to_saw_items(rollouts, weights)
    [retok_item] = rollouts_to_saw_items(
        rollouts, weights, retokenize=True, chat_template=HFChatTemplate(tokenizer)
    )
    newline = tuple(tokenizer.encode("\n", add_special_tokens=False))
    assert retok_item.input_ids == token_item.input_ids + newline


def test_retokenized_length_cut_without_trace_keeps_its_finish_reason_for_filters(
    tiny_tokenizer,
) -> None:
    agent = Agent(
        client=ScriptedChatClient(tiny_tokenizer, ["a very long answer"]),
        context=FullDialog(),
        parser=lambda text: xml_tag_parser("x")(f"<x>{text}</x>"),
        chat_template=HFChatTemplate(tiny_tokenizer),
    )
    env = TaskEnv("q")
    inference = InferenceSpec(SamplingSpec(max_tokens=3), returns=ReturnSpec.for_eval())
    rollouts = asyncio.run(
        SingleAgentProtocol(agent).run(env=env, max_steps=1, inference=inference)
    )
    assert rollouts[0].agent_steps[0].trace is None
    [item] = rollouts_to_saw_items(
        rollouts,
        ConstantCredit().compute(rollouts),
        retokenize=True,
        chat_template=HFChatTemplate(tiny_tokenizer),
    )
    assert item.meta["finish_reason"] == "length"
    assert not drop_incomplete_completions()(item)


@pytest.mark.parametrize("tools", [[], [add]])
def test_agent_steps_record_the_tool_schemas_they_were_rendered_with(tiny_tokenizer, tools) -> None:
    rollouts = run_episode(tool_agent(tiny_tokenizer, ["<answer>35</answer>"], tools=tools))
    info = rollouts[0].agent_steps[0].info
    if tools:
        assert info["tools"][0]["function"]["name"] == "add"
    else:
        assert "tools" not in info
