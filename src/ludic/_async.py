"""Small asyncio helpers shared by the protocols and the rollout engine."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


async def gather_or_cancel(*aws: Awaitable[T]) -> list[T]:
    """``asyncio.gather(*aws)``, except that when one awaitable fails (or the caller is
    cancelled) the others are cancelled and awaited before the error propagates, so none
    keeps running in the background or loses its own error."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class PerLoop(Generic[T]):
    """One ``make()`` value per running event loop, made on first use in that loop.

    asyncio locks and semaphores belong to the loop they first wait on; an object that
    successive ``asyncio.run`` calls share (a reward manager, a reward loop) keeps its
    primitives here so that each loop gets its own instead of a "bound to a different
    event loop" error."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._values: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, T] = (
            weakref.WeakKeyDictionary()
        )

    def get(self) -> T:
        loop = asyncio.get_running_loop()
        value = self._values.get(loop)
        if value is None:
            value = self._values[loop] = self._make()
        return value


async def in_daemon_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a new daemon thread, awaited without blocking the loop.

    Unlike ``asyncio.to_thread`` (the loop's default executor), a call that never returns
    keeps neither ``asyncio.run`` from returning nor the interpreter from exiting: when the
    awaiting task is cancelled (a timeout), the thread is abandoned and its result or
    error dropped. Context variables are copied into the thread, as ``to_thread`` does.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def settle(ok: bool, value: Any) -> None:
        if future.done():  # cancelled: the caller gave up on this call
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def target() -> None:
        try:
            outcome = (True, context.run(fn, *args, **kwargs))
        except BaseException as e:  # noqa: BLE001 (delivered to the awaiting task)
            outcome = (False, e)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(settle, *outcome)

    name = f"ludic-{getattr(fn, '__qualname__', 'call')}"
    threading.Thread(target=target, name=name, daemon=True).start()
    return await future


_COMPUTE_THREAD = concurrent.futures.ThreadPoolExecutor(
    max_workers=1, thread_name_prefix="ludic-compute"
)
_ABANDONED: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "ludic_compute_abandoned", default=None
)
_in_flight = 0  # calls submitted to the compute thread and not yet finished
_in_flight_lock = threading.Lock()


class ComputeAbandoned(Exception):
    """Raised inside a compute-thread call whose awaiting task was cancelled."""


def raise_if_abandoned() -> None:
    """For long loops running on the compute thread (token-by-token sampling): stop once
    the task that awaits this call has been cancelled, instead of computing (and drawing
    from the global RNG) for nobody."""
    event = _ABANDONED.get()
    if event is not None and event.is_set():
        raise ComputeAbandoned("the task awaiting this compute call was cancelled")


def compute_calls_in_flight() -> int:
    """Calls submitted to the compute thread that have not finished (queued or running)."""
    return _in_flight


async def on_compute_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on ludic's one compute thread, awaited without blocking the
    loop.

    The in-process backends (sampling, reward scoring) and the sync Trainer's update all
    run their torch work here, one call after another, so that work happens on a single
    OS thread. Torch's CPU ops parallelize over an OpenMP thread team per calling thread:
    sampling on one thread and training on another gave two teams, whose idle threads
    spin while the other team runs (a 2-core machine: a GRPO step of a tiny model took
    1.3x longer; see ``benchmarks/generation.py``). Context variables are copied in, as
    ``asyncio.to_thread`` does. Must not be called from the compute thread itself.

    When the awaiting task is cancelled, a call that has not started never runs, and a
    running one stops at its next :func:`raise_if_abandoned` check.
    """
    global _in_flight
    if threading.current_thread().name.startswith("ludic-compute"):
        raise RuntimeError("on_compute_thread called from the compute thread: it would deadlock")
    loop = asyncio.get_running_loop()
    abandoned = threading.Event()
    context = contextvars.copy_context()
    context.run(_ABANDONED.set, abandoned)

    def call() -> T:
        if abandoned.is_set():
            raise ComputeAbandoned("cancelled before it started")
        return context.run(fn, *args, **kwargs)

    def finished(_: concurrent.futures.Future[T]) -> None:  # run, failed or cancelled
        global _in_flight
        with _in_flight_lock:
            _in_flight -= 1

    with _in_flight_lock:
        _in_flight += 1
    try:
        future = _COMPUTE_THREAD.submit(call)
    except BaseException:
        finished(concurrent.futures.Future())
        raise
    future.add_done_callback(finished)
    try:
        return await asyncio.wrap_future(future, loop=loop)
    except asyncio.CancelledError:
        abandoned.set()
        raise
