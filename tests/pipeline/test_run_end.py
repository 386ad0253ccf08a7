"""The end of a pipeline run against a real redis-server: the learner's ``finish_run`` stops
actors wherever they wait (admission, a full queue), refuses later pushes and records what
was still queued; the learner's announcement for actors to wait on."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from tests.pipeline.helpers import new_queue, rollout_source

from ludic.pipeline.batch_source import run_pipeline_actor
from ludic.pipeline.redis_queue import PushStopped, RunFinishedError

pytestmark = pytest.mark.redis


def test_finish_run_refuses_pushes_and_records_what_was_queued_as_unused(redis_server) -> None:
    q = new_queue(redis_server, max_queued=4)
    q.push("b0", b"x")
    q.push("b1", b"y")
    q.client.lpush(q.keys.queue, b"\xff")  # an id that is not UTF-8 ends there too
    q.client.set(q.keys.payload("").encode() + b"\xff", b"z")
    assert q.finish_run(reason="test over") == 3
    assert q.is_done() and q.queued() == 0
    assert set(q.records("unused")) == {"b0", "b1", "0xff"}
    assert q.client.exists(q.keys.payload("").encode() + b"\xff") == 0
    assert q.records("unused")["b0"]["reason"] == "test over"
    assert q.counters()["unused_batches"] == 3
    assert q.finished_batches() == 3  # admission after a resume does not wait for them
    assert q.client.exists(q.keys.payload("b0")) == 0
    with pytest.raises(RunFinishedError, match="ended the run; batch b2 is not wanted"):
        q.push("b2", b"z")
    q.start_run()  # a resumed run takes batches again
    assert not q.is_done() and q.push("b2", b"z")


def test_a_push_waiting_on_a_full_queue_ends_with_the_run_or_its_stop_flag(redis_server) -> None:
    q = new_queue(redis_server, max_queued=1, push_timeout_s=30)
    q.push("b0", b"x")
    stop = threading.Event()
    timer = threading.Timer(0.3, stop.set)
    timer.start()
    started = time.monotonic()
    with pytest.raises(PushStopped):
        q.push("b1", b"y", stop=stop.is_set)
    threading.Timer(0.3, q.finish_run).start()
    with pytest.raises(RunFinishedError):
        q.push("b1", b"y")
    assert time.monotonic() - started < 5.0


def test_actors_waiting_for_admission_or_room_stop_when_the_learner_ends_the_run(
    redis_server,
) -> None:
    q = new_queue(redis_server, max_queued=1, push_timeout_s=60)
    q.set_max_staleness(0)
    prefix = q.keys.prefix

    async def actor(name: str) -> list[str]:
        return await run_pipeline_actor(
            rollout_source(),
            new_queue(redis_server, prefix=prefix, max_queued=1, push_timeout_s=60),
            actor_id=name,
            max_staleness=0,
            admission_timeout_s=60,
            poll_s=0.01,
        )

    async def main() -> list[list[str]]:
        tasks = [asyncio.create_task(actor(n)) for n in ("a", "b")]
        # batch 0 is admitted at once; batch 1 waits for the learner (max_staleness 0)
        while q.queued() < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        await asyncio.to_thread(q.finish_run)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)

    pushed = asyncio.run(main())
    assert sorted(len(p) for p in pushed) == [0, 1]
    assert q.client.hlen(q.keys.claims) == 0  # the waiting actor abandoned its claim
    abandoned = q.records("abandoned")  # batches 1 and 2, each with its reason
    assert sorted(abandoned) == ["batch-1", "batch-2"]
    assert {r["reason"] for r in abandoned.values()} == {"the run ended before the batch was made"}
    assert set(q.records("unused")) == {"batch-0"}


def test_the_learner_announcement_is_cleared_by_a_new_run(redis_server) -> None:
    q = new_queue(redis_server)
    assert q.learner_info() is None
    q.announce_learner({"version": 3, "weights": "redis"})
    assert q.learner_info() == {"version": 3, "weights": "redis"}
    q.finish_run()
    q.start_run()
    assert q.learner_info() is None and not q.is_done()
