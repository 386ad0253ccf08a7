"""The pipeline wire format: exact round trips, and hostile payloads rejected by name."""

from __future__ import annotations

import json
import pickle
import struct
import tracemalloc

import numpy as np
import pytest

from ludic.training.batching.wire import (
    FORMAT_VERSION,
    MAGIC,
    Producer,
    WireFormatError,
    decode_batch,
    encode_batch,
)
from ludic.training.types import SAWBatch, SAWItem

PRODUCER = Producer("batch-7", "actor-a", 7, policy_version=3)


def _batch() -> SAWBatch:
    items = [
        SAWItem(
            [10, 11, 12, 13, 14],
            [0, 0, 1, 1, 1],
            weight=0.25,
            old_logprobs=[0.0, 0.0, -0.5, -1.25, -2.0],
            action_versions=[3, 3, 4],
            meta={"rollout_id": "r0", "reward": 1.0, "group_id": "g", "turn": 0},
        ),
        SAWItem([1, 2, 3], [0, 1, 0], weight=-1.5, policy_version=5, meta={"reward": 0.0}),
        # sampled while an update to version 7 landed without a pause
        SAWItem(
            [4, 5, 6],
            [0, 1, 1],
            weight=0.5,
            policy_version=6,
            version_end=7,
            logprob_temperature=1.3,
        ),
        SAWItem([7, 8], [0, 1], weight=0.0),
    ]
    return SAWBatch(items=items, meta={"num_rollouts": 3, "reward_mean": 0.5, "tag": "x"})


def _split(payload: bytes) -> tuple[dict, bytes]:
    _, _, n = struct.unpack_from("<8sII", payload)
    return json.loads(payload[16 : 16 + n]), payload[16 + n :]


def _join(header: dict, body: bytes, version: int = FORMAT_VERSION) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<8sII", MAGIC, version, len(head)) + head + body


def _with_header(payload: bytes, edit) -> bytes:
    header, body = _split(payload)
    edit(header)
    return _join(header, body)


def _array_offset(header: dict, name: str) -> int:
    offset = 0
    for spec in header["arrays"]:
        if spec["name"] == name:
            return offset
        offset += np.dtype(spec["dtype"]).itemsize * spec["count"]
    raise KeyError(name)


def test_round_trip_keeps_items_meta_and_producer() -> None:
    batch = _batch()
    wire = decode_batch(encode_batch(batch, PRODUCER))
    assert wire.producer == PRODUCER
    assert wire.batch.meta == batch.meta
    for got, want in zip(wire.batch.items, batch.items, strict=True):
        assert got.input_ids == want.input_ids
        assert got.action_mask == want.action_mask
        assert got.weight == want.weight
        assert got.policy_version == want.policy_version
        assert got.action_versions == want.action_versions
        assert got.version_end == want.version_end
        assert got.version_span == want.version_span
        assert got.logprob_temperature == want.logprob_temperature
        assert got.meta == want.meta
        if want.old_logprobs is None:
            assert got.old_logprobs is None
        else:  # float32 on the wire
            assert got.old_logprobs == pytest.approx(want.old_logprobs, abs=1e-7)
    assert wire.batch.items[0].policy_version == 3  # derived from action_versions
    assert [item.version_span for item in wire.batch.items] == [1, 0, 1, 0]
    assert [item.logprob_temperature for item in wire.batch.items] == [1.0, 1.0, 1.3, 1.0]


def test_token_ids_use_int32_when_they_fit_and_int64_otherwise() -> None:
    small = encode_batch(_batch(), PRODUCER)
    big_item = SAWItem([2**40, 5], [0, 1], weight=1.0)
    big = encode_batch(SAWBatch([big_item]), PRODUCER)
    dtype = lambda p: next(a for a in _split(p)[0]["arrays"] if a["name"] == "input_ids")  # noqa: E731
    assert dtype(small)["dtype"] == "<i4"
    assert dtype(big)["dtype"] == "<i8"
    assert decode_batch(big).batch.items[0].input_ids == (2**40, 5)


def test_every_truncation_is_rejected() -> None:
    payload = encode_batch(_batch(), PRODUCER)
    for cut in range(len(payload)):
        with pytest.raises(WireFormatError):
            decode_batch(payload[:cut])


def test_trailing_bytes_are_rejected() -> None:
    with pytest.raises(WireFormatError, match="trailing bytes"):
        decode_batch(encode_batch(_batch(), PRODUCER) + b"\0")


def test_wrong_magic_and_pickles_are_rejected_without_unpickling() -> None:
    payload = encode_batch(_batch(), PRODUCER)
    with pytest.raises(WireFormatError, match="bad magic"):
        decode_batch(b"NOTLUDIC" + payload[8:])
    with pytest.raises(WireFormatError, match="bad magic"):
        decode_batch(pickle.dumps(_batch()))


def test_unsupported_format_version_is_rejected() -> None:
    header, body = _split(encode_batch(_batch(), PRODUCER))
    for version in (FORMAT_VERSION - 1, FORMAT_VERSION + 1):  # 1: before version_end
        with pytest.raises(WireFormatError, match=f"format version {version} is not supported"):
            decode_batch(_join(header, body, version=version))


def test_a_header_that_is_not_json_is_rejected() -> None:
    payload = bytearray(encode_batch(_batch(), PRODUCER))
    payload[16:20] = b"\xff{[,"
    with pytest.raises(WireFormatError, match="header is not valid UTF-8 JSON"):
        decode_batch(bytes(payload))
    head = b"[1, 2]"
    with pytest.raises(WireFormatError, match="header must be a JSON object"):
        decode_batch(struct.pack("<8sII", MAGIC, FORMAT_VERSION, len(head)) + head)


