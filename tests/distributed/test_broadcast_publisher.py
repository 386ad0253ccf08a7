"""BroadcastPolicyPublisher end to end: the pytest process is the trainer, a spawned process
is an inference worker that loads into its own copy of the model with ModuleWeightLoader.
The control plane is faked with multiprocessing queues (the HTTP one belongs to the vLLM
server)."""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
from pathlib import Path

import pytest
import torch

from ludic.distributed import PolicyPublisher
from ludic.distributed.broadcast_publisher import BroadcastPolicyPublisher, Rank0OnlyPublisher
from ludic.distributed.weight_transfer import (
    ModelWeightExtractor,
    ModuleWeightLoader,
    create_strategy,
    free_port,
    sync_info_from_dict,
)

ROOT = Path(__file__).resolve().parents[2]


class TinyLM(torch.nn.Module):
    """Embedding, two blocks and a head tied to the embedding (two names, one tensor)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(50, 16)
        self.blocks = torch.nn.Sequential(
            torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)
        )
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight


def worker_main(info: dict, requests, results) -> None:
    strategy = create_strategy("broadcast", backend="gloo")
    receiver = strategy.create_receiver(sync_info_from_dict(info), rank=1)
    model = TinyLM(seed=1)
    loader = ModuleWeightLoader(model)
    while (data := requests.get()) is not None:
        try:
            request = receiver.parse_request(data)
            loader.load(receiver.receive(request))
            state = {n: t.clone() for n, t in model.state_dict().items()} if request.last else None
            results.put(("ok", request.version, request.last, state))
        except Exception as e:
            results.put(("error", None, None, f"{type(e).__name__}: {e}"))


class QueueControlPlane:
    def __init__(self, requests, results) -> None:
        self.requests, self.results = requests, results
        self.pending = 0
        self.applied: list = []

    def announce(self, request) -> None:
        self.requests.put(json.loads(json.dumps(request.to_dict())))
        self.pending += 1

    def wait_until_applied(self, timeout_s: float) -> None:
        for _ in range(self.pending):
            status, version, last, payload = self.results.get(timeout=timeout_s)
            if status != "ok":
                raise RuntimeError(payload)
            self.applied.append((version, last, payload))
        self.pending = 0


def test_published_weights_equal_the_trainers_in_the_worker() -> None:
    ctx = mp.get_context("spawn")
    requests, results = ctx.Queue(), ctx.Queue()
    strategy = create_strategy("broadcast", backend="gloo", timeout_s=60.0)
    info = strategy.create_sync_info(master_addr="127.0.0.1", master_port=free_port(), world_size=2)
    sys.path.append(str(ROOT))  # the child imports this module by its pytest name
    try:
        proc = ctx.Process(
            target=worker_main, args=(info.to_dict(), requests, results), daemon=True
        )
        proc.start()
    finally:
        sys.path.remove(str(ROOT))
    try:
        control = QueueControlPlane(requests, results)
        publisher = BroadcastPolicyPublisher(
            strategy.create_sender(info), control, ModelWeightExtractor(chunk_bytes=2048)
        )
        assert isinstance(publisher, PolicyPublisher)
        trainer = TinyLM(seed=0)
        for version in (1, 2):
            publisher.publish(trainer.state_dict(), version=version)
            *_, (last_version, last, worker_state) = control.applied
            assert (last_version, last) == (version, True)
            for name, tensor in trainer.state_dict().items():
                assert torch.equal(worker_state[name], tensor), name
            with torch.no_grad():
                trainer.blocks[0].weight.add_(1.0)  # a training step
        assert publisher.last_version == 2
        assert len(control.applied) > 2  # several chunks per publish
    finally:
        requests.put(None)
        proc.join(10)


class RecordingPublisher:
    def __init__(self) -> None:
        self.versions: list[int] = []

    def publish(self, state_dict, version: int) -> None:
        self.versions.append(version)


def test_rank0_only_publisher_publishes_on_rank_0_and_skips_elsewhere() -> None:
    inner = RecordingPublisher()
    Rank0OnlyPublisher(inner, rank=1).publish({"w": torch.zeros(1)}, version=3)
    assert inner.versions == []
    Rank0OnlyPublisher(inner, rank=0).publish({"w": torch.zeros(1)}, version=3)
    assert inner.versions == [3]


class NeverCalled:
    def send(self, chunks, control, *, version) -> None:
        raise AssertionError("nothing may be sent")

    def announce(self, request) -> None:
        raise AssertionError("nothing may be announced")

    def wait_until_applied(self, timeout_s: float) -> None:
        raise AssertionError("nothing to wait for")


def test_publisher_refuses_non_finite_weights_before_announcing() -> None:
    fake = NeverCalled()
    publisher = BroadcastPolicyPublisher(fake, fake)
    with pytest.raises(ValueError, match="'b.weight' contains NaN/inf"):
        publisher.publish({"a.weight": torch.ones(2), "b.weight": torch.tensor([float("nan")])}, 1)
