"""Agent test fixtures: a chat template on the tiny tokenizer, a context and a tag parser."""

from __future__ import annotations

import re

import pytest

from ludic.context.full_dialog import FullDialog
from ludic.inference.chat_template import HFChatTemplate
from ludic.parsers import ParseResult


def _answer_parser(text: str) -> ParseResult:
    m = re.search(r"<answer>(.*?)</answer>", text, re.DOTALL)
    if m is None:
        return ParseResult(action=None, reward=-1.0, obs="Use <answer>...</answer>.")
    return ParseResult(action=m.group(1).strip(), reward=0.1)


@pytest.fixture
def answer_parser():
    """``<answer>X</answer>`` -> action X (reward 0.1); else a -1.0 failure with feedback."""
    return _answer_parser


@pytest.fixture
def chat_template(tiny_tokenizer) -> HFChatTemplate:
    return HFChatTemplate(tiny_tokenizer)


@pytest.fixture
def context() -> FullDialog:
    return FullDialog(system_prompt="You add numbers.")
