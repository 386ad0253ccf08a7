"""Byte layout of broadcast weight payloads: piece cuts, packing and unpacking, receive buffers,
and the header both sides compare (int64s: tensor count, bytes, flags, version, a layout hash).

``packed=True`` (chunks of small tensors): the bytes concatenated into one flat uint8 buffer,
moved in pieces of about ``PIECE_BYTES`` cut at tensor boundaries, each unpacked while the next
moves. ``packed=False``: one broadcast per tensor, straight from the trainer's tensor, each at
a multiple of ``ALIGN_BYTES`` in the receive buffer. Workers return views into the buffer (a
copy only where misaligned for the dtype); a buffer is reused once nothing views it, so load
(copy) the tensors and drop them. How the header is compared: ``broadcast.py``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import torch

from ludic.distributed.weight_transfer.base import DTYPES, dtype_name

MIB = 2**20
PIECE_BYTES = 8 * MIB
"""Packed payloads move in pieces of at least this size (cut at tensor boundaries; both
sides derive the same cuts from the tensor sizes)."""
ALIGN_BYTES = 64  # offsets of unpacked tensors in a receive buffer

HEADER_MAGIC = 0x4C5544494357  # "LUDICW"
PROTOCOL_VERSION = 1
# [magic, protocol, n_tensors, total_bytes, packed, version (-1 = None), last, checksum]
HEADER_FIELDS = ("magic", "protocol", "tensors", "bytes", "packed", "version", "last", "checksum")


class PackBuffers:
    """Two flat uint8 pack buffers used in turn, each grown to the largest packed chunk it
    held: the next chunk is packed into one while the previous one may still be moving."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._packed_chunks = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """The pack buffer not used by the previous chunk (which may still be moving)."""
        i = self._packed_chunks % 2
        self._packed_chunks += 1
        buf = self._buffers[i]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._buffers[i] = buf
        return buf

    def clear(self) -> None:
        self._buffers = [None, None]


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


def contiguous_bytes(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A flat uint8 view of ``tensors`` when they lie back to back, in order, in one
    storage (e.g. parameters kept in one flat buffer); ``None`` otherwise. Such a piece
    is exactly the bytes packing would produce, without the copy."""
    first = tensors[0]
    storage = first.untyped_storage()
    base = storage.data_ptr()
    at = first.data_ptr()
    for t in tensors:
        if t.data_ptr() != at or t.untyped_storage().data_ptr() != base or not t.is_contiguous():
            return None
        at += t.numel() * t.element_size()
    start = first.data_ptr() - base
    flat = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage)
    return flat[start : start + (at - first.data_ptr())]


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
            # torch.split_with_sizes: Tensor.split's Python wrapper costs ~2 us a tensor
            parts = torch.split_with_sizes(run, [s // dtype.itemsize for s in sizes[i:j]])
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


# ------------------------------------------------------------------------------ header
def layout_checksum(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> int:
    """A 63-bit hash of the JSON of a chunk's names, dtypes and shapes."""
    meta = json.dumps([list(names), list(dtypes), [list(s) for s in shapes]], separators=(",", ":"))
    digest = hashlib.blake2b(meta.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _header(
    n_tensors: int,
    checksum: int,
    *,
    total_bytes: int,
    packed: bool,
    version: int | None,
    last: bool,
) -> torch.Tensor:
    version_field = -1 if version is None else int(version)
    values = [HEADER_MAGIC, PROTOCOL_VERSION, n_tensors, total_bytes, int(packed)]
    return torch.tensor(values + [version_field, int(last), checksum], dtype=torch.int64)


def _describe(header: torch.Tensor | None) -> str:
    if header is None:
        return "nothing it can check"
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
