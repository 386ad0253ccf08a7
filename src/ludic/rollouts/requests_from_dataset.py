"""Curriculum helper: turn a queue or an iterable of dataset items into a ``requests_fn``.

``RolloutBatchSource`` calls ``requests_fn()`` once per batch; the function built here
pulls up to ``batch_size`` items per call and maps each to a ``RolloutRequest``.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ludic.rollouts.requests import DataExhausted, RolloutRequest

T = TypeVar("T")


def make_requests_fn_from_queue(
    source: queue.Queue[T] | asyncio.Queue[T] | Iterable[T],
    *,
    build_request: Callable[[T], RolloutRequest],
    batch_size: int,
) -> Callable[[], list[RolloutRequest]]:
    """A ``requests_fn`` that takes up to ``batch_size`` items per call.

    ``source`` is a ``queue.Queue``/``asyncio.Queue`` (read without blocking, so producers
    may keep filling it) or any iterable (consumed once). A call that finds fewer items
    returns what there is; a call that finds none raises :class:`DataExhausted`.
    """
    if batch_size < 1:
        raise ValueError(f"make_requests_fn_from_queue: batch_size must be >= 1, got {batch_size}")
    take: Callable[[], Any]
    if isinstance(source, queue.Queue | asyncio.Queue):
        take = _queue_taker(source)
    else:
        take = _iterator_taker(iter(source))

    def requests_fn() -> list[RolloutRequest]:
        items: list[Any] = []
        while len(items) < batch_size:
            ok, item = take()
            if not ok:
                break
            items.append(item)
        if not items:
            raise DataExhausted(
                "make_requests_fn_from_queue: the item source is empty; refill the queue, pass "
                "a longer (or cycling) iterable, or stop training"
            )
        return [build_request(item) for item in items]

    return requests_fn


def _queue_taker(q: queue.Queue[Any] | asyncio.Queue[Any]) -> Callable[[], tuple[bool, Any]]:
    def take() -> tuple[bool, Any]:
        try:
            return True, q.get_nowait()
        except (queue.Empty, asyncio.QueueEmpty):
            return False, None

    return take


def _iterator_taker(it: Any) -> Callable[[], tuple[bool, Any]]:
    def take() -> tuple[bool, Any]:
        try:
            return True, next(it)
        except StopIteration:
            return False, None

    return take
