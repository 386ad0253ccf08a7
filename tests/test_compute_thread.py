"""``on_compute_thread``: every call runs on one named thread, in order; errors and
context variables come back; a call from the compute thread itself is refused."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from ludic._async import on_compute_thread

REQUEST = contextvars.ContextVar("REQUEST", default="unset")


def test_calls_share_one_thread_and_keep_their_order() -> None:
    seen: list[tuple[str, int]] = []

    def work(i: int) -> int:
        seen.append((threading.current_thread().name, i))
        return i * i

    async def run() -> list[int]:
        return list(await asyncio.gather(*(on_compute_thread(work, i) for i in range(8))))

    assert asyncio.run(run()) == [i * i for i in range(8)]
    assert [i for _, i in seen] == list(range(8))
    names = {name for name, _ in seen}
    assert len(names) == 1 and names.pop().startswith("ludic-compute")
    assert threading.current_thread().name != "ludic-compute"


def test_errors_and_context_variables_come_through() -> None:
    def fail() -> None:
        raise ValueError("from the compute thread")

    async def run() -> str:
        REQUEST.set("step 3")
        with pytest.raises(ValueError, match="from the compute thread"):
            await on_compute_thread(fail)
        return await on_compute_thread(REQUEST.get)

    assert asyncio.run(run()) == "step 3"


def test_a_call_from_the_compute_thread_is_refused_not_deadlocked() -> None:
    def nested() -> None:
        asyncio.run(on_compute_thread(lambda: None))

    with pytest.raises(RuntimeError, match="would deadlock"):
        asyncio.run(on_compute_thread(nested))
