"""Weight update requests and sync info as JSON, and the strategy factory."""

from __future__ import annotations

import json

import pytest
import torch

from ludic.distributed.weight_transfer import (
    STRATEGIES,
    BroadcastTransferReceiver,
    BroadcastTransferSender,
    BroadcastTransferStrategy,
    BroadcastWeightUpdateRequest,
    CudaIpcTransferStrategy,
    CudaIpcWeightUpdateRequest,
    EmptyWeightSyncInfo,
    PackedCudaIpcTransferStrategy,
    PackedCudaIpcWeightUpdateRequest,
    TorchDistributedWeightSyncInfo,
    WeightChunk,
    create_strategy,
    request_from_dict,
    sync_info_from_dict,
)

REQUESTS = [
    BroadcastWeightUpdateRequest(
        names=["a.weight", "a.bias"],
        dtypes=["bfloat16", "float32"],
        shapes=[[2, 3], [3]],
        version=4,
        last=True,
        packed=True,
    ),
    CudaIpcWeightUpdateRequest(
        names=["w"],
        dtypes=["float16"],
        shapes=[[5]],
        ipc_handles=[{"0": {"handle": "AAEC", "size": [5], "event_handle": None}}],
    ),
    PackedCudaIpcWeightUpdateRequest(
        names=["x", "y"],
        dtypes=["float32", "int64"],
        shapes=[[], [2]],
        version=0,
        sizes=[4, 16],
        ipc_handles={"3": {"handle": "AAEC", "storage_size_bytes": 20}},
    ),
]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.kind)
def test_requests_round_trip_through_json(request_) -> None:
    data = json.loads(json.dumps(request_.to_dict()))
    parsed = request_from_dict(data)
    assert type(parsed) is type(request_) and parsed == request_
    assert data["kind"] == request_.kind


def test_request_sizes_come_from_dtypes_and_shapes() -> None:
    request = REQUESTS[0]
    assert request.sizes_bytes == [12, 12] and request.total_size_bytes == 24


def test_unknown_or_malformed_requests_are_rejected_with_the_reason() -> None:
    with pytest.raises(ValueError, match="unknown weight update request kind 'rdma'"):
        request_from_dict({"kind": "rdma"})
    with pytest.raises(ValueError, match="bad broadcast weight update request"):
        request_from_dict({"kind": "broadcast", "names": ["a"], "dtypes": ["float32"]})
    with pytest.raises(ValueError, match="one entry per tensor"):
        request_from_dict({"kind": "broadcast", "names": ["a"], "dtypes": [], "shapes": []})
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        request_from_dict(
            {"kind": "broadcast", "names": ["a"], "dtypes": ["float8"], "shapes": [[1]]}
        )


def test_a_receiver_refuses_requests_of_another_strategy() -> None:
    receiver = BroadcastTransferReceiver(pg=None)
    with pytest.raises(ValueError, match="expects 'broadcast' requests, got 'cuda_ipc'"):
        receiver.parse_request(REQUESTS[1].to_dict())
    assert receiver.parse_request(REQUESTS[0].to_dict()) == REQUESTS[0]


def test_broadcast_sender_packs_chunks_of_several_tensors_only() -> None:
    sender = BroadcastTransferSender(pg=None)
    two = WeightChunk(names=["a", "b"], tensors=[torch.zeros(2), torch.zeros(3, dtype=torch.int64)])
    one = WeightChunk(names=["big"], tensors=[torch.zeros(4, 4, dtype=torch.bfloat16)])
    request = sender.create_request(two, version=2, last=False)
    assert (
        request.packed and request.dtypes == ["float32", "int64"] and request.shapes == [[2], [3]]
    )
    request = sender.create_request(one, version=2, last=True)
    assert not request.packed and request.last and request.dtypes == ["bfloat16"]
    big = WeightChunk(names=["x", "y"], tensors=[torch.zeros(2**20), torch.zeros(2**20)])
    assert not sender.create_request(big).packed  # large tensors skip the packing copy


# ------------------------------------------------------------------------------ strategies
def test_create_strategy_builds_each_registered_strategy() -> None:
    assert sorted(STRATEGIES) == ["broadcast", "cuda_ipc", "packed_cuda_ipc"]
    strategy = create_strategy("broadcast", backend="nccl", timeout_s=5.0)
    assert isinstance(strategy, BroadcastTransferStrategy)
    assert (strategy.backend, strategy.timeout_s) == ("nccl", 5.0)
    assert isinstance(create_strategy("cuda_ipc"), CudaIpcTransferStrategy)
    assert isinstance(create_strategy("packed_cuda_ipc"), PackedCudaIpcTransferStrategy)
    assert create_strategy("packed_cuda_ipc").request_type is PackedCudaIpcWeightUpdateRequest


def test_create_strategy_errors_list_the_names_and_the_bad_argument() -> None:
    with pytest.raises(ValueError, match=r"unknown weight transfer strategy 'rdma'.*'broadcast'"):
        create_strategy("rdma")
    with pytest.raises(TypeError, match=r"create_strategy\('cuda_ipc'"):
        create_strategy("cuda_ipc", backend="gloo")
    with pytest.raises(ValueError, match="expected one of"):
        create_strategy("broadcast", backend="mpi")


def test_sync_info_round_trips_through_json() -> None:
    strategy = BroadcastTransferStrategy("gloo", timeout_s=7.0)
    info = strategy.create_sync_info(master_addr="10.0.0.1", master_port=29500, world_size=3)
    assert sync_info_from_dict(json.loads(json.dumps(info.to_dict()))) == info
    assert info.timeout_s == 7.0 and info.backend == "gloo"
    empty = CudaIpcTransferStrategy().create_sync_info()
    assert sync_info_from_dict(empty.to_dict()) == EmptyWeightSyncInfo()
    with pytest.raises(ValueError, match="bad weight sync info"):
        sync_info_from_dict({"master_addr": "x"})


def test_broadcast_strategy_checks_sync_info_and_rank_before_joining() -> None:
    strategy = BroadcastTransferStrategy()
    with pytest.raises(TypeError, match="needs TorchDistributedWeightSyncInfo"):
        strategy.create_sender(EmptyWeightSyncInfo())
    info = TorchDistributedWeightSyncInfo(master_addr="127.0.0.1", master_port=1, world_size=3)
    with pytest.raises(ValueError, match=r"ranks 1\.\.2"):
        strategy.create_receiver(info, rank=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
@pytest.mark.parametrize("name", ["cuda_ipc", "packed_cuda_ipc"])
def test_cuda_ipc_strategies_say_they_need_a_gpu(name) -> None:
    strategy = create_strategy(name)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        strategy.create_sender(strategy.create_sync_info())
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        strategy.create_receiver(strategy.create_sync_info(), rank=1)
