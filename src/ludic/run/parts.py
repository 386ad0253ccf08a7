"""Ready-made parts that configs refer to by name (see :mod:`ludic.run.registries`)."""

from __future__ import annotations

import functools
from typing import Any

from ludic.envs.dataset_qa_env import (
    DatasetQAEnv,
    exact_match,
    gsm8k_answer,
    gsm8k_match,
    numeric_match,
    parse_number,
)
from ludic.envs.dataset_source import Part, Records, load_records, split_holdout
from ludic.parsers import (
    ParseResult,
    boxed_parser,
    compose_parsers,
    think_prefix_parser,
    xml_tag_parser,
)


def math_verifier(prediction: str, target: str) -> bool:
    """:func:`ludic.envs.math_verifier.math_match` (imported on first use: math-verify is
    an optional dependency)."""
    from ludic.envs.math_verifier import math_match

    return math_match(prediction, target)


VERIFIERS = {
    "numeric": numeric_match,
    "exact": exact_match,
    "gsm8k": gsm8k_match,
    "math": math_verifier,
}


def dataset_qa_env_from_file(
    *,
    path: str,
    verifier: str = "numeric",
    question_key: str = "question",
    answer_key: str = "answer",
    subset: str | None = None,
    holdout: float | int = 0,
    holdout_seed: int = 0,
    part: Part = "train",
    **kwargs: Any,
) -> DatasetQAEnv:
    """A :class:`DatasetQAEnv` over a dataset: a local JSONL / JSON / Parquet / CSV file or
    ``hf:NAME[:SPLIT]`` (see :mod:`ludic.envs.dataset_source`; ``subset`` is the Hub
    dataset's config, e.g. ``main`` for GSM8K). Field mapping: ``question_key`` and
    ``answer_key`` name the record fields; ``prompt_template`` may use any field.

    ``holdout`` (a count, or a fraction when < 1) samples, drawn with ``holdout_seed``, are
    kept out of the ``train`` part and form the ``heldout`` part: evaluate on them with
    ``env.eval_kwargs: {part: heldout}``.

    Every record is checked when the env is built (both fields present; every answer one
    the verifier can read), so a bad one is reported with its line or row before the run
    rather than by the episode that draws it. ``verifier``: numeric (exact numbers, also
    ``\\frac{1}{2}`` from a boxed answer), exact (strings), gsm8k (the answer after
    ``####``, else the last number, on both sides) or math (``math-verify``: LaTeX,
    fractions, intervals, equations; the ``math`` extra)."""
    if verifier not in VERIFIERS:
        raise ValueError(f"env.kwargs.verifier: {verifier!r}; choose one of {sorted(VERIFIERS)}")
    records = load_records(path, subset=subset, field="env.kwargs.path")
    samples = _checked(records, verifier, question_key, answer_key)
    samples = split_holdout(samples, holdout, seed=holdout_seed, part=part)
    return DatasetQAEnv(
        samples,
        verifier=VERIFIERS[verifier],
        question_key=question_key,
        answer_key=answer_key,
        **kwargs,
    )


@functools.lru_cache(maxsize=8)
def _checked(
    records: Records,
    verifier: str,
    question_key: str,
    answer_key: str,
) -> tuple[dict[str, Any], ...]:
    """The records' samples, each checked (cached: a run builds an env per episode)."""
    for where, sample in records.rows:
        for key, arg in ((question_key, "question_key"), (answer_key, "answer_key")):
            if key not in sample:
                raise ValueError(
                    f"{where}: no key {key!r} (keys: {sorted(sample)}); fix the "
                    f"record or set env.kwargs.{arg}"
                )
        problem = _answer_problem(sample[answer_key], verifier)
        if problem:
            raise ValueError(
                f"{where}: {answer_key}={sample[answer_key]!r} {problem}, which verifier "
                f"{verifier} needs; fix the answer or set env.kwargs.verifier=exact"
            )
    return tuple(sample for _, sample in records.rows)


def _answer_problem(answer: Any, verifier: str) -> str | None:
    """Why ``verifier`` cannot read ``answer`` as a target, or ``None``."""
    if verifier == "exact":
        return None
    scalar = not isinstance(answer, bool) and isinstance(answer, str | int | float)
    if verifier == "math":
        from ludic.envs.math_verifier import parse_math, readable_target

        readable = scalar and readable_target(parse_math(str(answer)))
        return None if readable else "is not an answer math-verify reads"
    final = str(answer) if verifier == "numeric" else gsm8k_answer(str(answer))
    if scalar and final is not None and parse_number(final) is not None:
        return None
    return "is not a number" + (" (nor ends in #### N)" if verifier == "gsm8k" else "")


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
