"""RedisBatchQueue against a real redis-server: the reliable queue, backpressure, claims."""

from __future__ import annotations

import threading
import time

import pytest
from tests.pipeline.helpers import new_queue

from ludic.pipeline.redis_queue import (
    PipelineConnectionError,
    PipelineStateError,
    QueueFullError,
    QueueInterrupted,
    RedisBatchQueue,
)

pytestmark = pytest.mark.redis


def test_push_take_ack_round_trip(redis_server) -> None:
    q = new_queue(redis_server)
    assert q.push("b0", b"payload-0", actor_id="a", info={"num_items": 2}) is True
    assert q.queued() == 1
    taken = q.take(timeout_s=1.0)
    assert taken is not None and (taken.batch_id, taken.payload) == ("b0", b"payload-0")
    assert q.client.lrange(q.processing_key, 0, -1) == [b"b0"]
    q.ack("b0", {"num_items": 2, "dropped_items": 1}, version=1)

    assert q.client.llen(q.processing_key) == 0
    # not final until a checkpoint covers version 1: the payload stays for a resume
    assert q.client.lrange(q.uncommitted_key, 0, -1) == [b"b0"]
    assert q.client.exists(q.keys.payload("b0")) == 1
    assert q.commit(0) == 0 and q.commit(1) == 1
    assert q.client.exists(q.keys.payload("b0")) == 0 and q.client.llen(q.uncommitted_key) == 0
    assert q.version() == 1
    assert q.records("trained")["b0"]["num_items"] == 2
    assert q.records("produced")["b0"]["actor_id"] == "a"
    counters = q.counters()
    assert counters["pushed_batches"] == counters["trained_batches"] == 1
    assert (counters["trained_items"], counters["dropped_items"]) == (2, 1)
    assert q.finished_batches() == 1


def test_batches_come_out_in_push_order_and_prefixes_isolate_runs(redis_server) -> None:
    q1, q2 = new_queue(redis_server, max_queued=8), new_queue(redis_server)
    for i in range(3):
        q1.push(f"b{i}", b"x")
    assert q2.take(timeout_s=0.2) is None
    assert [q1.take(timeout_s=1.0).batch_id for _ in range(3)] == ["b0", "b1", "b2"]


def test_a_repeated_push_of_the_same_id_is_recognised(redis_server) -> None:
    q = new_queue(redis_server)
    assert q.push("b0", b"x") is True
    assert q.push("b0", b"x") is False
    assert q.queued() == 1 and q.counters()["pushed_batches"] == 1


def test_a_full_queue_blocks_the_actor_and_times_out(redis_server) -> None:
    q = new_queue(redis_server, max_queued=2)
    q.push("b0", b"x")
    q.push("b1", b"x")
    started = time.monotonic()
    with pytest.raises(
        QueueFullError, match=r"stayed full \(2 batches\) for 0.3s while pushing b2"
    ):
        q.push("b2", b"x", timeout_s=0.3)
    assert time.monotonic() - started >= 0.3
    assert q.queued() == 2

    done = threading.Event()
    pusher = threading.Thread(target=lambda: (q.push("b2", b"x", timeout_s=10), done.set()))
    pusher.start()
    assert not done.wait(0.3)  # still blocked: nobody took anything
    assert q.take(timeout_s=1.0).batch_id == "b0"
    assert done.wait(5.0)
    pusher.join()
    assert q.queued() == 2