def test_nan_in_the_header_is_rejected() -> None:
    header, body = _split(encode_batch(_batch(), PRODUCER))
    header["meta"]["reward_mean"] = float("nan")  # json.dumps writes NaN
    with pytest.raises(WireFormatError, match="NaN is not allowed"):
        decode_batch(_join(header, body))
    text = json.dumps(header).replace("NaN", "1e999").encode()
    raw = struct.pack("<8sII", MAGIC, FORMAT_VERSION, len(text)) + text + body
    with pytest.raises(WireFormatError, match="overflows"):
        decode_batch(raw)


def test_missing_or_extra_header_fields_are_named() -> None:
    payload = encode_batch(_batch(), PRODUCER)
    with pytest.raises(WireFormatError, match=r"missing \['producer'\]"):
        decode_batch(_with_header(payload, lambda h: h.pop("producer")))
    with pytest.raises(WireFormatError, match=r"unexpected \['code'\]"):
        decode_batch(_with_header(payload, lambda h: h.update(code="print(1)")))


def test_lengths_that_lie_are_rejected() -> None:
    payload = encode_batch(_batch(), PRODUCER)

    def shift(name: str, delta: int):
        def edit(header: dict) -> None:
            spec = next(a for a in header["arrays"] if a["name"] == name)
            spec["count"] += delta

        return edit

    with pytest.raises(WireFormatError, match="declare .* bytes but .* follow"):
        decode_batch(_with_header(payload, shift("input_ids", 1)))
    # Counts that add up to the right size but disagree with each other.
    lying = _with_header(payload, lambda h: (shift("input_ids", 2)(h), shift("weight", -1)(h)))
    with pytest.raises(WireFormatError, match="array weight has 3 entries, expected 4"):
        decode_batch(lying)
    with pytest.raises(WireFormatError, match="num_items must be an int >= 1"):
        decode_batch(_with_header(payload, lambda h: h.update(num_items=True)))


def test_huge_declared_lengths_do_not_allocate() -> None:
    payload = encode_batch(_batch(), PRODUCER)

    def huge(header: dict) -> None:
        header["num_items"] = 10**15
        header["item_meta"] = []
        for spec in header["arrays"]:
            spec["count"] = 10**15

    hostile = _with_header(payload, huge)
    tracemalloc.start()
    try:
        with pytest.raises(WireFormatError):
            decode_batch(hostile)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000
    head = b"{}"
    prefix = struct.pack("<8sII", MAGIC, FORMAT_VERSION, 2**32 - 1)
    with pytest.raises(WireFormatError, match="header length 4294967295 exceeds"):
        decode_batch(prefix + head)


def test_a_nan_weight_is_rejected_naming_the_item() -> None:
    payload = bytearray(encode_batch(_batch(), PRODUCER))
    header, body = _split(bytes(payload))
    at = len(payload) - len(body) + _array_offset(header, "weight") + 8  # item 1
    payload[at : at + 8] = struct.pack("<d", float("nan"))
    with pytest.raises(WireFormatError, match="item 1: weight is nan"):
        decode_batch(bytes(payload))


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_a_temperature_that_is_not_positive_and_finite_is_rejected(temperature) -> None:
    payload = bytearray(encode_batch(_batch(), PRODUCER))
    header, body = _split(bytes(payload))
    at = len(payload) - len(body) + _array_offset(header, "logprob_temperature") + 16  # item 2
    payload[at : at + 8] = struct.pack("<d", temperature)
    with pytest.raises(WireFormatError, match="item 2: SAWItem: logprob_temperature="):
        decode_batch(bytes(payload))


def test_bad_masks_dtypes_and_items_are_named() -> None:
    payload = encode_batch(_batch(), PRODUCER)
    header, body = _split(payload)
    data = bytearray(payload)
    at = len(payload) - len(body) + _array_offset(header, "action_mask")
    data[at + 2] = 2
    with pytest.raises(WireFormatError, match="action_mask must hold only 0/1"):
        decode_batch(bytes(data))
    data = bytearray(payload)
    data[at + 6] = 0  # item 1 ([0, 1, 0]) keeps no action token
    with pytest.raises(WireFormatError, match="item 1: SAWItem: no action tokens"):
        decode_batch(bytes(data))
    edit = lambda h: h["arrays"][3].update(dtype="<f4")  # noqa: E731
    with pytest.raises(WireFormatError, match=r"array weight: dtype '<f4' is not one of"):
        decode_batch(_with_header(payload, edit))
    edit = lambda h: h["producer"].update(batch_index=-1)  # noqa: E731
    with pytest.raises(WireFormatError, match="producer.batch_index must be an int >= 0"):
        decode_batch(_with_header(payload, edit))


def test_encoding_refuses_meta_that_is_not_json_and_empty_batches() -> None:
    item = SAWItem([1, 2], [0, 1], weight=1.0, meta={"when": object()})
    with pytest.raises(WireFormatError, match=r"item 0 meta\['when'\] is not JSON"):
        encode_batch(SAWBatch([item]), PRODUCER)
    batch = SAWBatch([SAWItem([1, 2], [0, 1], weight=1.0)], meta={"loss": float("inf")})
    with pytest.raises(WireFormatError, match=r"batch.meta\['loss'\] is not JSON"):
        encode_batch(batch, PRODUCER)
    with pytest.raises(WireFormatError, match="empty SAWBatch"):
        encode_batch(SAWBatch([]), PRODUCER)
