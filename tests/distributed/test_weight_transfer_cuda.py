"""CUDA transfers: CUDA IPC (one handle per tensor, or one per packed chunk) and NCCL
broadcast. The JSON side of IPC handles is checked everywhere; moving bytes needs GPUs and
is skipped with the reason elsewhere."""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
from pathlib import Path

import pytest
import torch

from ludic.distributed.weight_transfer import (
    CudaIpcTransferReceiver,
    ModelWeightExtractor,
    PackedCudaIpcTransferReceiver,
    create_strategy,
    free_port,
    sync_info_from_dict,
    tensor_from_ipc_handle,
    tensor_to_ipc_handle,
)
from ludic.distributed.weight_transfer.broadcast import as_bytes
from ludic.distributed.weight_transfer.cuda_ipc import _b64, _unb64, physical_gpu_index

ROOT = Path(__file__).resolve().parents[2]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="NCCL broadcast needs two GPUs (NCCL refuses two ranks on one GPU)",
)


def test_handle_bytes_travel_as_base64_text() -> None:
    raw = bytes(range(256))
    assert _unb64(json.loads(json.dumps(_b64(raw)))) == raw
    assert _b64(None) is None and _unb64(None) is None


def test_physical_gpu_index_resolves_cuda_visible_devices(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert physical_gpu_index(1) == 5
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-uuid-a,GPU-uuid-b")
    assert physical_gpu_index(1) == 1  # UUIDs: keep the local index
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert physical_gpu_index(2) == 2


def test_ipc_handles_refuse_cpu_tensors_and_malformed_dicts() -> None:
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        tensor_to_ipc_handle(torch.zeros(2))
    with pytest.raises(ValueError, match="malformed CUDA IPC handle"):
        tensor_from_ipc_handle({"tensor_cls": "Tensor"}, device=0)
    with pytest.raises(ValueError, match="malformed CUDA IPC handle"):
        tensor_from_ipc_handle({"tensor_cls": "Pickled"}, device=0)


# ------------------------------------------------------------------------------ GPU only
def encode(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[int], bytes]]:
    return {
        n: (str(t.dtype), list(t.shape), as_bytes(t.contiguous().cpu()).numpy().tobytes())
        for n, t in tensors.items()
    }


def spawn(target, *args) -> mp.process.BaseProcess:
    sys.path.append(str(ROOT))  # the child imports this module by its pytest name
    try:
        proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
        proc.start()
    finally:
        sys.path.remove(str(ROOT))
    return proc


class QueueControlPlane:
    """Hands each announced JSON dict to one worker; ``wait_until_applied`` collects its
    replies (the IPC senders wait after every chunk)."""

    def __init__(self, requests, results) -> None:
        self.requests, self.results = requests, results
        self.pending = 0
        self.replies: list = []

    def announce(self, request) -> None:
        self.requests.put(json.loads(json.dumps(request.to_dict())))
        self.pending += 1

    def wait_until_applied(self, timeout_s: float) -> None:
        for _ in range(self.pending):
            self.replies.append(self.results.get(timeout=timeout_s))
        self.pending = 0


def ipc_receiver_main(requests, results) -> None:
    torch.cuda.set_device(0)
    receivers = {
        "cuda_ipc": CudaIpcTransferReceiver(),
        "packed_cuda_ipc": PackedCudaIpcTransferReceiver(),
    }
    while (data := requests.get()) is not None:
        try:
            receiver = receivers[data["kind"]]
            results.put(("ok", encode(receiver.receive(receiver.parse_request(data)))))
        except Exception as e:
            results.put(("error", f"{type(e).__name__}: {e}"))


def sample_state(device: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "a.weight": torch.randn(16, 8, device=device).to(torch.bfloat16),
        "a.bias": torch.randn(3, device=device).to(torch.bfloat16),  # odd bytes: misaligns
        "b.weight": torch.randn(5, 7, device=device),
        "b.ids": torch.arange(4, device=device),
    }


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["cuda_ipc", "packed_cuda_ipc"])
def test_cuda_ipc_moves_tensors_to_another_process_bit_identical(name) -> None:
    ctx = mp.get_context("spawn")
    requests, results = ctx.Queue(), ctx.Queue()
    proc = spawn(ipc_receiver_main, requests, results)
    try:
        torch.cuda.set_device(0)
        state = sample_state("cuda")
        strategy = create_strategy(name)
        sender = strategy.create_sender(strategy.create_sync_info())
        control = QueueControlPlane(requests, results)
        chunks = ModelWeightExtractor(chunk_bytes=600).extract_state_dict(state)
        sender.send(chunks, control, version=1)
        got: dict = {}
        for status, payload in control.replies:
            assert status == "ok", payload
            got.update(payload)
        assert got == encode(state)
    finally:
        requests.put(None)
        proc.join(30)


def nccl_receiver_main(info: dict, requests, results) -> None:
    torch.cuda.set_device(1)
    strategy = create_strategy("broadcast", backend="nccl")
    receiver = strategy.create_receiver(sync_info_from_dict(info), rank=1)
    while (data := requests.get()) is not None:
        try:
            results.put(("ok", encode(receiver.receive(receiver.parse_request(data)))))
        except Exception as e:
            results.put(("error", f"{type(e).__name__}: {e}"))


@pytest.mark.gpu
@needs_two_gpus
def test_nccl_broadcast_moves_cuda_tensors_bit_identical() -> None:
    ctx = mp.get_context("spawn")
    requests, results = ctx.Queue(), ctx.Queue()
    strategy = create_strategy("broadcast", backend="nccl", timeout_s=60.0)
    info = strategy.create_sync_info(master_addr="127.0.0.1", master_port=free_port(), world_size=2)
    proc = spawn(nccl_receiver_main, info.to_dict(), requests, results)
    try:
        torch.cuda.set_device(0)
        sender = strategy.create_sender(info)
        state = sample_state("cuda") | {"lm_head.weight": torch.randn(512, 512, device="cuda")}
        control = QueueControlPlane(requests, results)
        chunks = list(ModelWeightExtractor(chunk_bytes=4096).extract_state_dict(state))
        sender.send(chunks, control, version=1)
        control.wait_until_applied(60.0)
        got: dict = {}
        for status, payload in control.replies:
            assert status == "ok", payload
            got.update(payload)
        assert got == encode(state)
    finally:
        requests.put(None)
        proc.join(30)
