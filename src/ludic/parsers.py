"""Parsers: turn raw completion text into an action, plus an intrinsic format reward.

A parser is any callable ``(text: str) -> ParseResult``. ``action=None`` is a failure: the
protocol shows ``obs`` (feedback) to the agent instead of calling ``env.step``, and
``reward`` is typically a penalty. Ready-made (``failure_reward`` and feedback on failure,
``success_reward`` and ``obs=None`` on success): :func:`xml_tag_parser` (the last
``<tag>...</tag>``), :func:`think_prefix_parser` (a leading ``<think>...</think>``
required; returns what follows) and :func:`boxed_parser` (the last ``\\boxed{...}``).
:func:`compose_parsers` chains them: ``(think_prefix_parser(), xml_tag_parser("move"))``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from ludic.types import ContractError, check_reward


@dataclass(frozen=True)
class ParseResult:
    action: str | None
    reward: float = 0.0
    obs: str | None = None

    def __post_init__(self) -> None:
        check_reward("ParseResult.reward", self.reward)
        if self.action is not None and not isinstance(self.action, str):
            raise ContractError(
                f"ParseResult.action={self.action!r} ({type(self.action).__name__}) is not a "
                "str; return the parsed action as text, or None for a parse failure"
            )

    @property
    def ok(self) -> bool:
        return self.action is not None


Parser: TypeAlias = Callable[[str], ParseResult]


def compose_parsers(*parsers: Parser) -> Parser:
    """Chain parsers left to right into one parser.

    Semantics, exactly:

    * The first parser gets the completion text; each later parser gets the previous
      parser's ``action`` as its input text.
    * Rewards add up over every parser that ran.
    * The first failure stops the chain: the result is ``action=None``, that parser's
      ``obs``, and the summed reward of all parsers so far (the failing one included).
      Later parsers do not run.
    * On success the result carries the last parser's ``action`` and ``obs`` and the
      summed reward.
    """
    if not parsers:
        raise ValueError("compose_parsers() needs at least one parser, got none")
    for i, p in enumerate(parsers):
        if not callable(p):
            raise TypeError(
                f"compose_parsers: argument {i} is {p!r}, not a parser; pass callables "
                "(text: str) -> ParseResult such as xml_tag_parser('answer')"
            )

    def composed(text: str) -> ParseResult:
        total = 0.0
        current = text
        obs: str | None = None
        for parser in parsers:
            result = parser(current)
            total += result.reward
            if result.action is None:
                return ParseResult(action=None, reward=total, obs=result.obs)
            current = result.action
            obs = result.obs
        return ParseResult(action=current, reward=total, obs=obs)

    return composed


_TAG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


def xml_tag_parser(
    tag: str, *, success_reward: float = 0.0, failure_reward: float = -1.0
) -> Parser:
    """A parser that returns the stripped content of the *last* ``<tag>...</tag>``.

    Fails (``action=None``) when no complete ``<tag>...</tag>`` pair is present or when
    the last one is empty after stripping; the feedback ``obs`` states the format.
    """
    if not isinstance(tag, str) or not _TAG_NAME.fullmatch(tag):
        raise ValueError(
            f"xml_tag_parser: tag={tag!r} is not a tag name; pass the bare name, e.g. "
            "'answer' for <answer>...</answer>"
        )
    pattern = re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL)
    feedback = f"Put your final answer inside <{tag}>...</{tag}>."

    def parse(text: str) -> ParseResult:
        matches = pattern.findall(text)
        if not matches:
            return ParseResult(None, failure_reward, f"No <{tag}>...</{tag}> found. {feedback}")
        content = matches[-1].strip()
        if not content:
            return ParseResult(None, failure_reward, f"Your <{tag}> tag is empty. {feedback}")
        return ParseResult(content, success_reward)

    return parse


def think_prefix_parser(
    *, success_reward: float = 0.0, failure_reward: float = -1.0, tag: str = "think"
) -> Parser:
    """A parser that requires the completion to open with ``<think>...</think>``.

    Leading whitespace is allowed before ``<think>``. Returns the stripped text after the
    first ``</think>``. Fails when the completion does not start with ``<think>``, when
    ``</think>`` is missing (unclosed reasoning, e.g. a length-cut completion) or when
    nothing follows it.
    """
    if not isinstance(tag, str) or not _TAG_NAME.fullmatch(tag):
        raise ValueError(f"think_prefix_parser: tag={tag!r} is not a tag name, e.g. 'think'")
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    fmt = f"Start with {open_tag}your reasoning{close_tag}, then give your answer."

    def parse(text: str) -> ParseResult:
        body = text.lstrip()
        if not body.startswith(open_tag):
            return ParseResult(None, failure_reward, f"Missing {open_tag} at the start. {fmt}")
        end = body.find(close_tag, len(open_tag))
        if end < 0:
            return ParseResult(None, failure_reward, f"Unclosed {open_tag}. {fmt}")
        rest = body[end + len(close_tag) :].strip()
        if not rest:
            return ParseResult(None, failure_reward, f"Nothing after {close_tag}. {fmt}")
        return ParseResult(rest, success_reward)

    return parse


_BOXED = "\\boxed{"


def last_boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, or ``None`` if its braces never close."""
    start = text.rfind(_BOXED)
    depth = 1
    i = start + len(_BOXED)
    while i < len(text):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(_BOXED) : i]
        i += 1
    return None


def boxed_parser(*, success_reward: float = 0.0, failure_reward: float = -1.0) -> Parser:
    """A parser that returns the stripped content of the *last* ``\\boxed{...}``.

    Nested braces are matched (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``). Fails
    when there is no ``\\boxed{``, when the last one's braces never balance (no fallback
    to an earlier box: the final answer is malformed) or when it is empty.
    """
    fmt = "Give your final answer as \\boxed{...}."

    def parse(text: str) -> ParseResult:
        if _BOXED not in text:
            return ParseResult(None, failure_reward, f"No \\boxed{{...}} found. {fmt}")
        content = last_boxed_content(text)
        if content is None:
            return ParseResult(None, failure_reward, f"Unbalanced braces in \\boxed{{. {fmt}")
        content = content.strip()
        if not content:
            return ParseResult(None, failure_reward, f"Your \\boxed{{}} is empty. {fmt}")
        return ParseResult(content, success_reward)

    return parse
