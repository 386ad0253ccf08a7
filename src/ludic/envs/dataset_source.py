"""Where a QA env's samples come from: a local file or ``hf:NAME[:SPLIT]``.

``*.jsonl`` is read line by line by ludic (errors name ``file:line``; fields may mix types,
which Arrow would refuse); ``*.json``, ``*.parquet`` and ``*.csv`` go through the
``datasets`` library, and so does ``hf:NAME[:SPLIT]`` (``load_dataset(NAME, subset,
split=SPLIT)``, ``train`` by default; only the local cache with ``HF_HUB_OFFLINE=1``).
``datasets`` (the ``data`` extra) is imported only for the sources that need it.
:func:`split_holdout` carves a held-out part out of the samples, the same on every call.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ludic.jsonl import iter_jsonl

HF_PREFIX = "hf:"
DATASETS_BUILDERS = {".json": "json", ".parquet": "parquet", ".csv": "csv"}
SUFFIXES = (".jsonl", *DATASETS_BUILDERS)

Part = Literal["train", "heldout"]


@dataclass(frozen=True, eq=False)
class Records:
    """One read of a source: ``(where, record)`` pairs, ``where`` naming the record in
    errors (``file.jsonl:LINE`` or ``SOURCE row N``). Hashed by identity, so a cache keyed
    by it holds one entry per read (a file that changes is a new read)."""

    rows: tuple[tuple[str, dict[str, Any]], ...]

    def __len__(self) -> int:
        return len(self.rows)


def load_records(source: str, *, subset: str | None = None, field: str = "path") -> Records:
    """Every record of ``source`` (cached per file version; ``hf:`` sources once per
    process). ``field`` is the config field that holds ``source``, named in errors."""
    if source.startswith(HF_PREFIX):
        return _hub_records(source, subset, field)
    file = Path(source).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"{field}: dataset file {str(file)!r} does not exist")
    suffix = file.suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(
            f"{field}: {str(file)!r} has suffix {suffix!r}; read are {list(SUFFIXES)} files "
            f"and {HF_PREFIX}NAME[:SPLIT] datasets"
        )
    if subset is not None:
        raise ValueError(f"subset={subset!r} applies to {HF_PREFIX} datasets only, not files")
    stat = file.stat()
    return _file_records(str(file.resolve()), stat.st_mtime_ns, stat.st_size, field)


@functools.lru_cache(maxsize=8)
def _file_records(path: str, mtime_ns: int, size: int, field: str) -> Records:
    """Cached per file version: a run builds an env per episode."""
    if path.endswith(".jsonl"):
        rows = []
        for lineno, record in iter_jsonl(path):  # a line that is not JSON: file:line
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {record!r}")
            rows.append((f"{path}:{lineno}", record))
        return Records(tuple(rows))
    builder = DATASETS_BUILDERS[Path(path).suffix.lower()]
    dataset = _load(field, path, builder, data_files=path, split="train")
    return Records(tuple((f"{path} row {i + 1}", r) for i, r in enumerate(dataset.to_list())))


@functools.lru_cache(maxsize=8)
def _hub_records(source: str, subset: str | None, field: str) -> Records:
    name, _, split = source.removeprefix(HF_PREFIX).partition(":")
    if not name:
        raise ValueError(f"{field}: {source!r} names no dataset; write {HF_PREFIX}NAME[:SPLIT]")
    dataset = _load(field, source, name, subset, split=split or "train")
    return Records(tuple((f"{source} row {i + 1}", r) for i, r in enumerate(dataset.to_list())))


def _load(field: str, source: str, *args: Any, **kwargs: Any) -> Any:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            f"{field}: reading {source!r} needs the datasets package: pip install 'ludic-rl[data]'"
        ) from e
    quiet = not datasets.utils.are_progress_bars_disabled()
    if quiet:
        datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(*args, **kwargs)
    except (ValueError, FileNotFoundError, ConnectionError, OSError) as e:
        hint = (
            " (offline: set HF_HUB_OFFLINE=1 to read a dataset from the local cache, "
            "HF_DATASETS_CACHE)"
            if source.startswith(HF_PREFIX)
            else ""
        )
        raise ValueError(f"{field}: could not read {source!r}: {e}{hint}") from None
    except Exception as e:  # datasets' own errors (DatasetGenerationError, ...)
        raise ValueError(f"{field}: could not read {source!r}: {type(e).__name__}: {e}") from None
    finally:
        if quiet:
            datasets.enable_progress_bars()


def split_holdout(
    records: Sequence[Any], holdout: float | int, *, seed: int = 0, part: Part = "train"
) -> list[Any]:
    """The ``train`` or ``heldout`` part of ``records``: ``holdout`` records (a count, or a
    fraction of the total when < 1) drawn by ``random.Random(seed)``; both parts keep the
    file's order. ``holdout=0``: everything is ``train``."""
    n = len(records)
    if isinstance(holdout, bool) or holdout < 0:
        raise ValueError(f"holdout={holdout!r}; expected a count >= 0 or a fraction in (0, 1)")
    k = round(holdout * n) if 0 < holdout < 1 else int(holdout)
    if holdout and not 0 < k < n:
        raise ValueError(
            f"holdout={holdout!r} holds out {k} of {n} samples; leave at least one on each side"
        )
    if part not in ("train", "heldout"):
        raise ValueError(f"part={part!r}; choose 'train' or 'heldout'")
    held = set(random.Random(seed).sample(range(n), k))
    keep = held if part == "heldout" else set(range(n)) - held
    return [r for i, r in enumerate(records) if i in keep]
