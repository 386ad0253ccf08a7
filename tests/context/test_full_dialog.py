"""FullDialog: the prompt is the whole history, and a copy of it."""

from __future__ import annotations

from ludic.context import ContextStrategy, FullDialog


def test_full_dialog_prompt_is_entire_history_in_order() -> None:
    ctx = FullDialog(system_prompt="sys")
    ctx.on_env_reset("obs0", {})
    ctx.on_after_act({"role": "assistant", "content": "<think>a</think>act0"})
    ctx.on_tool_results([{"role": "tool", "content": "r", "tool_call_id": "1"}])
    ctx.on_after_step("obs1", {})
    assert ctx.on_before_act() == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "obs0"},
        {"role": "assistant", "content": "<think>a</think>act0"},
        {"role": "tool", "content": "r", "tool_call_id": "1"},
        {"role": "user", "content": "obs1"},
    ]
    assert isinstance(ctx, ContextStrategy)


def test_full_dialog_prompt_edits_do_not_touch_history() -> None:
    ctx = FullDialog()
    ctx.on_env_reset("obs0", {})
    prompt = ctx.on_before_act()
    prompt[0]["content"] = "changed"
    prompt.append({"role": "user", "content": "extra"})
    assert ctx.messages == [{"role": "user", "content": "obs0"}]


def test_full_dialog_reset_clears_previous_episode() -> None:
    ctx = FullDialog(system_prompt="sys")
    ctx.on_env_reset("a", {})
    ctx.on_after_act({"role": "assistant", "content": "x"})
    ctx.on_env_reset("b", {})
    assert ctx.on_before_act() == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "b"},
    ]


def test_env_system_prompt_applies_per_episode_and_never_overrides_the_users() -> None:
    from ludic.context import FullDialog

    own = FullDialog(system_prompt="mine")
    own.on_env_reset("q", {}, system_prompt="env's")
    assert own.messages[0] == {"role": "system", "content": "mine"}

    bare = FullDialog()
    bare.on_env_reset("q1", {}, system_prompt="env A")
    assert bare.messages[0]["content"] == "env A"
    bare.on_env_reset("q2", {})  # the next env suggests nothing: no leak from the last one
    assert bare.messages == [{"role": "user", "content": "q2"}]
