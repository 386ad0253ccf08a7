"""The ``math`` verifier: equivalence through ``math-verify`` (fractions, LaTeX, intervals,
equations), wrong answers rejected, unreadable targets refused, usable off the main
thread (where math-verify's SIGALRM timeout cannot be set)."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("math_verify", reason="the math extra (math-verify) is not installed")

from ludic.envs.math_verifier import math_match  # noqa: E402


@pytest.mark.parametrize(
    ("prediction", "target"),
    [
        ("\\frac{1}{2}", "0.5"),
        ("0.5", "\\frac{1}{2}"),
        ("\\dfrac{1}{2}", "1/2"),
        ("\\boxed{72}", "72"),
        ("The answer is 72.", "72"),
        ("1,000", "1000"),
        ("\\left(0, 1\\right]", "(0, 1]"),
        ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"),
        ("x = 3", "3"),
        ("$x^2$", "x \\cdot x"),
    ],
)
def test_equivalent_answers_match(prediction, target) -> None:
    assert math_match(prediction, target)


@pytest.mark.parametrize(
    ("prediction", "target"),
    [("3", "4"), ("0.333", "\\frac{1}{3}"), ("", "3"), ("banana", "3"), ("[0, 1]", "(0, 1]")],
)
def test_wrong_answers_are_rejected(prediction, target) -> None:
    assert not math_match(prediction, target)


def test_an_unreadable_target_is_a_dataset_error() -> None:
    with pytest.raises(ValueError, match="target '\\?\\?\\?' is not an answer math-verify"):
        math_match("3", "???")


def test_it_works_off_the_main_thread() -> None:
    results: list[bool] = []
    worker = threading.Thread(target=lambda: results.append(math_match("\\frac{3}{4}", "0.75")))
    worker.start()
    worker.join(30)
    assert results == [True]
