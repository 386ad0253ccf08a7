"""Verifying a weight sync: every server holds, as loaded, what the trainer sent.

A tensor's checksum sums its elements read as signed integers of their own width, wrapping in
that width (plus their squares for 1- and 2-byte dtypes): exact, and blind to an element's
place, so it survives vLLM's fused ``qkv_proj``, padded vocabularies and tensor-parallel
shards; permutations are the canary's (``ludic.inference.vllm.canary``). Checked **received**
(each worker's sums of what arrived against the trainer's of what it sent) and **loaded** (each
parameter the sync wrote, read back, against the received parts cast to its dtype). Reports
are JSON (:func:`make_report`); :func:`check_reports` raises :class:`SyncVerificationError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

Checksum = tuple[int, ...]
"""A tensor's checksum: the wrapped sum of its elements as integers (and, for 1- and 2-byte
dtypes, of their squares)."""

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class SyncVerificationError(RuntimeError):
    """A server's weights after a sync differ from what the trainer sent. ``servers``: the
    base URLs of the servers that failed (a group spanning several checks every one)."""

    def __init__(self, message: str, *, servers: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.servers = list(servers)


def checksums(tensors: Sequence[torch.Tensor]) -> list[Checksum]:
    """The checksum of each tensor, computed on its device, fetched at once."""
    return fetch_checksums([checksum_tensors(t) for t in tensors])


def checksum_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """``t``'s checksum as 0-d int64 tensors on its device (not fetched yet)."""
    ints = t.detach().reshape(-1).view(_INT_OF_SIZE[t.element_size()])
    sums = [ints.sum(dtype=ints.dtype)]
    if t.element_size() < 4:
        sums.append((ints * ints).sum(dtype=ints.dtype))
    return [s.to(torch.int64) for s in sums]


def fetch_checksums(pending: Sequence[Sequence[torch.Tensor]]) -> list[Checksum]:
    """The checksums of :func:`checksum_tensors` results, in one device-to-host copy."""
    parts = [p for row in pending for p in row]
    if not parts:
        return [() for _ in pending]
    device = parts[0].device
    flat = torch.stack([p.to(device) for p in parts]).tolist()
    out, i = [], 0
    for row in pending:
        out.append(tuple(flat[i : i + len(row)]))
        i += len(row)
    return out


def add_checksums(parts: Iterable[Sequence[int]], element_size: int) -> Checksum:
    """The checksum of the concatenation of tensors (of one dtype) with checksums ``parts``."""
    bits = 8 * element_size
    total: list[int] = []
    for part in parts:
        total = list(part) if not total else [a + b for a, b in zip(total, part)]
    return tuple(_wrap(v, bits) for v in total)


def _wrap(value: int, bits: int) -> int:
    """``value`` as a signed ``bits``-bit integer (two's complement wrap-around)."""
    half = 1 << (bits - 1)
    return (value + half) % (1 << bits) - half


