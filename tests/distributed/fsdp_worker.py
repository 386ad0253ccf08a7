"""One rank of a data-parallel (FSDP2) trainer run on CPU, for ``test_fsdp_trainer.py``.

    python -m torch.distributed.run --nproc-per-node N tests/distributed/fsdp_worker.py \
        OUT ALGORITHM DTYPE [--steps K] [--minibatches M] [--budget TOKENS] [--redis URL]
    python tests/distributed/fsdp_worker.py OUT ...        # one process, no process group

Every rank builds the same tiny policy and the same batches (rank 0's batch source is the
one used; with ``--redis`` it is a pipeline learner's: rank 0 first pushes the batches to
a queue of their own at URL, then takes them from there, in the wire format, and
acknowledges each after its step); after the steps rank 0 writes ``OUT/result.pt``: each
step's metrics, the final full weights (gathered from the shards) and, with ``--redis``,
the ids of the batches the queue recorded as trained and how many acknowledgements it
counted. Several runs, one after the other in the
same processes (and process group): ``OUT1 ARGS1 + OUT2 ARGS2 + ...``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

from ludic.models.tiny import build_tiny_causal_lm, build_tiny_tokenizer
from ludic.training.algorithm import make_decoupled_ppo, make_grpo, make_gspo, make_sft
from ludic.training.checkpoint import CheckpointConfig
from ludic.training.config import TrainerConfig
from ludic.training.data_parallel import TrainerRanks
from ludic.training.trainer import Trainer
from ludic.training.types import DataExhausted, SAWBatch, SAWItem

ALGORITHMS = {
    "grpo": lambda: make_grpo(group_size=2),
    "gspo": lambda: make_gspo(group_size=2),
    "decoupled_ppo": lambda: make_decoupled_ppo(),
    "sft": make_sft,
}


def batches(num: int, size: int, seed: int = 0, groups: bool = False) -> list[SAWBatch]:
    """Seeded batches of sequences of 6..24 tokens (3..10 of them actions), with
    behaviour logprobs and advantages."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(num):
        items = []
        for i in range(size):
            prompt = int(torch.randint(3, 15, (1,), generator=g))
            completion = int(torch.randint(3, 11, (1,), generator=g))
            ids = torch.randint(3, 250, (prompt + completion,), generator=g).tolist()
            if groups and i % 2:  # pairs share their prompt, as GRPO groups do
                prompt = items[-1].action_mask.index(1)
                ids = list(items[-1].input_ids[:prompt]) + ids[-completion:]
            mask = [0] * prompt + [1] * completion
            old = [0.0] * prompt + (-5.5 + torch.rand(completion, generator=g)).tolist()
            weight = float(torch.randn(1, generator=g))
            meta = {"rollout_id": f"b{b}r{i}", "reward": weight, "group_id": f"b{b}g{i // 2}"}
            items.append(SAWItem(ids, mask, weight, old_logprobs=old, meta=meta, policy_version=0))
        out.append(SAWBatch(items=items))
    return out


class ListSource:
    """The batches in order; past the last one, ``DataExhausted`` (or, with ``fail``, a
    ``RuntimeError``)."""

    def __init__(self, items: list[SAWBatch], fail: bool = False) -> None:
        self.items, self.calls, self.fail = items, 0, fail

    async def next_batch(self) -> SAWBatch:
        self.calls += 1
        if self.calls > len(self.items):
            if self.fail:
                raise RuntimeError("the rollout engine broke")
            raise DataExhausted("no more batches")
        return self.items[self.calls - 1]


