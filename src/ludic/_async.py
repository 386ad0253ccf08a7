"""Small asyncio helpers shared by the protocols and the rollout engine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

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
