"""What a step trains on: the batch source's batch after the sample filter, the staleness
rule (``training/staleness.py``), ``preprocess`` and the loss's input check.

An asynchronous source is asked again when every item of a batch was dropped; an
acknowledging (Redis) source's batch the loss cannot use is set aside and the next one
taken. Everything dropped is reported to the books (``training/step_books.py``); nothing
here counts or logs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence

from ludic.training.filters import SampleFilter
from ludic.training.staleness import is_too_stale, staleness_metrics, tightest
from ludic.training.step_books import StepBooks
from ludic.training.types import (
    AcknowledgingBatchSource,
    BatchSource,
    EmptyBatchError,
    SAWBatch,
    SAWItem,
    StalenessBoundedSource,
    TrainingAlgorithm,
)

__all__ = ["MAX_EMPTY_ASYNC_BATCHES", "MAX_REJECTED_BATCHES", "Selection", "StepSelector"]

log = logging.getLogger(__name__)

MAX_REJECTED_BATCHES = 16
"""Batches in a row an acknowledging source may have rejected (items the loss cannot use)
before the step fails: one is a poison pill, this many is a misconfigured producer."""
MAX_EMPTY_ASYNC_BATCHES = 8
"""How many batches in a row an asynchronous step may find empty (all stale or filtered)
before it raises ``EmptyBatchError``."""


@dataclasses.dataclass(frozen=True)
class Selection:
    """A step's batch, the source's batches it came from, and what was dropped."""

    batch: SAWBatch
    raw_batches: list[SAWBatch]
    metrics: dict[str, float]


@dataclasses.dataclass
class StepSelector:
    """Takes a step's batch from ``source`` (``SampleFilter``: ``SAWItem -> bool``, True
    keeps). ``max_staleness`` is the trainer's own bound; the source's, if it has one, is
    combined with it by :func:`~ludic.training.staleness.tightest`."""

    source: BatchSource
    algorithm: TrainingAlgorithm
    books: StepBooks
    sample_filter: SampleFilter | None = None
    trainer_max_staleness: int | None = None
    concurrent: bool = False

    def __post_init__(self) -> None:
        source = self.source
        self._acknowledging = source if isinstance(source, AcknowledgingBatchSource) else None
        self._bounded = source if isinstance(source, StalenessBoundedSource) else None

    @property
    def max_staleness(self) -> int | None:
        """The oldest token version trained on is ``step - max_staleness``: the tightest
        of ``TrainerConfig.max_staleness`` and the batch source's (``None``: no bound)."""
        source_bound = None if self._bounded is None else self._bounded.max_staleness
        return tightest(self.trainer_max_staleness, source_bound)

    async def select(self, step: int) -> Selection:
        """The batch of step ``step + 1``, trained into the weights of version ``step``."""
        raw_batches: list[SAWBatch] = []
        dropped = {"dropped/filter": 0, "dropped/stale": 0}
        attempts = MAX_EMPTY_ASYNC_BATCHES if self.concurrent else 1
        rejected, problem = 0, None
        while len(raw_batches) < attempts and rejected < MAX_REJECTED_BATCHES:
            raw = await self.source.next_batch()
            fresh = self._fresh_items(raw, step, dropped)
            if not fresh:
                raw_batches.append(raw)
                continue
            batch = SAWBatch(items=fresh, meta=raw.meta)
            if self.algorithm.preprocess is not None:  # a baseline over the kept items
                batch = self.algorithm.preprocess(batch)
            problem = self.loss_input_problem(batch.items)
            if problem is None:
                raw_batches.append(raw)
                metrics = {**dropped, **staleness_metrics(batch.items, step)}
                return Selection(batch, raw_batches, metrics)
            if self._acknowledging is None:
                raise ValueError(problem)
            # a batch from another process (a Redis learner's): set it aside, never crash
            # on it again after a restart, and train on the next one
            log.error("step %d: batch rejected: %s", step + 1, problem)
            self.books.rejected(fresh)
            await asyncio.to_thread(self._acknowledging.reject, raw, problem)
            rejected += 1
        if rejected >= MAX_REJECTED_BATCHES:
            raise EmptyBatchError(
                f"step {step + 1}: {rejected} batches in a row rejected (the last: "
                f"{problem}); they are set aside, but the producers keep making such batches: "
                "check their sampling settings against the loss"
            )
        raise EmptyBatchError(self._empty_message(raw_batches, dropped, step))

    def _fresh_items(self, batch: SAWBatch, step: int, dropped: dict[str, int]) -> list[SAWItem]:
        keep = self.sample_filter
        kept = [i for i in batch.items if keep is None or keep(i)]
        bound = self.max_staleness
        fresh = [i for i in kept if not is_too_stale(i.policy_version, step, bound)]
        dropped["dropped/filter"] += len(batch.items) - len(kept)
        dropped["dropped/stale"] += len(kept) - len(fresh)
        self.books.saw(batch, kept, fresh)
        return fresh

    def loss_input_problem(self, items: Sequence[SAWItem]) -> str | None:
        """Why the loss cannot train on ``items`` (``None``: it can)."""
        loss = self.algorithm.loss
        if not loss.requires_old_logprobs:
            return None
        missing = [item for item in items if item.old_logprobs is None]
        if not missing:
            return None
        rollout_ids = [item.meta.get("rollout_id") for item in missing[:3]]
        return (
            f"{type(loss).__name__} requires old_logprobs, but {len(missing)} of "
            f"{len(items)} items have none (rollouts {rollout_ids}); request behaviour "
            "logprobs with InferenceSpec(returns=ReturnSpec.for_rl())"
        )

    def _empty_message(self, raw: list[SAWBatch], dropped: dict[str, int], step: int) -> str:
        received = sum(len(b.items) for b in raw)
        what = (
            f"batch of {received} items is"
            if len(raw) == 1
            else f"{len(raw)} batches in a row ({received} items) are"
        )
        return (
            f"step {step + 1}: {what} empty after {dropped['dropped/filter']} dropped by "
            "sample_filter and "
            f"{dropped['dropped/stale']} stale (a token older than version {step} - "
            f"max_staleness={self.max_staleness}); loosen the filter, raise "
            "TrainerConfig.max_staleness (or the batch source's), or check the batch source"
        )
