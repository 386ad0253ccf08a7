"""``LatestObservation``: the system prompt and the newest env observation on; a parse
failure's feedback follows the observation instead of replacing it."""

from __future__ import annotations

from ludic.context import LatestObservation


def test_the_prompt_is_the_newest_observation_and_what_followed_it() -> None:
    context = LatestObservation(system_prompt="Play well.")
    context.on_env_reset("board 1", {})
    assert context.on_before_act() == [
        {"role": "system", "content": "Play well."},
        {"role": "user", "content": "board 1"},
    ]
    context.on_after_act({"role": "assistant", "content": "[9]"})
    context.on_after_step("Reply with a move.", {"parse_error": True})
    assert [m["content"] for m in context.on_before_act()] == [
        "Play well.",
        "board 1",
        "[9]",
        "Reply with a move.",
    ]  # the retry still sees the board
    context.on_after_act({"role": "assistant", "content": "[4]"})
    context.on_after_step("board 2", {})
    assert [m["content"] for m in context.on_before_act()] == ["Play well.", "board 2"]
    assert len(context.messages) == 6  # the full history is kept


def test_without_a_system_prompt() -> None:
    context = LatestObservation()
    context.on_env_reset("board 1", {})
    context.on_after_step("board 2", {})
    assert context.on_before_act() == [{"role": "user", "content": "board 2"}]
