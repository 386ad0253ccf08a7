"""A Redis for other nodes (``ludic launch``): password-protected, the password never shown.

``start_redis_server(host=..., password=...)`` passes ``requirepass`` on stdin (no process
list shows it); a client without it is refused; the queue works through the URL that
carries it, and every message, log line and RUN_DIR/pipeline.json shows it redacted.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
from tests.pipeline.helpers import require_redis_server

from ludic.pipeline.redis_keys import redis
from ludic.pipeline.redis_queue import RedisBatchQueue
from ludic.pipeline.redis_server import start_redis_server
from ludic.pipeline.redis_urls import redacted
from ludic.pipeline.run_info import write_pipeline_info
from ludic.run.run_dir import RunDirectory

pytestmark = pytest.mark.redis

PASSWORD = 'pa ss"wo\\rd@:/'


def test_a_password_protected_redis_refuses_strangers_and_hides_the_password(
    tmp_path: Path,
) -> None:
    require_redis_server()
    server = start_redis_server(tmp_path / "redis", password=PASSWORD)
    try:
        assert PASSWORD not in " ".join(psutil.Process(server.process.pid).cmdline())
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=server.host, port=server.port).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=server.host, port=server.port, password="wrong").ping()
        queue = RedisBatchQueue(server.url, prefix="auth", reconnect_timeout_s=1.0)
        try:
            queue.start_run()
            assert queue.learner_info() is None  # a working connection
            assert PASSWORD not in queue.url and ":***@" in queue.url
        finally:
            queue.close()
        run = RunDirectory(tmp_path / "run")
        run.path.mkdir()
        write_pipeline_info(run, server.url, "auth")
        info = json.loads((run.path / "pipeline.json").read_text())
        assert info["redis_url"] == f"redis://:***@127.0.0.1:{server.port}/0"
    finally:
        server.stop()


def test_redis_beyond_loopback_needs_a_password(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"host='10.1.2.3' exposes Redis .* give a password"):
        start_redis_server(tmp_path, host="10.1.2.3")


def test_redacted_keeps_everything_but_the_password() -> None:
    assert redacted("redis://:s3cret@10.0.0.1:6379/0") == "redis://:***@10.0.0.1:6379/0"
    assert redacted("redis://user:s3cret@host/2") == "redis://user:***@host/2"
    assert redacted("redis://10.0.0.1:6379/0") == "redis://10.0.0.1:6379/0"
