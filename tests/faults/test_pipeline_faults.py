"""The Redis pipeline under real crashes: ``kill -9`` of a learner process mid-step, and of
redis-server mid-run. Nothing produced is lost, nothing acknowledged is lost, and every
batch is trained on once (per the durable ``P:trained`` record) or counted as dropped."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tests.pipeline.helpers import new_queue, require_redis_server, rollout_source, running_redis

from ludic.pipeline.batch_source import PipelineBatchSource, run_pipeline_actor
from ludic.pipeline.redis_queue import RedisBatchQueue
from ludic.pipeline.redis_server import RedisServer, start_redis_server
from ludic.training.algorithm import make_reinforce
from ludic.training.config import TrainerConfig
from ludic.training.trainer import Trainer
from ludic.training.types import DataExhausted

pytestmark = pytest.mark.redis

LEARNER = Path(__file__).with_name("pipeline_learner.py")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from running_redis(tmp_path / "redis")


def _wait(what: str, check: Callable[[], object], timeout_s: float = 30.0) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.002)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def _actor(queue: RedisBatchQueue, num_batches: int, max_staleness: int, lags) -> list[str]:
    """One actor thread: real RolloutBatchSource -> run_pipeline_actor; closes the queue
    when done. ``lags``: how many versions behind the learner its weights are per batch."""
    lag = iter(lags)
    pushed = asyncio.run(
        run_pipeline_actor(
            rollout_source(num_rollouts=4),
            queue,
            actor_id="actor-0",
            max_staleness=max_staleness,
            num_batches=num_batches,
            policy_version=lambda: max(0, (queue.version() or 0) - next(lag)),
            admission_timeout_s=60,
            poll_s=0.005,
        )
    )
    queue.close_producing()
    return pushed


def _launch(out: Path, name: str, url: str, prefix: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(LEARNER), url, prefix, "1", *extra],
        stdin=subprocess.PIPE,
        stdout=(out / f"{name}.out").open("w"),
        stderr=(out / f"{name}.err").open("w"),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )


def _lines(out: Path, name: str) -> list[str]:
    return (out / f"{name}.out").read_text().splitlines()


def test_a_learner_killed_mid_step_and_restarted_trains_every_batch_once_or_drops_it(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    num_batches, items_per_batch = 14, 4
    q = new_queue(redis_server, max_queued=4)
    prefix, url = q.keys.prefix, redis_server.url
    # The replacement starts now and waits before touching Redis: importing torch takes
    # ~5-10 s on 2 shared cores, so the test pays for it once.
    first = _launch(tmp_path, "first", url, prefix)
    second = _launch(tmp_path, "second", url, prefix, "--wait-for-go")
    pool = ThreadPoolExecutor(1)
    try:
        _wait("the first learner", lambda: "start version=0" in _lines(tmp_path, "first"), 60)
        lags = itertools.cycle([0, 0, 1, 3])  # every 4th batch is 3 versions stale: dropped
        actor = pool.submit(
            _actor, new_queue(redis_server, prefix=prefix, max_queued=4), num_batches, 1, lags
        )

        # Freeze the learner while it holds a batch it took but has not acknowledged, then
        # kill it for real (SIGSTOP makes "mid-step" deterministic; SIGKILL is the crash).
        def frozen_mid_step() -> bool:
            if q.counters()["trained_batches"] < 3 or not q.client.llen(q.processing_key):
                return False
            os.kill(first.pid, signal.SIGSTOP)
            if q.client.llen(q.processing_key):
                return True
            os.kill(first.pid, signal.SIGCONT)
            return False

        _wait("the first learner mid-step", frozen_mid_step)
        os.kill(first.pid, signal.SIGKILL)
        assert first.wait(10) == -signal.SIGKILL
        in_flight = {b.decode() for b in q.client.lrange(q.processing_key, 0, -1)}
        trained_at_kill = set(q.records("trained"))

        second.stdin.write(b"go\n")
        second.stdin.close()
        pushed = actor.result(timeout=60)
        assert second.wait(60) == 0, (tmp_path / "second.err").read_text()[-3000:]
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        pool.shutdown(wait=False)

    produced, trained, dropped = (q.records(r) for r in ("produced", "trained", "dropped"))
    assert len(pushed) == num_batches and set(pushed) == set(produced)
    assert set(trained) | set(dropped) == set(produced)
    assert not set(trained) & set(dropped)
    assert trained and dropped and not q.records("dead")
    assert q.queued() == 0 and q.client.llen(q.processing_key) == 0
    assert in_flight and in_flight <= set(trained) | set(dropped)
    assert q.counters()["requeued_batches"] == len(in_flight)

    # Each side's log: acknowledged batches are never trained again after the restart.
    first_acks = [
        line.split()[1] for line in _lines(tmp_path, "first") if line.startswith("trained")
    ]
    second_log = _lines(tmp_path, "second")
    second_acks = [line.split()[1] for line in second_log if line.startswith("trained")]
    assert set(first_acks) == trained_at_kill
    assert sorted(first_acks + second_acks) == sorted(trained)
    assert f"start version={len(trained_at_kill)}" in second_log
    assert second_log[-1].endswith(f"step={len(trained)}") and q.version() == len(trained)
    c = q.counters()
    assert c["trained_items"] + c["dropped_items"] == num_batches * items_per_batch


def test_redis_killed_and_restarted_mid_run_loses_nothing_acknowledged(
    tmp_path: Path, tiny_model
) -> None:
    require_redis_server()
    data_dir = tmp_path / "redis"
    server = start_redis_server(data_dir)
    num_batches = 24
    q = new_queue(server, max_queued=2, reconnect_timeout_s=20)
    prefix = q.keys.prefix
    learner_q = new_queue(server, prefix=prefix, max_queued=2, reconnect_timeout_s=20)
    source = PipelineBatchSource(learner_q, max_staleness=2, batch_timeout_s=30)
    trainer = Trainer(tiny_model, make_reinforce(), source, TrainerConfig(lr=1e-3))
    acked: list[str] = []

    async def learn() -> None:
        trainer.step = source.version
        while True:
            try:
                await trainer.train_step()
            except DataExhausted:
                return
            acked.append(source.last_batch.meta["pipeline_batch_id"])

    pool = ThreadPoolExecutor(2)
    try:
        learner = pool.submit(asyncio.run, learn())
        _wait("the learner to announce max_staleness", lambda: q.max_staleness() == 2)
        actor_q = new_queue(server, prefix=prefix, max_queued=2, reconnect_timeout_s=20)
        actor = pool.submit(_actor, actor_q, num_batches, 2, itertools.repeat(0))
        _wait("4 trained batches", lambda: q.counters()["trained_batches"] >= 4)
        produced_before, trained_before = set(q.records("produced")), set(q.records("trained"))
        acked_before = list(acked)

        server.kill()  # kill -9: only what reached the fsynced AOF survives
        time.sleep(0.5)
        server = start_redis_server(data_dir, port=server.port)

        pushed = actor.result(timeout=60)
        learner.result(timeout=60)
    finally:
        server.stop()
        pool.shutdown(wait=False)

    server = start_redis_server(data_dir, port=server.port)  # the final state, from the AOF
    try:
        q = new_queue(server, prefix=prefix)
        produced, trained, dropped = (set(q.records(r)) for r in ("produced", "trained", "dropped"))
        counters, version = q.counters(), q.version()
    finally:
        server.stop()
    assert produced_before <= produced and trained_before <= trained
    assert len(produced_before) < num_batches and len(trained_before) < len(trained)  # mid-run
    assert set(acked_before) <= trained_before
    assert len(pushed) == num_batches and set(pushed) == produced
    assert set(acked) == trained and len(acked) == len(trained)
    assert trained | dropped == produced
    assert counters["trained_batches"] == len(trained) and counters["pushed_batches"] == num_batches
    assert version == trainer.step == len(acked)
