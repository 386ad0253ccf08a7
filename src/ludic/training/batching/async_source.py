"""Asynchronous batches: generation runs ahead of training by at most ``max_staleness`` versions.

:class:`AsyncBatchSource` wraps any ``BatchSource`` and generates batches in background tasks
while the trainer trains. Admission as in AReaL (arXiv:2505.24298), the rule being
:func:`ludic.training.staleness.may_start`: batch ``k``, numbered by start from the trainer's
version ``v0``, starts once the newest published version ``v`` has ``k <= v - v0 +
max_staleness``; batches reach the trainer in start order. The trainer calls
:meth:`on_policy_version` after each publish and :meth:`aclose` at the end. A generation failure
is raised from the next :meth:`next_batch`. Dropping stale items is the Trainer's, not this one's.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable
from typing import Any

from ludic.training.ledger import GENERATED
from ludic.training.staleness import may_start
from ludic.training.types import BatchSource, DataExhausted, SAWBatch

__all__ = ["AsyncBatchSource"]


class AsyncBatchSource:
    """Generate batches from ``source`` in the background, ``max_staleness`` versions ahead.

    * ``max_staleness`` (η >= 0): how many policy versions generation may run ahead of
      training (see the module docstring for the exact rule).
    * ``max_concurrent``: batches generated at the same time (default η + 1).

    ``last_rollouts`` holds the rollouts behind the batch last returned by
    :meth:`next_batch` when the wrapped source exposes ``last_rollouts``.
    """

    def __init__(
        self,
        source: BatchSource,
        *,
        max_staleness: int,
        max_concurrent: int | None = None,
    ) -> None:
        if not isinstance(source, BatchSource):
            raise TypeError(
                f"AsyncBatchSource(source={source!r}): expected a BatchSource (an object "
                "with `async next_batch() -> SAWBatch`), e.g. RolloutBatchSource"
            )
        if isinstance(source, AsyncBatchSource):
            raise TypeError("AsyncBatchSource(source=): the source is already asynchronous")
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(
                f"AsyncBatchSource: max_staleness={max_staleness!r}; expected an int >= 0 "
                "(0 = on-policy: generation waits for every update)"
            )
        if max_concurrent is None:
            max_concurrent = max_staleness + 1
        if not isinstance(max_concurrent, int) or max_concurrent < 1:
            raise ValueError(
                f"AsyncBatchSource: max_concurrent={max_concurrent!r}; expected an int >= 1"
            )
        self.source = source
        self.max_staleness = max_staleness
        self.max_concurrent = max_concurrent
        self.last_rollouts: list[Any] = []
        self._base_version: int | None = None
        self._version = 0
        self._started = 0  # batches whose generation has started
        self._pending: collections.deque[asyncio.Task[tuple[SAWBatch, list[Any]]]] = (
            collections.deque()
        )
        self._wakeup: asyncio.Event | None = None
        self._producer: asyncio.Task[None] | None = None
        self._exhausted = False
        self._closed = False
        self._generated = 0  # completion tokens of the batches made (the token ledger)
        self._discarded = 0  # of them, in batches made and never handed out (set by aclose)

    # ---------------------------------------------------------------- the trainer side
    def on_policy_version(self, version: int) -> None:
        """The newest policy version the inference side serves; admits new batches."""
        if self._base_version is None:
            self._base_version = version
        self._version = max(self._version, version)
        if self._wakeup is not None:
            self._wakeup.set()

    async def next_batch(self) -> SAWBatch:
        """The oldest batch started (waiting for it if needed)."""
        if self._closed:
            raise RuntimeError("AsyncBatchSource.next_batch() after aclose()")
        self._ensure_started()
        while not self._pending:
            if self._exhausted:
                raise DataExhausted("the wrapped batch source is exhausted")
            if self._producer is not None and self._producer.done():
                self._producer.result()  # re-raise a producer failure
                raise DataExhausted("the wrapped batch source is exhausted")
            assert self._wakeup is not None
            self._wakeup.clear()
            await self._wakeup.wait()
        task = self._pending[0]
        try:
            batch, rollouts = await task
        except DataExhausted:
            self._exhausted = True
            await self._cancel_pending()
            raise
        finally:
            if self._pending and self._pending[0] is task:
                self._pending.popleft()
            if self._wakeup is not None:
                self._wakeup.set()  # a slot is free
        self.last_rollouts = rollouts
        batch.meta["async/queued_batches"] = sum(t.done() for t in self._pending)
        batch.meta["async/generating_batches"] = sum(not t.done() for t in self._pending)
        return batch

    ledger_run_wide = False  # counts what this process generated
    ledger_committed_before = 0

    def ledger_totals(self) -> tuple[int, int]:
        """(tokens generated in the batches made so far, of them those in batches made but
        not yet handed out), for the token ledger (``ludic.training.ledger``); after
        :meth:`aclose`, the second are those of the batches it discarded. A batch cancelled
        while generating was never made: its tokens are in neither."""
        if self._closed:
            return self._generated, self._discarded
        return self._generated, _made_tokens(self._pending)

    async def aclose(self) -> None:
        """Stop generating: cancel the producer and every batch in progress (the batches
        made and not handed out are discarded: ``ledger_totals`` keeps their tokens)."""
        if self._closed:
            return
        self._closed = True
        if self._producer is not None:
            self._producer.cancel()
            await asyncio.gather(self._producer, return_exceptions=True)
        self._discarded = _made_tokens(await self._cancel_pending())

    # ---------------------------------------------------------------- the producer
    def _admitted(self) -> bool:
        base = self._base_version if self._base_version is not None else self._version
        return may_start(self._started, self._version - base, self.max_staleness)

    def _ensure_started(self) -> None:
        if self._producer is not None:
            return
        if self._base_version is None:
            self.on_policy_version(0)
        self._wakeup = asyncio.Event()
        self._producer = asyncio.get_running_loop().create_task(self._produce())

    async def _produce(self) -> None:
        assert self._wakeup is not None
        while not self._exhausted:
            generating = sum(not t.done() for t in self._pending)
            if self._admitted() and generating < self.max_concurrent:
                self._started += 1
                task = asyncio.get_running_loop().create_task(self._generate())
                task.add_done_callback(lambda _: self._wakeup and self._wakeup.set())
                self._pending.append(task)
                self._wakeup.set()  # a consumer may be waiting for the first batch
                await asyncio.sleep(0)
                continue
            self._wakeup.clear()
            await self._wakeup.wait()

    async def _generate(self) -> tuple[SAWBatch, list[Any]]:
        batch = await self.source.next_batch()
        self._generated += int(batch.meta.get(GENERATED, 0))
        rollouts = list(getattr(self.source, "last_rollouts", []) or [])
        return batch, rollouts

    async def _cancel_pending(self) -> list[asyncio.Task[tuple[SAWBatch, list[Any]]]]:
        """Cancel the batches in progress; returns every pending task (a batch made before
        the cancel keeps its result)."""
        tasks = list(self._pending)
        self._pending.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return tasks


def _made_tokens(tasks: Iterable[asyncio.Task[tuple[SAWBatch, list[Any]]]]) -> int:
    """Completion tokens of the batches among ``tasks`` that were made (done, neither
    cancelled nor failed)."""
    return sum(
        int(t.result()[0].meta.get(GENERATED, 0))
        for t in tasks
        if t.done() and not t.cancelled() and t.exception() is None
    )
