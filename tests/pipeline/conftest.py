"""One real redis-server for the module's pipeline tests; each test uses its own prefix."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tests.pipeline.helpers import running_redis

from ludic.pipeline.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    yield from running_redis(tmp_path_factory.mktemp("redis"))
