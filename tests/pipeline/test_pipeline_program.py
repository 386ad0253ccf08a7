"""An agent program in pipeline mode: ``ludic train`` starts the learner and an actor; the
actor runs the program against its own endpoint and pushes the recorded calls' exact tokens
through Redis; the learner trains on them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from tests.run.test_program_job import program_config

from ludic import jobs

pytestmark = pytest.mark.redis


def test_an_agent_program_trains_in_pipeline_mode(
    redis_server, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = program_config(
        tmp_path,
        "trainer.mode=pipeline",
        "trainer.max_staleness=1",
        "pipeline.num_actors=1",
        f"pipeline.redis_url={redis_server.url}",
        f"pipeline.prefix=program-{time.monotonic_ns()}",
    )
    run_dir = jobs.train(config)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["phase"] == "rl"] == [1, 2]
    assert "pushed" in (run_dir / "logs" / "actor-0.log").read_text()
