"""ModelWeightExtractor: grouping by module, batching by bytes, dtype conversion, peft
merging, and FSDP2 (DTensor) gathering across two real processes (gloo, CPU)."""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

import pytest
import torch

from ludic.distributed.broadcast_publisher import BroadcastPolicyPublisher, Rank0OnlyPublisher
from ludic.distributed.weight_transfer import (
    ModelWeightExtractor,
    WeightChunk,
    free_port,
)
from ludic.distributed.weights import policy_state_dict

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


def names_per_chunk(chunks: list[WeightChunk]) -> list[list[str]]:
    return [chunk.names for chunk in chunks]


def f32(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.float32)


def test_tensors_of_one_module_share_a_chunk_and_small_modules_are_batched() -> None:
    state = {
        "a.weight": f32(64),  # 256 bytes per tensor
        "a.bias": f32(64),
        "b.weight": f32(64),
        "b.bias": f32(64),
        "c.weight": f32(64),
    }
    chunks = list(ModelWeightExtractor(chunk_bytes=1024).extract_state_dict(state))
    assert names_per_chunk(chunks) == [["a.weight", "a.bias", "b.weight", "b.bias"], ["c.weight"]]
    assert [c.module_name for c in chunks] == [None, "c"]

    chunks = list(ModelWeightExtractor(chunk_bytes=768).extract_state_dict(state))
    # b (512 bytes) does not fit after a (512) in 768: it starts the next chunk, whole.
    assert names_per_chunk(chunks) == [["a.weight", "a.bias"], ["b.weight", "b.bias", "c.weight"]]
    assert chunks[0].module_name == "a"


def test_without_grouping_chunks_are_filled_tensor_by_tensor() -> None:
    state = {"a.weight": f32(64), "a.bias": f32(64), "b.weight": f32(64)}
    chunks = list(
        ModelWeightExtractor(chunk_bytes=768, group_by_module=False).extract_state_dict(state)
    )
    assert names_per_chunk(chunks) == [["a.weight", "a.bias", "b.weight"]]
    chunks = list(
        ModelWeightExtractor(chunk_bytes=600, group_by_module=True).extract_state_dict(state)
    )
    assert names_per_chunk(chunks) == [["a.weight", "a.bias"], ["b.weight"]]


def test_a_tensor_larger_than_chunk_bytes_is_a_chunk_of_its_own() -> None:
    state = {"x.small": f32(4), "y.huge": f32(1024), "y.bias": f32(4), "z.small": f32(4)}
    chunks = list(ModelWeightExtractor(chunk_bytes=1024).extract_state_dict(state))
    # y (4112 bytes) is larger than the budget: split into its tensors, huge alone.
    assert names_per_chunk(chunks) == [["x.small"], ["y.huge"], ["y.bias", "z.small"]]
    assert all(c.total_size_bytes <= 1024 for c in chunks if len(c) > 1)


def test_one_extractor_plans_a_layout_once_and_replans_when_it_changes() -> None:
    extractor = ModelWeightExtractor(chunk_bytes=1024)
    planned = 0
    plan = extractor._plan

    def counting_plan(state_dict):
        nonlocal planned
        planned += 1
        return plan(state_dict)

    extractor._plan = counting_plan
    state = {"a.weight": f32(64), "a.bias": f32(64), "b.weight": f32(64), "c.weight": f32(64)}
    first = list(extractor.extract_state_dict(state))
    trained = {name: t + 1 for name, t in state.items()}  # new values, same layout
    second = list(extractor.extract_state_dict(trained))
    assert planned == 1
    assert names_per_chunk(second) == names_per_chunk(first)
    assert all(torch.equal(t, trained[n]) for c in second for n, t in zip(c.names, c.tensors))
    second[0].names.append("scribbled")  # a caller's edit does not reach the cached plan

    grown = {**state, "b.weight": f32(200)}  # a size changed: chunks change
    assert names_per_chunk(list(extractor.extract_state_dict(grown))) == [
        ["a.weight", "a.bias"], ["b.weight"], ["c.weight"]
    ]  # fmt: skip
    renamed = {"z.weight" if n == "c.weight" else n: t for n, t in state.items()}
    assert names_per_chunk(list(extractor.extract_state_dict(renamed)))[-1][-1] == "z.weight"
    assert planned == 3
    assert names_per_chunk(list(extractor.extract_state_dict(state))) == names_per_chunk(first)


def test_chunks_cover_every_tensor_once_in_state_dict_order() -> None:
    g = torch.Generator().manual_seed(0)
    state = {
        f"m{i // 3}.p{i % 3}": torch.randn(
            int(torch.randint(1, 300, (1,), generator=g)), generator=g
        )
        for i in range(90)
    }
    chunks = list(ModelWeightExtractor(chunk_bytes=2048).extract_state_dict(state))
    assert [n for c in chunks for n in c.names] == list(state)
    assert all(c.total_size_bytes <= 2048 or len(c) == 1 for c in chunks)


