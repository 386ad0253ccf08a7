"""Weight-sync throughput over gloo between two processes on this machine.

    .venv/bin/python benchmarks/weight_sync.py [--repeats 5] [--small-tensors 2000]

This process is the trainer (rank 0); one spawned process is the inference worker
(rank 1). The control plane is a multiprocessing queue. For two models, (i) many small
tensors, (i') the same kept flat in one buffer (as ``TrainerConfig.flat_parameters`` keeps
a model's parameters) and (ii) a few large ones, it times these ways of moving the same
bytes:

  (a) ludic:  ModelWeightExtractor + BroadcastTransferSender (per chunk: JSON
              announcement, header + status handshake, one packed buffer or one
              broadcast per tensor); the worker runs BroadcastTransferReceiver.receive.
              A steady-state sync: the layouts are known, chunks are announced by id.
  (a1) ludic, first sync of the layout: planned afresh, announced in full.
  (b) naive:  per tensor, announce its metadata through the same queue, then broadcast it.
  (c) floor:  one broadcast of a flat buffer of the same total bytes, preallocated on
              both sides (what the link can do; nothing to describe or unpack).

Each run ends when the worker's acknowledgement of the last byte arrives. Prints the
median throughput of each and the ratios (a)/(c), (a1)/(c) and (a)/(b) from the same run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable

import torch

from ludic.distributed.weight_transfer import (
    BroadcastTransferReceiver,
    BroadcastTransferSender,
    ModelWeightExtractor,
    dtype_from_name,
    dtype_name,
    free_port,
    init_process_group,
)
from ludic.distributed.weight_transfer.groups import broadcast
from ludic.distributed.weight_transfer.layout import SentLayouts
from ludic.training.flat_parameters import flatten_parameters

HOST = "127.0.0.1"
MIB = 2**20


def many_small_tensors(count: int) -> dict[str, torch.Tensor]:
    """``count`` float32 tensors of 4 KiB to 64 KiB each (~34 KiB on average)."""
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(1024, 16 * 1024 + 1, (count,), generator=g)
    return {
        f"model.layers.{i // 8}.p{i % 8}.weight": torch.randn(int(n), generator=g)
        for i, n in enumerate(sizes)
    }


def kept_flat(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors as the parameters of a module kept flat by ``flatten_parameters``
    (``TrainerConfig.flat_parameters``): its state dict, views back to back in one buffer."""
    root = torch.nn.Module()
    for name, tensor in state.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(tensor.clone()))
    flatten_parameters(root)
    return root.state_dict()


