"""AsyncBatchSource: admission control (at most max_staleness versions ahead), FIFO order,
failures and exhaustion raised from next_batch, cancellation on aclose."""

from __future__ import annotations

import asyncio

import pytest

from ludic.training.batching.async_source import AsyncBatchSource
from ludic.training.types import DataExhausted, SAWBatch, SAWItem


class GatedSource:
    """Batch k is released when the test sets ``gates[k]``; records start order."""

    def __init__(self, limit: int | None = None) -> None:
        self.started: list[int] = []
        self.gates: dict[int, asyncio.Event] = {}
        self.limit = limit
        self.cancelled: list[int] = []

    def gate(self, k: int) -> asyncio.Event:
        return self.gates.setdefault(k, asyncio.Event())

    async def next_batch(self) -> SAWBatch:
        k = len(self.started)
        if self.limit is not None and k >= self.limit:
            raise DataExhausted("done")
        self.started.append(k)
        try:
            await self.gate(k).wait()
        except asyncio.CancelledError:
            self.cancelled.append(k)
            raise
        item = SAWItem((1, 2, 3), (0, 1, 1), weight=1.0, policy_version=0, meta={"k": k})
        return SAWBatch(items=[item], meta={"k": k})


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_generation_runs_at_most_max_staleness_versions_ahead() -> None:
    async def run() -> None:
        inner = GatedSource()
        source = AsyncBatchSource(inner, max_staleness=2)
        source.on_policy_version(5)  # the trainer's version when training starts
        first = asyncio.ensure_future(source.next_batch())
        await _settle()
        assert inner.started == [0, 1, 2]  # batches 0..eta admitted at version 5
        inner.gate(0).set()
        assert (await first).meta["k"] == 0
        await _settle()
        assert inner.started == [0, 1, 2]  # consuming does not admit: a new version does
        source.on_policy_version(6)
        await _settle()
        assert inner.started == [0, 1, 2, 3]
        await source.aclose()
        assert sorted(inner.cancelled) == [1, 2, 3]

    asyncio.run(run())


def test_zero_staleness_is_on_policy_one_batch_per_version() -> None:
    async def run() -> None:
        inner = GatedSource()
        source = AsyncBatchSource(inner, max_staleness=0)
        source.on_policy_version(0)
        for version in range(3):
            inner.gate(version).set()
            batch = await source.next_batch()
            await _settle()
            assert batch.meta["k"] == version
            assert inner.started == list(range(version + 1))  # nothing runs ahead
            source.on_policy_version(version + 1)
        await source.aclose()

    asyncio.run(run())


def test_batches_come_back_in_start_order_even_when_they_finish_out_of_order() -> None:
    async def run() -> None:
        inner = GatedSource()
        source = AsyncBatchSource(inner, max_staleness=2)
        source.on_policy_version(0)
        await _settle()
        inner.gate(2).set()
        inner.gate(1).set()
        await _settle()
        pending = asyncio.ensure_future(source.next_batch())
        await _settle()
        assert not pending.done()  # batch 0 first, although 1 and 2 are ready
        inner.gate(0).set()
        assert [(await pending).meta["k"]] + [
            (await source.next_batch()).meta["k"] for _ in range(2)
        ] == [0, 1, 2]
        await source.aclose()

    asyncio.run(run())


def test_a_generation_failure_is_raised_from_next_batch() -> None:
    class Failing:
        async def next_batch(self) -> SAWBatch:
            raise RuntimeError("env exploded")

    async def run() -> None:
        source = AsyncBatchSource(Failing(), max_staleness=1)
        with pytest.raises(RuntimeError, match="env exploded"):
            await asyncio.wait_for(source.next_batch(), 5)
        await source.aclose()

    asyncio.run(run())


def test_exhaustion_ends_after_the_batches_already_made() -> None:
    async def run() -> None:
        inner = GatedSource(limit=2)
        for k in range(2):
            inner.gate(k).set()
        source = AsyncBatchSource(inner, max_staleness=3)
        source.on_policy_version(0)
        assert [(await source.next_batch()).meta["k"] for _ in range(2)] == [0, 1]
        with pytest.raises(DataExhausted):
            await asyncio.wait_for(source.next_batch(), 5)
        await source.aclose()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_staleness": -1}, "max_staleness"),
        ({"max_staleness": 1, "max_concurrent": 0}, "max_concurrent"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        AsyncBatchSource(GatedSource(), **kwargs)


def test_a_non_source_is_rejected() -> None:
    with pytest.raises(TypeError, match="BatchSource"):
        AsyncBatchSource(object(), max_staleness=1)  # type: ignore[arg-type]
