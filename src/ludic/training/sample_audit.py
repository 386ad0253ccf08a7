"""The bias audit: are the samples a run drops unlike the ones it trains on?

Long completions take longer to generate, so they go stale most, and a run that drops them
trains on a population shifted toward short answers without saying so. :class:`SampleAudit`
keeps, over the run, the count and mean prompt length, completion length and reward of the items
trained and dropped (stale, filtered, dropped by a source, or weight 0 after a failed reward),
logged every step as ``audit/<trained|dropped>_<field>``, and warns (:meth:`SampleAudit.warning`)
when dropped completions average over :data:`LONGER_DROPS` times the trained ones' length (the
rule, on logged metrics, is :func:`longer_drops`, which the run's plot shares).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ludic.training.types import SAWItem

__all__ = ["DROPPED_BY_SOURCE", "LONGER_DROPS", "MIN_DROPPED", "SampleAudit", "longer_drops"]

DROPPED_BY_SOURCE = "audit_dropped"
"""``batch.meta`` key: the totals (:meth:`SampleAudit.totals_of`) of the items a batch
source dropped before the Trainer saw them (a pipeline learner's stale items); the
Trainer adds them to its dropped side."""

LONGER_DROPS = 1.5
"""Dropped completions this many times longer than trained ones, on average, are reported."""
MIN_DROPPED = 8
"""Dropped items needed before the comparison is reported (fewer say little)."""


def longer_drops(metrics: Mapping[str, Any]) -> float | None:
    """How many times longer dropped completions are than trained ones on average, from the
    ``audit/*`` metrics (:meth:`SampleAudit.metrics`, or a logged step), when that is more
    than :data:`LONGER_DROPS` with at least :data:`MIN_DROPPED` dropped; else ``None``."""
    keys = ("dropped_samples", "trained_completion_length", "dropped_completion_length")
    values = [metrics.get(f"audit/{key}") for key in keys]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return None  # no trained or no dropped items yet
    dropped, trained_length, dropped_length = (float(v) for v in values)
    if not (dropped >= MIN_DROPPED and trained_length > 0):
        return None
    ratio = dropped_length / trained_length
    return ratio if ratio > LONGER_DROPS else None


@dataclass
class _Totals:
    samples: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reward: float = 0.0

    def add(self, item: SAWItem) -> None:
        completion = item.num_action_tokens
        prompt = item.meta.get("prompt_length", item.num_tokens - completion)
        reward = item.meta.get("reward")
        self.samples += 1
        self.prompt_tokens += int(prompt)
        self.completion_tokens += completion
        self.reward += float(reward) if isinstance(reward, int | float) else 0.0

    def means(self, name: str) -> dict[str, float]:
        if not self.samples:
            return {f"audit/{name}_samples": 0.0}
        n = self.samples
        return {
            f"audit/{name}_samples": float(n),
            f"audit/{name}_prompt_length": self.prompt_tokens / n,
            f"audit/{name}_completion_length": self.completion_tokens / n,
            f"audit/{name}_reward": self.reward / n,
        }


@dataclass
class SampleAudit:
    """Cumulative totals of trained and dropped items (see the module docstring)."""

    trained: _Totals = field(default_factory=_Totals)
    dropped: _Totals = field(default_factory=_Totals)

    def add(self, items: Iterable[SAWItem], *, dropped: bool) -> None:
        totals = self.dropped if dropped else self.trained
        for item in items:
            totals.add(item)

    @staticmethod
    def totals_of(items: Iterable[SAWItem]) -> dict[str, float]:
        """The totals of ``items``, for :data:`DROPPED_BY_SOURCE`."""
        totals = _Totals()
        for item in items:
            totals.add(item)
        return asdict(totals)

    def add_dropped_totals(self, totals: Mapping[str, float]) -> None:
        """Add what a batch source dropped (:data:`DROPPED_BY_SOURCE`)."""
        self.dropped.samples += int(totals.get("samples", 0))
        self.dropped.prompt_tokens += int(totals.get("prompt_tokens", 0))
        self.dropped.completion_tokens += int(totals.get("completion_tokens", 0))
        self.dropped.reward += float(totals.get("reward", 0.0))

    def metrics(self) -> dict[str, float]:
        return {**self.trained.means("trained"), **self.dropped.means("dropped")}

    def warning(self) -> str | None:
        """A sentence when dropped completions are more than :data:`LONGER_DROPS` times
        longer than trained ones on average (with at least :data:`MIN_DROPPED` dropped)."""
        ratio = longer_drops(self.metrics())
        if ratio is None:
            return None
        kept, gone = self.trained, self.dropped
        return (
            f"dropped samples are {ratio:.1f}x longer than trained ones on average "
            f"({gone.samples} dropped, {kept.samples} trained): the run trains on a "
            "population shifted toward short completions; raise max_staleness or loosen "
            "the filter (see audit/* in the metrics)"
        )

    def state(self) -> dict[str, dict[str, float]]:
        """For a checkpoint."""
        return {"trained": asdict(self.trained), "dropped": asdict(self.dropped)}

    @classmethod
    def from_state(cls, state: Mapping[str, Mapping[str, float]] | None) -> SampleAudit:
        if not state:
            return cls()
        return cls(_Totals(**state["trained"]), _Totals(**state["dropped"]))  # type: ignore[arg-type]
