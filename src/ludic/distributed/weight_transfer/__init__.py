"""Moving trainer weights into inference workers: extract -> announce -> move -> load.

See ``base.py`` for the contracts and ``broadcast.py`` for the safety protocol. Typical
trainer side::

    strategy = create_strategy("broadcast", backend="gloo")
    info = strategy.create_sync_info(master_addr=..., master_port=..., world_size=1 + workers)
    sender = strategy.create_sender(info)          # after the workers were told to join
    publisher = BroadcastPolicyPublisher(sender, control, ModelWeightExtractor(dtype=...))

and in each inference worker::

    receiver = strategy.create_receiver(sync_info_from_dict(info_json), rank=rank)
    loader = VLLMWeightLoader(self.model_runner)
    loader.load(receiver.receive(receiver.parse_request(request_json)))
"""

from ludic.distributed.weight_transfer.base import (
    DTYPES,
    REQUEST_TYPES,
    BroadcastWeightUpdateRequest,
    ControlPlane,
    CudaIpcWeightUpdateRequest,
    EmptyWeightSyncInfo,
    PackedCudaIpcWeightUpdateRequest,
    TorchDistributedWeightSyncInfo,
    WeightChunk,
    WeightExtractor,
    WeightLoader,
    WeightSyncInfo,
    WeightTransferReceiver,
    WeightTransferSender,
    WeightTransferStrategy,
    WeightUpdateRequest,
    dtype_from_name,
    dtype_name,
    request_from_dict,
)
from ludic.distributed.weight_transfer.broadcast import (
    BroadcastTransferReceiver,
    BroadcastTransferSender,
    WeightTransferError,
)
from ludic.distributed.weight_transfer.cuda_ipc import (
    CudaIpcTransferReceiver,
    CudaIpcTransferSender,
    PackedCudaIpcTransferReceiver,
    PackedCudaIpcTransferSender,
    tensor_from_ipc_handle,
    tensor_to_ipc_handle,
)
from ludic.distributed.weight_transfer.extractor import (
    ModelWeightExtractor,
    gather_full_tensors,
    is_dtensor,
)
from ludic.distributed.weight_transfer.groups import free_port, init_process_group
from ludic.distributed.weight_transfer.loaders import ModuleWeightLoader, VLLMWeightLoader
from ludic.distributed.weight_transfer.strategy import (
    STRATEGIES,
    BroadcastTransferStrategy,
    CudaIpcTransferStrategy,
    PackedCudaIpcTransferStrategy,
    create_strategy,
    sync_info_from_dict,
)

__all__ = [
    "DTYPES",
    "REQUEST_TYPES",
    "STRATEGIES",
    "BroadcastTransferReceiver",
    "BroadcastTransferSender",
    "BroadcastTransferStrategy",
    "BroadcastWeightUpdateRequest",
    "ControlPlane",
    "CudaIpcTransferReceiver",
    "CudaIpcTransferSender",
    "CudaIpcTransferStrategy",
    "CudaIpcWeightUpdateRequest",
    "EmptyWeightSyncInfo",
    "ModelWeightExtractor",
    "ModuleWeightLoader",
    "PackedCudaIpcTransferReceiver",
    "PackedCudaIpcTransferSender",
    "PackedCudaIpcTransferStrategy",
    "PackedCudaIpcWeightUpdateRequest",
    "TorchDistributedWeightSyncInfo",
    "VLLMWeightLoader",
    "WeightChunk",
    "WeightExtractor",
    "WeightLoader",
    "WeightSyncInfo",
    "WeightTransferError",
    "WeightTransferReceiver",
    "WeightTransferSender",
    "WeightTransferStrategy",
    "WeightUpdateRequest",
    "create_strategy",
    "dtype_from_name",
    "dtype_name",
    "free_port",
    "gather_full_tensors",
    "init_process_group",
    "is_dtensor",
    "request_from_dict",
    "sync_info_from_dict",
    "tensor_from_ipc_handle",
    "tensor_to_ipc_handle",
]
