"""Transfer strategies: which sender, receiver and sync info go together.

``broadcast``: a process group of the trainer and every worker (``gloo`` for CPU tensors,
``nccl`` for GPU; across hosts). ``cuda_ipc``: trainer and server share a GPU, one handle per
tensor; ``packed_cuda_ipc``: one per chunk. The trainer calls ``create_sync_info`` and
``create_sender``; the sync info reaches workers as JSON (:func:`sync_info_from_dict`) and each
calls ``create_receiver(sync_info, rank=...)``. For ``broadcast`` every ``create_*`` blocks
until all ranks joined (``timeout_s``): start the workers' join before creating the sender.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ludic.distributed.weight_transfer.base import (
    BroadcastWeightUpdateRequest,
    CudaIpcWeightUpdateRequest,
    EmptyWeightSyncInfo,
    PackedCudaIpcWeightUpdateRequest,
    TorchDistributedWeightSyncInfo,
    WeightSyncInfo,
    WeightTransferReceiver,
    WeightTransferSender,
    WeightTransferStrategy,
)
from ludic.distributed.weight_transfer.broadcast import (
    BroadcastTransferReceiver,
    BroadcastTransferSender,
)
from ludic.distributed.weight_transfer.cuda_ipc import (
    CudaIpcTransferReceiver,
    CudaIpcTransferSender,
    PackedCudaIpcTransferReceiver,
    PackedCudaIpcTransferSender,
)
from ludic.distributed.weight_transfer.groups import BACKENDS, init_process_group


class BroadcastTransferStrategy(WeightTransferStrategy):
    """Trainer = rank 0 of a stateless group with every inference worker (ranks 1..).

    ``backend="gloo"`` moves CPU tensors, ``backend="nccl"`` CUDA tensors on each
    process's current device. ``timeout_s`` bounds joining and every collective.
    """

    name = "broadcast"
    request_type = BroadcastWeightUpdateRequest

    def __init__(self, backend: str = "gloo", *, timeout_s: float = 120.0) -> None:
        if backend not in BACKENDS:
            raise ValueError(
                f"BroadcastTransferStrategy(backend={backend!r}); expected one of {BACKENDS} "
                "(gloo: CPU tensors, nccl: CUDA tensors)"
            )
        self.backend = backend
        self.timeout_s = timeout_s

    def create_sync_info(
        self, *, master_addr: str, master_port: int, world_size: int
    ) -> TorchDistributedWeightSyncInfo:
        return TorchDistributedWeightSyncInfo(
            master_addr=master_addr,
            master_port=master_port,
            world_size=world_size,
            backend=self.backend,
            timeout_s=self.timeout_s,
        )

    def create_sender(self, sync_info: WeightSyncInfo) -> BroadcastTransferSender:
        info = _torch_info(sync_info)
        pg = self._join(info, rank=0)
        return BroadcastTransferSender(pg, device=_device(info.backend), timeout_s=info.timeout_s)

    def create_receiver(self, sync_info: WeightSyncInfo, *, rank: int) -> BroadcastTransferReceiver:
        info = _torch_info(sync_info)
        if not 1 <= rank < info.world_size:
            raise ValueError(
                f"receiver rank={rank}; inference workers are ranks 1..{info.world_size - 1} "
                "(rank 0 is the trainer)"
            )
        pg = self._join(info, rank=rank)
        return BroadcastTransferReceiver(pg, device=_device(info.backend), timeout_s=info.timeout_s)

    @staticmethod
    def _join(info: TorchDistributedWeightSyncInfo, *, rank: int):
        return init_process_group(
            master_addr=info.master_addr,
            master_port=info.master_port,
            rank=rank,
            world_size=info.world_size,
            backend=info.backend,
            timeout_s=info.timeout_s,
        )


class CudaIpcTransferStrategy(WeightTransferStrategy):
    """Colocated trainer and server on one GPU; one IPC handle per tensor."""

    name = "cuda_ipc"
    request_type = CudaIpcWeightUpdateRequest
    sender_cls: type[WeightTransferSender] = CudaIpcTransferSender
    receiver_cls: type[WeightTransferReceiver] = CudaIpcTransferReceiver

    def __init__(self, *, timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s

    def create_sync_info(
        self, *, master_addr: str = "", master_port: int = 0, world_size: int = 0
    ) -> EmptyWeightSyncInfo:
        """No group to join: requests carry the handles."""
        return EmptyWeightSyncInfo()

    def create_sender(self, sync_info: WeightSyncInfo) -> WeightTransferSender:
        return self.sender_cls(timeout_s=self.timeout_s)

    def create_receiver(
        self, sync_info: WeightSyncInfo, *, rank: int = 1
    ) -> WeightTransferReceiver:
        return self.receiver_cls()


class PackedCudaIpcTransferStrategy(CudaIpcTransferStrategy):
    """Colocated trainer and server on one GPU; one IPC handle per chunk."""

    name = "packed_cuda_ipc"
    request_type = PackedCudaIpcWeightUpdateRequest
    sender_cls = PackedCudaIpcTransferSender
    receiver_cls = PackedCudaIpcTransferReceiver


STRATEGIES: dict[str, type[WeightTransferStrategy]] = {
    cls.name: cls
    for cls in (BroadcastTransferStrategy, CudaIpcTransferStrategy, PackedCudaIpcTransferStrategy)
}


def create_strategy(name: str, **kwargs: Any) -> WeightTransferStrategy:
    """``create_strategy("broadcast", backend="nccl")``; names: see ``STRATEGIES``."""
    cls = STRATEGIES.get(name)
    if cls is None:
        raise ValueError(
            f"unknown weight transfer strategy {name!r}; available: {sorted(STRATEGIES)}"
        )
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise TypeError(f"create_strategy({name!r}, ...): {e}") from None


def sync_info_from_dict(data: Mapping[str, Any]) -> WeightSyncInfo:
    """Parse ``WeightSyncInfo.to_dict()`` (JSON) back: an empty dict is
    :class:`EmptyWeightSyncInfo`, anything else a :class:`TorchDistributedWeightSyncInfo`."""
    if not data:
        return EmptyWeightSyncInfo()
    try:
        return TorchDistributedWeightSyncInfo(**data)
    except TypeError as e:
        raise ValueError(f"bad weight sync info {dict(data)}: {e}") from None


def _torch_info(sync_info: WeightSyncInfo) -> TorchDistributedWeightSyncInfo:
    if not isinstance(sync_info, TorchDistributedWeightSyncInfo):
        raise TypeError(
            f"the broadcast strategy needs TorchDistributedWeightSyncInfo, got "
            f"{type(sync_info).__name__}; build it with strategy.create_sync_info(...)"
        )
    return sync_info


def _device(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
