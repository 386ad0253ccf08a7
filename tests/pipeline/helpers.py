"""Real redis-server processes and queues for the pipeline tests (tests/pipeline, tests/faults)."""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from ludic.pipeline.redis_queue import RedisBatchQueue
from ludic.pipeline.redis_server import RedisServer, start_redis_server

_prefixes = itertools.count()


def require_redis_server() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; make test does)")


def running_redis(data_dir: Path) -> Iterator[RedisServer]:
    """A redis-server with an fsync-always AOF in ``data_dir``, stopped afterwards."""
    require_redis_server()
    server = start_redis_server(data_dir)
    try:
        yield server
    finally:
        server.stop()


def new_queue(server: RedisServer, **kwargs) -> RedisBatchQueue:
    """A queue on a prefix no other test uses (several runs share one Redis)."""
    prefix = kwargs.pop("prefix", None) or f"test{next(_prefixes)}"
    kwargs.setdefault("block_s", 0.2)
    kwargs.setdefault("reconnect_timeout_s", 5.0)
    return RedisBatchQueue(server.url, prefix=prefix, **kwargs)


def rollout_source(num_rollouts: int = 2, completion: tuple[int, ...] = (4, 5)):
    """A real RolloutBatchSource on the fake one-step env/protocol of tests/rollouts/fakes."""
    from tests.rollouts.fakes import make_fakes

    from ludic.rollouts.engine import RolloutEngine
    from ludic.training.batching.synced_batching import RolloutBatchSource
    from ludic.training.types import EnvSpec, ProtocolSpec, RolloutRequest

    fakes = make_fakes()
    engine = RolloutEngine(
        {"fake": fakes.FakeEnv}, {"fake": lambda: fakes.FakeProtocol(completion=completion)}
    )

    def requests() -> list[RolloutRequest]:
        return [RolloutRequest(EnvSpec("fake"), ProtocolSpec("fake")) for _ in range(num_rollouts)]

    return RolloutBatchSource(engine, requests, fakes.TurnRewardCredit())
