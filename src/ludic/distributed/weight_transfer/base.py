"""The weight-transfer layer's data and contracts (docs/design.md, "Weight transfer").

No Ray: the control plane is HTTP to the inference server, the data plane a process group or
CUDA IPC. One sync: ``WeightExtractor.extract(model)`` -> ``WeightChunk`` s (trainer);
``WeightTransferSender.send(chunks, control)`` announces each chunk's ``WeightUpdateRequest``
over the control plane, then moves its bytes; ``WeightTransferReceiver.receive(request)`` ->
``{name: tensor}``, then ``WeightLoader.load`` (inference worker). Requests travel as JSON
(``to_dict`` / ``request_from_dict``); nothing received over a network is ever unpickled.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""dtype names on the wire."""


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype} cannot be transferred; supported: {sorted(DTYPES)}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; supported: {sorted(DTYPES)}") from None


@dataclass
class WeightChunk:
    """A group of parameters moved together (e.g. one module, or a byte-size bucket)."""

    names: list[str]
    tensors: list[torch.Tensor]
    module_name: str | None = None

    def __post_init__(self) -> None:
        if len(self.names) != len(self.tensors):
            raise ValueError(
                f"WeightChunk: {len(self.names)} names for {len(self.tensors)} tensors"
            )
        if len(set(self.names)) != len(self.names):
            raise ValueError("WeightChunk: duplicate parameter names")

    @property
    def dtypes(self) -> list[torch.dtype]:
        return [t.dtype for t in self.tensors]

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(t.shape) for t in self.tensors]

    @property
    def total_size_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def __len__(self) -> int:
        return len(self.names)


# ------------------------------------------------------------------------------ requests
@dataclass
class WeightUpdateRequest:
    """What the control plane announces before a chunk's bytes move.

    ``names``/``dtypes``/``shapes`` describe every tensor of the chunk, in order;
    ``version`` is the policy version the update belongs to (``None`` = unversioned);
    ``last`` marks the final chunk of a sync (the server bumps its version then).
    """

    kind: ClassVar[str] = "base"
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    version: int | None = None
    last: bool = False

    def __post_init__(self) -> None:
        n = len(self.names)
        if len(self.dtypes) != n or len(self.shapes) != n:
            raise ValueError(
                f"{type(self).__name__}: {n} names, {len(self.dtypes)} dtypes and "
                f"{len(self.shapes)} shapes; they must have one entry per tensor"
            )
        for name in set(self.dtypes):
            dtype_from_name(name)
        self.shapes = [list(map(int, s)) for s in self.shapes]
        if self.shapes and min(min(s, default=0) for s in self.shapes) < 0:
            raise ValueError(f"{type(self).__name__}: negative dimension in shapes")

    @property
    def sizes_bytes(self) -> list[int]:
        """Bytes of each tensor, from its dtype and shape."""
        itemsize = {name: dtype_from_name(name).itemsize for name in set(self.dtypes)}
        return [
            math.prod(shape) * itemsize[dtype] for dtype, shape in zip(self.dtypes, self.shapes)
        ]

    @property
    def total_size_bytes(self) -> int:
        return sum(self.sizes_bytes)

    def to_dict(self) -> dict[str, Any]:
        # A JSON round trip: a deep copy that proves the request is JSON, and several times
        # faster than dataclasses.asdict for chunks of thousands of tensors.
        data = {"kind": self.kind, **{f.name: getattr(self, f.name) for f in fields(self)}}
        return json.loads(json.dumps(data))


@dataclass
class BroadcastWeightUpdateRequest(WeightUpdateRequest):
    """Broadcast over a process group. ``packed``: the chunk travels as one flat uint8
    buffer (the tensors' bytes concatenated in order) instead of one broadcast per tensor."""

    kind: ClassVar[str] = "broadcast"
    packed: bool = True
    layout: str | None = None
    """The layout's id (see ``layout.py``): with ``names`` etc., workers remember the layout
    under it; with no tensors listed, the request refers to a layout announced earlier over
    the same group."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layout is not None and not (
            isinstance(self.layout, str)
            and len(self.layout) == 16
            and all(c in "0123456789abcdef" for c in self.layout)
        ):
            raise ValueError(f"layout={self.layout!r}; expected 16 lowercase hex digits or null")

    @property
    def is_reference(self) -> bool:
        """Whether this names an earlier layout by id instead of listing the tensors."""
        return self.layout is not None and not self.names


@dataclass
class CudaIpcWeightUpdateRequest(WeightUpdateRequest):
    """CUDA IPC: ``ipc_handles[i]`` maps a GPU index (as a string) to the JSON form of
    tensor ``i``'s IPC handle (see ``cuda_ipc.py``)."""

    kind: ClassVar[str] = "cuda_ipc"
    ipc_handles: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class PackedCudaIpcWeightUpdateRequest(WeightUpdateRequest):
    """Packed CUDA IPC: one handle per GPU for a flat bucket holding every tensor's bytes
    in order; ``sizes[i]`` is tensor ``i``'s size in bytes."""

    kind: ClassVar[str] = "packed_cuda_ipc"
    sizes: list[int] = field(default_factory=list)
    ipc_handles: dict[str, Any] = field(default_factory=dict)