def pipeline_source(url: str, prefix: str, items: list[SAWBatch]) -> tuple[Any, Any]:
    """A pipeline learner's batch source over a fresh queue holding ``items`` (pushed as
    an actor does, then closed) and the queue."""
    from ludic.pipeline.batch_source import PipelineBatchSource
    from ludic.pipeline.redis_queue import RedisBatchQueue
    from ludic.training.batching.wire import Producer, encode_batch

    queue = RedisBatchQueue(url, prefix=prefix, max_queued=len(items), block_s=0.2)
    queue.purge()
    for index, batch in enumerate(items):
        batch_id = f"batch-{index}"
        queue.push(batch_id, encode_batch(batch, Producer(batch_id, "actor", index)))
    queue.close_producing()
    return PipelineBatchSource(queue, max_staleness=None, batch_timeout_s=30.0), queue


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("algorithm", choices=sorted(ALGORITHMS))
    parser.add_argument("dtype", choices=["float32", "float64"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=7)
    parser.add_argument("--minibatches", type=int, default=1)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--logprobs", default="chunked")
    parser.add_argument("--adam-eps", type=float, default=1e-8)
    parser.add_argument("--batches", type=int, help="fewer batches than steps (default: steps)")
    parser.add_argument("--fail", action="store_true", help="the source fails after --batches")
    parser.add_argument("--checkpoints", type=Path, help="checkpoint every step here")
    parser.add_argument("--resume", action="store_true", help="from the latest checkpoint")
    parser.add_argument("--server", help="publish every step to this ludic vLLM server")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--groups", action="store_true", help="pairs of items share a prompt")
    parser.add_argument("--no-shared-prefix", action="store_true")
    parser.add_argument("--redis", help="rank 0 reads the batches from a queue at this URL")
    return parser


def main() -> None:
    runs, current = [], []
    for arg in sys.argv[1:]:  # OUT1 ARGS1 + OUT2 ARGS2 ...
        if arg == "+":
            runs.append(current)
            current = []
        else:
            current.append(arg)
    runs.append(current)
    all_args = [parser().parse_args(argv) for argv in runs if argv]
    ranks = TrainerRanks.from_env()
    device = all_args[0].device
    if ranks is not None:
        if device == "cuda":  # one GPU per rank, NCCL
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            device = f"cuda:{os.environ['LOCAL_RANK']}"
        backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
        torch.distributed.init_process_group(backend)
        ranks = TrainerRanks.current()
    torch.set_num_threads(1)
    for args in all_args:
        train_once(args, ranks, device)
    if ranks is not None:
        from ludic.run.trainer_ranks import leave_trainer_group

        leave_trainer_group()


def train_once(args: argparse.Namespace, ranks: TrainerRanks | None, device: str) -> None:
    dtype = getattr(torch, args.dtype)
    model = build_tiny_causal_lm(build_tiny_tokenizer(), seed=0).to(dtype)
    config = TrainerConfig(
        lr=1e-2,
        eps=args.adam_eps,
        max_grad_norm=1.0,
        max_tokens_per_microbatch=args.budget,
        num_minibatches=args.minibatches,
        logprobs=args.logprobs,
        dtype=None,
        seed=1,
        publish_every=1,
        device=device,
        shared_prefix=not args.no_shared_prefix,  # ignored (off) when sharded
    )
    publisher, client = None, None
    if args.server and (ranks is None or ranks.is_main):  # rank 0 alone talks to the server
        from ludic.distributed.publisher import ClientPolicyPublisher
        from ludic.inference.vllm.client import VLLMChatClient

        client = VLLMChatClient(args.server, api_key=os.environ["LUDIC_API_KEY"], timeout_s=60)
        client.init_weight_sync(backend="gloo")
        publisher = ClientPolicyPublisher(client)
    items = batches(args.batches or args.steps, args.batch, groups=args.groups)
    source = ListSource(items, fail=args.fail)
    queue = None
    if args.redis and (ranks is None or ranks.is_main):
        source, queue = pipeline_source(args.redis, f"fsdp-{args.out}", items)
    checkpoint = CheckpointConfig(args.checkpoints, every_n_steps=1) if args.checkpoints else None
    trainer = Trainer(
        model,
        ALGORITHMS[args.algorithm](),
        source,
        config,
        ranks=ranks,
        checkpoint=checkpoint,
        publisher=publisher,
    )
    if args.resume:
        source.calls = trainer.resume()  # the batches of the steps done are skipped
    history = trainer.train_sync(args.steps - trainer.step)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = get_model_state_dict(
        trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    weights = {name: tensor.cpu() for name, tensor in weights.items()}
    if ranks is None or ranks.is_main:
        args.out.mkdir(parents=True, exist_ok=True)
        trained = sorted(queue.records("trained")) if queue is not None else []
        acks = queue.counters()["trained_batches"] if queue is not None else 0
        result = {"history": history, "weights": weights, "trained": trained, "acks": acks}
        torch.save(result, args.out / "result.pt")
    if client is not None:
        client.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
