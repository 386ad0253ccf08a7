"""The bias audit: are the samples a run drops unlike the ones it trains on?

Dropping stale or filtered samples is not neutral: long completions take longer to
generate, so they are the ones most likely to go stale, and a run that drops them trains
on a population shifted toward short answers without saying so. :class:`SampleAudit`
keeps, cumulatively over the run, the count and the mean prompt length, completion length
and reward of the items the Trainer trained on and of those it dropped (stale or by the
sample filter), logged every step as ``audit/<trained|dropped>_<field>``, and says when
dropped completions are on average more than :data:`LONGER_DROPS` times longer than
trained ones (:meth:`SampleAudit.warning`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

from ludic.training.types import SAWItem

__all__ = ["LONGER_DROPS", "MIN_DROPPED", "SampleAudit"]

LONGER_DROPS = 1.5
"""Dropped completions this many times longer than trained ones, on average, are reported."""
MIN_DROPPED = 8
"""Dropped items needed before the comparison is reported (fewer say little)."""


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

    def metrics(self) -> dict[str, float]:
        return {**self.trained.means("trained"), **self.dropped.means("dropped")}

    def warning(self) -> str | None:
        """A sentence when dropped completions are more than :data:`LONGER_DROPS` times
        longer than trained ones on average (with at least :data:`MIN_DROPPED` dropped)."""
        kept, gone = self.trained, self.dropped
        if gone.samples < MIN_DROPPED or not kept.samples or not kept.completion_tokens:
            return None
        ratio = (gone.completion_tokens / gone.samples) / (kept.completion_tokens / kept.samples)
        if ratio <= LONGER_DROPS:
            return None
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