class SentChecksums:
    """The trainer's side: the checksum of every tensor it sent in one sync, recorded as
    the chunks go out."""

    def __init__(self) -> None:
        self.checksums: dict[str, Checksum] = {}

    def record(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        self.checksums.update(zip(names, checksums(tensors)))


# ------------------------------------------------------------------------------ worker side
def make_report(
    *,
    version: int | None,
    tp_rank: int,
    tp_size: int,
    received: Mapping[str, Checksum],
    loaded: Mapping[str, dict[str, Any]],
    unverified: Mapping[str, str],
    **extra: Any,
) -> dict[str, Any]:
    """A worker's report of one sync (JSON-shaped), with the ``extra`` keys (a vLLM
    worker's: ``partial``, the parts of a fused layer written in part; ``adapter``).

    ``received``: HF name -> checksum as received. ``loaded``: served parameter name ->
    ``{"parts": [HF names], "checksum": [..], "expected": [..], "element_size": n,
    "sharded": bool}`` (``expected``: the received parts' checksum in the parameter's
    dtype; ``sharded``: this worker holds one tensor-parallel shard). ``unverified``: HF
    name -> why its load cannot be read back (``"tied"``: an alias vLLM skips; anything
    else fails the check).
    """
    return {
        "version": version,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "received": {k: list(v) for k, v in received.items()},
        "loaded": dict(loaded),
        "unverified": dict(unverified),
        **extra,
    }


TIED = "tied"
"""``unverified`` reason of a tied alias (``lm_head.weight`` of tied embeddings), which vLLM
skips on load: its values are the embeddings', checked under their own name."""


# ------------------------------------------------------------------------------ trainer side
def check_reports(
    sent: SentChecksums,
    reports: Sequence[Mapping[str, Any]],
    *,
    server: str,
    version: int | None,
) -> None:
    """Raise :class:`SyncVerificationError` unless every worker of ``server`` received every
    sent tensor unchanged and loaded it unchanged as version ``version``."""
    if not reports:
        raise SyncVerificationError(f"{server} returned no worker report for version {version}")
    where = f"server {server}, version {version}"
    for i, report in enumerate(reports):
        worker = f"worker {i}"
        if report.get("version") != version:
            raise SyncVerificationError(
                f"{where}: {worker} reports its last loaded sync as version "
                f"{report.get('version')}, not {version}; the sync did not reach it"
            )
        _check_received(sent, report, f"{where}, {worker}")
        for name, reason in report.get("unverified", {}).items():
            if reason != TIED:
                raise SyncVerificationError(
                    f"{where}, {worker}: tensor {name!r} cannot be verified: {reason}"
                )
    _check_loaded(reports, where)


def _check_received(sent: SentChecksums, report: Mapping[str, Any], where: str) -> None:
    received = report.get("received", {})
    for name, expected in sent.checksums.items():
        got = received.get(name)
        if got is None:
            raise SyncVerificationError(
                f"{where}: tensor {name!r} was sent but not received "
                f"({len(received)} of {len(sent.checksums)} tensors received)"
            )
        if tuple(got) != tuple(expected):
            raise SyncVerificationError(
                f"{where}: tensor {name!r} arrived changed: checksum {list(got)} received, "
                f"{list(expected)} sent"
            )
    extra = sorted(set(received) - set(sent.checksums))
    if extra:
        raise SyncVerificationError(f"{where}: received tensors that were not sent: {extra[:3]}")


def _check_loaded(reports: Sequence[Mapping[str, Any]], where: str) -> None:
    """Each served parameter's checksum as loaded against its expected one: replicated
    parameters worker by worker, tensor-parallel shards added up over the workers."""
    shards: dict[str, list[tuple[int, Mapping[str, Any]]]] = {}
    for i, report in enumerate(reports):
        for name, entry in report.get("loaded", {}).items():
            if entry.get("sharded"):
                shards.setdefault(name, []).append((i, entry))
            else:
                _compare_loaded(name, entry["checksum"], entry, f"{where}, worker {i}")
    for name, entries in shards.items():
        size = int(entries[0][1]["element_size"])
        total = add_checksums((e["checksum"] for _, e in entries), size)
        workers = ", ".join(str(i) for i, _ in entries)
        _compare_loaded(name, total, entries[0][1], f"{where}, workers {workers} (shards)")


def _compare_loaded(name: str, got: Sequence[int], entry: Mapping[str, Any], where: str) -> None:
    expected = tuple(entry["expected"])
    if tuple(got) != expected:
        parts = entry.get("parts") or [name]
        raise SyncVerificationError(
            f"{where}: served parameter {name!r} (from {', '.join(parts)}) does not hold the "
            f"received values after the load: checksum {list(got)} loaded, {list(expected)} "
            "expected"
        )


def check_copy(
    sources: Mapping[str, torch.Tensor],
    targets: Mapping[str, torch.Tensor],
    *,
    where: str,
    version: int | None,
) -> None:
    """In process: after copying each source into the target of its name, raise
    :class:`SyncVerificationError` unless every target holds its source's values (in the
    target's dtype). Catches, e.g., a tied alias overwritten by a later copy."""
    names = list(sources)
    expected = checksums(
        [sources[n].detach().to(targets[n].device, targets[n].dtype) for n in names]
    )
    got = checksums([targets[n] for n in names])
    for name, e, g in zip(names, expected, got):
        if g != e:
            raise SyncVerificationError(
                f"{where}, version {version}: tensor {name!r} does not hold the synced values "
                f"after the copy: checksum {list(g)} held, {list(e)} sent"
            )
