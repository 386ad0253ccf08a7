"""Broadcast weight transfer between real processes over gloo on 127.0.0.1.

The pytest process is the trainer (rank 0); receivers are spawned processes. The control
plane is faked with multiprocessing queues: ``announce`` hands each worker the request's
JSON dict (that is the control plane's whole job; the HTTP one lives with the vLLM server),
and the worker answers with what it received, as raw bytes per tensor.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ludic.distributed.weight_transfer import (
    BroadcastTransferReceiver,
    BroadcastTransferSender,
    ModelWeightExtractor,
    WeightChunk,
    WeightTransferError,
    free_port,
    init_process_group,
)
from ludic.distributed.weight_transfer.broadcast import (
    HEADER_FIELDS,
    STATUS_OK,
    ReceiveBuffers,
    as_bytes,
    unpack_bytes,
)
from ludic.distributed.weight_transfer.groups import all_reduce_max, broadcast
from ludic.distributed.weight_transfer.layout import SentLayouts

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[2]
JOIN_TIMEOUT_S = 60.0


# ------------------------------------------------------------------------------ harness
def spawn(target: Callable[..., None], *args: Any) -> mp.process.BaseProcess:
    """Run ``target(*args)`` in a fresh interpreter. The child imports this module by its
    pytest name (``tests.distributed...``), so the repo root goes on its ``sys.path``."""
    added = str(ROOT) not in sys.path
    if added:
        sys.path.append(str(ROOT))
    try:
        proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
        proc.start()
    finally:
        if added:
            sys.path.remove(str(ROOT))
    return proc


def encode(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[int], bytes]]:
    return {
        name: (str(t.dtype), list(t.shape), as_bytes(t.contiguous()).numpy().tobytes())
        for name, t in tensors.items()
    }


def receiver_main(rank: int, port: int, world_size: int, requests, results) -> None:
    pg = init_process_group(
        master_addr=HOST,
        master_port=port,
        rank=rank,
        world_size=world_size,
        timeout_s=JOIN_TIMEOUT_S,
    )
    receiver = BroadcastTransferReceiver(pg)
    held: dict[str, torch.Tensor] = {}  # a sync's tensors, kept until its last chunk
    while (data := requests.get()) is not None:
        if data["kind"] == "test-collectives":
            t = torch.zeros(4)
            broadcast(pg, t)
            m = torch.tensor([10 * rank], dtype=torch.int64)
            all_reduce_max(pg, m)
            results.put((rank, "ok", (t.tolist(), int(m.item()))))
            continue
        try:
            request = receiver.parse_request(data)
            held.update(receiver.receive(request))
            # Encoded only at the end: tensors held across later receives must not change.
            results.put((rank, "ok", encode(held) if request.last else None))
            if request.last:
                held.clear()
        except Exception as e:
            held.clear()
            results.put((rank, "error", f"{type(e).__name__}: {e}"))


def dying_receiver_main(port: int, requests) -> None:
    """Takes part in the handshake of the first chunk, then dies before the payload."""
    pg = init_process_group(
        master_addr=HOST, master_port=port, rank=1, world_size=2, timeout_s=JOIN_TIMEOUT_S
    )
    requests.get()
    broadcast(pg, torch.zeros(len(HEADER_FIELDS), dtype=torch.int64))
    all_reduce_max(pg, torch.tensor([STATUS_OK], dtype=torch.int64))
    os._exit(1)


@dataclass
class Pool:
    pg: Any
    requests: list[Any]
    results: Any


class QueueControlPlane:
    """Fake control plane: every worker gets the announced JSON dict on its queue.
    ``tamper(rank, data)`` may rewrite what one worker is told."""

    def __init__(self, pool: Pool, tamper: Callable[[int, dict], dict] | None = None) -> None:
        self.pool = pool
        self.tamper = tamper
        self.announced: list[dict] = []
        self.pending = 0

    def announce(self, request) -> None:
        data = json.loads(json.dumps(request.to_dict()))  # what travels over HTTP
        self.announced.append(data)
        for rank, queue in enumerate(self.pool.requests, start=1):
            queue.put(self.tamper(rank, dict(data)) if self.tamper else data)
        self.pending += 1

    def wait_until_applied(self, timeout_s: float) -> None:
        pass

    def replies(self) -> list[dict[int, tuple[str, Any]]]:
        """One ``{rank: (status, payload)}`` per announced request, in order."""
        per_rank: dict[int, list] = {rank: [] for rank in range(1, len(self.pool.requests) + 1)}
        for _ in range(self.pending * len(self.pool.requests)):
            rank, status, payload = self.pool.results.get(timeout=30)
            per_rank[rank].append((status, payload))
        self.pending = 0
        return [dict(zip(per_rank, replies)) for replies in zip(*per_rank.values())]


@pytest.fixture(scope="module")
def pool():
    port = free_port()
    ctx = mp.get_context("spawn")
    requests = [ctx.Queue() for _ in range(2)]
    results = ctx.Queue()
    procs = [spawn(receiver_main, rank, port, 3, requests[rank - 1], results) for rank in (1, 2)]
    pg = init_process_group(
        master_addr=HOST, master_port=port, rank=0, world_size=3, timeout_s=JOIN_TIMEOUT_S
    )
    yield Pool(pg, requests, results)
    for queue in requests:
        queue.put(None)
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def assert_received_exactly(replies, sent: dict[str, torch.Tensor]) -> None:
    expected = encode(sent)
    for by_rank in replies:
        assert sorted(by_rank) == [1, 2]
    for rank in (1, 2):
        for by_rank in replies:
            assert by_rank[rank][0] == "ok", by_rank[rank][1]
        got = replies[-1][rank][1]  # everything the worker held until the last chunk
        assert list(got) == list(expected), f"rank {rank}: names or order differ"
        for name, (dtype, shape, data) in expected.items():
            assert got[name][:2] == (dtype, shape), name
            assert got[name][2] == data, f"rank {rank}: {name} differs"


def mixed_state_dict(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """~300 small tensors of awkward sizes (odd byte counts misalign the next tensor in
    a packed buffer), plus integer and bool buffers."""
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for layer in range(60):
        prefix = f"model.layers.{layer}"
        out[f"{prefix}.attn.q_proj.weight"] = torch.randn(16, 24, generator=g).to(dtype)
        out[f"{prefix}.attn.q_proj.bias"] = torch.randn(3, generator=g).to(dtype)
        out[f"{prefix}.norm.weight"] = torch.randn(5, generator=g).to(torch.float32)
        out[f"{prefix}.mask"] = torch.rand(7, generator=g) > 0.5
        out[f"{prefix}.position_ids"] = torch.arange(layer % 4 + 1)
    out["model.scale"] = torch.tensor(1.5, dtype=dtype)
    out["model.empty"] = torch.zeros(0, 4, dtype=dtype)
    return out


# ------------------------------------------------------------------------------ tests
def test_group_helpers_broadcast_and_all_reduce_max_across_three_processes(pool) -> None:
    for queue in pool.requests:
        queue.put({"kind": "test-collectives"})
    t = torch.arange(4, dtype=torch.float32)
    broadcast(pool.pg, t)
    m = torch.tensor([0], dtype=torch.int64)
    all_reduce_max(pool.pg, m)
    replies = sorted(pool.results.get(timeout=30) for _ in pool.requests)
    assert m.item() == 20
    assert replies == [(1, "ok", ([0.0, 1.0, 2.0, 3.0], 20)), (2, "ok", ([0.0, 1.0, 2.0, 3.0], 20))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_small_tensors_arrive_bit_identical_in_packed_chunks(pool, dtype) -> None:
    state = mixed_state_dict(dtype)
    control = QueueControlPlane(pool)
    chunks = ModelWeightExtractor(chunk_bytes=16 * 1024).extract_state_dict(state)
    BroadcastTransferSender(pool.pg).send(chunks, control, version=3)

    assert_received_exactly(control.replies(), state)
    announced = control.announced
    assert len(announced) > 2 and all(a["kind"] == "broadcast" for a in announced)
    assert all(a["packed"] for a in announced if len(a["names"]) > 1)
    assert [a["last"] for a in announced] == [False] * (len(announced) - 1) + [True]
    assert {a["version"] for a in announced} == {3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_tensors_travel_unpacked_and_bit_identical(pool, dtype) -> None:
    state = {
        "lm_head.weight": torch.randn(1024, 1024).to(dtype),
        "model.embed.weight": torch.randn(701, 1001).to(dtype),  # odd byte count
        "model.norm.weight": torch.randn(1001, 900).to(dtype),
        "model.norm.empty": torch.zeros(0, 3, dtype=dtype),  # nothing to move
    }
    control = QueueControlPlane(pool)
    budget = 1_700_000 * dtype.itemsize  # lm_head alone, then the other three together
    chunks = ModelWeightExtractor(chunk_bytes=budget).extract_state_dict(state)
    BroadcastTransferSender(pool.pg).send(chunks, control, version=None)

    assert_received_exactly(control.replies(), state)
    assert [len(a["names"]) for a in control.announced] == [1, 3]
    assert [a["packed"] for a in control.announced] == [False, False]
    assert control.announced[-1]["last"] is True


def test_mismatched_announcement_fails_on_both_sides_and_the_group_stays_usable(pool) -> None:
    state = {"a.weight": torch.randn(4, 6), "a.bias": torch.randn(6)}

    def wrong_shape_for_rank_1(rank: int, data: dict) -> dict:
        if rank == 1:
            data["shapes"] = [[6, 4], [6]]
        return data

    control = QueueControlPlane(pool, tamper=wrong_shape_for_rank_1)
    chunks = [WeightChunk(names=list(state), tensors=list(state.values()))]
    with pytest.raises(WeightTransferError, match="inference worker.*rejected the update"):
        BroadcastTransferSender(pool.pg).send(chunks, control, version=1)
    [by_rank] = control.replies()
    assert by_rank[1][0] == by_rank[2][0] == "error"
    assert "announced" in by_rank[1][1] and "but the trainer is sending" in by_rank[1][1]
    assert "rejected by another inference worker" in by_rank[2][1]

    # Nothing moved, so every rank is still in step: a correct update goes through.
    control = QueueControlPlane(pool)
    BroadcastTransferSender(pool.pg).send(chunks, control, version=2)
    assert_received_exactly(control.replies(), state)


def test_later_syncs_announce_known_layouts_by_id_and_deliver_the_new_values(pool) -> None:
    state = mixed_state_dict(torch.float32)
    extractor = ModelWeightExtractor(chunk_bytes=16 * 1024)
    sender = BroadcastTransferSender(pool.pg)
    first = QueueControlPlane(pool)
    sender.send(extractor.extract_state_dict(state), first, version=1)
    assert_received_exactly(first.replies(), state)
    assert all(a["names"] and a["layout"] for a in first.announced)  # in full, with ids

    trained = {n: t + 1 if t.is_floating_point() else t.flip(0) for n, t in state.items()}
    second = QueueControlPlane(pool)
    sender.send(extractor.extract_state_dict(trained), second, version=2)
    assert_received_exactly(second.replies(), trained)
    assert [a["layout"] for a in second.announced] == [a["layout"] for a in first.announced]
    assert all(a["names"] == [] for a in second.announced)  # by id only
    assert len(json.dumps(second.announced)) < len(json.dumps(first.announced)) / 10

    # A changed layout (one tensor resized) is announced in full again, under a new id.
    resized = {**trained, "model.layers.0.attn.q_proj.bias": torch.randn(4)}
    third = QueueControlPlane(pool)
    sender.send(extractor.extract_state_dict(resized), third, version=3)
    assert_received_exactly(third.replies(), resized)
    assert third.announced[0]["names"] and third.announced[0]["layout"] not in {
        a["layout"] for a in first.announced
    }
    assert all(a["names"] == [] for a in third.announced[1:])


def test_past_its_capacity_a_sender_announces_new_layouts_in_full_without_an_id(pool) -> None:
    state = {"p.weight": torch.randn(3, 3), "q.weight": torch.randn(2, 4)}
    chunks = [WeightChunk(names=[name], tensors=[t]) for name, t in state.items()]
    sender = BroadcastTransferSender(pool.pg)
    sender.layouts = SentLayouts(capacity=1)
    for version in (1, 2):
        control = QueueControlPlane(pool)
        sender.send(chunks, control, version=version)
        assert_received_exactly(control.replies(), state)
        first, second = control.announced
        assert (first["names"] == []) == (version == 2) and first["layout"] is not None
        assert second["names"] == ["q.weight"] and second["layout"] is None


def test_a_reference_a_worker_does_not_know_is_rejected_and_nothing_moves(pool) -> None:
    state = {"u.weight": torch.randn(3, 5), "u.bias": torch.randn(5)}
    chunk = WeightChunk(names=list(state), tensors=list(state.values()))
    sender = BroadcastTransferSender(pool.pg)
    control = QueueControlPlane(pool)
    sender.send([chunk], control, version=1)
    assert_received_exactly(control.replies(), state)

    def unknown_id_for_rank_2(rank: int, data: dict) -> dict:
        if rank == 2:
            data["layout"] = "0123456789abcdef"
        return data

    control = QueueControlPlane(pool, tamper=unknown_id_for_rank_2)
    with pytest.raises(WeightTransferError, match="rejected the update.*layout id"):
        sender.send([chunk], control, version=2)
    [by_rank] = control.replies()
    assert by_rank[2] == (
        "error",
        "WeightTransferError: weight update rejected: the control plane announced a reference "
        "to layout 0123456789abcdef, which this worker was never announced (was it restarted "
        "or its weight-sync group rebuilt without the trainer's?) but the trainer is sending "
        + by_rank[2][1].split("but the trainer is sending ", 1)[1],
    )
    assert "rejected by another inference worker" in by_rank[1][1]

    # Everyone is still in step, and the layout stays known: the next sync goes by id.
    control = QueueControlPlane(pool)
    sender.send([chunk], control, version=3)
    assert_received_exactly(control.replies(), state)
    assert control.announced[0]["names"] == []


def test_a_rejected_full_announcement_is_sent_in_full_again(pool) -> None:
    state = {"v.weight": torch.randn(2, 7), "v.bias": torch.randn(7)}
    chunk = WeightChunk(names=list(state), tensors=list(state.values()))

    def wrong_shape_for_rank_1(rank: int, data: dict) -> dict:
        if rank == 1:
            data["shapes"] = [[7, 2], [7]]
        return data

    sender = BroadcastTransferSender(pool.pg)
    control = QueueControlPlane(pool, tamper=wrong_shape_for_rank_1)
    with pytest.raises(WeightTransferError):
        sender.send([chunk], control, version=1)
    control.replies()
    control = QueueControlPlane(pool)
    sender.send([chunk], control, version=2)
    assert_received_exactly(control.replies(), state)
    assert control.announced[0]["names"] == list(state)  # not assumed known


def flat_state_dict(sizes: list[int]) -> dict[str, torch.Tensor]:
    """Views lying back to back in one buffer, as flatten_parameters leaves parameters."""
    buf = torch.randn(sum(sizes))
    views = buf.split(sizes)
    return {f"flat.p{i}.weight": v for i, v in enumerate(views)}


def test_tensors_back_to_back_in_memory_move_without_a_packing_copy(pool) -> None:
    state = flat_state_dict([1000 + 37 * i for i in range(64)])
    sender = BroadcastTransferSender(pool.pg)
    control = QueueControlPlane(pool)
    sender.send([WeightChunk(names=list(state), tensors=list(state.values()))], control, version=1)
    assert_received_exactly(control.replies(), state)
    assert control.announced[0]["packed"]
    assert sender._pack_buffers._buffers == [None, None]  # nothing was copied

    # One tensor elsewhere in memory: its piece is packed, the same bytes arrive.
    mixed = dict(state)
    mixed["flat.p5.weight"] = mixed["flat.p5.weight"].clone()
    control = QueueControlPlane(pool)
    sender.send([WeightChunk(names=list(mixed), tensors=list(mixed.values()))], control, version=2)
    assert_received_exactly(control.replies(), mixed)
    assert sender._pack_buffers._buffers != [None, None]


def test_sender_refuses_a_request_that_does_not_describe_its_chunk(pool) -> None:
    class LyingSender(BroadcastTransferSender):
        def create_request(self, chunk, *, version=None, last=False):
            request = super().create_request(chunk, version=version, last=last)
            request.shapes[0] = [2, 2]
            return request

    control = QueueControlPlane(pool)
    chunk = WeightChunk(names=["w", "b"], tensors=[torch.zeros(3), torch.zeros(1)])
    with pytest.raises(ValueError, match="refusing to send.*nothing was sent"):
        LyingSender(pool.pg).send([chunk], control, version=1)
    assert control.announced == []  # refused before anything was announced


def test_receiver_death_mid_sync_makes_the_sender_raise_not_hang() -> None:
    port = free_port()
    requests = mp.get_context("spawn").Queue()
    proc = spawn(dying_receiver_main, port, requests)
    pg = init_process_group(
        master_addr=HOST, master_port=port, rank=0, world_size=2, timeout_s=JOIN_TIMEOUT_S
    )

    class OneWorker:
        def announce(self, request) -> None:
            requests.put(request.to_dict())

        def wait_until_applied(self, timeout_s: float) -> None:
            pass

    sender = BroadcastTransferSender(pg, timeout_s=10.0)
    chunk = WeightChunk(names=["big"], tensors=[torch.zeros(16 * 2**20, dtype=torch.uint8)])
    start = time.monotonic()
    # The dying worker votes OK in the handshake, so the sender goes on to the payload
    # and finds the peer gone.
    with pytest.raises(WeightTransferError, match="weight sync failed while sending"):
        sender.send([chunk], OneWorker(), version=1)
    assert time.monotonic() - start < 10.0
    proc.join(10)


def test_send_without_chunks_is_an_error() -> None:
    with pytest.raises(ValueError, match="no chunks"):
        BroadcastTransferSender(pg=None).send([], control=None, version=1)


def test_receive_buffers_are_reused_only_once_nothing_views_them() -> None:
    buffers = ReceiveBuffers(torch.device("cpu"), keep=2)
    first = buffers.take(100)
    pointer, view = first.data_ptr(), first[10:20]
    del first
    second = buffers.take(50)
    assert second.data_ptr() != pointer  # `view` still reads the first buffer
    del view, second
    assert buffers.take(80).data_ptr() == pointer  # now free, and large enough
    assert buffers.take(1000).data_ptr() != pointer  # too small: a new one


def test_unpack_bytes_views_aligned_tensors_and_copies_misaligned_ones() -> None:
    values = torch.tensor([1.0, 2.0], dtype=torch.float32)
    pad = torch.zeros(1, dtype=torch.uint8)
    # bytes: [pad][values @ 1][pad x3][values @ 12]
    buf = torch.cat([pad, as_bytes(values), pad, pad, pad, as_bytes(values)])
    misaligned = unpack_bytes(buf, 1, 8, torch.float32, [2])
    aligned = unpack_bytes(buf, 12, 8, torch.float32, [2])
    assert misaligned.tolist() == aligned.tolist() == values.tolist()
    assert misaligned.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    assert aligned.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
