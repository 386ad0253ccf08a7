"""Staleness: the one rule for what is too old to train on, and when generation may start.

An item's staleness is the trainer's policy version minus the version of its oldest token.
:func:`is_too_stale` is the drop rule (the Trainer, a pipeline learner's source);
:func:`may_start` is admission (AReaL): batch ``k`` starts once training has made ``k -
max_staleness`` progress (the in-process async source, the pipeline actors). A correction
for the staleness that remains lives in the loss (``losses/decoupled.py``), not here.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from ludic.training.types import SAWItem

__all__ = ["is_too_stale", "may_start", "staleness_metrics", "tightest"]


def is_too_stale(item_version: int | None, version: int, max_staleness: int | None) -> bool:
    """Whether an item whose oldest token is ``item_version`` is too old to train into the
    weights of ``version`` (``None`` for either: unknown or unbounded, never too old)."""
    if max_staleness is None or item_version is None:
        return False
    return version - item_version > max_staleness


def may_start(batch_index: int, progress: int, max_staleness: int | None) -> bool:
    """Whether generation may start batch ``batch_index`` (0-based) once training has made
    ``progress`` (policy versions since the first, or batches finished): at most
    ``max_staleness`` ahead, so no batch is older than the bound when it is trained."""
    return max_staleness is None or batch_index <= progress + max_staleness


def tightest(*bounds: int | None) -> int | None:
    """The smallest of the known bounds (``None``: none is known, no bound)."""
    known = [bound for bound in bounds if bound is not None]
    return min(known) if known else None


def staleness_metrics(items: Sequence[SAWItem], version: int) -> dict[str, float]:
    """``staleness/{mean,max}`` over the items with known versions, and the largest number
    of updates one item's tokens straddle (``staleness/version_span_max``)."""
    ages = [version - i.policy_version for i in items if i.policy_version is not None]
    if not ages:
        return {}
    return {
        "staleness/mean": statistics.fmean(ages),
        "staleness/max": float(max(ages)),
        "staleness/version_span_max": float(max(i.version_span for i in items)),
    }