REQUEST_TYPES: dict[str, type[WeightUpdateRequest]] = {
    cls.kind: cls
    for cls in (
        BroadcastWeightUpdateRequest,
        CudaIpcWeightUpdateRequest,
        PackedCudaIpcWeightUpdateRequest,
    )
}


def request_from_dict(data: Mapping[str, Any]) -> WeightUpdateRequest:
    """Parse a JSON request; raises ``ValueError`` naming the problem."""
    kind = data.get("kind")
    cls = REQUEST_TYPES.get(str(kind))
    if cls is None:
        raise ValueError(
            f"unknown weight update request kind {kind!r}; expected one of {sorted(REQUEST_TYPES)}"
        )
    fields = {k: v for k, v in data.items() if k != "kind"}
    try:
        return cls(**fields)
    except TypeError as e:
        raise ValueError(f"bad {kind} weight update request: {e}") from None


# ------------------------------------------------------------------------------ sync info
@dataclass(frozen=True)
class WeightSyncInfo:
    """What the inference side needs to join the transfer (strategy-specific)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TorchDistributedWeightSyncInfo(WeightSyncInfo):
    """A process group of the trainer (rank 0) and every inference worker
    (ranks 1..world_size-1). The trainer hosts the rendezvous store at
    ``master_addr:master_port``.

    ``rank_offset``: the rank of the receiving server's first worker (its workers take
    ``rank_offset .. rank_offset + workers - 1``). 1 when one server forms the group; in a
    group spanning several servers (``ludic.inference.vllm.pool``) each server is sent its
    own offset.
    """

    master_addr: str
    master_port: int
    world_size: int
    backend: str = "gloo"
    group_name: str = "ludic_weight_sync"
    timeout_s: float = 120.0
    rank_offset: int = 1

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={self.backend!r}; expected 'gloo' (CPU) or 'nccl' (GPU)")
        if self.world_size < 2:
            raise ValueError(f"world_size={self.world_size}; need the trainer plus >= 1 worker")
        if not 1 <= self.rank_offset < self.world_size:
            raise ValueError(
                f"rank_offset={self.rank_offset} with world_size={self.world_size}; the "
                "trainer is rank 0, so a server's first worker is a rank in 1..world_size-1"
            )


@dataclass(frozen=True)
class EmptyWeightSyncInfo(WeightSyncInfo):
    """No group to join (CUDA IPC rides on the control plane)."""


# ------------------------------------------------------------------------------ contracts
@runtime_checkable
class ControlPlane(Protocol):
    """The trainer's view of the inference server's control plane (HTTP)."""

    def announce(self, request: WeightUpdateRequest) -> None:
        """Tell every worker what is about to arrive; returns once they are ready to
        receive (the receive runs in the background on the server)."""
        ...

    def wait_until_applied(self, timeout_s: float) -> None:
        """Block until every announced update has been received and loaded, or raise."""
        ...


class WeightExtractor(ABC):
    """Turns a training model into chunks ready to move (names are HF checkpoint names,
    tensors contiguous, in the inference dtype)."""

    @abstractmethod
    def extract(self, model: torch.nn.Module) -> Iterator[WeightChunk]: ...


class WeightTransferSender(ABC):
    @abstractmethod
    def send(
        self, chunks: Iterable[WeightChunk], control: ControlPlane, *, version: int | None
    ) -> None:
        """Announce and move every chunk; the last announced request has ``last=True``."""


class WeightTransferReceiver(ABC):
    request_type: ClassVar[type[WeightUpdateRequest]]

    @abstractmethod
    def receive(self, request: WeightUpdateRequest) -> dict[str, torch.Tensor]:
        """Take part in moving the announced chunk; returns its tensors by name."""

    def parse_request(self, data: Mapping[str, Any]) -> WeightUpdateRequest:
        return self.check_kind(request_from_dict(data))

    def check_kind(self, request: WeightUpdateRequest) -> WeightUpdateRequest:
        """``request``, if it is a :attr:`request_type` (``ValueError`` otherwise)."""
        if not isinstance(request, self.request_type):
            raise ValueError(
                f"{type(self).__name__} expects {self.request_type.kind!r} requests, got {request.kind!r}"
            )
        return request

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the group / handles."""


class WeightLoader(ABC):
    """Loads named tensors into an inference engine's model."""

    @abstractmethod
    def load(self, named_tensors: Mapping[str, torch.Tensor]) -> None: ...


class WeightTransferStrategy(ABC):
    """Factory for one transfer method's sender, receiver and sync info."""

    name: ClassVar[str]
    request_type: ClassVar[type[WeightUpdateRequest]]

    @abstractmethod
    def create_sync_info(
        self, *, master_addr: str, master_port: int, world_size: int
    ) -> WeightSyncInfo: ...

    @abstractmethod
    def create_sender(self, sync_info: WeightSyncInfo) -> WeightTransferSender:
        """Trainer side (rank 0); joins the group/handles as needed."""

    @abstractmethod
    def create_receiver(self, sync_info: WeightSyncInfo, *, rank: int) -> WeightTransferReceiver:
        """Inference side (worker ``rank`` >= 1 for group strategies)."""
