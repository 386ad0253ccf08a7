"""A broadcast chunk's layout, derived once from its names, dtypes and shapes, and the
caches that let a layout travel by reference after its first sync.

Describing a chunk of thousands of tensors costs microseconds of Python per tensor on both
sides, and training changes values, not layouts. So a chunk is announced in full with its
layout id (a hash of names, dtypes and shapes) the first time it crosses a group, and by id
alone afterwards. The broadcast header still carries the hash of what is sent, so an unknown
or wrong id fails the handshake like any mismatch. The caches live as long as the sender,
receivers and their group: a rebuilt group starts empty.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from ludic.distributed.weight_transfer.base import BroadcastWeightUpdateRequest, dtype_from_name
from ludic.distributed.weight_transfer.packing import (
    _aligned_offsets,
    _header,
    _packed_offsets,
    layout_checksum,
    pieces,
)

MAX_LAYOUTS = 256
"""Layouts a sender announces by id over one group, and so what each receiver remembers.
A sender that has used them all announces further layouts in full, without an id."""


@dataclass(frozen=True, eq=False)
class ChunkLayout:
    """Everything about a broadcast chunk that follows from its names, dtypes and shapes.

    ``offsets`` are where each tensor's bytes lie in the payload buffer (consecutive when
    ``packed``, ``ALIGN_BYTES``-aligned otherwise); ``ranges`` are the tensor index ranges
    ``[lo, hi)`` that move in one broadcast each (pieces when packed, single tensors
    otherwise).
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool
    dtypes: list[torch.dtype]
    sizes: list[int]
    offsets: list[int]
    ranges: list[tuple[int, int]]
    checksum: int

    @classmethod
    def of(
        cls,
        names: Sequence[str],
        dtype_names: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        packed: bool,
    ) -> ChunkLayout:
        dtypes = [dtype_from_name(d) for d in dtype_names]
        shapes = [list(s) for s in shapes]
        sizes = [math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes)]
        return cls(
            names=list(names),
            dtype_names=list(dtype_names),
            shapes=shapes,
            packed=packed,
            dtypes=dtypes,
            sizes=sizes,
            offsets=_packed_offsets(sizes) if packed else _aligned_offsets(sizes),
            ranges=pieces(sizes) if packed else [(i, i + 1) for i in range(len(sizes))],
            checksum=layout_checksum(names, dtype_names, shapes),
        )

    @classmethod
    def of_request(cls, request: BroadcastWeightUpdateRequest) -> ChunkLayout:
        return cls.of(request.names, request.dtypes, request.shapes, packed=request.packed)

    @property
    def id(self) -> str:
        """The id a layout reference names it by: its checksum as 16 hex digits."""
        return f"{self.checksum:016x}"

    @property
    def payload_bytes(self) -> int:
        return sum(self.sizes)

    @property
    def buffer_bytes(self) -> int:
        """Size of the buffer the payload lands in (alignment padding included)."""
        return self.offsets[-1] + self.sizes[-1] if self.sizes else 0

    def span(self, lo: int, hi: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of tensors ``lo..hi-1`` in the payload buffer."""
        return self.offsets[lo], self.offsets[hi - 1] + self.sizes[hi - 1]

    def header(self, *, version: int | None, last: bool) -> torch.Tensor:
        """The header of a chunk with this layout (see ``packing.py``)."""
        return _header(
            len(self.names),
            self.checksum,
            total_bytes=self.payload_bytes,
            packed=self.packed,
            version=version,
            last=last,
        )

    def request(
        self, *, version: int | None, last: bool, by_reference: bool, with_id: bool = True
    ) -> BroadcastWeightUpdateRequest:
        """The announcement: the full layout (with its id, for the workers to remember,
        when ``with_id``), or only its id when ``by_reference``."""
        if by_reference:
            return BroadcastWeightUpdateRequest(
                names=[], dtypes=[], shapes=[], version=version, last=last,
                packed=self.packed, layout=self.id,
            )  # fmt: skip
        return BroadcastWeightUpdateRequest(
            names=list(self.names),
            dtypes=list(self.dtype_names),
            shapes=[list(s) for s in self.shapes],
            version=version,
            last=last,
            packed=self.packed,
            layout=self.id if with_id else None,
        )


@dataclass
class SentLayout:
    layout: ChunkLayout
    known: bool = False  # every worker agreed to a full announcement carrying its id


class SentLayouts:
    """The trainer's side: layouts by chunk signature (names, dtypes, shapes of the
    tensors about to move), and whether the workers know each by id."""

    def __init__(self, capacity: int = MAX_LAYOUTS) -> None:
        self.capacity = capacity
        self._by_signature: dict[Hashable, SentLayout] = {}

    def get(self, signature: Hashable) -> SentLayout | None:
        return self._by_signature.get(signature)

    def add(self, signature: Hashable, layout: ChunkLayout) -> SentLayout | None:
        """Track ``layout`` (``None`` once ``capacity`` layouts are tracked: it is then
        announced in full every time, without an id)."""
        if len(self._by_signature) >= self.capacity:
            return None
        entry = self._by_signature[signature] = SentLayout(layout)
        return entry

    def __len__(self) -> int:
        return len(self._by_signature)


def chunk_signature(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> Hashable:
    """What a chunk's layout depends on, cheap to compute and to compare."""
    return tuple(names), tuple([t.dtype for t in tensors]), tuple([t.shape for t in tensors])


class KnownLayouts:
    """A worker's side: the layouts announced to it by id, at most ``capacity``."""

    def __init__(self, capacity: int = MAX_LAYOUTS) -> None:
        self.capacity = capacity
        self._by_id: dict[str, ChunkLayout] = {}

    def resolve(self, request: BroadcastWeightUpdateRequest) -> ChunkLayout:
        """The layout ``request`` announces; raises ``ValueError`` saying why there is
        none (an unknown id, an id that is not the hash of the announced layout, or one
        layout too many)."""
        if request.is_reference:
            layout = self._by_id.get(str(request.layout))
            if layout is None:
                raise ValueError(
                    f"a reference to layout {request.layout}, which this worker was never "
                    "announced (was it restarted or its weight-sync group rebuilt without "
                    "the trainer's?)"
                )
            if layout.packed != request.packed:
                raise ValueError(
                    f"a reference to layout {request.layout} with packed={request.packed}, "
                    f"but that layout was announced with packed={layout.packed}"
                )
            return layout
        layout = ChunkLayout.of_request(request)
        if request.layout is not None:
            if request.layout != layout.id:
                raise ValueError(
                    f"layout id {request.layout} for names/dtypes/shapes whose id is {layout.id}"
                )
            if request.layout not in self._by_id and len(self._by_id) >= self.capacity:
                raise ValueError(
                    f"a new layout id {request.layout}, but this worker already holds the "
                    f"most a trainer may announce by id ({self.capacity})"
                )
        return layout

    def remember(self, request: BroadcastWeightUpdateRequest, layout: ChunkLayout) -> None:
        """After the handshake agreed: keep a full announcement's layout under its id."""
        if request.layout is not None and not request.is_reference:
            self._by_id[request.layout] = layout

    def __len__(self) -> int:
        return len(self._by_id)
