"""Weight transfer by broadcast over a process group (gloo on CPU, NCCL on GPU).

Per chunk the trainer (rank 0) checks the request against the chunk and announces it, then
broadcasts a header of what it actually sends (``packing.py``); every worker compares it with
the announced request and all ranks vote (``all_reduce(max)``). A mismatch raises
:class:`WeightTransferError` on every rank before the payload moves, so the group stays usable;
a dead peer raises within the group timeout, and the group must be rebuilt. ``send`` prepares
chunk ``k+1`` while chunk ``k``'s payload moves. Byte layout: ``packing.py``; layouts sent by
id: ``layout.py``. Nothing is unpickled: requests are JSON, payloads raw bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch._C._distributed_c10d import ProcessGroup

from ludic.distributed.weight_transfer.base import (
    BroadcastWeightUpdateRequest,
    ControlPlane,
    WeightChunk,
    WeightTransferReceiver,
    WeightTransferSender,
    WeightUpdateRequest,
)
from ludic.distributed.weight_transfer.groups import (
    all_reduce_max,
    all_reduce_max_async,
    broadcast_async,
    wait,
)
from ludic.distributed.weight_transfer.layout import (
    ChunkLayout,
    KnownLayouts,
    SentLayout,
    SentLayouts,
    chunk_signature,
)
from ludic.distributed.weight_transfer.packing import (
    ALIGN_BYTES,  # noqa: F401 (re-exported)
    HEADER_FIELDS,
    HEADER_MAGIC,  # noqa: F401 (re-exported)
    MIB,
    PIECE_BYTES,  # noqa: F401 (re-exported)
    PROTOCOL_VERSION,  # noqa: F401 (re-exported)
    PackBuffers,
    ReceiveBuffers,
    _describe,
    _difference,
    _dtype_name,
    _nbytes,
    _on,
    _pack_into,
    _unpack,
    as_bytes,
    contiguous_bytes,
    unpack_bytes,  # noqa: F401 (re-exported)
)

PACK_BELOW_MEAN_BYTES = 1 * MIB
"""A chunk is packed when it holds several tensors averaging less than this; larger tensors
are broadcast one by one, which saves the copy into the packed buffer."""
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
        self._pack_buffers = PackBuffers(self.device)
        self.bytes_moved = 0  # payload bytes every worker has received, over all syncs
        # Layouts announced over this group; known ones travel by id (see layout.py).
        self.layouts = SentLayouts()

    def create_request(
        self, chunk: WeightChunk, *, version: int | None = None, last: bool = False
    ) -> BroadcastWeightUpdateRequest:
        """The request announcing ``chunk`` in full; packed when it holds several small
        tensors."""
        layout = _layout_of(chunk.names, chunk.tensors)
        return layout.request(version=version, last=last, by_reference=False, with_id=False)

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
        self._pack_buffers.clear()
        self.pg.shutdown()

    def _prepare(self, chunk: WeightChunk, *, version: int | None, last: bool) -> _Outgoing:
        """Request and header for ``chunk``, both from the layout of the tensors that will
        move: the announcement describes them by construction. A layout the workers already
        know is announced by id. A subclass's own ``create_request`` is checked against the
        tensors before anything is announced (and announced as it is)."""
        if len(chunk) == 0:
            raise ValueError("refusing to send an empty WeightChunk")
        tensors = [_on(self.device, t) for t in chunk.tensors]
        entry: SentLayout | None = None
        if type(self).create_request is not BroadcastTransferSender.create_request:
            actual = _layout_of(chunk.names, tensors)
            request = self.create_request(chunk, version=version, last=last)
            check_request_describes(request, chunk.names, actual.dtype_names, actual.shapes)
            layout = ChunkLayout.of_request(request)
        else:
            signature = chunk_signature(chunk.names, tensors)
            entry = self.layouts.get(signature)
            if entry is None:
                layout = _layout_of(chunk.names, tensors)
                entry = self.layouts.add(signature, layout)  # None once it tracks its most
            else:
                layout = entry.layout
            request = layout.request(
                version=version,
                last=last,
                by_reference=entry is not None and entry.known,
                with_id=entry is not None,
            )
        header = layout.header(version=version, last=last).to(self.device)
        where = f"chunk of {len(chunk)} tensor(s) starting at {chunk.names[0]!r}"
        return _Outgoing(request, layout, tensors, header, where, entry)

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
            layout = out.layout
            if not layout.packed:
                self._agreed(handshake, block=True)
                works = [self._start(as_bytes(t)) for t in out.tensors]
                return _InFlight(works, out.where, sum(out.layout.sizes))
            buf: torch.Tensor | None = None
            works: list[torch.distributed.Work | None] = []
            packed: list[torch.Tensor] = []  # packed, not yet started
            for lo, hi in layout.ranges:
                # Tensors already back to back in memory (flatten_parameters) move where
                # they are; others are copied into the pack buffer.
                piece = contiguous_bytes(out.tensors[lo:hi])
                if piece is None:
                    if buf is None:
                        buf = self._pack_buffers.take(layout.buffer_bytes)
                    start, end = layout.span(lo, hi)
                    piece = buf[start:end]
                    _pack_into(piece, out.tensors[lo:hi])
                packed.append(piece)
                if self._agreed(handshake, block=False):
                    works += [self._start(p) for p in packed]
                    packed = []
            self._agreed(handshake, block=True)
            works += [self._start(p) for p in packed]
            return _InFlight(works, out.where, sum(out.layout.sizes))
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
                "request whose names/dtypes/shapes/version differ, or a layout id a worker "
                "does not know; the worker's log says which). Nothing was transferred; the "
                "servers keep their current weights."
            )
        handshake.agreed = True
        out = handshake.out
        if out.entry is not None and out.request.layout is not None:
            out.entry.known = True  # every worker now holds it under its id
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
        self.bytes_moved += in_flight.nbytes

    def _start(self, tensor: torch.Tensor) -> torch.distributed.Work | None:
        return start_payload(self.pg, tensor, self.src, self.timeout_s)


@dataclass
class _Outgoing:
    request: BroadcastWeightUpdateRequest
    layout: ChunkLayout
    tensors: list[torch.Tensor]
    header: torch.Tensor
    where: str
    entry: SentLayout | None  # the sender's cache entry for the layout, if tracked


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
    nbytes: int = 0


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
        self.layouts = KnownLayouts()  # layouts announced by id over this group

    def receive(self, request: WeightUpdateRequest) -> dict[str, torch.Tensor]:
        header = torch.zeros(len(HEADER_FIELDS), dtype=torch.int64, device=self.device)
        layout, expected = None, None
        problem = "a request this receiver cannot handle (not a broadcast request)"
        try:
            # Resolve what was announced while the trainer's header is on its way.
            incoming = broadcast_async(self.pg, header, self.src, timeout_s=self.timeout_s)
            if isinstance(request, BroadcastWeightUpdateRequest):
                try:
                    layout = self.layouts.resolve(request)
                    expected = layout.header(version=request.version, last=request.last)
                except ValueError as e:
                    problem = str(e)
            wait(incoming, self.timeout_s)
            header = header.cpu()
            agrees = expected is not None and torch.equal(header, expected)
            verdict = STATUS_OK if agrees else STATUS_REJECTED
            status = torch.tensor([verdict], dtype=torch.int64, device=self.device)
            all_reduce_max(self.pg, status, timeout_s=self.timeout_s)
        except RuntimeError as e:
            raise _group_failure("waiting for the trainer's header", "announced update", e) from e
        if not agrees:
            announced = problem if expected is None else _describe(expected)
            raise WeightTransferError(
                f"weight update rejected: the control plane announced {announced} "
                f"but the trainer is sending {_describe(header)}{_difference(expected, header)}. "
                "Nothing was loaded; this server keeps its current weights."
            )
        if int(status.item()) != STATUS_OK:
            raise WeightTransferError(
                "weight update rejected by another inference worker (its announced metadata "
                "does not match the tensors sent). Nothing was loaded; this server keeps its "
                "current weights."
            )
        assert isinstance(request, BroadcastWeightUpdateRequest) and layout is not None
        self.layouts.remember(request, layout)
        try:
            return self._receive_payload(layout)
        except RuntimeError as e:
            raise _group_failure("receiving", "announced update", e) from e

    def close(self) -> None:
        self.buffers.clear()
        self.pg.shutdown()

    def _receive_payload(self, layout: ChunkLayout) -> dict[str, torch.Tensor]:
        buf = self.buffers.take(layout.buffer_bytes)
        starts = [self._start(buf[slice(*layout.span(lo, hi))]) for lo, hi in layout.ranges]
        tensors: list[torch.Tensor] = []
        for (lo, hi), work in zip(layout.ranges, starts):
            if work is not None:
                wait(work, self.timeout_s)  # unpack what arrived while the rest moves
            tensors += _unpack(
                buf, layout.offsets[lo:hi], layout.sizes[lo:hi], layout.dtypes[lo:hi],
                layout.shapes[lo:hi],
            )  # fmt: skip
        return dict(zip(layout.names, tensors))

    def _start(self, tensor: torch.Tensor) -> torch.distributed.Work | None:
        return start_payload(self.pg, tensor, self.src, self.timeout_s)


def _layout_of(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> ChunkLayout:
    """The layout of a chunk of ``tensors``: packed when there are several averaging less
    than ``PACK_BELOW_MEAN_BYTES``."""
    n = len(tensors)
    total = sum(_nbytes(t) for t in tensors)
    return ChunkLayout.of(
        names,
        [_dtype_name(t.dtype) for t in tensors],
        [list(t.shape) for t in tensors],
        packed=n > 1 and total < n * PACK_BELOW_MEAN_BYTES,
    )


def start_payload(
    pg: ProcessGroup, tensor: torch.Tensor, src: int, timeout_s: float | None
) -> torch.distributed.Work | None:
    """Start broadcasting a payload ``tensor`` (sender and receivers alike); empty tensors
    have nothing to move (both sides skip them)."""
    if tensor.numel() == 0:
        return None
    return broadcast_async(pg, tensor, src, timeout_s=timeout_s)


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


class GroupFailureError(WeightTransferError):
    """A collective of the weight-sync group did not complete: a peer died or stalled past
    the timeout (``timed_out``); the group is no longer usable."""

    def __init__(self, message: str, *, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def _group_failure(stage: str, where: str, error: Exception) -> GroupFailureError:
    text = str(error)
    return GroupFailureError(
        f"weight sync failed while {stage} ({where}): {text}. A peer died, or did not take "
        "part within the group timeout; the process group is no longer usable, rebuild the "
        "sender and receivers (TorchDistributedWeightSyncInfo.timeout_s sets the timeout)",
        timed_out="timed out" in text.lower() or "timeout" in text.lower(),
    )


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
