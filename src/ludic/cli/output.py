"""What the ``ludic`` command prints: exit codes, one-line errors, metric tables."""

from __future__ import annotations

import sys
from pathlib import Path

EXIT_OK = 0
EXIT_FAILURE = 1  # an unexpected exception (a bug, or an environment problem)
EXIT_USAGE = 2  # a mistake the user can fix: bad config, missing file, RunError
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT


MAX_ERROR_CHARS = 1000
"""An error line is cut after this many characters (``--debug`` shows the whole message)."""


def one_line(err: BaseException) -> str:
    if isinstance(err, FileNotFoundError) and err.filename is not None:
        text = f"{err.strerror or 'no such file or directory'}: {err.filename}"
    else:
        text = str(err)
    text = " ".join(text.split())
    if len(text) <= MAX_ERROR_CHARS:
        return text
    more = len(text) - MAX_ERROR_CHARS
    return f"{text[:MAX_ERROR_CHARS]} ... ({more} more characters)"


def print_error(line: str) -> None:
    print(line, file=sys.stderr)


def stdout():
    from rich.console import Console

    return Console()


def print_metrics(metrics: dict[str, float], source: str | Path) -> None:
    from rich.table import Table

    table = Table(title=f"eval ({source})", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        table.add_row(key, shown)
    stdout().print(table)
