"""JSON Lines files: one reader for the whole project, an fsynced append and an atomic
rewrite (pure stdlib).

A process killed while appending leaves at most one *torn* last line: :func:`read_jsonl`
drops it with a :class:`TornLineWarning` naming the file (``tolerate_torn_tail=True``, for
files this library appends to); a malformed line anywhere else is a :class:`JSONLError`
naming ``file:line``. :func:`rewrite_jsonl` writes a temporary file in the same folder,
fsyncs it and renames it over the original: a kill leaves the old or the new content.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "JSONLError",
    "TornLineWarning",
    "append_jsonl",
    "iter_jsonl",
    "read_jsonl",
    "rewrite_jsonl",
]


class JSONLError(ValueError):
    """A line of a JSONL file is not valid JSON (the message names ``file:line``)."""


class TornLineWarning(UserWarning):
    """The last line of a JSONL file was cut short by a crash and was dropped."""


def iter_jsonl(
    path: str | Path, *, tolerate_torn_tail: bool = False, encoding: str = "utf-8"
) -> Iterator[tuple[int, Any]]:
    """``(line_number, value)`` for each non-blank line of ``path`` (1-based numbers).

    A line that is not JSON raises :class:`JSONLError` naming ``path:line``, except, with
    ``tolerate_torn_tail``, the last non-blank line, which is dropped with a
    :class:`TornLineWarning` (what a crash in the middle of an append leaves).
    """
    path = Path(path)
    lines = path.read_text(encoding=encoding).split("\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            if tolerate_torn_tail and index == last:
                warnings.warn(
                    f"{path}:{index + 1}: dropped a torn last line ({len(line)} characters "
                    "that are not complete JSON, left by a crash while appending)",
                    TornLineWarning,
                    stacklevel=2,
                )
                return
            where = "the last line" if index == last else "a line in the middle"
            raise JSONLError(
                f"{path}:{index + 1}: not valid JSON ({err.msg} at column {err.colno}); "
                f"{where} of the file is damaged: fix or delete that line"
            ) from None
        yield index + 1, value


def read_jsonl(
    path: str | Path, *, tolerate_torn_tail: bool = False, encoding: str = "utf-8"
) -> list[Any]:
    """The values of :func:`iter_jsonl` (blank lines skipped)."""
    return [
        value
        for _, value in iter_jsonl(path, tolerate_torn_tail=tolerate_torn_tail, encoding=encoding)
    ]


def append_jsonl(path: str | Path, *records: Any, fsync: bool = True) -> None:
    """Append ``records``, one line each, and (``fsync``) flush them to disk before
    returning, so anything saved after this call (a checkpoint) never gets ahead of the
    file."""
    path = Path(path)
    with path.open("a", encoding="utf-8") as f:
        if f.tell() > 0 and not _ends_with_newline(path):
            f.write("\n")  # never glue a record onto a torn line
        f.writelines(json.dumps(record) + "\n" for record in records)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def rewrite_jsonl(path: str | Path, records: Iterable[Any]) -> None:
    """Replace ``path`` with ``records``, one per line, atomically (:func:`write_atomic`)."""
    write_atomic(path, "".join(json.dumps(record) + "\n" for record in records))


def write_atomic(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically: a temporary file in the same folder is
    written, fsynced and renamed over ``path`` (``os.replace``), then the folder is
    fsynced; a reader sees the old content or the new one, never a torn file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: str | Path) -> None:
    """Flush a folder's entries (a rename into it) to disk; a no-op where unsupported."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def fsync_tree(folder: str | Path) -> None:
    """Flush every file under ``folder``, then every folder's entries (deepest first), to
    disk: what a folder written next to its destination needs before it is renamed in."""
    folder = Path(folder)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for sub in sorted((p for p in folder.rglob("*") if p.is_dir()), reverse=True):
        fsync_dir(sub)
    fsync_dir(folder)
