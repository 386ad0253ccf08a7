"""Policy weights through Redis, for pipeline actors with an in-process model
(``inference.backend: transformers``), which cannot join a weight-sync group.

:class:`RedisWeightPublisher` (the learner's) writes each version as ``P:weights`` (the bytes of
``safetensors.torch.save``: HF names, LoRA merged, on CPU, metadata ``{"format":
"ludic.policy_weights", "version": "<int>"}``; no pickle) and ``P:weights_version``, in one
``MULTI``/``EXEC``; an actor's :class:`RedisWeightSubscriber` reads both in one, checks that the
versions agree and loads them (``refresh()``, before each batch). Redis keeps one copy: fine
for small models; real ones use ``inference.backend: vllm`` and the learner's weight-sync group.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ludic.distributed import check_finite
from ludic.pipeline.redis_queue import RedisBatchQueue

__all__ = [
    "WEIGHTS_FORMAT",
    "RedisWeightPublisher",
    "RedisWeightSubscriber",
    "WeightsFormatError",
    "decode_weights",
    "encode_weights",
]

WEIGHTS_FORMAT = "ludic.policy_weights"


class WeightsFormatError(ValueError):
    """Bytes under ``P:weights`` are not a ludic weights payload (the message says why)."""


def encode_weights(state_dict: Mapping[str, torch.Tensor], version: int) -> bytes:
    """``state_dict`` as safetensors bytes with the format name and ``version`` in the
    metadata. Tensors are copied to contiguous CPU memory (tied weights become two
    tensors: safetensors refuses shared storage)."""
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in state_dict.items()}
    return save_safetensors(tensors, metadata={"format": WEIGHTS_FORMAT, "version": str(version)})


def decode_weights(data: bytes) -> tuple[dict[str, torch.Tensor], int]:
    """Bytes from :func:`encode_weights` -> (tensors, version); anything else raises
    :class:`WeightsFormatError`."""
    metadata = _metadata(data)
    if metadata.get("format") != WEIGHTS_FORMAT or not str(metadata.get("version", "")).isdigit():
        raise WeightsFormatError(
            f"safetensors metadata {metadata!r} lacks format={WEIGHTS_FORMAT!r} and an "
            "integer version: not written by RedisWeightPublisher"
        )
    try:
        tensors = load_safetensors(bytes(data))
    except Exception as err:  # noqa: BLE001 (SafetensorError names no field)
        raise WeightsFormatError(f"unreadable safetensors payload ({err})") from None
    return tensors, int(metadata["version"])


def _metadata(data: bytes) -> dict[str, Any]:
    """The ``__metadata__`` of a safetensors payload, read from its JSON header."""
    if len(data) < 8:
        raise WeightsFormatError(f"weights payload of {len(data)} bytes is truncated")
    (head_len,) = struct.unpack_from("<Q", data)
    if head_len > len(data) - 8:
        raise WeightsFormatError(
            f"weights header length {head_len} exceeds the {len(data) - 8} bytes that follow"
        )
    try:
        header = json.loads(bytes(data[8 : 8 + head_len]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightsFormatError(f"weights header is not UTF-8 JSON ({err})") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else {}


class RedisWeightPublisher:
    """A ``PolicyPublisher`` that stores each version in Redis (learner side)."""

    def __init__(self, queue: RedisBatchQueue) -> None:
        self.queue = queue
        self.last_version: int | None = None

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        check_finite(state_dict)
        data = encode_weights(state_dict, version)
        keys = self.queue.keys

        def write(client: Any) -> None:
            with client.pipeline(transaction=True) as pipe:  # MULTI ... EXEC
                pipe.set(keys.weights, data)
                pipe.set(keys.weights_version, version)
                pipe.execute()

        self.queue.call(f"publish weights version {version}", write)
        self.last_version = version


class RedisWeightSubscriber:
    """Loads the newest weights from Redis into ``client`` (``client.sync_weights(params,
    version=)``, e.g. a ``TransformersChatClient``) whenever their version differs from
    the one loaded (actor side). ``version`` is the loaded version (``None`` before the
    first load)."""

    def __init__(self, queue: RedisBatchQueue, client: Any) -> None:
        self.queue = queue
        self.client = client
        self.version: int | None = None

    def published_version(self) -> int | None:
        """The version in Redis (one small read), ``None`` before the first publish."""
        raw = self.queue.call(
            "read the weights version", lambda c: c.get(self.queue.keys.weights_version)
        )
        return None if raw is None else int(raw)

    def refresh(self) -> int | None:
        """Load the published weights if their version differs from the loaded one;
        returns the loaded version."""
        if self.published_version() in (None, self.version):
            return self.version
        keys = self.queue.keys

        def read(client: Any) -> list[Any]:
            with client.pipeline(transaction=True) as pipe:  # both keys from one moment
                pipe.get(keys.weights_version)
                pipe.get(keys.weights)
                return pipe.execute()

        raw_version, data = self.queue.call("read the weights", read)
        if data is None or raw_version is None:
            raise WeightsFormatError(f"{keys.weights_version} is set but {keys.weights} is missing")
        tensors, version = decode_weights(data)
        if version != int(raw_version):
            raise WeightsFormatError(
                f"{keys.weights} holds version {version} but {keys.weights_version} says "
                f"{int(raw_version)}: written by something other than RedisWeightPublisher"
            )
        self.client.sync_weights(tensors, version=version)
        self.version = version
        return version
