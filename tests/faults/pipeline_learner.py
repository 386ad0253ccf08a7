"""A pipeline learner process for test_pipeline_faults.py: the real Trainer (REINFORCE) on
the tiny model, fed by a PipelineBatchSource, acknowledging each batch after its step.

    python pipeline_learner.py REDIS_URL PREFIX MAX_STALENESS [--wait-for-go]

Prints ``ready`` once torch and the model are loaded, then (after a line on stdin with
``--wait-for-go``) ``start version=V`` when it takes over the queue, and ``trained ID
step=S`` after each acknowledged step. Exits 0 when the producers are done.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from ludic.models.tiny import build_tiny_causal_lm, build_tiny_tokenizer
from ludic.pipeline.batch_source import PipelineBatchSource
from ludic.pipeline.redis_queue import RedisBatchQueue
from ludic.training.algorithm import make_reinforce
from ludic.training.config import TrainerConfig
from ludic.training.trainer import Trainer
from ludic.training.types import DataExhausted


async def learn(trainer: Trainer, source: PipelineBatchSource) -> None:
    while True:
        try:
            await trainer.train_step()
        except DataExhausted:
            return
        batch = source.last_batch  # the Trainer acknowledged it (mark_trained)
        print(f"trained {batch.meta['pipeline_batch_id']} step={trainer.step}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("prefix")
    parser.add_argument("max_staleness", type=int)
    parser.add_argument("--wait-for-go", action="store_true")
    args = parser.parse_args()

    model = build_tiny_causal_lm(build_tiny_tokenizer(), seed=0)
    queue = RedisBatchQueue(args.url, prefix=args.prefix, block_s=0.1, reconnect_timeout_s=10)
    source = PipelineBatchSource(queue, max_staleness=args.max_staleness, batch_timeout_s=30)
    trainer = Trainer(model, make_reinforce(), source, TrainerConfig(lr=1e-3))
    print("ready", flush=True)
    if args.wait_for_go:
        sys.stdin.readline()
    trainer.step = source.version  # requeues what a crashed run left, continues its version
    print(f"start version={trainer.step}", flush=True)
    asyncio.run(learn(trainer, source))


if __name__ == "__main__":
    main()
