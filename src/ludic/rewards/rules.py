"""Built-in rule rewards chosen by ``data_source`` (spec 5's default reward function); each
returns 1.0 for a correct answer, else 0.0.

* GSM8K (``gsm8k``, ``openai/gsm8k``): the number after the response's last ``####``, else
  its last number, equals the ground truth's (which may be a whole GSM8K solution).
* MATH (``math``, ``hendrycks_math``, ...): the last ``\\boxed{}`` is equivalent to the
  ground truth through ``math-verify`` (the ``math`` extra); no box: 0.
* ``arithmetic``: ``numeric_match`` (``"19"``, ``" 19 "`` and ``"19.0"`` match 19).
* ``format_score``: 1 for a non-empty ``\\boxed{}`` (or ``<answer>``, ``tag="answer"``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from ludic.envs.dataset_qa_env import gsm8k_match, numeric_match
from ludic.envs.math_verifier import math_match
from ludic.parsers import last_boxed_content

GSM8K_SOURCES = frozenset({"gsm8k", "openai/gsm8k"})
NUMERIC_SOURCES = frozenset({"arithmetic"})
MATH_SOURCES = frozenset(
    {
        "math",
        "math500",
        "hendrycks_math",
        "lighteval/MATH",
        "DigitalLearningGmbH/MATH-lighteval",
        "HuggingFaceH4/MATH-500",
    }
)


def gsm8k_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
) -> float:
    """1.0 when the response's final number equals the ground truth's (GSM8K's ``####``)."""
    try:
        return 1.0 if gsm8k_match(solution_str, str(ground_truth)) else 0.0
    except ValueError as e:  # a ground truth without a number is the dataset's error
        raise ValueError(f"gsm8k reward ({data_source}): {e}") from None


def math_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
) -> float:
    """1.0 when the last ``\\boxed{}`` of the response equals the ground truth under
    ``math-verify``; 0.0 without a box."""
    answer = last_boxed_content(solution_str) if "\\boxed" in solution_str else None
    if not answer:
        return 0.0
    try:
        return 1.0 if math_match(answer, str(ground_truth)) else 0.0
    except ValueError as e:
        raise ValueError(f"math reward ({data_source}): {e}") from None


def arithmetic_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
) -> float:
    """1.0 when the response is the ground truth's number (``numeric_match``)."""
    return 1.0 if numeric_match(solution_str, str(ground_truth)) else 0.0


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def format_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any = None,
    extra_info: Any = None,
    *,
    tag: str = "boxed",
) -> float:
    """1.0 when the response states an answer in the expected format (a non-empty
    ``\\boxed{}``, or ``<answer>...</answer>`` with ``tag="answer"``)."""
    if tag == "answer":
        found = _ANSWER_TAG.findall(solution_str)
        return 1.0 if found and found[-1].strip() else 0.0
    if tag != "boxed":
        raise ValueError(f"format_score: tag={tag!r}; choose 'boxed' or 'answer'")
    content = last_boxed_content(solution_str) if "\\boxed" in solution_str else None
    return 1.0 if content else 0.0


RULES: Mapping[str, Callable[..., float]] = {
    **dict.fromkeys(GSM8K_SOURCES, gsm8k_score),
    **dict.fromkeys(MATH_SOURCES, math_score),
    **dict.fromkeys(NUMERIC_SOURCES, arithmetic_score),
}


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Any = None,
    *,
    fallback: Callable[..., float] | None = None,
) -> float:
    """The rule reward for ``data_source`` (see the module docstring); ``fallback`` for
    other sources, else a ``ValueError`` naming the known ones."""
    rule = RULES.get(data_source)
    if rule is None:
        if fallback is None:
            raise ValueError(
                f"no built-in reward for data_source={data_source!r}; known: "
                f"{sorted(RULES)}; pass a reward function (or a fallback)"
            )
        rule = fallback
    return rule(data_source, solution_str, ground_truth, extra_info)
