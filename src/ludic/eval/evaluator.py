"""Evaluators: what a training loop calls every N steps to measure the policy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from ludic.eval.core import run_eval
from ludic.rollouts.engine import RolloutEngine
from ludic.rollouts.requests import RolloutRequest
from ludic.stats import Reducer
from ludic.types import Rollout


@runtime_checkable
class Evaluator(Protocol):
    async def evaluate(self) -> dict[str, float]:
        """Run one evaluation and return its metrics."""
        ...


class EngineEvaluator:
    """Evaluates with a ``RolloutEngine``: ``requests_fn()`` supplies the eval requests
    (e.g. fixed env seeds with ``ReturnSpec.for_eval()`` and low temperature), and the
    reducers (default: :func:`ludic.eval.core.default_reducers`) turn rollouts into
    metrics. ``last_rollouts`` keeps the latest evaluation's rollouts."""

    def __init__(
        self,
        engine: RolloutEngine,
        requests_fn: Callable[[], Sequence[RolloutRequest]],
        reducers: Sequence[Reducer] | None = None,
    ) -> None:
        self.engine = engine
        self.requests_fn = requests_fn
        self.reducers = reducers
        self.last_rollouts: list[Rollout] = []

    async def evaluate(self) -> dict[str, float]:
        metrics, self.last_rollouts = await run_eval(
            self.engine, list(self.requests_fn()), self.reducers
        )
        return metrics