def test_floating_point_tensors_are_converted_and_others_kept() -> None:
    state = {
        "w": torch.randn(3, 4).t(),  # not contiguous
        "ids": torch.arange(5),
        "mask": torch.tensor([True, False]),
        "half": torch.randn(2, dtype=torch.float16),
    }
    [chunk] = ModelWeightExtractor(dtype=torch.bfloat16).extract_state_dict(state)
    got = dict(zip(chunk.names, chunk.tensors))
    assert got["w"].dtype == got["half"].dtype == torch.bfloat16
    assert got["ids"].dtype == torch.int64 and got["mask"].dtype == torch.bool
    assert all(t.is_contiguous() for t in chunk.tensors)
    assert torch.equal(got["w"], state["w"].to(torch.bfloat16))


def test_tied_weights_keep_every_state_dict_name(tiny_model) -> None:
    tiny_model.lm_head.weight = tiny_model.model.embed_tokens.weight  # tie
    names = [n for c in ModelWeightExtractor().extract(tiny_model) for n in c.names]
    assert names == list(tiny_model.state_dict())
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names


def test_a_lora_model_is_extracted_merged_under_base_names(tiny_tokenizer) -> None:
    peft = pytest.importorskip("peft")
    from ludic.models.tiny import build_tiny_causal_lm

    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], lora_dropout=0.0, init_lora_weights=False
    )
    model = peft.get_peft_model(build_tiny_causal_lm(tiny_tokenizer, seed=0), config)
    expected = policy_state_dict(model)

    chunks = list(ModelWeightExtractor(dtype=torch.bfloat16, chunk_bytes=MIB).extract(model))
    got = {n: t for c in chunks for n, t in zip(c.names, c.tensors)}
    assert list(got) == list(expected)
    assert not any("lora" in n or "base_layer" in n for n in got)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor.to(torch.bfloat16)), name


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        ModelWeightExtractor(chunk_bytes=0)
    with pytest.raises(ValueError, match="cannot be transferred"):
        ModelWeightExtractor(dtype=torch.complex64)


# ------------------------------------------------------------------------------ FSDP2
class RecordingSender:
    def __init__(self) -> None:
        self.chunks: list[WeightChunk] = []

    def send(self, chunks, control, *, version) -> None:
        self.chunks.extend(chunks)


class NoControl:
    def announce(self, request) -> None:
        pass

    def wait_until_applied(self, timeout_s: float) -> None:
        pass


def fsdp_rank_main(rank: int, port: int, results) -> None:
    """Rank 0 publishes an FSDP2 model through the extractor; rank 1 only joins gathers."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # The store on a socket bound to loopback: a TCPStore left to bind by itself listens on
    # every interface, whatever host it is given (the loopback guard, tests/loopback.py).
    from ludic.distributed.weight_transfer.groups import listening_socket

    listen_fd = listening_socket("127.0.0.1", port) if rank == 0 else None
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, master_listen_fd=listen_fd)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3)
        )
        reference = {n: t.clone() for n, t in model.state_dict().items()}
        mesh = init_device_mesh("cpu", (2,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sharded = type(next(iter(model.state_dict().values()))).__name__

        sender = RecordingSender()
        inner = BroadcastPolicyPublisher(
            sender, NoControl(), ModelWeightExtractor(dtype=torch.bfloat16, chunk_bytes=64)
        )
        Rank0OnlyPublisher(inner, rank=rank).publish(policy_state_dict(model), version=1)
        got = {n: t for c in sender.chunks for n, t in zip(c.names, c.tensors)}
        ok = rank == 1 or (
            list(got) == list(reference)
            and all(type(t) is torch.Tensor for t in got.values())
            and all(torch.equal(got[n], reference[n].to(torch.bfloat16)) for n in reference)
        )
        results.put((rank, sharded, len(sender.chunks), ok))
    except Exception as e:
        results.put((rank, f"error: {e!r}", 0, False))
    finally:
        dist.destroy_process_group()


def test_fsdp2_weights_are_gathered_full_while_other_ranks_join_the_gathers() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    sys.path.append(str(ROOT))  # the children import this module by its pytest name
    try:
        procs = [ctx.Process(target=fsdp_rank_main, args=(r, port, results)) for r in (0, 1)]
        for proc in procs:
            proc.start()
    finally:
        sys.path.remove(str(ROOT))
    replies = sorted(results.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(10)
    assert [r[1] for r in replies] == ["DTensor", "DTensor"]
    (_, _, chunks0, ok0), (_, _, chunks1, _) = replies
    assert ok0 and chunks0 > 1  # several chunks: gathers interleave with sending
    assert chunks1 == 0  # rank 1 published nothing
