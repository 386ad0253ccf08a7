"""Staleness has one rule: ``is_too_stale`` drops, ``may_start`` admits, and every part that
drops or admits (the Trainer's step selection, the in-process async source, the pipeline's
learner source and actors) calls them rather than a formula of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ludic.training.staleness import is_too_stale, may_start, staleness_metrics, tightest
from ludic.training.types import SAWItem

SRC = Path(__file__).resolve().parents[2] / "src" / "ludic"


def test_an_item_is_too_stale_only_past_the_bound() -> None:
    assert not is_too_stale(8, 10, 2)  # staleness 2 = the bound: trained
    assert is_too_stale(7, 10, 2)
    assert not is_too_stale(12, 10, 0)  # a newer version (weights a crash lost): kept
    assert not is_too_stale(None, 10, 0) and not is_too_stale(0, 10, None)


def test_a_batch_may_start_at_most_max_staleness_ahead() -> None:
    assert may_start(3, 1, 2) and not may_start(4, 1, 2)
    assert may_start(0, 0, 0) and not may_start(1, 0, 0)  # 0: on-policy, one at a time
    assert may_start(10**6, 0, None)


def test_bounds_combine_to_the_tightest_and_metrics_count_ages() -> None:
    assert tightest(None, 3, 1) == 1 and tightest(None, None) is None
    items = [
        SAWItem((1, 2, 3), (0, 1, 1), 1.0, action_versions=(4, 5)),
        SAWItem((1, 2), (0, 1), 1.0, policy_version=6),
    ]
    assert staleness_metrics(items, 6) == {
        "staleness/mean": 1.0,
        "staleness/max": 2.0,
        "staleness/version_span_max": 1.0,
    }


@pytest.mark.parametrize(
    ("module", "rule"),
    [
        ("training/step_selection.py", "is_too_stale"),
        ("training/batching/async_source.py", "may_start"),
        ("pipeline/batch_source.py", "is_too_stale"),
        ("pipeline/batch_source.py", "may_start"),
    ],
)
def test_every_part_that_drops_or_admits_calls_the_rule(module: str, rule: str) -> None:
    tree = ast.parse((SRC / module).read_text())
    called = {
        node.func.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    assert rule in called, f"{module} no longer calls staleness.{rule}"
