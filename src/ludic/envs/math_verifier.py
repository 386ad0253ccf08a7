"""``math_match``: answer equivalence through Hugging Face's ``math-verify`` package.

``math-verify`` parses LaTeX and plain expressions into sympy and compares them:
``\\frac{1}{2}`` = ``0.5`` = ``1/2``, ``\\left(0, 1\\right]`` is an interval,
``x = 3`` an equation, ``\\sqrt{2}/2`` a surd. It is an optional dependency
(``pip install 'ludic-rl[math]'``), imported on first use.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

PARSE_TIMEOUT_S = 5
"""Seconds ``math-verify`` may spend parsing or comparing one answer. Its timeout is a
``SIGALRM``, which Python allows in the main thread only: elsewhere no timeout applies."""


@functools.cache
def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(
            "the math verifier needs the math-verify package: pip install 'ludic-rl[math]'"
        ) from e
    return math_verify


def _timeout() -> int | None:
    return PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def parse_math(text: str) -> list[Any]:
    """``text`` parsed by ``math-verify`` (an empty list when nothing parses).

    A bare answer (what the ``boxed`` parser or a dataset's answer field holds, e.g.
    ``\\dfrac{1}{2}``) is read as if it were boxed, since ``math-verify`` finds LaTeX by
    its delimiters; a text that has its own ``\\boxed{}`` or ``$`` is read as is, and so
    is one that does not parse when boxed (a sentence ending in a number).
    """
    mv = _math_verify()
    timeout = _timeout()
    if "\\boxed" not in text and "$" not in text:
        parsed = mv.parse(f"\\boxed{{{text}}}", parsing_timeout=timeout)
        if parsed:
            return parsed
    return mv.parse(text, parsing_timeout=timeout)


def readable_target(parsed: list[Any]) -> bool:
    """A target needs a value math-verify can compare (a sympy expression, set, interval or
    equation), not only the raw-string fallback ``parse`` returns for text like ``???``."""
    return any(not isinstance(value, str) for value in parsed)


def math_match(prediction: str, target: str) -> bool:
    """True when ``math-verify`` finds the prediction equal to the target (numbers,
    fractions, LaTeX expressions, intervals, equations). An unparsable prediction scores
    ``False``; an unparsable *target* is a dataset bug and raises ``ValueError``."""
    gold = parse_math(target)
    if not readable_target(gold):
        raise ValueError(
            f"math_match: target {target!r} is not an answer math-verify can read; fix the "
            "dataset's answer field or use the exact_match verifier"
        )
    answer = parse_math(prediction)
    if not answer:
        return False
    return bool(_math_verify().verify(gold, answer, timeout_seconds=_timeout()))
