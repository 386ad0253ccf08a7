"""Where a step's time goes: seconds per stage, summed over the process's threads.

The stages ludic times (``STAGES``): ``template`` (chat template rendering and
tokenization), ``sample`` (the in-process backend's sampling, on the compute thread),
``env`` (env ``reset`` / ``step``), ``parser`` (the agent's parser), ``credit`` (credit
assignment and building the batch's items), ``logging`` and ``checkpoint``. The trainer
adds each step's totals to its metrics as ``time/stage/<stage>_s`` (logging and checkpoint
of a step land in the next step's figures, as they run after its metrics are made).

Times are wall clock inside each stage. A stage runs synchronously (no ``await`` inside),
so time on one thread is not counted twice; stages on different threads (the compute
thread samples while the event loop renders templates) may overlap, and then add up to
more than the step took.
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
