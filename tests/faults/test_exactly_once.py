"""Exactly once in pipeline mode, as a user runs it: ``ludic train`` (a local redis-server,
a learner and two actors), the learner killed with SIGKILL at random moments, then
``ludic train --resume RUN_DIR``, five times over, then resumed to the end. Every step's
batch index is trained exactly once in the final run (the updates a kill lost are trained
again from the checkpoint, their first records undone), every step has one metrics line,
and every batch an actor produced is trained, dropped or left unused with its reason."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
from tests.faults.helpers import launch, records, run_dir, steps
from tests.pipeline.helpers import require_redis_server

from ludic.pipeline.redis_queue import RedisBatchQueue
from ludic.pipeline.redis_server import start_redis_server

pytestmark = [pytest.mark.redis, pytest.mark.slow]

STEPS = 30
KILLS = 5
PIPELINE = [
    "trainer.mode=pipeline",
    "pipeline.num_actors=2",
    "warm_start.steps=0",
    f"trainer.steps={STEPS}",
    "trainer.checkpoint_every=3",
    "trainer.checkpoint_policy=false",
    "pipeline.reconnect_timeout_s=10",
]


def _learner(parent: subprocess.Popen) -> psutil.Process | None:
    for child in psutil.Process(parent.pid).children(recursive=True):
        try:
            if "learner" in child.cmdline()[3:5]:
                return child
        except psutil.Error:
            continue
    return None


def _kill_learner_at_a_random_moment(
    out: Path, parent: subprocess.Popen, after_step: int, delay_s: float
) -> int:
    """Once the run has logged RL step ``after_step``, wait ``delay_s`` (mid-step, mid-ack
    or mid-checkpoint), SIGKILL the learner and wait for the run to end; returns the last
    step logged before the kill."""
    deadline = time.monotonic() + 240
    while True:
        run = run_dir(out)
        if run is not None and steps(run, "rl") and max(steps(run, "rl")) >= after_step:
            break
        assert parent.poll() is None, f"the run ended ({parent.returncode}) before the kill"
        assert time.monotonic() < deadline, "no RL step in 240 s"
        time.sleep(0.01)
    time.sleep(delay_s)
    learner = _learner(parent)
    assert learner is not None
    last = max(steps(run, "rl"))
    learner.kill()
    family = psutil.Process(parent.pid).children(recursive=True)
    assert parent.wait(timeout=120) != 0  # the learner failed: `ludic train` says so
    _gone, alive = psutil.wait_procs(family, timeout=30)
    assert alive == [], [p.cmdline() for p in alive]
    return last


def test_learner_sigkilled_at_random_moments_trains_every_batch_exactly_once(
    tmp_path: Path,
) -> None:
    require_redis_server()
    rng = random.Random(20261126)
    kills: list[tuple[int, float, int]] = []
    run = None
    after = 1
    for _ in range(KILLS):
        parent = launch(tmp_path, *PIPELINE, resume=run)
        try:
            delay = rng.uniform(0.0, 0.2)  # a step takes ~0.1-0.3 s here
            last = _kill_learner_at_a_random_moment(tmp_path, parent, after, delay)
        finally:
            if parent.poll() is None:
                os.killpg(parent.pid, signal.SIGKILL)
        run = run_dir(tmp_path)
        kills.append((after, round(delay, 2), last))
        after = min(last + rng.randint(1, 3), STEPS - 6)
    parent = launch(tmp_path, *PIPELINE, resume=run)
    assert parent.wait(timeout=600) == 0, (tmp_path / "stderr5.txt").read_text()[-3000:]
    assert run is not None
    print(f"kills (after step, delay s, last step logged): {kills}")

    # one metrics line per step, whatever was killed when
    assert steps(run, "rl") == list(range(1, STEPS + 1)), kills

    server = start_redis_server(run / "redis")  # what the run's Redis kept (AOF)
    try:
        q = RedisBatchQueue(server.url, prefix=run.name, reconnect_timeout_s=5.0)
        trained = q.records("trained")
        indices = Counter(r["batch_index"] for r in trained.values())
        assert len(trained) == STEPS and max(indices.values()) == 1, (indices, kills)
        assert sorted(r["version"] for r in trained.values()) == list(range(1, STEPS + 1))
        produced = q.records("produced")
        finished = {**trained, **q.records("dropped"), **q.records("dead"), **q.records("unused")}
        assert set(produced) <= set(finished) | set(q.client.lrange(q.keys.queue, 0, -1))
        c = q.counters()
        assert c["trained_batches"] == STEPS
        assert c["retrained_batches"] >= 1, kills  # some kill lost trained updates
        assert q.client.llen(q.processing_key) == q.client.llen(q.uncommitted_key) == 0
        # each step trained the batch recorded for it: the metrics line names its index
        by_step = {r["step"]: r["batch/pipeline_batch_index"] for r in records(run, "rl")}
        assert by_step == {r["version"]: r["batch_index"] for r in trained.values()}
        print(json.dumps({"kills": len(kills), "retrained": c["retrained_batches"], **c}))
    finally:
        server.stop()
