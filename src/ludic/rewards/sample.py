"""What a reward function scores and what scoring returns (pure data)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RewardSample:
    """One finished rollout as a reward function sees it (spec 5's arguments).

    ``solution_str`` is the policy's response text, ``ground_truth`` the reference answer,
    ``extra_info`` anything else the data carries (e.g. ``question``).
    ``response_length`` (tokens) and ``max_response_length`` are what length-aware
    managers (``dapo``) read; ``None`` where unknown.
    """

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)
    response_length: int | None = None
    max_response_length: int | None = None
    sample_id: str | None = None


@dataclass(frozen=True)
class RewardResult:
    """The score of one sample, the metrics its function returned next to ``score``, and,
    when scoring failed (the function raised, timed out or returned something that is not
    a score), ``error`` with ``score`` the manager's fallback or ``None`` (dropped)."""

    score: float | None
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    def __post_init__(self) -> None:
        if self.score is not None and not math.isfinite(self.score):
            raise ValueError(f"RewardResult.score={self.score!r}; expected a finite number")

    @property
    def ok(self) -> bool:
        return self.error is None
