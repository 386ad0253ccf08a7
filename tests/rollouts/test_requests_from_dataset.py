"""make_requests_fn_from_queue: dataset items -> per-batch request lists."""

from __future__ import annotations

import asyncio
import queue

import pytest

from ludic.rollouts.requests import DataExhausted, EnvSpec, ProtocolSpec, RolloutRequest
from ludic.rollouts.requests_from_dataset import make_requests_fn_from_queue


def build(item: int) -> RolloutRequest:
    return RolloutRequest(EnvSpec("qa", {"index": item}), ProtocolSpec("p"), env_seed=item)


def seeds(requests):
    return [r.env_seed for r in requests]


def test_iterable_is_consumed_in_batches_then_exhausted():
    fn = make_requests_fn_from_queue(range(5), build_request=build, batch_size=2)
    assert seeds(fn()) == [0, 1]
    assert seeds(fn()) == [2, 3]
    assert seeds(fn()) == [4]
    with pytest.raises(DataExhausted, match="item source is empty"):
        fn()


def test_queue_is_read_without_blocking_and_can_be_refilled():
    q: queue.Queue[int] = queue.Queue()
    for i in range(3):
        q.put(i)
    fn = make_requests_fn_from_queue(q, build_request=build, batch_size=2)
    assert seeds(fn()) == [0, 1]
    assert seeds(fn()) == [2]
    with pytest.raises(DataExhausted):
        fn()
    q.put(9)
    assert seeds(fn()) == [9]


def test_asyncio_queue_is_supported():
    q: asyncio.Queue[int] = asyncio.Queue()
    q.put_nowait(4)
    fn = make_requests_fn_from_queue(q, build_request=build, batch_size=3)
    assert seeds(fn()) == [4]


def test_batch_size_below_one_is_rejected():
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        make_requests_fn_from_queue([1], build_request=build, batch_size=0)
