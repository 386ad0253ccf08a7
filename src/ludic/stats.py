"""Declarative metrics: a ``Reducer`` names a value on each item and how to reduce it.

``source`` is a dotted path read through attributes or mapping keys (``"total_reward"``,
``"meta.reward"``, ``"info.correct"``) or a callable ``item -> value``. Example::

    aggregate_stats([Reducer("reward_mean", "total_reward"),
                     Reducer("success_rate", "total_reward", reduce="fraction",
                             transform=lambda r: r > 0)], rollouts)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Reduce = Literal["mean", "sum", "max", "min", "count", "fraction"]
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "max", "min", "count", "fraction")


class StatsPathError(KeyError):
    """A ``Reducer`` source path does not exist on an item."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def lookup(item: Any, path: str) -> Any:
    """Follow the dotted ``path`` through mapping keys (for mappings) or attributes."""
    value = item
    parts = path.split(".")
    for i, part in enumerate(parts):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif not isinstance(value, Mapping) and hasattr(value, part):
            value = getattr(value, part)
        else:
            where = ".".join(parts[:i]) or "<item>"
            raise StatsPathError(
                f"stats path {path!r}: {type(value).__name__} at {where!r} has no "
                f"{'key' if isinstance(value, Mapping) else 'attribute'} {part!r} (item type "
                f"{type(item).__name__}); fix the Reducer source"
            )
    return value


@dataclass(frozen=True)
class Reducer:
    """One metric: read ``source`` from every item, apply ``transform``, then reduce.

    Reductions: ``mean``/``sum``/``max``/``min`` of the values; ``count`` = number of items
    whose value is truthy; ``fraction`` = that count / number of items. Over no items,
    ``mean``/``max``/``min``/``fraction`` are NaN and ``sum``/``count`` are 0.
    """

    name: str
    source: str | Callable[[Any], Any]
    reduce: Reduce = "mean"
    transform: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if self.reduce not in REDUCTIONS:
            raise ValueError(
                f"Reducer {self.name!r}: reduce={self.reduce!r}; expected one of {REDUCTIONS}"
            )
        if isinstance(self.source, str) and not self.source:
            raise ValueError(f"Reducer {self.name!r}: source is an empty path")

    def value(self, item: Any) -> Any:
        v = self.source(item) if callable(self.source) else lookup(item, self.source)
        return v if self.transform is None else self.transform(v)

    def __call__(self, items: Sequence[Any]) -> float:
        values = [self.value(it) for it in items]
        if self.reduce in ("count", "fraction"):
            hits = sum(1 for v in values if v)
            if self.reduce == "count":
                return float(hits)
            return hits / len(values) if values else math.nan
        nums = [self._number(v, it) for v, it in zip(values, items)]
        if self.reduce == "sum":
            return float(sum(nums))
        if not nums:
            return math.nan
        if self.reduce == "mean":
            return sum(nums) / len(nums)
        return float(max(nums) if self.reduce == "max" else min(nums))

    def _number(self, v: Any, item: Any) -> float:
        if isinstance(v, bool | int | float):
            return float(v)
        raise TypeError(
            f"Reducer {self.name!r}: value {v!r} ({type(v).__name__}) from a "
            f"{type(item).__name__} is not a number; add a transform or use "
            "reduce='count'/'fraction'"
        )


def aggregate_stats(reducers: Iterable[Reducer], items: Iterable[Any]) -> dict[str, float]:
    """``{reducer.name: reducer(items)}``. Names must be unique."""
    items = list(items)
    out: dict[str, float] = {}
    for r in reducers:
        if r.name in out:
            raise ValueError(f"aggregate_stats: two reducers are named {r.name!r}")
        out[r.name] = r(items)
    return out
