"""Chunk layouts and the caches that let a layout travel by id (no processes here; the
protocol over a real group is tested in test_weight_transfer_broadcast.py)."""

from __future__ import annotations

import json

import pytest
import torch

from ludic.distributed.weight_transfer import BroadcastWeightUpdateRequest, request_from_dict
from ludic.distributed.weight_transfer.layout import (
    ChunkLayout,
    KnownLayouts,
    SentLayouts,
    chunk_signature,
)
from ludic.distributed.weight_transfer.packing import (
    ALIGN_BYTES,
    as_bytes,
    contiguous_bytes,
    layout_checksum,
)


def layout(packed: bool = True, shapes=([2, 3], [5], [])) -> ChunkLayout:
    names = [f"m.p{i}" for i in range(len(shapes))]
    dtypes = ["bfloat16", "float32", "int64"][: len(shapes)]
    return ChunkLayout.of(names, dtypes, shapes, packed=packed)


def test_a_layout_derives_sizes_offsets_ranges_and_its_id_from_names_dtypes_shapes() -> None:
    packed = layout(packed=True)
    assert packed.sizes == [12, 20, 8]
    assert packed.offsets == [0, 12, 32] and packed.buffer_bytes == packed.payload_bytes == 40
    assert packed.ranges == [(0, 3)]  # one piece: far below PIECE_BYTES
    assert packed.span(1, 3) == (12, 40)
    unpacked = layout(packed=False)
    assert unpacked.offsets == [0, ALIGN_BYTES, 2 * ALIGN_BYTES]
    assert unpacked.ranges == [(0, 1), (1, 2), (2, 3)]
    assert packed.id == unpacked.id == f"{packed.checksum:016x}"
    assert packed.checksum == layout_checksum(packed.names, packed.dtype_names, packed.shapes)
    assert layout(shapes=([3, 2], [5], [])).id != packed.id


def test_header_carries_count_bytes_flags_version_and_checksum() -> None:
    header = layout().header(version=7, last=True).tolist()
    assert header[2:] == [3, 40, 1, 7, 1, layout().checksum]
    assert layout().header(version=None, last=False).tolist()[5:7] == [-1, 0]


def test_requests_in_full_or_by_reference_round_trip_through_json() -> None:
    lay = layout()
    full = lay.request(version=1, last=False, by_reference=False)
    ref = lay.request(version=2, last=True, by_reference=True)
    bare = lay.request(version=1, last=False, by_reference=False, with_id=False)
    assert (full.layout, ref.layout, bare.layout) == (lay.id, lay.id, None)
    assert not full.is_reference and ref.is_reference and not bare.is_reference
    assert ref.names == ref.dtypes == ref.shapes == []
    for request in (full, ref, bare):
        assert request_from_dict(json.loads(json.dumps(request.to_dict()))) == request


@pytest.mark.parametrize("bad", ["XYZ", "0123", 12, "0123456789ABCDEF"])
def test_a_malformed_layout_id_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="layout=.*16 lowercase hex digits"):
        BroadcastWeightUpdateRequest(names=[], dtypes=[], shapes=[], layout=bad)


def test_a_worker_resolves_references_only_to_layouts_it_agreed_to() -> None:
    known = KnownLayouts()
    lay = layout()
    full = lay.request(version=1, last=False, by_reference=False)
    ref = lay.request(version=2, last=False, by_reference=True)
    with pytest.raises(ValueError, match="never announced"):
        known.resolve(ref)
    resolved = known.resolve(full)
    assert resolved.checksum == lay.checksum
    with pytest.raises(ValueError, match="never announced"):
        known.resolve(ref)  # resolving is not agreeing: nothing is remembered yet
    known.remember(full, resolved)
    assert known.resolve(ref) is resolved and len(known) == 1
    flipped = BroadcastWeightUpdateRequest(
        names=[], dtypes=[], shapes=[], packed=False, layout=lay.id
    )
    with pytest.raises(ValueError, match="packed=False.*announced with packed=True"):
        known.resolve(flipped)


def test_a_worker_refuses_an_id_that_is_not_its_layouts_hash() -> None:
    other = layout(shapes=([3, 2], [5], []))
    lying = layout().request(version=1, last=False, by_reference=False)
    lying.layout = other.id
    with pytest.raises(ValueError, match=f"layout id {other.id} for names/dtypes/shapes"):
        KnownLayouts().resolve(lying)


def test_a_worker_holds_at_most_capacity_layouts() -> None:
    known = KnownLayouts(capacity=2)
    layouts = [layout(shapes=([i + 1], [5], [])) for i in range(3)]
    for lay in layouts[:2]:
        request = lay.request(version=None, last=False, by_reference=False)
        known.remember(request, known.resolve(request))
    again = layouts[0].request(version=None, last=False, by_reference=False)
    known.resolve(again)  # an id it holds may be announced again
    with pytest.raises(ValueError, match="already holds the most a trainer may announce"):
        known.resolve(layouts[2].request(version=None, last=False, by_reference=False))
    # without an id, a full announcement needs no room
    known.resolve(layouts[2].request(version=None, last=False, by_reference=False, with_id=False))


def test_the_trainer_tracks_at_most_capacity_layouts_by_signature() -> None:
    sent = SentLayouts(capacity=1)
    a = [torch.zeros(2, 3), torch.zeros(5)]
    sig = chunk_signature(["x", "y"], a)
    assert sig == chunk_signature(["x", "y"], [torch.ones(2, 3), torch.ones(5)])  # values
    assert sig != chunk_signature(["x", "y"], [torch.zeros(3, 2), torch.zeros(5)])
    assert sig != chunk_signature(["x", "y"], [a[0].double(), a[1]])
    assert sig != chunk_signature(["y", "x"], a)
    entry = sent.add(sig, layout())
    assert sent.get(sig) is entry and not entry.known
    assert sent.add(("other",), layout()) is None and len(sent) == 1


def test_contiguous_bytes_views_only_tensors_back_to_back_in_one_storage() -> None:
    buf = torch.arange(12, dtype=torch.float32)
    a, b, c = buf[2:5], buf[5:9].view(2, 2), buf[9:12]
    run = contiguous_bytes([a, b, c])
    assert run is not None and run.data_ptr() == a.data_ptr()
    assert torch.equal(run, torch.cat([as_bytes(a), as_bytes(b), as_bytes(c)]))
    assert contiguous_bytes([a, c]) is None  # a gap
    assert contiguous_bytes([b, a]) is None  # out of order
    assert contiguous_bytes([a, b.clone()]) is None  # another storage
    assert contiguous_bytes([buf.view(3, 4).t()]) is None  # not contiguous
    assert contiguous_bytes([buf[0:4].view(2, 2), buf[4:8].view(2, 2).t()]) is None
