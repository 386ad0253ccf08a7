"""Ready-made parts that configs refer to by name (see :mod:`ludic.run.registries`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ludic.envs.dataset_qa_env import DatasetQAEnv, exact_match, numeric_match
from ludic.jsonl import read_jsonl
from ludic.parsers import (
    ParseResult,
    boxed_parser,
    compose_parsers,
    think_prefix_parser,
    xml_tag_parser,
)

VERIFIERS = {"numeric": numeric_match, "exact": exact_match}


def dataset_qa_env_from_file(
    *, path: str, verifier: str = "numeric", **kwargs: Any
) -> DatasetQAEnv:
    """A :class:`DatasetQAEnv` over a JSONL file of ``{"question": ..., "answer": ...}``
    lines (keys configurable via ``question_key`` / ``answer_key``)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"env.kwargs.path: dataset file {str(file)!r} does not exist")
    if verifier not in VERIFIERS:
        raise ValueError(f"env.kwargs.verifier: {verifier!r}; choose one of {sorted(VERIFIERS)}")
    samples = read_jsonl(file)  # a line that is not JSON: JSONLError naming file:line
    return DatasetQAEnv(samples, verifier=VERIFIERS[verifier], **kwargs)


def plain_answer_parser(text: str) -> ParseResult:
    """The stripped completion is the answer; an empty one is a format failure (-0.1)."""
    answer = text.strip()
    if not answer:
        return ParseResult(action=None, reward=-0.1, obs="Reply with your answer.")
    return ParseResult(action=answer)


def identity_parser(text: str) -> ParseResult:
    """The completion, unchanged, is the action."""
    return ParseResult(action=text)


xml_answer_parser = xml_tag_parser("answer", failure_reward=-0.1)
"""The content of the last <answer>...</answer>."""

boxed_answer_parser = boxed_parser()
"""The content of the last \\boxed{...}."""

think_then_answer_parser = compose_parsers(think_prefix_parser(), xml_answer_parser)
"""<think>...</think> first, then <answer>...</answer>."""
