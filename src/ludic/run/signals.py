"""SIGTERM handled like Ctrl-C, so ``kill PID`` leaves a run as resumable as Ctrl-C does.

:func:`terminate_as_interrupt` routes SIGTERM to whatever handles SIGINT at that moment
(inside ``asyncio.run``: the main task is cancelled at its next await) and re-raises the
interrupt as :class:`Terminated`, so the CLI exits with 143. A background job (``ludic
train ... &``) has SIGINT ignored, so ``asyncio.run`` cancels nothing: loops started with
:func:`run_interruptible` are cancelled by SIGTERM all the same. Synchronous loops wrap each
step in :func:`interrupts_deferred`, so a signal lands between steps, never between an
optimizer step and its bookkeeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Coroutine, Iterator
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = [
    "EXIT_TERMINATED",
    "Terminated",
    "interrupts_deferred",
    "run_interruptible",
    "terminate_as_interrupt",
]

EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, as shells report a SIGTERM death


class Terminated(KeyboardInterrupt):
    """The run received SIGTERM; it stopped as it does on Ctrl-C."""


_main_tasks: list[asyncio.Task[Any]] = []  # run_interruptible's running main tasks
_cancelled_by_sigterm = threading.Event()


def run_interruptible(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``, whose main task a SIGTERM (inside
    :func:`terminate_as_interrupt`) cancels at its next await even when SIGINT is ignored;
    that cancellation leaves as :class:`Terminated`."""

    async def main() -> T:
        task = asyncio.current_task()
        assert task is not None
        _main_tasks.append(task)
        try:
            return await coro
        finally:
            _main_tasks.remove(task)

    try:
        return asyncio.run(main())
    except asyncio.CancelledError:
        if _cancelled_by_sigterm.is_set():
            raise Terminated("SIGTERM") from None
        raise


def _cancel_main_tasks() -> bool:
    """Cancel every running :func:`run_interruptible` task (from a signal handler)."""
    for task in list(_main_tasks):
        _cancelled_by_sigterm.set()
        task.get_loop().call_soon_threadsafe(task.cancel)
    return bool(_main_tasks)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While active (main thread only; elsewhere a no-op), SIGTERM behaves like SIGINT and
    the resulting ``KeyboardInterrupt`` leaves as :class:`Terminated`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        on_sigint = signal.getsignal(signal.SIGINT)
        if callable(on_sigint):
            on_sigint(signal.SIGINT, frame)  # asyncio's handler: cancel at the next await
        elif not _cancel_main_tasks():  # SIGINT ignored (a background job), and no
            raise KeyboardInterrupt  # run_interruptible loop to cancel: interrupt here

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    _cancelled_by_sigterm.clear()
    try:
        yield
    except KeyboardInterrupt as interrupt:
        if received and not isinstance(interrupt, Terminated):
            raise Terminated("SIGTERM") from interrupt
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive inside the block are held until it ends, then raised
    as ``KeyboardInterrupt`` (:class:`Terminated` for SIGTERM). Main thread only; elsewhere
    a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, hold) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if signal.SIGTERM in received:
        raise Terminated("SIGTERM")
    if received:
        raise KeyboardInterrupt