def few_large_tensors(count: int, mib: int) -> dict[str, torch.Tensor]:
    return {f"model.big{i}.weight": torch.randn(mib * MIB // 4) for i in range(count)}


# ------------------------------------------------------------------------------ worker
def worker(port: int, commands, acks) -> None:
    pg = init_process_group(master_addr=HOST, master_port=port, rank=1, world_size=2)
    receiver = BroadcastTransferReceiver(pg)
    floor_buffer = None
    while (command := commands.get()) is not None:
        kind = command["kind"]
        if kind == "broadcast":  # (a) a ludic request
            request = receiver.parse_request(command)
            receiver.receive(request)
            if request.last:
                acks.put("done")
        elif kind == "naive":  # (b) one tensor's metadata
            t = torch.empty(command["shape"], dtype=dtype_from_name(command["dtype"]))
            broadcast(pg, t)
            if command["last"]:
                acks.put("done")
        elif kind == "floor-setup":
            floor_buffer = torch.empty(command["nbytes"], dtype=torch.uint8)
            acks.put("ready")
        elif kind == "floor":  # (c)
            broadcast(pg, floor_buffer)
            acks.put("done")


class QueueControlPlane:
    def __init__(self, commands, acks) -> None:
        self.commands, self.acks = commands, acks

    def announce(self, request) -> None:
        self.commands.put(request.to_dict())

    def wait_until_applied(self, timeout_s: float) -> None:
        self.acks.get(timeout=timeout_s)


# ------------------------------------------------------------------------------ methods
def run_ludic(
    extractor: ModelWeightExtractor,
    sender: BroadcastTransferSender,
    control: QueueControlPlane,
    state: dict[str, torch.Tensor],
) -> None:
    sender.send(extractor.extract_state_dict(state), control, version=1)
    control.wait_until_applied(600)


def run_ludic_first_sync(
    extractor: ModelWeightExtractor,
    sender: BroadcastTransferSender,
    control: QueueControlPlane,
    state: dict[str, torch.Tensor],
) -> None:
    """(a1): as (a), but as the first sync of this layout: the extractor plans afresh and
    every chunk is announced in full (the worker sees the same ids again and keeps them)."""
    extractor.forget_plan()
    sender.layouts = SentLayouts()
    run_ludic(extractor, sender, control, state)


def run_naive(pg, control: QueueControlPlane, state: dict[str, torch.Tensor]) -> None:
    last = len(state) - 1
    for i, (name, t) in enumerate(state.items()):
        meta = {"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
        control.commands.put({"kind": "naive", **meta, "last": i == last})
        broadcast(pg, t)
    control.wait_until_applied(600)


def make_floor(pg, control: QueueControlPlane, nbytes: int) -> Callable[[], None]:
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    control.commands.put({"kind": "floor-setup", "nbytes": nbytes})
    control.acks.get(timeout=60)

    def run() -> None:
        control.commands.put({"kind": "floor"})
        broadcast(pg, buffer)
        control.wait_until_applied(600)

    return run


def seconds(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--small-tensors", type=int, default=2000)
    parser.add_argument("--large-tensors", type=int, default=4)
    parser.add_argument("--large-mib", type=int, default=32)
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    commands, acks = ctx.Queue(), ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=worker, args=(port, commands, acks), daemon=True)
    proc.start()
    pg = init_process_group(master_addr=HOST, master_port=port, rank=0, world_size=2)
    control = QueueControlPlane(commands, acks)
    # One of each per trainer, as BroadcastPolicyPublisher holds them: the sender keeps its
    # pack buffers and the layouts the worker knows, the extractor its plan.
    sender = BroadcastTransferSender(pg)
    extractor = ModelWeightExtractor()

    small = many_small_tensors(args.small_tensors)
    models = {
        f"{args.small_tensors} small tensors": small,
        f"{args.small_tensors} small, kept flat": kept_flat(small),
        f"{args.large_tensors} x {args.large_mib} MiB tensors": few_large_tensors(
            args.large_tensors, args.large_mib
        ),
    }
    print(
        f"gloo on {HOST}, 2 processes, {torch.get_num_threads()} torch threads; "
        f"{args.repeats} rounds of (a), (a1), (b), (c) in turn after one warm-up round; medians"
    )
    print(
        f"{'model':<24}{'MB':>7}{'(a) ludic':>12}{'(a1) 1st':>12}{'(b) naive':>12}"
        f"{'(c) floor':>12}{'a/c':>7}{'a/c range':>12}{'a1/c':>7}{'a/b':>7}"
    )
    for label, state in models.items():
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        runs = {
            "a": lambda s=state: run_ludic(extractor, sender, control, s),
            "a1": lambda s=state: run_ludic_first_sync(extractor, sender, control, s),
            "b": lambda s=state: run_naive(pg, control, s),
            "c": make_floor(pg, control, nbytes),
        }
        for run in runs.values():
            run()  # warm-up: first-touch page faults, lazy allocations
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.repeats):  # interleaved, so drifting load hits all of them
            for k, run in runs.items():
                times[k].append(seconds(run))
        rate = {k: nbytes / statistics.median(v) / 1e6 for k, v in times.items()}  # MB/s
        a_over_c = [c / a for a, c in zip(times["a"], times["c"])]  # per round
        a1_over_c = [c / a for a, c in zip(times["a1"], times["c"])]
        print(
            f"{label:<24}{nbytes / 1e6:>7.1f}"
            + "".join(f"{rate[k]:>7.0f} MB/s" for k in ("a", "a1", "b", "c"))
            + f"{statistics.median(a_over_c):>7.2f}"
            + f"{min(a_over_c):>6.2f}-{max(a_over_c):.2f}"
            + f"{statistics.median(a1_over_c):>7.2f}"
            + f"{rate['a'] / rate['b']:>7.2f}"
        )
    commands.put(None)
    proc.join(30)


if __name__ == "__main__":
    main()
