"""Moving trainer weights into inference workers: extract -> announce -> move -> load.

Contracts in ``base.py``, the broadcast safety protocol in ``broadcast.py``, strategies in
``strategy.py``. The trainer makes ``create_strategy("broadcast", backend="gloo")``, its
``create_sync_info(master_addr=, master_port=, world_size=1 + workers)`` and, once the workers
were told to join, ``create_sender(info)`` for a ``BroadcastPolicyPublisher``; each worker makes
``create_receiver(sync_info_from_dict(info_json), rank=rank)`` and loads what
``receiver.receive(receiver.parse_request(request_json))`` returns (``VLLMWeightLoader``).
Publishers live in ``ludic.distributed``; the servers' side in ``ludic.inference.vllm``.
"""

from __future__ import annotations

from ludic._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "DTYPES": "ludic.distributed.weight_transfer.base",
    "REQUEST_TYPES": "ludic.distributed.weight_transfer.base",
    "BroadcastWeightUpdateRequest": "ludic.distributed.weight_transfer.base",
    "ControlPlane": "ludic.distributed.weight_transfer.base",
    "CudaIpcWeightUpdateRequest": "ludic.distributed.weight_transfer.base",
    "EmptyWeightSyncInfo": "ludic.distributed.weight_transfer.base",
    "PackedCudaIpcWeightUpdateRequest": "ludic.distributed.weight_transfer.base",
    "TorchDistributedWeightSyncInfo": "ludic.distributed.weight_transfer.base",
    "WeightChunk": "ludic.distributed.weight_transfer.base",
    "WeightExtractor": "ludic.distributed.weight_transfer.base",
    "WeightLoader": "ludic.distributed.weight_transfer.base",
    "WeightSyncInfo": "ludic.distributed.weight_transfer.base",
    "WeightTransferReceiver": "ludic.distributed.weight_transfer.base",
    "WeightTransferSender": "ludic.distributed.weight_transfer.base",
    "WeightTransferStrategy": "ludic.distributed.weight_transfer.base",
    "WeightUpdateRequest": "ludic.distributed.weight_transfer.base",
    "dtype_from_name": "ludic.distributed.weight_transfer.base",
    "dtype_name": "ludic.distributed.weight_transfer.base",
    "request_from_dict": "ludic.distributed.weight_transfer.base",
    "BroadcastTransferReceiver": "ludic.distributed.weight_transfer.broadcast",
    "BroadcastTransferSender": "ludic.distributed.weight_transfer.broadcast",
    "GroupFailureError": "ludic.distributed.weight_transfer.broadcast",
    "WeightTransferError": "ludic.distributed.weight_transfer.broadcast",
    "CudaIpcTransferReceiver": "ludic.distributed.weight_transfer.cuda_ipc",
    "CudaIpcTransferSender": "ludic.distributed.weight_transfer.cuda_ipc",
    "PackedCudaIpcTransferReceiver": "ludic.distributed.weight_transfer.cuda_ipc",
    "PackedCudaIpcTransferSender": "ludic.distributed.weight_transfer.cuda_ipc",
    "tensor_from_ipc_handle": "ludic.distributed.weight_transfer.cuda_ipc",
    "tensor_to_ipc_handle": "ludic.distributed.weight_transfer.cuda_ipc",
    "ModelWeightExtractor": "ludic.distributed.weight_transfer.extractor",
    "gather_full_tensors": "ludic.distributed.weight_transfer.extractor",
    "is_dtensor": "ludic.distributed.weight_transfer.extractor",
    "GroupPortBusyError": "ludic.distributed.weight_transfer.groups",
    "check_port_free": "ludic.distributed.weight_transfer.groups",
    "free_port": "ludic.distributed.weight_transfer.groups",
    "init_process_group": "ludic.distributed.weight_transfer.groups",
    "ModuleWeightLoader": "ludic.distributed.weight_transfer.loaders",
    "VLLMWeightLoader": "ludic.distributed.weight_transfer.loaders",
    "STRATEGIES": "ludic.distributed.weight_transfer.strategy",
    "BroadcastTransferStrategy": "ludic.distributed.weight_transfer.strategy",
    "CudaIpcTransferStrategy": "ludic.distributed.weight_transfer.strategy",
    "PackedCudaIpcTransferStrategy": "ludic.distributed.weight_transfer.strategy",
    "create_strategy": "ludic.distributed.weight_transfer.strategy",
    "sync_info_from_dict": "ludic.distributed.weight_transfer.strategy",
}

__getattr__, __all__ = lazy_exports(__name__, globals(), _EXPORTS)
