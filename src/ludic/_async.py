"""Small asyncio helpers shared by the protocols and the rollout engine."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

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
