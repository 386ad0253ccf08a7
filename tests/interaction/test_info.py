"""merge_step_info: last writer wins on plain keys, reserved keys cannot be overwritten."""

from __future__ import annotations

import pytest

from ludic.interaction import RESERVED_STEP_INFO_KEYS, merge_step_info


def test_later_dict_wins_on_plain_key_collisions() -> None:
    assert merge_step_info({"a": 1, "b": 1}, {"b": 2}, {"c": 3}) == {"a": 1, "b": 2, "c": 3}


def test_overwriting_a_reserved_key_raises_naming_the_key_and_both_values() -> None:
    with pytest.raises(ValueError, match=r"'truncation_reason'.*'time_limit'.*'env'.*env_"):
        merge_step_info({"truncation_reason": "env"}, {"truncation_reason": "time_limit"})


def test_repeating_a_reserved_key_with_the_same_value_is_allowed() -> None:
    merged = merge_step_info({"parse_error": True}, {"parse_error": True, "x": 1})
    assert merged == {"parse_error": True, "x": 1}


def test_a_reserved_key_set_only_once_passes_through() -> None:
    assert merge_step_info({}, {"agent_id": "a"}) == {"agent_id": "a"}


def test_none_entries_are_skipped_and_inputs_are_not_modified() -> None:
    first = {"a": 1}
    merged = merge_step_info(first, None, {"a": 2})
    assert merged == {"a": 2}
    assert first == {"a": 1}


def test_custom_reserved_set_replaces_the_default() -> None:
    assert merge_step_info({"parse_error": 1}, {"parse_error": 2}, reserved=()) == {
        "parse_error": 2
    }
    with pytest.raises(ValueError, match="'mine'"):
        merge_step_info({"mine": 1}, {"mine": 2}, reserved={"mine"})


def test_reserved_keys_cover_what_the_protocol_writes() -> None:
    assert {"parse_error", "synthetic", "truncation_reason", "agent_id", "tool_calls"} <= (
        RESERVED_STEP_INFO_KEYS
    )
