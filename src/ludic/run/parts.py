"""Ready-made parts that configs refer to by name (see :mod:`ludic.run.registries`)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from ludic.envs.dataset_qa_env import (
    DatasetQAEnv,
    exact_match,
    gsm8k_answer,
    gsm8k_match,
    numeric_match,
    parse_number,
)
from ludic.jsonl import iter_jsonl
from ludic.parsers import (
    ParseResult,
    boxed_parser,
    compose_parsers,
    think_prefix_parser,
    xml_tag_parser,
)

VERIFIERS = {"numeric": numeric_match, "exact": exact_match, "gsm8k": gsm8k_match}


def dataset_qa_env_from_file(
    *,
    path: str,
    verifier: str = "numeric",
    question_key: str = "question",
    answer_key: str = "answer",
    **kwargs: Any,
) -> DatasetQAEnv:
    """A :class:`DatasetQAEnv` over a JSONL file of ``{"question": ..., "answer": ...}``
    lines (keys configurable via ``question_key`` / ``answer_key``). The whole file is
    checked when the env is built (every line JSON with both keys, every answer a number
    for the numeric verifier, or a number or a solution ending in ``#### N`` for gsm8k),
    so a bad line is reported with its line number before the run rather than by the
    episode that draws it. ``verifier``: numeric (exact numbers, also ``\\frac{1}{2}``
    from a boxed answer), exact (strings) or gsm8k (the answer after ``####``, else the
    last number, on both sides)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"env.kwargs.path: dataset file {str(file)!r} does not exist")
    if verifier not in VERIFIERS:
        raise ValueError(f"env.kwargs.verifier: {verifier!r}; choose one of {sorted(VERIFIERS)}")
    stat = file.stat()
    samples = _read_dataset(
        str(file.resolve()), stat.st_mtime_ns, stat.st_size, verifier, question_key, answer_key
    )
    return DatasetQAEnv(
        samples,
        verifier=VERIFIERS[verifier],
        question_key=question_key,
        answer_key=answer_key,
        **kwargs,
    )


@functools.lru_cache(maxsize=8)
def _read_dataset(
    path: str, mtime_ns: int, size: int, verifier: str, question_key: str, answer_key: str
) -> tuple[dict[str, Any], ...]:
    """The checked samples of ``path`` (cached per file version: every episode builds an
    env)."""
    samples = []
    for lineno, sample in iter_jsonl(path):  # a line that is not JSON: JSONLError, file:line
        if not isinstance(sample, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {sample!r}")
        for key, arg in ((question_key, "question_key"), (answer_key, "answer_key")):
            if key not in sample:
                raise ValueError(
                    f"{path}:{lineno}: no key {key!r} (keys: {sorted(sample)}); fix the "
                    f"line or set env.kwargs.{arg}"
                )
        answer = sample[answer_key]
        numeric = not isinstance(answer, bool) and isinstance(answer, str | int | float)
        final = str(answer) if verifier == "numeric" else gsm8k_answer(str(answer))
        if verifier in ("numeric", "gsm8k") and (
            not numeric or final is None or parse_number(final) is None
        ):
            raise ValueError(
                f"{path}:{lineno}: {answer_key}={answer!r} is not a number"
                + (" (nor ends in #### N)" if verifier == "gsm8k" else "")
                + f", which verifier {verifier} needs; fix the answer or set "
                "env.kwargs.verifier=exact"
            )
        samples.append(sample)
    return tuple(samples)


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
