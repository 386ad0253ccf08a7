"""Where a step's time goes: seconds per stage, summed over the process's threads.

Stages (``STAGES``): ``template`` (chat template and tokenization), ``sample`` (in-process
sampling, on the compute thread), ``env`` (``reset`` / ``step``), ``parser``, ``credit``
(credit assignment and the batch's items), ``logging`` and ``checkpoint``. The trainer logs
each step's totals as ``time/stage/<stage>_s`` (a step's logging and checkpoint land in the
next step's). A stage runs synchronously, so one thread's time is not counted twice; stages
on different threads may overlap and add up to more than the step took.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["STAGES", "take_stage_seconds", "timed"]

STAGES = ("template", "sample", "env", "parser", "credit", "logging", "checkpoint")

_seconds: dict[str, float] = {}
_lock = threading.Lock()


@contextmanager
def timed(stage: str) -> Iterator[None]:
    """Add the time spent in the ``with`` block to ``stage``'s total."""
    started = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - started
        with _lock:
            _seconds[stage] = _seconds.get(stage, 0.0) + elapsed


def take_stage_seconds() -> dict[str, float]:
    """The totals since the last call (every stage of ``STAGES``, 0.0 if it did not run),
    then start again from zero."""
    global _seconds
    with _lock:
        taken, _seconds = _seconds, {}
    return {stage: taken.get(stage, 0.0) for stage in STAGES} | taken
