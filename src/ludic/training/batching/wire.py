"""Wire format of one ``SAWBatch`` between pipeline processes (actor -> Redis -> learner).

No pickle, no ``eval``: ``b"LUDICSAW"``, a uint32 format version (:data:`FORMAT_VERSION`; any
other is refused), a uint32 header length, a JSON header (producer, batch and item meta, the
array table) and raw little-endian arrays; the byte layout is in docs/design.md ("Wire format").
:func:`encode_batch` writes it. :func:`decode_batch` checks every field, dtype and count against
the bytes received before reading an array (a lying length cannot make it allocate), then builds
each ``SAWItem`` through its own checks; anything wrong is a :class:`WireFormatError` naming the
field. Round trip: exact but for ``old_logprobs`` (float32) and meta (JSON: tuples -> lists).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ludic.training.types import SAWBatch, SAWItem

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAGIC",
    "Producer",
    "WireBatch",
    "WireFormatError",
    "decode_batch",
    "encode_batch",
]

MAGIC = b"LUDICSAW"
FORMAT_NAME = "ludic.saw_batch"
FORMAT_VERSION = 3
_PREFIX = struct.Struct("<8sII")  # magic, format version, header length

# (name, allowed dtypes, one entry per: "item" | "token" | "logprob_token" | "version_token")
_ARRAYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("num_tokens", ("<u4",)),
    ("input_ids", ("<i4", "<i8")),
    ("action_mask", ("|u1",)),
    ("weight", ("<f8",)),
    ("has_old_logprobs", ("|u1",)),
    ("old_logprobs", ("<f4",)),
    ("has_policy_version", ("|u1",)),
    ("policy_version", ("<i8",)),
    ("has_action_versions", ("|u1",)),
    ("action_versions", ("<i8",)),
    ("has_version_end", ("|u1",)),
    ("version_end", ("<i8",)),
    ("logprob_temperature", ("<f8",)),
)
_HEADER_KEYS = {"format", "version", "num_items", "producer", "meta", "item_meta", "arrays"}


class WireFormatError(ValueError):
    """A payload is not a valid ludic SAW batch (the message names what is wrong)."""


@dataclass(frozen=True)
class Producer:
    """Who made a batch: ``batch_id`` (unique within a pipeline prefix), the actor, the
    global batch index it claimed, and the policy version it generated with (``None`` when
    unknown)."""

    batch_id: str
    actor_id: str
    batch_index: int
    policy_version: int | None = None

    def __post_init__(self) -> None:
        for name in ("batch_id", "actor_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise WireFormatError(f"producer.{name} must be a non-empty string, got {value!r}")
        if not _is_int(self.batch_index) or self.batch_index < 0:
            raise WireFormatError(
                f"producer.batch_index must be an int >= 0, got {self.batch_index!r}"
            )
        if self.policy_version is not None and not _is_int(self.policy_version):
            raise WireFormatError(
                f"producer.policy_version must be an int or null, got {self.policy_version!r}"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "batch_id": self.batch_id,
            "actor_id": self.actor_id,
            "batch_index": self.batch_index,
            "policy_version": self.policy_version,
        }


@dataclass(frozen=True)
class WireBatch:
    """A decoded payload: the batch and who produced it."""

    batch: SAWBatch
    producer: Producer


# ---------------------------------------------------------------------------------- encode
def encode_batch(batch: SAWBatch, producer: Producer) -> bytes:
    """``batch`` + ``producer`` -> payload bytes (layout: docs/design.md, "Wire format")."""
    items = batch.items
    if not items:
        raise WireFormatError("cannot encode an empty SAWBatch (no items)")
    n = len(items)
    ids = [t for item in items for t in item.input_ids]
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= 2**63:
        raise WireFormatError(f"input_ids must lie in [0, 2**63), got values in [{lo}, {hi}]")
    arrays: dict[str, np.ndarray] = {
        "num_tokens": np.array([item.num_tokens for item in items], dtype="<u4"),
        "input_ids": np.array(ids, dtype="<i4" if hi < 2**31 else "<i8"),
        "action_mask": np.array([m for item in items for m in item.action_mask], dtype="|u1"),
        "weight": np.array([item.weight for item in items], dtype="<f8"),
        **_optional_array(items, "old_logprobs", "<f4", per_token=True),
        **_optional_array(items, "policy_version", "<i8", per_token=False),
        **_optional_array(items, "action_versions", "<i8", per_token=True),
        **_optional_array(items, "version_end", "<i8", per_token=False),
        "logprob_temperature": np.array([item.logprob_temperature for item in items], dtype="<f8"),
    }
    if not np.isfinite(arrays["old_logprobs"]).all():
        bad = next(i for i, item in enumerate(items) if _nonfinite(item.old_logprobs))
        raise WireFormatError(f"item {bad}: old_logprobs has a NaN/inf value")
    header = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "num_items": n,
        "producer": producer.to_json(),
        "meta": _checked_json("batch.meta", batch.meta),
        "item_meta": [_checked_json(f"item {i} meta", item.meta) for i, item in enumerate(items)],
        "arrays": [
            {"name": name, "dtype": arrays[name].dtype.str, "count": int(arrays[name].size)}
            for name, _ in _ARRAYS
        ],
    }
    head = json.dumps(header, allow_nan=False, separators=(",", ":")).encode("utf-8")
    body = b"".join(arrays[name].tobytes() for name, _ in _ARRAYS)
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(head)) + head + body


def _optional_array(
    items: Sequence[SAWItem], name: str, dtype: str, *, per_token: bool
) -> dict[str, np.ndarray]:
    """``has_<name>`` (1 where the item's ``name`` is set) and ``name``: the set values back
    to back (``per_token``), else one value per item, 0 where unset."""
    values = [getattr(item, name) for item in items]
    if per_token:
        flat = [x for value in values if value is not None for x in value]
    else:
        flat = [0 if value is None else value for value in values]
    present = [value is not None for value in values]
    return {f"has_{name}": np.array(present, dtype="|u1"), name: np.array(flat, dtype=dtype)}


def _checked_json(what: str, value: Mapping[str, Any]) -> dict[str, Any]:
    """``value`` if it is a JSON object (str keys, finite numbers), else a clear error."""
    if not isinstance(value, Mapping):
        raise WireFormatError(f"{what} must be a dict, got {type(value).__name__}")
    for key, field in value.items():
        if not isinstance(key, str):
            raise WireFormatError(f"{what} has a non-string key {key!r}")
        try:
            json.dumps(field, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise WireFormatError(
                f"{what}[{key!r}] is not JSON ({err}); keep meta to str keys, finite "
                "numbers, strings, lists and dicts"
            ) from None
    return dict(value)


def _nonfinite(values: Sequence[float] | None) -> bool:
    return values is not None and not all(math.isfinite(v) for v in values)


# ---------------------------------------------------------------------------------- decode
def decode_batch(data: bytes | bytearray | memoryview) -> WireBatch:
    """Payload bytes -> :class:`WireBatch`; raises :class:`WireFormatError` on anything
    malformed (never executes or unpickles anything)."""
    data = memoryview(data).cast("B")
    if len(data) < _PREFIX.size:
        raise WireFormatError(
            f"payload is {len(data)} bytes, shorter than the {_PREFIX.size}-byte prefix "
            "(truncated, or not a ludic SAW batch)"
        )
    magic, version, head_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise WireFormatError(
            f"bad magic {bytes(magic)!r}, expected {MAGIC!r}: not a ludic SAW batch"
        )
    if version != FORMAT_VERSION:
        raise WireFormatError(
            f"format version {version} is not supported (this ludic reads version "
            f"{FORMAT_VERSION}); run actors and learner with the same ludic version"
        )
    if head_len > len(data) - _PREFIX.size:
        raise WireFormatError(
            f"header length {head_len} exceeds the {len(data) - _PREFIX.size} bytes after "
            "the prefix (truncated payload)"
        )
    header = _parse_header(bytes(data[_PREFIX.size : _PREFIX.size + head_len]))
    body = data[_PREFIX.size + head_len :]
    n = header["num_items"]
    arrays = _read_arrays(header["arrays"], body)
    items = _build_items(n, arrays, header["item_meta"])
    producer = Producer(**header["producer"])
    return WireBatch(SAWBatch(items=items, meta=header["meta"]), producer)


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(
            raw.decode("utf-8"), parse_constant=_reject_constant, parse_float=_finite_float
        )
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as err:
        raise WireFormatError(f"header is not valid UTF-8 JSON ({err})") from None
    if not isinstance(header, dict):
        raise WireFormatError(f"header must be a JSON object, got {type(header).__name__}")
    if set(header) != _HEADER_KEYS:
        missing, extra = _HEADER_KEYS - set(header), set(header) - _HEADER_KEYS
        raise WireFormatError(
            f"header fields differ from the format: missing {sorted(missing)}, "
            f"unexpected {sorted(extra)}"
        )
    if header["format"] != FORMAT_NAME:
        raise WireFormatError(f"header.format is {header['format']!r}, expected {FORMAT_NAME!r}")
    if header["version"] != FORMAT_VERSION:
        raise WireFormatError(
            f"header.version is {header['version']!r} but the prefix says {FORMAT_VERSION}"
        )
    n = header["num_items"]
    if not _is_int(n) or n < 1:
        raise WireFormatError(f"header.num_items must be an int >= 1, got {n!r}")
    if not isinstance(header["meta"], dict):
        raise WireFormatError("header.meta must be a JSON object")
    item_meta = header["item_meta"]
    if not isinstance(item_meta, list) or len(item_meta) != n:
        raise WireFormatError(f"header.item_meta must be a list of {n} objects")
    if not all(isinstance(m, dict) for m in item_meta):
        bad = next(i for i, m in enumerate(item_meta) if not isinstance(m, dict))
        raise WireFormatError(f"header.item_meta[{bad}] is not a JSON object")
    producer = header["producer"]
    if not isinstance(producer, dict) or set(producer) != {
        "batch_id",
        "actor_id",
        "batch_index",
        "policy_version",
    }:
        raise WireFormatError(
            "header.producer must be an object with batch_id, actor_id, batch_index and "
            "policy_version"
        )
    return header


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} overflows to {value}")
    return value


def _read_arrays(specs: Any, body: memoryview) -> dict[str, np.ndarray]:
    """Check the array table against the format and the received size, then view the
    arrays (no copy, nothing allocated from a declared length)."""
    if not isinstance(specs, list) or len(specs) != len(_ARRAYS):
        raise WireFormatError(f"header.arrays must list the {len(_ARRAYS)} arrays of the format")
    sizes: list[tuple[str, np.dtype, int]] = []
    for spec, (name, dtypes) in zip(specs, _ARRAYS):
        if not isinstance(spec, dict) or spec.get("name") != name:
            got = spec.get("name") if isinstance(spec, dict) else spec
            raise WireFormatError(f"header.arrays: expected {name!r} next, got {got!r}")
        dtype, count = spec.get("dtype"), spec.get("count")
        if dtype not in dtypes:
            raise WireFormatError(f"array {name}: dtype {dtype!r} is not one of {list(dtypes)}")
        if not _is_int(count) or count < 0:
            raise WireFormatError(f"array {name}: count must be an int >= 0, got {count!r}")
        sizes.append((name, np.dtype(dtype), count))
    declared = sum(dt.itemsize * count for _, dt, count in sizes)
    if declared != len(body):
        raise WireFormatError(
            f"the arrays declare {declared} bytes but {len(body)} follow the header "
            f"({'truncated payload' if declared > len(body) else 'trailing bytes'})"
        )
    arrays, offset = {}, 0
    for name, dt, count in sizes:
        arrays[name] = np.frombuffer(body, dtype=dt, count=count, offset=offset)
        offset += dt.itemsize * count
    return arrays


def _build_items(
    n: int, a: dict[str, np.ndarray], item_meta: list[dict[str, Any]]
) -> list[SAWItem]:
    starts, actions = _check_arrays(n, a)
    items: list[SAWItem] = []
    lp_at = av_at = 0
    for i in range(n):
        lo, hi = int(starts[i]), int(starts[i + 1])
        old_logprobs = action_versions = None
        if a["has_old_logprobs"][i]:
            old_logprobs = a["old_logprobs"][lp_at : lp_at + hi - lo].tolist()
            lp_at += hi - lo
        if a["has_action_versions"][i]:
            action_versions = a["action_versions"][av_at : av_at + actions[i]].tolist()
            av_at += int(actions[i])
        version = int(a["policy_version"][i]) if a["has_policy_version"][i] else None
        end = int(a["version_end"][i]) if a["has_version_end"][i] else None
        try:
            items.append(
                SAWItem(
                    input_ids=a["input_ids"][lo:hi].tolist(),
                    action_mask=a["action_mask"][lo:hi].tolist(),
                    weight=float(a["weight"][i]),
                    old_logprobs=old_logprobs,
                    policy_version=version,
                    meta=item_meta[i],
                    action_versions=action_versions,
                    version_end=end,
                    logprob_temperature=float(a["logprob_temperature"][i]),
                )
            )
        except ValueError as err:
            raise WireFormatError(f"item {i}: {err}") from None
    return items


def _check_arrays(n: int, a: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Check the arrays' counts and values against ``n`` items and each other; returns the
    items' token offsets [n + 1] and action-token counts [n]."""
    for name in ("num_tokens", "weight", "has_old_logprobs", "has_policy_version"):
        _expect_count(a, name, n)
    _expect_count(a, "policy_version", n)
    _expect_count(a, "has_action_versions", n)
    _expect_count(a, "has_version_end", n)
    _expect_count(a, "version_end", n)
    _expect_count(a, "logprob_temperature", n)
    flags = ("has_old_logprobs", "has_policy_version", "has_action_versions", "has_version_end")
    for name in ("action_mask", *flags):
        if (a[name] > 1).any():
            raise WireFormatError(f"array {name} must hold only 0/1")
    lengths = a["num_tokens"].astype(np.int64)
    total = int(lengths.sum())
    _expect_count(a, "input_ids", total)
    _expect_count(a, "action_mask", total)
    if (a["input_ids"] < 0).any():
        raise WireFormatError("array input_ids has a negative token id")
    if not np.isfinite(a["weight"]).all():
        bad = int(np.flatnonzero(~np.isfinite(a["weight"]))[0])
        raise WireFormatError(f"item {bad}: weight is {float(a['weight'][bad])} (must be finite)")
    starts = np.concatenate(([0], np.cumsum(lengths)))
    mask = a["action_mask"]
    actions = np.array([int(mask[starts[i] : starts[i + 1]].sum()) for i in range(n)])
    has_lp, has_av = a["has_old_logprobs"].astype(bool), a["has_action_versions"].astype(bool)
    _expect_count(a, "old_logprobs", int(lengths[has_lp].sum()))
    _expect_count(a, "action_versions", int(actions[has_av].sum()))
    if not np.isfinite(a["old_logprobs"]).all():
        raise WireFormatError("array old_logprobs has a NaN/inf value")
    return starts, actions


def _expect_count(arrays: dict[str, np.ndarray], name: str, expected: int) -> None:
    if arrays[name].size != expected:
        raise WireFormatError(
            f"array {name} has {arrays[name].size} entries, expected {expected} from the "
            "other arrays"
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
