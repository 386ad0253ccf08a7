"""XMLJsonToolCallParser: <tool_call>{json}</tool_call> blocks -> ToolCall, failures as data."""

from __future__ import annotations

from ludic.inference.tool_parser import ToolCallParser, XMLJsonToolCallParser
from ludic.types import ToolCall

parse = XMLJsonToolCallParser()


def test_default_parser_satisfies_tool_call_parser_protocol() -> None:
    assert isinstance(parse, ToolCallParser)


def test_single_call_is_extracted_with_id_call_0_and_surrounding_text_kept() -> None:
    result = parse(
        'Let me add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    )
    assert result.ok
    assert result.calls == (ToolCall(id="call_0", name="add", arguments={"a": 1, "b": 2}),)
    assert result.content == "Let me add."


def test_several_calls_get_sequential_ids_in_order() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"x": [1]}}\n</tool_call>'
    )
    result = parse(text)
    assert [(c.id, c.name) for c in result.calls] == [("call_0", "a"), ("call_1", "b")]
    assert result.calls[1].arguments == {"x": [1]}


def test_text_without_tool_calls_parses_to_no_calls() -> None:
    result = parse("The answer is 4.")
    assert result.ok and result.calls == () and result.content == "The answer is 4."


def test_arguments_may_be_a_json_string_or_missing() -> None:
    result = parse(
        '<tool_call>{"name": "a", "arguments": "{\\"k\\": 2}"}</tool_call>'
        '<tool_call>{"name": "b"}</tool_call>'
    )
    assert [c.arguments for c in result.calls] == [{"k": 2}, {}]


def test_invalid_json_is_a_parse_failure_with_no_calls() -> None:
    result = parse(
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": b}</tool_call>'
    )
    assert not result.ok
    assert result.calls == ()
    assert "tool call #2 is not valid JSON" in result.error


def test_missing_name_is_a_parse_failure() -> None:
    result = parse('<tool_call>{"arguments": {}}</tool_call>')
    assert not result.ok and "no string 'name'" in result.error


def test_non_object_arguments_are_a_parse_failure() -> None:
    result = parse('<tool_call>{"name": "a", "arguments": [1, 2]}</tool_call>')
    assert not result.ok and "'arguments' is a list" in result.error


def test_non_object_payload_is_a_parse_failure() -> None:
    assert "JSON list" in parse("<tool_call>[1]</tool_call>").error


def test_unclosed_tool_call_is_a_parse_failure() -> None:
    result = parse('<tool_call>{"name": "a", "arguments": {}}')
    assert not result.ok and "unclosed <tool_call>" in result.error
