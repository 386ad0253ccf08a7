"""PipelineBatchSource + run_pipeline_actor against a real redis-server, with the real Trainer
on the tiny model: several actors, admission control, stale drops, bad payloads, timeouts."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from tests.pipeline.helpers import new_queue, rollout_source

from ludic.pipeline.batch_source import (
    RUN_ENDED,
    AdmissionTimeoutError,
    PipelineBatchSource,
    run_pipeline_actor,
)
from ludic.training.algorithm import make_grpo, make_reinforce
from ludic.training.batching.wire import Producer, encode_batch
from ludic.training.config import TrainerConfig
from ludic.training.trainer import Trainer
from ludic.training.types import BatchSource, DataExhausted, SAWBatch, SAWItem

pytestmark = pytest.mark.redis


def _trainer(model, source: PipelineBatchSource) -> Trainer:
    return Trainer(model, make_reinforce(), source, TrainerConfig(lr=1e-3))


async def _train_one(trainer: Trainer, source: PipelineBatchSource) -> dict[str, float]:
    """One Trainer step (the Trainer acknowledges its batch through mark_trained)."""
    return await trainer.train_step()


def _items(*versions: int | None) -> list[SAWItem]:
    return [
        SAWItem([1, 2, 3, 4 + i], [0, 0, 1, 1], weight=1.0, policy_version=v, meta={"i": i})
        for i, v in enumerate(versions)
    ]


def test_two_actors_feed_one_learner_and_every_batch_is_trained_once(
    redis_server, tiny_model
) -> None:
    learner_q = new_queue(redis_server, max_queued=2)
    prefix = learner_q.keys.prefix
    source = PipelineBatchSource(learner_q, max_staleness=2, batch_timeout_s=20)
    assert isinstance(source, BatchSource)
    trainer = _trainer(tiny_model, source)

    async def main() -> tuple[list[list[str]], list[dict[str, float]]]:
        source.version  # the learner starts first and announces max_staleness  # noqa: B018
        actors = [
            asyncio.create_task(
                run_pipeline_actor(
                    rollout_source(),
                    new_queue(redis_server, prefix=prefix, max_queued=2),
                    actor_id=name,
                    max_staleness=2,
                    num_batches=3,
                    policy_version=learner_q.version,
                    poll_s=0.01,
                )
            )
            for name in ("actor-a", "actor-b")
        ]
        history = [await _train_one(trainer, source) for _ in range(6)]
        return await asyncio.gather(*actors), history

    pushed, history = asyncio.run(main())
    assert [len(p) for p in pushed] == [3, 3]
    trained = learner_q.records("trained")
    assert set(trained) == set(pushed[0]) | set(pushed[1])
    assert {r["actor_id"] for r in trained.values()} == {"actor-a", "actor-b"}
    assert sorted(r["version"] for r in trained.values()) == [1, 2, 3, 4, 5, 6]
    assert trainer.step == source.version == learner_q.version() == 6
    assert all(m["batch/pipeline_dropped_stale"] == 0 for m in history)
    assert all(m["batch/pipeline_staleness_max"] <= 2 for m in history)
    assert learner_q.queued() == 0 and learner_q.counters()["trained_items"] == 12


def test_admission_control_holds_an_actor_max_staleness_batches_ahead(
    redis_server, tiny_model
) -> None:
    learner_q = new_queue(redis_server, max_queued=8)
    actor_q = new_queue(redis_server, prefix=learner_q.keys.prefix, max_queued=8)
    source = PipelineBatchSource(learner_q, max_staleness=1, batch_timeout_s=10)
    trainer = _trainer(tiny_model, source)

    async def main() -> list[str]:
        source.version  # noqa: B018
        stop = asyncio.Event()
        actor = asyncio.create_task(
            run_pipeline_actor(
                rollout_source(), actor_q, actor_id="a", max_staleness=1, stop=stop, poll_s=0.01
            )
        )
        await asyncio.sleep(0.5)
        assert learner_q.counters()["pushed_batches"] == 2  # batches 0 and 1; 2 waits
        await _train_one(trainer, source)
        await asyncio.sleep(0.5)
        assert learner_q.counters()["pushed_batches"] == 3  # one finished -> one more
        stop.set()
        return await actor

    assert asyncio.run(main()) == ["batch-0", "batch-1", "batch-2"]
    # Stopped while waiting, the actor keeps its claim on batch 3: restarted under its id
    # it makes batch 3 (its prompts are a function of the index), none is skipped.
    assert learner_q.counters()["abandoned_claims"] == 0
    assert learner_q.finished_batches() == 1
    with pytest.raises(AdmissionTimeoutError, match=r"batch 3 waits for the learner to finish 2"):
        asyncio.run(
            run_pipeline_actor(
                rollout_source(), actor_q, actor_id="a", max_staleness=1, admission_timeout_s=0.2
            )
        )


class TwoBatches:
    """A finite BatchSource: two batches, then DataExhausted."""

    def __init__(self) -> None:
        self.left = 2

    async def next_batch(self) -> SAWBatch:
        if not self.left:
            raise DataExhausted("no more prompts")
        self.left -= 1
        return SAWBatch(_items(0, 0))


def test_an_actor_whose_source_runs_out_gives_up_its_claim(redis_server) -> None:
    q = new_queue(redis_server, max_queued=8)
    pushed = asyncio.run(run_pipeline_actor(TwoBatches(), q, actor_id="a", max_staleness=None))
    assert pushed == ["batch-0", "batch-1"]
    assert q.counters()["abandoned_claims"] == 1
    assert q.records("abandoned")["batch-2"]["reason"] == "the actor's data ran out"
    assert q.client.hlen(q.keys.claims) == 0
    assert q.claim_index("a") == 3


class ServerGoneAfterOneBatch:
    """The first batch, then what an actor sees once the learner stopped its vLLM server:
    ``on_second`` runs (the learner ends the run, or not) and generation fails."""

    def __init__(self, on_second) -> None:
        self.calls, self.on_second = 0, on_second

    async def next_batch(self) -> SAWBatch:
        self.calls += 1
        if self.calls > 1:
            self.on_second()
            raise ConnectionError("connection to vLLM server failed: Server disconnected")
        return SAWBatch(_items(0, 0))


def test_an_actor_whose_generation_fails_after_the_run_ended_ends_as_at_the_runs_end(
    redis_server,
) -> None:
    q = new_queue(redis_server, max_queued=8)
    source = ServerGoneAfterOneBatch(on_second=q.finish_run)
    pushed = asyncio.run(run_pipeline_actor(source, q, actor_id="a", max_staleness=None))
    assert pushed == ["batch-0"] and source.calls == 2
    assert q.records("abandoned")["batch-1"]["reason"] == RUN_ENDED
    # while the run goes on, the same failure is the actor's error
    q = new_queue(redis_server, max_queued=8)
    with pytest.raises(ConnectionError, match="Server disconnected"):
        asyncio.run(
            run_pipeline_actor(
                ServerGoneAfterOneBatch(on_second=lambda: None), q, actor_id="a", max_staleness=None
            )
        )


def test_an_actor_with_another_max_staleness_than_the_learner_is_refused(redis_server) -> None:
    learner_q = new_queue(redis_server)
    PipelineBatchSource(learner_q, max_staleness=1).version  # noqa: B018
    with pytest.raises(ValueError, match=r"max_staleness=3 but the learner .* uses 1"):
        asyncio.run(run_pipeline_actor(rollout_source(), learner_q, actor_id="a", max_staleness=3))


def test_stale_items_are_dropped_and_counted_and_an_all_stale_batch_is_skipped(
    redis_server, tiny_model
) -> None:
    q = new_queue(redis_server, max_queued=8)
    source = PipelineBatchSource(q, max_staleness=2, version=10, batch_timeout_s=5)
    trainer = _trainer(tiny_model, source)
    trainer.step = source.version  # a learner resumed at step 10
    q.push("batch-0", encode_batch(SAWBatch(_items(10, 7, 9)), Producer("batch-0", "a", 0)))
    q.push("batch-1", encode_batch(SAWBatch(_items(3, 4)), Producer("batch-1", "a", 1)))
    unversioned = SAWBatch(_items(None, None))
    q.push("batch-2", encode_batch(unversioned, Producer("batch-2", "a", 2, policy_version=9)))

    first = asyncio.run(_train_one(trainer, source))
    assert first["num_items"] == 2
    assert first["batch/pipeline_dropped_stale"] == 1
    assert (first["batch/pipeline_staleness_max"], first["batch/pipeline_staleness_mean"]) == (
        1,
        0.5,
    )
    second = asyncio.run(_train_one(trainer, source))  # batch-1 is all stale: skipped
    assert second["batch/pipeline_batch_index"] == 2
    assert second["batch/pipeline_staleness_max"] == 2  # version 11 - producer version 9

    assert set(q.records("trained")) == {"batch-0", "batch-2"}
    assert q.records("dropped")["batch-1"]["dropped_items"] == 2
    c = q.counters()
    assert (c["trained_items"], c["dropped_items"], c["dropped_batches"]) == (4, 3, 1)
    assert trainer.step == source.version == 12


def test_items_from_versions_a_crash_lost_are_trained_and_counted(redis_server, tiny_model) -> None:
    """A learner resumed at version 4 takes a batch its crashed predecessor's version-6
    weights sampled: trained (behaviour logprobs are exact), staleness 0, counted."""
    q = new_queue(redis_server, max_queued=8)
    source = PipelineBatchSource(q, max_staleness=1, version=4, batch_timeout_s=5)
    trainer = _trainer(tiny_model, source)
    trainer.step = source.version
    q.push("batch-0", encode_batch(SAWBatch(_items(6, 6, 4)), Producer("batch-0", "a", 0)))
    metrics = asyncio.run(_train_one(trainer, source))
    assert metrics["num_items"] == 3 and metrics["batch/pipeline_from_lost_versions"] == 2
    assert metrics["batch/pipeline_staleness_max"] == 0


def test_a_bad_payload_is_rejected_moved_to_dead_and_not_trained_on(
    redis_server, tiny_model, caplog
) -> None:
    q = new_queue(redis_server, max_queued=8)
    source = PipelineBatchSource(q, max_staleness=None, batch_timeout_s=5)
    trainer = _trainer(tiny_model, source)
    good = encode_batch(SAWBatch(_items(0, 0)), Producer("batch-2", "a", 2))
    q.push("batch-0", b"\x80\x04 definitely not a ludic batch")
    q.push("batch-1", encode_batch(SAWBatch(_items(0)), Producer("batch-7", "a", 7)))
    q.push("batch-2", good)

    with caplog.at_level(logging.ERROR, logger="ludic.pipeline.batch_source"):
        metrics = asyncio.run(_train_one(trainer, source))
    assert metrics["batch/pipeline_batch_index"] == 2
    dead = q.records("dead")
    assert "bad magic" in dead["batch-0"]["error"]
    assert "payload says batch 'batch-7' but was queued as 'batch-1'" in dead["batch-1"]["error"]
    assert "rejected batch batch-0 (moved to dead): bad magic" in caplog.text
    assert set(q.records("trained")) == {"batch-2"}
    assert q.counters()["dead_batches"] == 2 and q.finished_batches() == 3


def test_poison_pills_go_to_dead_and_a_restarted_learner_goes_on(
    redis_server, tiny_model, caplog
) -> None:
    """An id that is not UTF-8 and a well-formed batch without the old_logprobs the loss
    needs: each is moved to P:dead with a message naming it, the learner trains the good
    batch, and a learner restarted on the same processing list does not meet them again."""
    q = new_queue(redis_server, max_queued=8)
    k = q.keys
    q.client.set(k.payload("").encode() + b"\xff\xfe", b"whatever")
    q.client.lpush(k.queue, b"\xff\xfe")
    no_logprobs = encode_batch(SAWBatch(_items(0, 0)), Producer("batch-1", "a", 1))
    with_logprobs = [
        SAWItem([1, 2, 3, 4], [0, 0, 1, 1], 1.0, old_logprobs=[0, 0, -1.0, -2.0], meta={"i": i})
        for i in range(2)
    ]
    q.push("batch-1", no_logprobs)
    q.push("batch-2", encode_batch(SAWBatch(with_logprobs), Producer("batch-2", "a", 2)))
    source = PipelineBatchSource(q, max_staleness=None, batch_timeout_s=5)
    trainer = Trainer(tiny_model, make_grpo(group_size=2), source, TrainerConfig(lr=1e-3))
    with caplog.at_level(logging.ERROR):
        metrics = asyncio.run(_train_one(trainer, source))
    assert metrics["batch/pipeline_batch_index"] == 2 and trainer.step == 1
    dead = q.records("dead")
    assert dead.keys() == {"0xfffe", "batch-1"}
    assert "batch id b'\\xff\\xfe' is not valid UTF-8" in dead["0xfffe"]["error"]
    assert q.client.get(k.dead_payload("0xfffe")) == b"whatever"
    assert "requires old_logprobs, but 2 of 2 items have none" in dead["batch-1"]["error"]
    assert "batch rejected: TokenClippedSurrogateLoss requires old_logprobs" in caplog.text
    assert set(q.records("trained")) == {"batch-2"}
    assert q.client.llen(q.processing_key) == 0  # nothing left to crash a restart
    assert q.counters()["dead_batches"] == 2


def test_next_batch_times_out_and_ends_with_data_exhausted_once_closed(
    redis_server, tiny_model
) -> None:
    q = new_queue(redis_server)
    source = PipelineBatchSource(q, max_staleness=1, batch_timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no batch in .*:queue for 0.3s"):
        asyncio.run(source.next_batch())
    assert time.monotonic() - started < 3.0
    q.close_producing()
    with pytest.raises(DataExhausted, match="producers are done"):
        asyncio.run(source.next_batch())
    assert asyncio.run(_trainer(tiny_model, source).train(5)) == []


def test_mark_trained_refuses_a_batch_the_source_did_not_hand_out(redis_server) -> None:
    source = PipelineBatchSource(new_queue(redis_server), max_staleness=1)
    with pytest.raises(ValueError, match="was not handed out by this PipelineBatchSource"):
        source.mark_trained(SAWBatch(_items(0), meta={"pipeline_batch_id": "batch-0"}))


def test_a_restarted_learner_continues_from_the_version_in_redis(redis_server, tiny_model) -> None:
    q = new_queue(redis_server, max_queued=8)
    for k in range(2):
        q.push(f"batch-{k}", encode_batch(SAWBatch(_items(0)), Producer(f"batch-{k}", "a", k)))
    source = PipelineBatchSource(q, max_staleness=None, batch_timeout_s=5)
    trainer = _trainer(tiny_model, source)
    for _ in range(2):
        asyncio.run(_train_one(trainer, source))
    again = PipelineBatchSource(new_queue(redis_server, prefix=q.keys.prefix), max_staleness=None)
    assert again.version == 2
    again.set_version(7)
    assert q.version() == 7


@pytest.mark.parametrize("side", ["learner", "actor"])
def test_cancelled_while_redis_is_down_the_event_loop_exits_at_once(side: str) -> None:
    # asyncio.run waits for worker threads before returning: without the interrupt a
    # cancelled call would keep retrying the dead Redis for reconnect_timeout_s (60 s).
    from ludic.distributed.weight_transfer.groups import free_port
    from ludic.pipeline.redis_queue import RedisBatchQueue

    dead = RedisBatchQueue(f"redis://127.0.0.1:{free_port()}/0", prefix="p", reconnect_timeout_s=60)
    if side == "learner":
        waiting = PipelineBatchSource(dead, max_staleness=1).next_batch()
    else:
        waiting = run_pipeline_actor(rollout_source(), dead, actor_id="a", max_staleness=1)

    async def cancelled_after_half_a_second() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(waiting, timeout=0.5)

    started = time.monotonic()
    asyncio.run(cancelled_after_half_a_second())
    assert time.monotonic() - started < 3.0
