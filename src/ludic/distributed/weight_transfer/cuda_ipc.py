"""Weight transfer by CUDA IPC: trainer and inference worker share a GPU (colocated), and the
worker reads the trainer's tensors in place instead of receiving a copy.

Each tensor (or, packed, one flat uint8 bucket per chunk) becomes a CUDA IPC handle
(``reduce_tensor``) sent as a JSON-safe dict and rebuilt with ``rebuild_cuda_tensor``; nothing
is pickled (classes are looked up by name in a fixed table). Handles name the *physical* GPU
(``CUDA_VISIBLE_DEVICES`` resolved). The sender keeps a chunk until it is applied
(``control.wait_until_applied``): one chunk of extra GPU memory. One trainer process only:
sharding the handles of several trainer ranks over several GPUs is not implemented.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ludic.distributed.weight_transfer.base import (
    ControlPlane,
    CudaIpcWeightUpdateRequest,
    PackedCudaIpcWeightUpdateRequest,
    WeightChunk,
    WeightTransferReceiver,
    WeightTransferSender,
    WeightUpdateRequest,
    dtype_from_name,
    dtype_name,
)
from ludic.distributed.weight_transfer.broadcast import (
    as_bytes,
    check_request_describes,
    unpack_bytes,
    with_last_flag,
)

TENSOR_CLASSES: dict[str, type] = {"Tensor": torch.Tensor, "Parameter": torch.nn.Parameter}
STORAGE_CLASSES: dict[str, type] = {
    "TypedStorage": torch.TypedStorage,
    "UntypedStorage": torch.UntypedStorage,
}


# ------------------------------------------------------------------------------ handles
def tensor_to_ipc_handle(tensor: torch.Tensor) -> dict[str, Any]:
    """JSON-safe CUDA IPC handle of ``tensor`` (which must stay alive until it is read)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not tensor.is_cuda:
        raise ValueError(f"CUDA IPC needs a CUDA tensor, got one on {tensor.device}")
    _, args = reduce_tensor(tensor.detach())
    (
        tensor_cls,
        size,
        stride,
        offset,
        storage_cls,
        dtype,
        device,
        handle,
        storage_size_bytes,
        storage_offset_bytes,
        requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    return {
        "tensor_cls": _class_name(tensor_cls, TENSOR_CLASSES),
        "size": list(size),
        "stride": list(stride),
        "offset": int(offset),
        "storage_cls": _class_name(storage_cls, STORAGE_CLASSES),
        "dtype": dtype_name(dtype),
        "device": int(device),
        "handle": _b64(handle),
        "storage_size_bytes": int(storage_size_bytes),
        "storage_offset_bytes": int(storage_offset_bytes),
        "requires_grad": bool(requires_grad),
        "ref_counter_handle": _b64(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": _b64(event_handle),
        "event_sync_required": bool(event_sync_required),
    }


def tensor_from_ipc_handle(handle: Mapping[str, Any], *, device: int | None = None) -> torch.Tensor:
    """Open a handle made by :func:`tensor_to_ipc_handle` on CUDA device ``device``
    (default: the current device), without copying."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        tensor_cls = TENSOR_CLASSES[handle["tensor_cls"]]
        storage_cls = STORAGE_CLASSES[handle["storage_cls"]]
        args = (
            tensor_cls,
            torch.Size(handle["size"]),
            tuple(handle["stride"]),
            int(handle["offset"]),
            storage_cls,
            dtype_from_name(handle["dtype"]),
            torch.cuda.current_device() if device is None else device,
            _unb64(handle["handle"]),
            int(handle["storage_size_bytes"]),
            int(handle["storage_offset_bytes"]),
            False,  # requires_grad: inference weights never need it
            _unb64(handle["ref_counter_handle"]),
            int(handle["ref_counter_offset"]),
            _unb64(handle["event_handle"]),
            bool(handle["event_sync_required"]),
        )
    except KeyError as e:
        raise ValueError(f"malformed CUDA IPC handle: missing or unknown {e}") from None
    return rebuild_cuda_tensor(*args)


def physical_gpu_index(device: int | None = None) -> int:
    """The physical index of CUDA device ``device`` (``CUDA_VISIBLE_DEVICES`` resolved)."""
    index = torch.cuda.current_device() if device is None else device
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible:
        return index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    try:
        return int(entries[index])
    except (IndexError, ValueError):  # UUID entries or a short list: keep the local index
        return index


# ------------------------------------------------------------------------------ senders
class _IpcSender(WeightTransferSender):
    def __init__(self, *, device: int | None = None, timeout_s: float = 120.0) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"{type(self).__name__} needs a CUDA device; on CPU use the broadcast "
                "strategy (create_strategy('broadcast', backend='gloo'))"
            )
        self.device = torch.device(
            "cuda", torch.cuda.current_device() if device is None else device
        )
        self.timeout_s = timeout_s

    def send(
        self, chunks: Iterable[WeightChunk], control: ControlPlane, *, version: int | None
    ) -> None:
        sent = 0
        for chunk, last in with_last_flag(chunks):
            if len(chunk) == 0:
                raise ValueError("refusing to send an empty WeightChunk")
            tensors = [t.detach().to(self.device).contiguous() for t in chunk.tensors]
            request, keep_alive = self._request(chunk.names, tensors, version=version, last=last)
            check_request_describes(
                request,
                chunk.names,
                [dtype_name(t.dtype) for t in tensors],
                [list(t.shape) for t in tensors],
            )
            control.announce(request)
            # The worker reads our memory: keep it until the chunk is loaded.
            control.wait_until_applied(self.timeout_s)
            del keep_alive
            sent += 1
        if sent == 0:
            raise ValueError(f"{type(self).__name__}.send got no chunks; nothing to publish")

    def _gpu_key(self) -> str:
        return str(physical_gpu_index(self.device.index))

    def _request(
        self, names: list[str], tensors: list[torch.Tensor], *, version: int | None, last: bool
    ) -> tuple[WeightUpdateRequest, object]:
        """The request for a chunk, and what must stay alive until it is applied."""
        raise NotImplementedError


class CudaIpcTransferSender(_IpcSender):
    """One IPC handle per tensor (no copy when the tensors are already on the GPU in the
    inference dtype)."""

    def _request(self, names, tensors, *, version, last):
        key = self._gpu_key()
        request = CudaIpcWeightUpdateRequest(
            names=list(names),
            dtypes=[dtype_name(t.dtype) for t in tensors],
            shapes=[list(t.shape) for t in tensors],
            version=version,
            last=last,
            ipc_handles=[{key: tensor_to_ipc_handle(t)} for t in tensors],
        )
        return request, tensors


class PackedCudaIpcTransferSender(_IpcSender):
    """One IPC handle per chunk: the tensors' bytes packed into one flat uint8 bucket."""

    def _request(self, names, tensors, *, version, last):
        bucket = torch.cat([as_bytes(t) for t in tensors])
        request = PackedCudaIpcWeightUpdateRequest(
            names=list(names),
            dtypes=[dtype_name(t.dtype) for t in tensors],
            shapes=[list(t.shape) for t in tensors],
            version=version,
            last=last,
            sizes=[t.numel() * t.element_size() for t in tensors],
            ipc_handles={self._gpu_key(): tensor_to_ipc_handle(bucket)},
        )
        return request, bucket


# ------------------------------------------------------------------------------ receivers
class _IpcReceiver(WeightTransferReceiver):
    def __init__(self, *, device: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(f"{type(self).__name__} needs a CUDA device")
        self.device_index = torch.cuda.current_device() if device is None else device

    def _handle_for_this_gpu(self, handles: Mapping[str, Any]) -> Mapping[str, Any]:
        key = str(physical_gpu_index(self.device_index))
        if key not in handles:
            raise ValueError(
                f"no CUDA IPC handle for this worker's GPU (physical index {key}); the "
                f"trainer shared GPU(s) {sorted(handles)}. CUDA IPC needs the trainer and the "
                "worker on the same GPU; use the broadcast strategy otherwise"
            )
        return handles[key]


class CudaIpcTransferReceiver(_IpcReceiver):
    """Opens one handle per tensor; returns tensors aliasing the trainer's memory."""

    request_type = CudaIpcWeightUpdateRequest

    def receive(self, request: WeightUpdateRequest) -> dict[str, torch.Tensor]:
        self.check_kind(request)
        if len(request.ipc_handles) != len(request.names):
            raise ValueError(
                f"request has {len(request.names)} names but {len(request.ipc_handles)} IPC handles"
            )
        out: dict[str, torch.Tensor] = {}
        for name, dtype, shape, handles in zip(
            request.names, request.dtypes, request.shapes, request.ipc_handles
        ):
            tensor = tensor_from_ipc_handle(
                self._handle_for_this_gpu(handles), device=self.device_index
            )
            if dtype_name(tensor.dtype) != dtype or list(tensor.shape) != list(shape):
                raise ValueError(
                    f"announced {name!r} as {dtype}{list(shape)} but its IPC handle holds "
                    f"{dtype_name(tensor.dtype)}{list(tensor.shape)}; nothing was loaded"
                )
            out[name] = tensor
        return out


class PackedCudaIpcTransferReceiver(_IpcReceiver):
    """Opens the chunk's bucket and splits it by ``sizes`` into views."""

    request_type = PackedCudaIpcWeightUpdateRequest

    def receive(self, request: WeightUpdateRequest) -> dict[str, torch.Tensor]:
        self.check_kind(request)
        if list(request.sizes) != request.sizes_bytes:
            raise ValueError(
                f"announced sizes {request.sizes} disagree with the announced dtypes/shapes "
                f"({request.sizes_bytes} bytes); nothing was loaded"
            )
        bucket = tensor_from_ipc_handle(
            self._handle_for_this_gpu(request.ipc_handles), device=self.device_index
        )
        if bucket.dtype != torch.uint8 or bucket.numel() != sum(request.sizes):
            raise ValueError(
                f"announced a {sum(request.sizes)}-byte bucket but the IPC handle holds "
                f"{bucket.numel() * bucket.element_size()} bytes of {bucket.dtype}; nothing was loaded"
            )
        out: dict[str, torch.Tensor] = {}
        offset = 0
        for name, dtype, shape, size in zip(
            request.names, request.dtypes, request.shapes, request.sizes
        ):
            out[name] = unpack_bytes(bucket, offset, size, dtype_from_name(dtype), shape)
            offset += size
        return out


# ------------------------------------------------------------------------------ helpers
def _class_name(cls: type, table: Mapping[str, type]) -> str:
    for name, known in table.items():
        if cls is known:
            return name
    raise ValueError(f"cannot describe {cls!r} in a CUDA IPC handle; known: {sorted(table)}")


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(bytes(data)).decode("ascii")


def _unb64(data: str | None) -> bytes | None:
    return None if data is None else base64.b64decode(data)
