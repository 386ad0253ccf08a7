"""Parsers: tag/think/boxed extraction, their failure paths, and composition."""

from __future__ import annotations

import pytest

from ludic.parsers import (
    ParseResult,
    boxed_parser,
    compose_parsers,
    think_prefix_parser,
    xml_tag_parser,
)

# -- xml_tag_parser --------------------------------------------------------------------


def test_xml_tag_parser_returns_stripped_content_of_last_tag() -> None:
    parse = xml_tag_parser("answer", success_reward=0.1)
    result = parse("<answer>1</answer> wait <answer>\n 42 \n</answer> done")
    assert result == ParseResult(action="42", reward=0.1, obs=None)


def test_xml_tag_parser_content_may_span_lines() -> None:
    assert xml_tag_parser("move")("<move>a\nb</move>").action == "a\nb"


def test_xml_tag_parser_missing_tag_fails_with_penalty_and_format_feedback() -> None:
    result = xml_tag_parser("answer", failure_reward=-0.5)("the answer is 42")
    assert result.action is None
    assert result.reward == -0.5
    assert "<answer>...</answer>" in result.obs


def test_xml_tag_parser_unclosed_tag_fails() -> None:
    result = xml_tag_parser("answer")("<answer>42")
    assert not result.ok
    assert result.reward == -1.0


def test_xml_tag_parser_empty_tag_fails() -> None:
    result = xml_tag_parser("answer")("<answer>  </answer>")
    assert not result.ok
    assert "empty" in result.obs


def test_xml_tag_parser_does_not_match_other_tags() -> None:
    assert not xml_tag_parser("answer")("<answers>4</answers>").ok


def test_xml_tag_parser_rejects_tag_given_with_brackets() -> None:
    with pytest.raises(ValueError, match="'<answer>' is not a tag name"):
        xml_tag_parser("<answer>")


# -- think_prefix_parser ---------------------------------------------------------------


def test_think_prefix_parser_returns_text_after_think_block() -> None:
    parse = think_prefix_parser(success_reward=0.2)
    result = parse("  <think>reason <b> here</think>\n <answer>7</answer> ")
    assert result == ParseResult(action="<answer>7</answer>", reward=0.2)


def test_think_prefix_parser_missing_open_tag_fails() -> None:
    result = think_prefix_parser(failure_reward=-0.3)("answer <think>x</think> 7")
    assert result.action is None
    assert result.reward == -0.3
    assert "Missing <think>" in result.obs


def test_think_prefix_parser_unclosed_think_fails() -> None:
    result = think_prefix_parser()("<think>still reasoning when the length cut hit")
    assert result.action is None
    assert "Unclosed <think>" in result.obs


def test_think_prefix_parser_nothing_after_think_fails() -> None:
    result = think_prefix_parser()("<think>done</think>   ")
    assert result.action is None
    assert "Nothing after </think>" in result.obs


def test_think_prefix_parser_supports_custom_tag() -> None:
    assert think_prefix_parser(tag="reasoning")("<reasoning>r</reasoning>5").action == "5"


# -- boxed_parser ----------------------------------------------------------------------


def test_boxed_parser_returns_last_boxed_content() -> None:
    result = boxed_parser(success_reward=1.0)(r"first \boxed{1}, finally \boxed{ 2 }.")
    assert result == ParseResult(action="2", reward=1.0)


def test_boxed_parser_matches_nested_braces() -> None:
    assert boxed_parser()(r"so \boxed{\frac{1}{2}} is it").action == r"\frac{1}{2}"


def test_boxed_parser_missing_boxed_fails() -> None:
    result = boxed_parser(failure_reward=-2.0)("42")
    assert result.action is None
    assert result.reward == -2.0
    assert r"\boxed{...}" in result.obs


def test_boxed_parser_unbalanced_last_box_fails_without_falling_back() -> None:
    result = boxed_parser()(r"\boxed{1} then \boxed{\frac{1}{2}")
    assert result.action is None
    assert "Unbalanced" in result.obs


def test_boxed_parser_empty_box_fails() -> None:
    assert not boxed_parser()(r"\boxed{ }").ok


# -- compose_parsers -------------------------------------------------------------------


def test_compose_feeds_each_parser_the_previous_action_and_sums_rewards() -> None:
    parse = compose_parsers(
        think_prefix_parser(success_reward=0.25), xml_tag_parser("answer", success_reward=0.5)
    )
    result = parse("<think>2+2</think><answer> 4 </answer>")
    assert result == ParseResult(action="4", reward=0.75, obs=None)


def test_compose_stops_at_first_failure_with_its_obs_and_accumulated_reward() -> None:
    calls: list[str] = []

    def spy(text: str) -> ParseResult:
        calls.append(text)
        return ParseResult(text, reward=10.0)

    parse = compose_parsers(
        think_prefix_parser(success_reward=0.25),
        xml_tag_parser("answer", failure_reward=-1.0),
        spy,
    )
    result = parse("<think>hmm</think> four")
    assert result.action is None
    assert result.reward == pytest.approx(-0.75)
    assert result.obs == xml_tag_parser("answer")("four").obs
    assert calls == []


def test_compose_first_parser_failure_returns_only_its_reward() -> None:
    parse = compose_parsers(think_prefix_parser(failure_reward=-0.5), xml_tag_parser("answer"))
    result = parse("<answer>4</answer>")
    assert result.action is None
    assert result.reward == -0.5
    assert "Missing <think>" in result.obs


def test_compose_success_keeps_last_parsers_obs() -> None:
    parse = compose_parsers(lambda t: ParseResult(t.upper()), lambda t: ParseResult(t, 0.0, "ok"))
    assert parse("abc") == ParseResult("ABC", 0.0, "ok")


def test_compose_requires_at_least_one_parser() -> None:
    with pytest.raises(ValueError, match="at least one parser"):
        compose_parsers()


def test_compose_rejects_non_callable_naming_its_position() -> None:
    with pytest.raises(TypeError, match="argument 1 is 'answer'"):
        compose_parsers(boxed_parser(), "answer")  # type: ignore[arg-type]
