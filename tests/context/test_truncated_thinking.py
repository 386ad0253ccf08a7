"""TruncatedThinkingContext: old reasoning hidden in the prompt, history left intact."""

from __future__ import annotations

import copy

import pytest

from ludic.context import TruncatedThinkingContext, truncate_thinking


def two_turn_context(**kwargs) -> TruncatedThinkingContext:
    ctx = TruncatedThinkingContext(system_prompt="sys", **kwargs)
    ctx.on_env_reset("obs0", {})
    ctx.on_after_act({"role": "assistant", "content": "<think>long plan A</think>move 1"})
    ctx.on_after_step("obs1", {})
    ctx.on_after_act({"role": "assistant", "content": "<think>plan B</think>move 2"})
    ctx.on_after_step("obs2", {})
    return ctx


def test_truncate_thinking_replaces_every_closed_block() -> None:
    text = "<think>a\nb</think>x<think>c</think>y"
    assert truncate_thinking(text) == "<think>...</think>x<think>...</think>y"
    assert truncate_thinking(text, placeholder="") == "<think></think>x<think></think>y"


def test_truncate_thinking_leaves_unclosed_think_alone() -> None:
    assert truncate_thinking("<think>cut off") == "<think>cut off"


def test_earlier_assistant_thinking_is_replaced_in_prompt() -> None:
    prompt = two_turn_context().on_before_act()
    assert [m["content"] for m in prompt] == [
        "sys",
        "obs0",
        "<think>...</think>move 1",
        "obs1",
        "<think>...</think>move 2",
        "obs2",
    ]


def test_history_is_left_intact() -> None:
    ctx = two_turn_context()
    before = copy.deepcopy(ctx.messages)
    ctx.on_before_act()
    assert ctx.messages == before
    assert ctx.messages[2]["content"] == "<think>long plan A</think>move 1"


def test_keep_last_assistant_keeps_most_recent_reasoning() -> None:
    prompt = two_turn_context(keep_last_assistant=True).on_before_act()
    assert prompt[2]["content"] == "<think>...</think>move 1"
    assert prompt[4]["content"] == "<think>plan B</think>move 2"


def test_current_turn_tool_loop_keeps_its_reasoning() -> None:
    ctx = two_turn_context()
    ctx.on_after_act({"role": "assistant", "content": "<think>need a tool</think>call"})
    ctx.on_tool_results([{"role": "tool", "content": "42", "tool_call_id": "t"}])
    prompt = ctx.on_before_act()
    assert prompt[-2]["content"] == "<think>need a tool</think>call"
    assert prompt[4]["content"] == "<think>...</think>move 2"


def test_custom_placeholder_and_non_string_content() -> None:
    ctx = TruncatedThinkingContext(placeholder="[hidden]")
    ctx.on_env_reset("q", {})
    parts = [{"type": "text", "text": "<think>x</think>"}]
    ctx.on_after_act({"role": "assistant", "content": "<think>x</think>a"})
    ctx.on_after_step("q2", {})
    ctx.on_after_act({"role": "assistant", "content": parts})
    ctx.on_after_step("q3", {})
    prompt = ctx.on_before_act()
    assert prompt[1]["content"] == "<think>[hidden]</think>a"
    assert prompt[3]["content"] == parts


def test_user_and_system_messages_are_never_truncated() -> None:
    ctx = TruncatedThinkingContext(system_prompt="<think>rules</think>")
    ctx.on_env_reset("<think>obs</think>", {})
    ctx.on_after_step("next", {})
    prompt = ctx.on_before_act()
    assert prompt[0]["content"] == "<think>rules</think>"
    assert prompt[1]["content"] == "<think>obs</think>"


def test_placeholder_containing_close_tag_is_rejected() -> None:
    with pytest.raises(ValueError, match="placeholder='</think>'"):
        TruncatedThinkingContext(placeholder="</think>")
