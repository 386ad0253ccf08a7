"""Verifying a weight sync: every server holds, as loaded, what the trainer sent.

The checksum of a tensor is the pair of float64 sums ``(Σ x, Σ x²)`` over its elements,
computed where the tensor lives (on the GPU for a CUDA worker). The pair does not depend on
where an element sits, so it survives the loader's own transforms: vLLM fuses
``q_proj``/``k_proj``/``v_proj`` into one ``qkv_proj`` (the fused sums are the parts'
sums added), pads the vocabulary with zero rows (zeros add nothing) and, with tensor
parallelism, splits a tensor over workers (the shards' sums add up to the tensor's). What
it cannot see, a permutation inside a tensor, is what the canary (a fixed prompt's
logprobs, ``ludic.inference.vllm.canary``) is for.

A sync is checked at two points:

* **received**: each worker's sums of every tensor it received (on the wire, in the wire
  dtype) against the trainer's sums of what it sent. A tensor sent and not received, or
  received different, fails here.
* **loaded**: each worker's sums of each served parameter the sync wrote, read back after
  the load (on a CPU worker: just before vLLM pre-packs it), against the sums of the
  received parts cast to the parameter's dtype. A loader that changes a value or skips a
  tensor fails here.

Two sums of the same values added in another order differ by about ``n · 1e-16 · Σ|x|``;
:data:`RTOL` (1e-8 of ``sqrt(n · Σx²)``, which bounds ``Σ|x|``) leaves ample room for that
and catches a change to any one element larger than about ``1e-8 · Σ|x|``.

Worker reports are JSON (see :func:`make_report`); :func:`check_reports` raises
:class:`SyncVerificationError` naming the server, the worker, the tensor and the version.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

Sums = tuple[float, float]
"""``(Σ x, Σ x²)`` of a tensor, in float64."""

RTOL = 1e-8
"""Relative tolerance of a sums comparison (see the module docstring)."""


class SyncVerificationError(RuntimeError):
    """A server's weights after a sync differ from what the trainer sent."""


def tensor_sums(tensors: Sequence[torch.Tensor]) -> list[Sums]:
    """``(Σ x, Σ x²)`` of each tensor in float64, computed on its device, fetched at once."""
    if not tensors:
        return []
    rows = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        s1 = torch.sum(flat, dtype=torch.float64)
        s2 = torch.linalg.vector_norm(flat, dtype=torch.float64).square()
        rows.append(torch.stack([s1, s2]).cpu())
    return [(float(a), float(b)) for a, b in torch.stack(rows).tolist()]


def add_sums(parts: Iterable[Sums]) -> Sums:
    s1 = s2 = 0.0
    for a, b in parts:
        s1, s2 = s1 + a, s2 + b
    return s1, s2


def sums_match(got: Sums, expected: Sums, numel: int) -> bool:
    """Whether ``got`` and ``expected`` are the sums of the same values (see :data:`RTOL`)."""
    scale2 = max(abs(expected[1]), abs(got[1]))
    tol1 = RTOL * math.sqrt(max(numel, 1) * scale2) + 1e-30
    tol2 = RTOL * scale2 + 1e-30
    return abs(got[0] - expected[0]) <= tol1 and abs(got[1] - expected[1]) <= tol2


class SentSums:
    """The trainer's side: sums (and element counts) of every tensor it sent in one sync,
    recorded as the chunks go out."""

    def __init__(self) -> None:
        self.sums: dict[str, Sums] = {}
        self.numel: dict[str, int] = {}

    def record(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        for name, t, s in zip(names, tensors, tensor_sums(tensors)):
            self.sums[name] = s
            self.numel[name] = int(t.numel())


# ------------------------------------------------------------------------------ worker side
def make_report(
    *,
    version: int | None,
    tp_rank: int,
    tp_size: int,
    received: Mapping[str, Sums],
    loaded: Mapping[str, dict[str, Any]],
    unverified: Mapping[str, str],
) -> dict[str, Any]:
    """A worker's report of one sync (JSON-shaped).

    ``received``: HF name -> sums as received. ``loaded``: served parameter name ->
    ``{"parts": [HF names], "sums": [..], "expected": [..], "numel": n, "sharded": bool}``
    (``expected``: the received parts' sums in the parameter's dtype; ``sharded``: this
    worker holds one tensor-parallel shard). ``unverified``: HF name -> why its load
    cannot be read back (``"tied"``: an alias vLLM skips; anything else fails the check).
    """
    return {
        "version": version,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "received": {k: list(v) for k, v in received.items()},
        "loaded": dict(loaded),
        "unverified": dict(unverified),
    }


TIED = "tied"
"""``unverified`` reason of a tied alias (``lm_head.weight`` of tied embeddings), which vLLM
skips on load: its values are the embeddings', checked under their own name."""


# ------------------------------------------------------------------------------ trainer side
def check_reports(
    sent: SentSums,
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


def _check_received(sent: SentSums, report: Mapping[str, Any], where: str) -> None:
    received = report.get("received", {})
    for name, expected in sent.sums.items():
        got = received.get(name)
        if got is None:
            raise SyncVerificationError(
                f"{where}: tensor {name!r} was sent but not received "
                f"({len(received)} of {len(sent.sums)} tensors received)"
            )
        if not sums_match(tuple(got), expected, sent.numel[name]):
            raise SyncVerificationError(
                f"{where}: tensor {name!r} arrived changed: (sum, sum of squares) "
                f"{_fmt(got)} received, {_fmt(expected)} sent"
            )
    extra = sorted(set(received) - set(sent.sums))
    if extra:
        raise SyncVerificationError(f"{where}: received tensors that were not sent: {extra[:3]}")


def _check_loaded(reports: Sequence[Mapping[str, Any]], where: str) -> None:
    """Each served parameter's sums as loaded against its expected sums: replicated
    parameters worker by worker, tensor-parallel shards added up over the workers."""
    shards: dict[str, list[tuple[int, Mapping[str, Any]]]] = {}
    for i, report in enumerate(reports):
        for name, entry in report.get("loaded", {}).items():
            if entry.get("sharded"):
                shards.setdefault(name, []).append((i, entry))
            else:
                _compare_loaded(name, entry["sums"], entry, f"{where}, worker {i}")
    for name, entries in shards.items():
        total = add_sums(tuple(e["sums"]) for _, e in entries)
        workers = ", ".join(str(i) for i, _ in entries)
        _compare_loaded(name, total, entries[0][1], f"{where}, workers {workers} (shards)")


def _compare_loaded(name: str, got: Sequence[float], entry: Mapping[str, Any], where: str) -> None:
    expected = tuple(entry["expected"])
    if not sums_match(tuple(got), expected, int(entry.get("numel", 1))):
        parts = entry.get("parts") or [name]
        raise SyncVerificationError(
            f"{where}: served parameter {name!r} (from {', '.join(parts)}) does not hold the "
            f"received values after the load: (sum, sum of squares) {_fmt(got)} loaded, "
            f"{_fmt(expected)} expected"
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
    expected = tensor_sums(
        [sources[n].detach().to(targets[n].device, targets[n].dtype) for n in names]
    )
    got = tensor_sums([targets[n] for n in names])
    for name, e, g in zip(names, expected, got):
        if not sums_match(g, e, int(targets[name].numel())):
            raise SyncVerificationError(
                f"{where}, version {version}: tensor {name!r} does not hold the synced values "
                f"after the copy: (sum, sum of squares) {_fmt(g)} held, {_fmt(e)} sent"
            )


def _fmt(sums: Sequence[float]) -> str:
    return f"({sums[0]:.9g}, {sums[1]:.9g})"
