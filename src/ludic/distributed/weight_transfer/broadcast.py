"""Weight transfer by broadcast over a process group (gloo on CPU, NCCL on GPU).

Per chunk, the trainer (rank 0) and every inference worker (ranks 1..) run::

    trainer                                   every worker
    -------                                   ------------
    check the request against the chunk
    control.announce(request)  ------------>  receive(request) starts (in the background)
    broadcast header  ---------------------->  compare header with the announced request
    all_reduce(max) status  <--------------->  all_reduce(max) status (1 = "does not match")
    status != 0: raise, nothing moves          status != 0: raise, nothing moves
    broadcast payload  --------------------->  unpack into the announced dtypes/shapes

The header is a few int64s describing what the trainer is actually sending (tensor count,
total bytes, packed flag, version, last flag and a 63-bit hash of the JSON of names, dtypes
and shapes). Because every rank learns the verdict from the same ``all_reduce`` and skips
the payload together, a mismatch leaves the group in step: both sides raise
:class:`WeightTransferError`, the server keeps its current weights and the next update
over the same group works. A peer that dies or stops answering makes the pending
collective raise within the group timeout; the group is then unusable and must be rebuilt.

Payload:

* ``packed=True`` (chunks of several small tensors): the tensors' bytes concatenated in
  order into one flat uint8 buffer, moved in pieces of about ``PIECE_BYTES`` cut at tensor
  boundaries, so the worker unpacks each piece while the next one moves.
* ``packed=False`` (one tensor, or large ones): one broadcast per tensor, straight from
  the trainer's tensor (no copy).

``send`` pipelines chunks: chunk ``k+1`` is extracted, checked, announced and packed (into
the second of two pack buffers) while chunk ``k``'s payload is still moving; within a chunk,
packing overlaps the handshake, and packed pieces start moving once every worker agreed.

Workers receive into a flat buffer and return views into it (a copy only for a tensor whose
offset in a packed buffer is misaligned for its dtype). Receive buffers are reused once
nothing views them any more: load (copy) the tensors and drop them, and the next chunk
lands in the same memory without new page faults.

Nothing here unpickles anything: requests are JSON and the payload is raw bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch._C._distributed_c10d import ProcessGroup

from ludic.distributed.weight_transfer.base import (
    DTYPES,
    BroadcastWeightUpdateRequest,
    ControlPlane,
    WeightChunk,
    WeightTransferReceiver,
    WeightTransferSender,
    WeightUpdateRequest,
    dtype_from_name,
    dtype_name,
)
from ludic.distributed.weight_transfer.groups import (
    all_reduce_max,
    all_reduce_max_async,
    broadcast,
    broadcast_async,
    wait,
)

MIB = 2**20
PIECE_BYTES = 8 * MIB
"""Packed payloads move in pieces of at least this size (cut at tensor boundaries; both
sides derive the same cuts from the tensor sizes)."""
PACK_BELOW_MEAN_BYTES = 1 * MIB
"""A chunk is packed when it holds several tensors averaging less than this; larger tensors
are broadcast one by one, which saves the copy into the packed buffer."""
ALIGN_BYTES = 64  # offsets of unpacked tensors in a receive buffer

HEADER_MAGIC = 0x4C5544494357  # "LUDICW"
PROTOCOL_VERSION = 1
# [magic, protocol, n_tensors, total_bytes, packed, version (-1 = None), last, checksum]
HEADER_FIELDS = ("magic", "protocol", "tensors", "bytes", "packed", "version", "last", "checksum")
STATUS_OK, STATUS_REJECTED = 0, 1


class WeightTransferError(RuntimeError):
    """A weight update that could not complete (rejected, or the group failed)."""


class BroadcastTransferSender(WeightTransferSender):
    """Trainer side (rank ``src`` of ``pg``, normally 0).

    Args:
        pg: a group from :func:`ludic.distributed.weight_transfer.groups.init_process_group`.
        device: where tensors must be for the backend: ``"cpu"`` for gloo, ``"cuda"`` for
            NCCL. Chunk tensors elsewhere are copied there.
        timeout_s: bound on each collective (default: the group's timeout).

    Keeps two pack buffers (the size of the largest packed chunk) between syncs.
    """

    def __init__(
        self,
        pg: ProcessGroup,
        *,
        device: str | torch.device = "cpu",
        timeout_s: float | None = None,
        src: int = 0,
    ) -> None:
        self.pg = pg
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.src = src
        # Two pack buffers: the next chunk is packed while the previous one moves.
        self._pack_buffers: list[torch.Tensor | None] = [None, None]
        self._packed_chunks = 0

    def create_request(
        self, chunk: WeightChunk, *, version: int | None = None, last: bool = False
    ) -> BroadcastWeightUpdateRequest:
        """The request announcing ``chunk``; packed when it holds several small tensors."""
        n = len(chunk)
        return BroadcastWeightUpdateRequest(
            names=list(chunk.names),
            dtypes=[_dtype_name(t.dtype) for t in chunk.tensors],
            shapes=[list(t.shape) for t in chunk.tensors],
            version=version,
            last=last,
            packed=n > 1 and chunk.total_size_bytes < n * PACK_BELOW_MEAN_BYTES,
        )

    def send(
        self, chunks: Iterable[WeightChunk], control: ControlPlane, *, version: int | None
    ) -> None:
        """Announce and move every chunk, pipelined: chunk ``k+1`` is extracted, checked,
        announced and packed while chunk ``k``'s payload is still moving. The control plane
        must therefore accept an announcement while the previous chunk is being received
        (and have the workers receive it once that one is done)."""
        previous: _InFlight | None = None
        sent = 0
        for chunk, last in with_last_flag(chunks):
            try:
                outgoing = self._prepare(chunk, version=version, last=last)
                control.announce(outgoing.request)
                current = self._move(outgoing)
            except BaseException:
                self._finish(previous)  # what was announced before completes first
                raise
            self._finish(previous)
            previous = current
            sent += 1
        self._finish(previous)
        if sent == 0:
            raise ValueError("BroadcastTransferSender.send got no chunks; nothing to publish")

    def send_chunk(
        self, chunk: WeightChunk, control: ControlPlane, *, version: int | None, last: bool
    ) -> None:
        """Announce and move one chunk, without pipelining."""
        outgoing = self._prepare(chunk, version=version, last=last)
        control.announce(outgoing.request)
        self._finish(self._move(outgoing))

    def close(self) -> None:
        """Free the pack buffers and shut the group down."""
        self._pack_buffers = [None, None]
        self.pg.shutdown()

    def _prepare(self, chunk: WeightChunk, *, version: int | None, last: bool) -> _Outgoing:
        """Request and header for ``chunk``; refuses a request that does not describe it."""
        if len(chunk) == 0:
            raise ValueError("refusing to send an empty WeightChunk")
        request = self.create_request(chunk, version=version, last=last)
        tensors = [_on(self.device, t) for t in chunk.tensors]
        dtypes = [_dtype_name(t.dtype) for t in tensors]
        shapes = [list(t.shape) for t in tensors]
        check_request_describes(request, chunk.names, dtypes, shapes)
        # The header describes the tensors themselves, not the request we announce.
        header = _header(
            chunk.names,
            dtypes,
            shapes,
            total_bytes=sum(_nbytes(t) for t in tensors),
            packed=request.packed,
            version=version,
            last=last,
        )
        where = f"chunk of {len(chunk)} tensor(s) starting at {chunk.names[0]!r}"
        return _Outgoing(request, tensors, header.to(self.device), where)

    def _move(self, out: _Outgoing) -> _InFlight:
        """Handshake, then start the payload; returns the payload's pending works.

        The handshake runs in the background while a packed chunk is packed piece by
        piece; pieces start moving as soon as every worker has agreed (and are never
        sent if one disagrees)."""
        status = torch.tensor([STATUS_OK], dtype=torch.int64, device=self.device)
        handshake = _Handshake(out, status)
        try:
            handshake.works = [
                broadcast_async(self.pg, out.header, self.src, timeout_s=self.timeout_s),
                all_reduce_max_async(self.pg, status, timeout_s=self.timeout_s),
            ]
            if not out.request.packed:
                self._agreed(handshake, block=True)
                return _InFlight([self._start(as_bytes(t)) for t in out.tensors], out.where)
            sizes = [_nbytes(t) for t in out.tensors]
            offsets = _packed_offsets(sizes)
            buf = self._buffer(offsets[-1] + sizes[-1])
            works: list[torch.distributed.Work | None] = []
            packed: list[torch.Tensor] = []  # packed, not yet started
            for lo, hi in pieces(sizes):
                piece = buf[offsets[lo] : offsets[hi - 1] + sizes[hi - 1]]
                _pack_into(piece, out.tensors[lo:hi])
                packed.append(piece)
                if self._agreed(handshake, block=False):
                    works += [self._start(p) for p in packed]
                    packed = []
            self._agreed(handshake, block=True)
            return _InFlight(works + [self._start(p) for p in packed], out.where)
        except RuntimeError as e:
            if isinstance(e, WeightTransferError):
                raise
            raise _group_failure("sending", out.where, e) from e

    def _agreed(self, handshake: _Handshake, *, block: bool) -> bool:
        """Whether every worker accepted the chunk; raises if one rejected it."""
        if handshake.agreed:
            return True
        if not block and not all(w.is_completed() for w in handshake.works):
            return False
        try:
            for work in handshake.works:
                wait(work, self.timeout_s)
        except RuntimeError as e:
            raise _group_failure("announcing", handshake.out.where, e) from e
        if int(handshake.status.item()) != STATUS_OK:
            raise WeightTransferError(
                "inference worker(s) rejected the update: announced metadata does not match "
                f"the tensors sent ({handshake.out.where}; the control plane delivered a "
                "request whose names/dtypes/shapes/version differ). Nothing was transferred; "
                "the servers keep their current weights."
            )
        handshake.agreed = True
        return True

    def _finish(self, in_flight: _InFlight | None) -> None:
        if in_flight is None:
            return
        try:
            for work in in_flight.works:
                if work is not None:
                    wait(work, self.timeout_s)
        except RuntimeError as e:
            raise _group_failure("sending", in_flight.where, e) from e

    def _start(self, tensor: torch.Tensor) -> torch.distributed.Work | None:
        """Start broadcasting ``tensor``; empty tensors have nothing to move (both sides
        skip them)."""
        if tensor.numel() == 0:
            return None
        return broadcast_async(self.pg, tensor, self.src, timeout_s=self.timeout_s)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """The pack buffer not used by the previous chunk (which may still be moving)."""
        i = self._packed_chunks % 2
        self._packed_chunks += 1
        buf = self._pack_buffers[i]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._pack_buffers[i] = buf
        return buf


@dataclass
class _Outgoing:
    request: BroadcastWeightUpdateRequest
    tensors: list[torch.Tensor]
    header: torch.Tensor
    where: str


@dataclass
class _Handshake:
    out: _Outgoing
    status: torch.Tensor  # the all_reduce(max) of every rank's verdict
    works: list[torch.distributed.Work] = field(default_factory=list)
    agreed: bool = False


@dataclass
class _InFlight:
    works: list[torch.distributed.Work | None]  # they hold the tensors they move
    where: str


class BroadcastTransferReceiver(WeightTransferReceiver):
    """Inference side (rank >= 1 of ``pg``). ``receive`` takes part in one chunk's
    handshake and payload; call it once per announced request, in announcement order.

    Returned tensors are views into a receive buffer that is reused only once none of them
    is referenced any more. Up to ``keep_buffers`` buffers of at most ``max_kept_bytes``
    each stay allocated between syncs (``close`` frees them).
    """

    request_type = BroadcastWeightUpdateRequest

    def __init__(
        self,
        pg: ProcessGroup,
        *,
        device: str | torch.device = "cpu",
        timeout_s: float | None = None,
        src: int = 0,
        keep_buffers: int = 2,
        max_kept_bytes: int = 256 * MIB,
    ) -> None:
        self.pg = pg
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.src = src
        self.buffers = ReceiveBuffers(self.device, keep=keep_buffers, max_bytes=max_kept_bytes)

    def receive(self, request: WeightUpdateRequest) -> dict[str, torch.Tensor]:
        expected = None
        if isinstance(request, BroadcastWeightUpdateRequest):
            sizes = _sizes(request.dtypes, request.shapes)
            expected = _header(
                request.names,
                request.dtypes,
                request.shapes,
                total_bytes=sum(sizes),
                packed=request.packed,
                version=request.version,
                last=request.last,
            )
        header = torch.zeros(len(HEADER_FIELDS), dtype=torch.int64, device=self.device)
        try:
            broadcast(self.pg, header, self.src, timeout_s=self.timeout_s)
            header = header.cpu()
            agrees = expected is not None and torch.equal(header, expected)
            verdict = STATUS_OK if agrees else STATUS_REJECTED
            status = torch.tensor([verdict], dtype=torch.int64, device=self.device)
            all_reduce_max(self.pg, status, timeout_s=self.timeout_s)
        except RuntimeError as e:
            raise _group_failure("waiting for the trainer's header", "announced update", e) from e
        if not agrees:
            raise WeightTransferError(
                f"weight update rejected: the control plane announced {_describe(expected)} "
                f"but the trainer is sending {_describe(header)}{_difference(expected, header)}. "
                "Nothing was loaded; this server keeps its current weights."
            )
        if int(status.item()) != STATUS_OK:
            raise WeightTransferError(
                "weight update rejected by another inference worker (its announced metadata "
                "does not match the tensors sent). Nothing was loaded; this server keeps its "
                "current weights."
            )
        assert isinstance(request, BroadcastWeightUpdateRequest)
        try:
            return self._receive_payload(request, sizes)
        except RuntimeError as e:
            raise _group_failure("receiving", "announced update", e) from e

    def close(self) -> None:
        self.buffers.clear()
        self.pg.shutdown()

    def _receive_payload(
        self, request: BroadcastWeightUpdateRequest, sizes: list[int]
    ) -> dict[str, torch.Tensor]:
        dtypes = [dtype_from_name(d) for d in request.dtypes]
        offsets = _packed_offsets(sizes) if request.packed else _aligned_offsets(sizes)
        buf = self.buffers.take(offsets[-1] + sizes[-1])
        if request.packed:
            ranges = pieces(sizes)
            starts = [
                self._start(buf[offsets[lo] : offsets[hi - 1] + sizes[hi - 1]]) for lo, hi in ranges
            ]
        else:
            ranges = [(i, i + 1) for i in range(len(sizes))]
            starts = [self._start(buf[o : o + s]) for o, s in zip(offsets, sizes)]
        tensors: list[torch.Tensor] = []
        for (lo, hi), work in zip(ranges, starts):
            if work is not None:
                wait(work, self.timeout_s)  # unpack what arrived while the rest moves
            tensors += _unpack(
                buf, offsets[lo:hi], sizes[lo:hi], dtypes[lo:hi], request.shapes[lo:hi]
            )
        return dict(zip(request.names, tensors))

    def _start(self, tensor: torch.Tensor) -> torch.distributed.Work | None:
        """Start broadcasting ``tensor``; empty tensors have nothing to move (both sides
        skip them)."""
        if tensor.numel() == 0:
            return None
        return broadcast_async(self.pg, tensor, self.src, timeout_s=self.timeout_s)


class ReceiveBuffers:
    """Flat uint8 receive buffers, reused once no tensor views them any more.

    Whether anything still views a buffer is read from its storage's reference count; on
    a torch without that hook, every receive allocates afresh.
    """

    def __init__(self, device: torch.device, *, keep: int = 2, max_bytes: int = 256 * MIB) -> None:
        self.device = device
        self.keep = keep
        self.max_bytes = max_bytes
        self._kept: list[tuple[torch.Tensor, int]] = []  # (buffer, use count when unused)

    def take(self, nbytes: int) -> torch.Tensor:
        free = [
            buf for buf, idle in self._kept if buf.numel() >= nbytes and _use_count(buf) == idle
        ]
        if free:
            return min(free, key=torch.Tensor.numel)[:nbytes]
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if nbytes <= self.max_bytes and self.keep > 0 and _use_count(buf) is not None:
            # Keep the newest buffers; drop idle ones first.
            self._kept.sort(key=lambda item: _use_count(item[0]) != item[1])
            self._kept = self._kept[-(self.keep - 1) :] if self.keep > 1 else []
            self._kept.append((buf, _use_count(buf)))
        return buf

    def clear(self) -> None:
        self._kept = []


# ------------------------------------------------------------------------------ layout
def pieces(sizes: Sequence[int], piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """Tensor index ranges ``[lo, hi)`` of the pieces a packed payload moves in: each piece
    takes tensors until it holds at least ``piece_bytes``."""
    out: list[tuple[int, int]] = []
    lo, acc = 0, 0
    for i, size in enumerate(sizes):
        acc += size
        if acc >= piece_bytes:
            out.append((lo, i + 1))
            lo, acc = i + 1, 0
    if lo < len(sizes):
        out.append((lo, len(sizes)))
    return out


def _packed_offsets(sizes: Sequence[int]) -> list[int]:
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += size
    return offsets


def _aligned_offsets(sizes: Sequence[int]) -> list[int]:
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += -(-size // ALIGN_BYTES) * ALIGN_BYTES
    return offsets


def _pack_into(dst: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy the tensors' bytes, in order, into the flat uint8 ``dst``."""
    dtype = tensors[0].dtype
    if all(t.dtype == dtype for t in tensors) and dst.storage_offset() % dtype.itemsize == 0:
        # One dtype: copy in it (several times faster than uint8 for many small tensors).
        torch.cat([t.flatten() for t in tensors], out=dst.view(dtype))
    else:
        torch.cat([as_bytes(t) for t in tensors], out=dst)


def _unpack(
    buf: torch.Tensor,
    offsets: Sequence[int],
    sizes: Sequence[int],
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[Sequence[int]],
) -> list[torch.Tensor]:
    """Tensors stored at ``offsets`` of ``buf``; runs of one aligned dtype are split in one
    call."""
    out: list[torch.Tensor] = []
    i, n = 0, len(sizes)
    while i < n:
        dtype = dtypes[i]
        j = i + 1
        while j < n and dtypes[j] == dtype and offsets[j] == offsets[j - 1] + sizes[j - 1]:
            j += 1
        start = buf.storage_offset() + offsets[i]
        if start % dtype.itemsize:
            out += [unpack_bytes(buf, offsets[k], sizes[k], dtype, shapes[k]) for k in range(i, j)]
        else:
            run = buf[offsets[i] : offsets[j - 1] + sizes[j - 1]].view(dtype)
            parts = run.split([s // dtype.itemsize for s in sizes[i:j]])
            out += [p if len(s) == 1 else p.view(s) for p, s in zip(parts, shapes[i:j])]
        i = j
    return out


def unpack_bytes(
    buf: torch.Tensor, offset: int, size: int, dtype: torch.dtype, shape: Sequence[int]
) -> torch.Tensor:
    """Tensor ``dtype``/``shape`` stored in ``buf[offset:offset+size]`` (flat uint8).

    A view into ``buf`` when ``offset`` is aligned for ``dtype``; a copy otherwise
    (``Tensor.view(dtype)`` needs an aligned storage offset)."""
    piece = buf[offset : offset + size]
    if (buf.storage_offset() + offset) % dtype.itemsize:
        piece = piece.clone()
    return piece.view(dtype).view(list(shape))


# ------------------------------------------------------------------------------ helpers
def _header(
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    *,
    total_bytes: int,
    packed: bool,
    version: int | None,
    last: bool,
) -> torch.Tensor:
    meta = json.dumps([list(names), list(dtypes), [list(s) for s in shapes]], separators=(",", ":"))
    digest = hashlib.blake2b(meta.encode(), digest_size=8).digest()
    checksum = int.from_bytes(digest, "little") & (2**63 - 1)
    version_field = -1 if version is None else int(version)
    values = [HEADER_MAGIC, PROTOCOL_VERSION, len(names), total_bytes, int(packed)]
    return torch.tensor(values + [version_field, int(last), checksum], dtype=torch.int64)


def _describe(header: torch.Tensor | None) -> str:
    if header is None:
        return "a request this receiver cannot handle (not a broadcast request)"
    h = dict(zip(HEADER_FIELDS, header.tolist()))
    if h["magic"] != HEADER_MAGIC or h["protocol"] != PROTOCOL_VERSION:
        return f"an unknown header {header.tolist()} (a different ludic version?)"
    version = None if h["version"] == -1 else h["version"]
    return (
        f"{h['tensors']} tensor(s), {h['bytes']} bytes, packed={bool(h['packed'])}, "
        f"version={version}, last={bool(h['last'])}, names/dtypes/shapes hash {h['checksum']:x}"
    )


def _difference(expected: torch.Tensor | None, header: torch.Tensor) -> str:
    if expected is None:
        return ""
    labels = {"checksum": "names/dtypes/shapes", "bytes": "total bytes", "tensors": "tensor count"}
    pairs = zip(HEADER_FIELDS, expected.tolist(), header.tolist())
    return f" (they differ in: {', '.join(labels.get(f, f) for f, a, b in pairs if a != b)})"


def check_request_describes(
    request: WeightUpdateRequest,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
) -> None:
    """Refuse (before anything is announced) a request that does not describe the chunk
    (``names`` and the ``dtypes``/``shapes`` of its tensors)."""
    actual = (list(names), list(dtypes), [list(s) for s in shapes])
    announced = (list(request.names), list(request.dtypes), [list(s) for s in request.shapes])
    if actual == announced:
        return
    for i, (a, b) in enumerate(zip(zip(*announced), zip(*actual))):
        if a != b:
            raise ValueError(
                f"refusing to send: the request announces {a} at position {i} but the chunk "
                f"holds {b} (name, dtype, shape); nothing was sent"
            )
    raise ValueError(
        f"refusing to send: the request announces {len(request.names)} tensor(s) but the "
        f"chunk holds {len(names)}; nothing was sent"
    )


def _group_failure(stage: str, where: str, error: Exception) -> WeightTransferError:
    return WeightTransferError(
        f"weight sync failed while {stage} ({where}): {error}. A peer died, or did not take "
        "part within the group timeout; the process group is no longer usable, rebuild the "
        "sender and receivers (TorchDistributedWeightSyncInfo.timeout_s sets the timeout)"
    )


def _sizes(dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[int]:
    sizes = []
    for dtype, shape in zip(dtypes, shapes):
        numel = 1
        for d in shape:
            numel *= d
        sizes.append(numel * dtype_from_name(dtype).itemsize)
    return sizes


_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype) or dtype_name(dtype)  # dtype_name raises for unknowns


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _on(device: torch.device, t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, contiguous and on ``device`` (no copy when it already is)."""
    if t.requires_grad:
        t = t.detach()
    if t.device != device:
        t = t.to(device)
    return t if t.is_contiguous() else t.contiguous()


def _use_count(buf: torch.Tensor) -> int | None:
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return None if use_count is None else use_count(buf.untyped_storage()._cdata)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def with_last_flag(chunks: Iterable[WeightChunk]) -> Iterator[tuple[WeightChunk, bool]]:
    """Pairs ``(chunk, is_last)``; looks one chunk ahead."""
    it = iter(chunks)
    try:
        current = next(it)
    except StopIteration:
        return
    for upcoming in it:
        yield current, False
        current = upcoming
    yield current, True
