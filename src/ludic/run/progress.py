"""A progress bar as a :class:`~ludic.training.loggers.TrainingLogger`.

``ProgressLogger`` shows ``description | bar | step/total | reward | tokens/s | elapsed |
remaining`` and moves to ``step`` on every ``log``. Share its ``console`` with other
rich loggers so their lines print above the bar. When the console is not a terminal (CI,
a redirected file) rich draws nothing while running and prints the bar once on
``close()``, so logs are not flooded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

TOKENS_PER_S_KEY = "tokens_per_s"


class ProgressLogger:
    """Progress of one training phase of ``total_steps`` optimizer steps.

    ``reward_key`` names the metric shown next to the bar (``"-"`` until a step reports
    it); its label is the key's last ``/`` part without ``_mean`` (``"batch/reward_mean"``
    shows as ``reward``, ``"loss"`` as ``loss``).
    """

    def __init__(
        self,
        total_steps: int,
        description: str,
        *,
        reward_key: str = "batch/reward_mean",
        console: Console | None = None,
    ) -> None:
        if total_steps < 1:
            raise ValueError(f"ProgressLogger(total_steps={total_steps}) is invalid; expected >= 1")
        self.total_steps = total_steps
        self.reward_key = reward_key
        label = reward_key.rsplit("/", 1)[-1].removesuffix("_mean")
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(label + " {task.fields[reward]}"),
            TextColumn("{task.fields[tokens_per_s]} tok/s"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            refresh_per_second=4,
        )
        self._task = self._progress.add_task(
            description, total=total_steps, reward="-", tokens_per_s="-"
        )
        self._progress.start()
        self._closed = False

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._closed:
            return
        self._progress.update(
            self._task,
            completed=min(step, self.total_steps),
            reward=_format(metrics.get(self.reward_key), "{:.3f}"),
            tokens_per_s=_format(metrics.get(TOKENS_PER_S_KEY), "{:,.0f}"),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._progress.stop()


def _format(value: object, spec: str) -> str:
    """``spec`` applied to a finite number; ``"-"`` for a missing or non-numeric value."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return "-"
    return spec.format(value)


def print_summary(console: Console, summary: Mapping[str, object], *, title: str) -> None:
    """``summary`` as a two-column table (floats to 3 decimals; a nested mapping's entries
    as ``key/name`` rows)."""
    table = Table(title=title, show_header=False)
    for key, value in summary.items():
        rows = value.items() if isinstance(value, Mapping) else [("", value)]
        for name, shown in rows:
            label = f"{key}/{name}" if name else key
            table.add_row(label, f"{shown:.3f}" if isinstance(shown, float) else str(shown))
    console.print(table)
