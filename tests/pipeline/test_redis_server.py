"""``ludic learner --run-dir rel/path``: the run directory and its Redis data folder are
made absolute (redis-server changes into ``--dir`` before it opens its log file, so a
relative path named a file that did not exist)."""

from __future__ import annotations

import pytest
from tests.pipeline.helpers import require_redis_server

from ludic.pipeline.redis_keys import redis
from ludic.pipeline.redis_server import start_redis_server
from ludic.pipeline.run_info import open_learner_run
from ludic.run.loading import load_config

pytestmark = pytest.mark.redis


def test_a_relative_data_dir_starts_redis(tmp_path, monkeypatch) -> None:
    require_redis_server()
    monkeypatch.chdir(tmp_path)
    server = start_redis_server("run/redis")
    try:
        assert redis.Redis(host=server.host, port=server.port).ping()
        assert (tmp_path / "run" / "redis" / "redis.log").is_file()
    finally:
        server.stop()


def test_a_relative_learner_run_dir_is_made_absolute(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    run, _ = open_learner_run(load_config(None, ["trainer.mode=pipeline"]), "runs/r")
    assert run.path == tmp_path / "runs" / "r"
    assert run.config_path.is_file()
