"""Deadlines of a weight sync's stages, derived from the bytes each one moves, and the
progress a failed sync reports.

A stage that moves ``n`` bytes gets ``base_s + n / FLOOR_BYTES_PER_S``: the control plane's
round trips (the client's ``timeout_s``) plus the bytes' time at the slowest rate ludic
accepts. The floor is far below what any link or loader here does (a vLLM CPU worker reloads
2.4 GB in about 10 s; ``benchmarks/sync_verify.py``), so a slow but working stage is never cut
short, and a stalled one is named within minutes, never left to hang.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

FLOOR_BYTES_PER_S = 20e6
"""The slowest a sync stage may move bytes (20 MB/s) before its deadline passes."""

STAGES = ("pause", "group init", "announce", "broadcast", "load", "report", "resume", "canary")
"""The stages a sync goes through, in order (``wake`` and ``sleep`` for a colocated server)."""


def stage_deadline(base_s: float, nbytes: int) -> float:
    """Seconds a stage moving ``nbytes`` may take: ``base_s + nbytes / FLOOR_BYTES_PER_S``."""
    return base_s + max(0, nbytes) / FLOOR_BYTES_PER_S


@dataclass
class SyncProgress:
    """Where one sync is: the stage it is in and the bytes moved so far (of
    ``bytes_total``), for the error that names a stage that failed."""

    version: int | None = None
    bytes_total: int = 0
    bytes_handed: int = 0  # bytes of the chunks the sender took (it looks one chunk ahead)
    stage: str = "pause"
    stages_done: list[str] = field(default_factory=list)
    moved: Callable[[], int] | None = None
    """Bytes every worker has received so far, where the sender counts them (broadcast)."""

    @property
    def bytes_moved(self) -> int:
        return self.moved() if self.moved is not None else self.bytes_handed

    def enter(self, stage: str) -> None:
        if self.stage != stage:
            if self.stage not in self.stages_done:
                self.stages_done.append(self.stage)
            self.stage = stage

    def describe(self) -> str:
        moved = f"{self.bytes_moved / 2**20:.1f} of {self.bytes_total / 2**20:.1f} MiB"
        return f"stage {self.stage!r} of the sync of version {self.version} ({moved} sent)"
