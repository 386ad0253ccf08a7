"""The pipeline's token ledger against a real redis-server: ``generated`` is what the actors
pushed (counted in Redis, in the push's transaction), ``in_flight`` the batches no learner
step has accounted for, and the learner's check closes across a crash and a resume from
an older checkpoint, with a batch trained after the checkpoint counted once and a batch
dropped after it counted as aborted; a Redis state that disagrees with the learner's
ledger stops the step."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tests.pipeline.helpers import new_queue

from ludic.pipeline.batch_source import PipelineBatchSource
from ludic.pipeline.redis_queue import RedisBatchQueue
from ludic.training.algorithm import make_reinforce
from ludic.training.batching.wire import Producer, encode_batch
from ludic.training.checkpoint import CheckpointConfig
from ludic.training.config import TrainerConfig
from ludic.training.ledger import GENERATED, LedgerError
from ludic.training.trainer import Trainer
from ludic.training.types import SAWBatch, SAWItem

pytestmark = pytest.mark.redis

ITEM_TOKENS = 2  # action tokens of each item below


def _push(q: RedisBatchQueue, name: str, version: int, num_items: int) -> int:
    """Push a batch of ``num_items`` items sampled by ``version``; returns its tokens."""
    items = [
        SAWItem([1, 2, 3, 4 + i], [0, 0, 1, 1], weight=1.0, policy_version=version)
        for i in range(num_items)
    ]
    tokens = ITEM_TOKENS * num_items
    batch = SAWBatch(items, meta={GENERATED: tokens})
    q.push(name, encode_batch(batch, Producer(name, "actor", 0)), tokens=tokens)
    return tokens


def _learner(q: RedisBatchQueue, model, checkpoints: Path) -> tuple[Trainer, PipelineBatchSource]:
    source = PipelineBatchSource(q, max_staleness=1, batch_timeout_s=5)
    trainer = Trainer(
        model,
        make_reinforce(),
        source,
        TrainerConfig(lr=1e-3),
        checkpoint=CheckpointConfig(checkpoints, every_n_steps=0),
    )
    return trainer, source


def _closes(m: dict[str, float]) -> bool:
    parts = ("trained", "dropped_stale", "dropped_filter", "dropped_reward", "aborted", "in_flight")
    return m["tokens/generated"] == sum(m[f"tokens/{k}"] for k in parts)


def test_the_ledger_closes_on_the_actors_counts_across_a_crash(
    redis_server, tiny_model, tmp_path
) -> None:
    q = new_queue(redis_server, max_queued=8)
    trainer, source = _learner(q, tiny_model, tmp_path)
    source.set_version(0)
    a, b = _push(q, "A", 0, 2), _push(q, "B", 0, 3)
    first = asyncio.run(trainer.train_step())
    queued = _push(q, "Q", 1, 1)  # waits in the queue until step 3
    assert _closes(first) and first["tokens/generated"] == a + b
    assert first["tokens/in_flight"] == b  # queued in Redis, not yet accounted
    second = asyncio.run(trainer.train_step())
    assert _closes(second) and second["tokens/trained"] == a + b
    assert second["tokens/generated"] == q.counters()["generated_tokens"] == a + b + queued
    trainer.save_checkpoint()  # step 2: A and B are in it
    # after the checkpoint: Q and a batch sampled by version 0 (2 versions behind: stale,
    # dropped whole), then C; the learner trains Q at step 3 and C at step 4, dropping S
    third = asyncio.run(trainer.train_step())
    stale, c = _push(q, "S", 0, 2), _push(q, "C", 2, 2)
    fourth = asyncio.run(trainer.train_step())
    assert _closes(third) and _closes(fourth)
    assert fourth["tokens/dropped_stale"] == stale and fourth["tokens/in_flight"] == 0
    # the learner's source dropped S before the Trainer saw it: the bias audit has it
    assert fourth["audit/dropped_samples"] == 2 and fourth["audit/trained_samples"] == 8

    # SIGKILL-like: the learner's process is gone; a new one resumes from step 2
    q2 = new_queue(redis_server, prefix=q.keys.prefix, max_queued=8)
    again, source2 = _learner(q2, tiny_model, tmp_path)
    assert again.resume() == 2
    source2.set_version(again.step)  # Q and C (trained after step 2) go back to the queue
    resumed = [asyncio.run(again.train_step()) for _ in range(2)]
    assert all(_closes(m) for m in resumed)
    last = resumed[-1]
    # Q and C trained once each; S, dropped after the checkpoint by the dead process,
    # is aborted (the resumed learner never saw it); nothing is left in flight
    assert last["tokens/generated"] == a + b + queued + stale + c
    assert last["tokens/trained"] == a + b + queued + c
    assert (last["tokens/aborted"], last["tokens/dropped_stale"]) == (stale, 0)
    assert last["tokens/in_flight"] == 0

    # a Redis state that disagrees with the learner's: C's mark removed by hand, so C
    # looks in flight while the learner counts it trained
    _push(q2, "D", 4, 1)
    q2.client.hdel(q2.keys.accounted, "C")
    with pytest.raises(LedgerError, match=rf"{c} tokens too many"):
        asyncio.run(again.train_step())