def test_concurrent_actors_never_overfill_the_queue(redis_server) -> None:
    probe = new_queue(redis_server)
    prefix = probe.keys.prefix
    results: list[bool | Exception] = []

    def actor(n: int) -> None:
        q = RedisBatchQueue(redis_server.url, prefix=prefix, max_queued=3)
        try:
            results.append(q.push(f"b{n}", b"x", timeout_s=0.5))
        except QueueFullError as err:
            results.append(err)

    threads = [threading.Thread(target=actor, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r is True for r in results) == 3
    assert sum(isinstance(r, QueueFullError) for r in results) == 5
    assert probe.queued() == 3


def test_requeue_puts_unacked_batches_back_at_the_head_oldest_first(redis_server) -> None:
    q = new_queue(redis_server, max_queued=8)
    for i in range(4):
        q.push(f"b{i}", b"x")
    assert [q.take(timeout_s=1.0).batch_id for _ in range(2)] == ["b0", "b1"]
    # The learner dies here; its replacement (same learner_id) starts.
    again = new_queue(redis_server, prefix=q.keys.prefix, max_queued=8)
    assert again.requeue_unacked(committed_version=0) == 2
    assert [again.take(timeout_s=1.0).batch_id for _ in range(4)] == ["b0", "b1", "b2", "b3"]
    assert again.counters()["requeued_batches"] == 2


def test_batches_trained_after_the_checkpoint_go_back_once_and_their_records_are_undone(
    redis_server,
) -> None:
    """A learner trains b0..b2 (versions 1..3) and checkpoints at version 1 (committed),
    and at version 2 without reaching the commit (killed between the two); b3 is taken,
    not trained. Resumed from the checkpoint of version 2: b0 and b1 stay trained, b2 and
    b3 go back to the head of the queue in the order they were taken, and b2's record and
    counts are undone, so the resumed learner trains each batch exactly once."""
    q = new_queue(redis_server, max_queued=8)
    for i in range(5):
        q.push(f"b{i}", b"x")
    for version in (1, 2, 3):
        batch_id = q.take(timeout_s=1.0).batch_id
        q.ack(batch_id, {"num_items": 2, "dropped_items": 1}, version=version)
        if version == 1:
            assert q.commit(1) == 1
    assert q.take(timeout_s=1.0).batch_id == "b3"
    assert q.finished_batches() == 3
    # killed; the resumed learner starts from its checkpoint of version 2
    again = new_queue(redis_server, prefix=q.keys.prefix, max_queued=8)
    assert again.requeue_unacked(committed_version=2) == 2  # b3 (taken) and b2 (trained)
    assert set(again.records("trained")) == {"b0", "b1"}
    assert again.client.exists(again.keys.payload("b1")) == 0  # committed by the resume
    c = again.counters()
    assert (c["trained_batches"], c["trained_items"], c["dropped_items"]) == (2, 4, 2)
    assert (c["retrained_batches"], c["requeued_batches"]) == (1, 1)
    assert again.finished_batches() == 2
    taken = [again.take(timeout_s=1.0) for _ in range(3)]
    assert [t.batch_id for t in taken] == ["b2", "b3", "b4"]
    assert all(t.payload == b"x" for t in taken)  # the payloads were kept


def test_a_batch_moved_without_a_reply_is_adopted_by_the_next_take(redis_server) -> None:
    q = new_queue(redis_server)
    q.push("b0", b"x")
    q.push("b1", b"y")
    # What a BLMOVE whose reply was lost (Redis restarted) leaves behind.
    q.client.lmove(q.keys.queue, q.processing_key, "RIGHT", "LEFT")
    assert q.take(timeout_s=1.0).batch_id == "b0"
    assert q.take(timeout_s=1.0).batch_id == "b1"


def test_finishing_a_batch_this_learner_does_not_hold_is_refused(redis_server) -> None:
    q = new_queue(redis_server)
    q.push("b0", b"x")
    with pytest.raises(PipelineStateError, match=r"batch b0 is not in .*:processing:learner"):
        q.ack("b0", {"num_items": 1}, version=1)
    taken = q.take(timeout_s=1.0)
    q.ack(taken.batch_id, {"num_items": 1}, version=1)
    q.ack(taken.batch_id, {"num_items": 1}, version=1)  # a retry after a lost reply: no-op
    assert q.counters()["trained_batches"] == 1


def test_drop_and_reject_record_the_batch_and_keep_the_rejected_bytes(redis_server) -> None:
    q = new_queue(redis_server)
    q.push("b0", b"stale")
    q.push("b1", b"garbage")
    q.drop(q.take(timeout_s=1.0).batch_id, {"dropped_items": 4})
    q.reject(q.take(timeout_s=1.0).batch_id, "bad magic")
    assert q.records("dropped")["b0"]["dropped_items"] == 4
    assert q.records("dead")["b1"]["error"] == "bad magic"
    assert q.client.get(q.keys.dead_payload("b1")) == b"garbage"
    c = q.counters()
    assert (c["dropped_batches"], c["dropped_items"], c["dead_batches"]) == (1, 4, 1)
    assert q.finished_batches() == 2


def test_an_id_without_payload_is_rejected_and_skipped(redis_server) -> None:
    q = new_queue(redis_server)
    q.client.lpush(q.keys.queue, "ghost")
    q.push("b0", b"x")
    assert q.take(timeout_s=1.0).batch_id == "b0"
    assert "no payload stored" in q.records("dead")["ghost"]["error"]


def test_claims_are_kept_per_actor_until_its_push(redis_server) -> None:
    q = new_queue(redis_server)
    assert q.claim_index("a") == 0
    assert q.claim_index("b") == 1
    assert q.claim_index("a") == 0  # a restarted actor regenerates its claimed batch
    q.push("batch-0", b"x", actor_id="a")
    assert q.claim_index("a") == 2


def test_purge_deletes_only_this_prefix(redis_server) -> None:
    q, other = new_queue(redis_server), new_queue(redis_server)
    for queue in (q, other):
        queue.push("b0", b"x")
        queue.take(timeout_s=1.0)
    assert q.purge() == 5  # payload:b0, processing:learner, produced, stats, batch_tokens
    assert q.client.keys(f"{q.keys.prefix}:*") == []
    assert other.client.keys(f"{other.keys.prefix}:*") != []


def test_take_returns_at_once_when_producers_closed_an_empty_queue(redis_server) -> None:
    q = new_queue(redis_server, block_s=0.1)
    q.push("b0", b"x")
    q.close_producing()
    assert q.take(timeout_s=5.0).batch_id == "b0"
    started = time.monotonic()
    assert q.take(timeout_s=5.0) is None
    assert time.monotonic() - started < 1.0


def test_an_unreachable_redis_raises_a_clear_connection_error_after_the_timeout() -> None:
    from ludic.distributed.weight_transfer.groups import free_port

    q = RedisBatchQueue(f"redis://127.0.0.1:{free_port()}/0", prefix="p", reconnect_timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(PipelineConnectionError, match=r"push batch b0: Redis at .* unreachable"):
        q.push("b0", b"x")
    assert 0.5 <= time.monotonic() - started < 3.0
    assert isinstance(PipelineConnectionError("x"), ConnectionError)


def _in_thread(fn) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - recorded for the test
            errors.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def _interrupt_after(q: RedisBatchQueue, thread: threading.Thread, wait_s: float = 0.5) -> float:
    time.sleep(wait_s)
    assert thread.is_alive()  # still waiting when interrupted
    started = time.monotonic()
    q.interrupt()
    thread.join(timeout=10)
    assert not thread.is_alive()
    return time.monotonic() - started


def test_interrupt_ends_a_retry_against_a_dead_redis_at_once() -> None:
    from ludic.distributed.weight_transfer.groups import free_port

    q = RedisBatchQueue(f"redis://127.0.0.1:{free_port()}/0", prefix="p", reconnect_timeout_s=60)
    thread, errors = _in_thread(lambda: q.push("b0", b"x"))
    assert _interrupt_after(q, thread) < 2.0
    assert len(errors) == 1 and isinstance(errors[0], QueueInterrupted), errors
    assert "push batch b0: interrupted" in str(errors[0])


@pytest.mark.parametrize("waiting", ["take", "push"])
def test_interrupt_ends_a_wait_on_an_empty_or_full_queue_and_later_calls_work(
    redis_server, waiting: str
) -> None:
    q = new_queue(redis_server, max_queued=1)
    if waiting == "take":
        thread, errors = _in_thread(lambda: q.take(timeout_s=60))
    else:
        q.push("b0", b"x")
        thread, errors = _in_thread(lambda: q.push("b1", b"y", timeout_s=60))
    assert _interrupt_after(q, thread) < 2.0
    assert len(errors) == 1 and isinstance(errors[0], QueueInterrupted), errors
    if waiting == "push":
        assert q.queued() == 1 and "b1" not in q.records("produced")  # nothing half-pushed
        assert q.take(timeout_s=1.0).batch_id == "b0"
    assert q.push("b2", b"z") is True  # the handle works after an interrupt
