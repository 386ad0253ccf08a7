"""examples/pipeline_rl.py runs end to end on a tiny budget against a real redis-server."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pipeline_rl.py"

pytestmark = pytest.mark.redis


def test_pipeline_rl_example_smoke(redis_server, capsys) -> None:
    spec = importlib.util.spec_from_file_location("pipeline_rl", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    sys.modules["pipeline_rl"] = example  # dataclasses look their module up here
    spec.loader.exec_module(example)
    example.main(
        example.Args(
            steps=3, prompts_per_step=2, group_size=2, redis_url=redis_server.url, prefix="ex"
        )
    )
    out = capsys.readouterr().out
    assert "actor: pushed 3 batches" in out
    assert "trained 3 batches, dropped 0 whole batches" in out
    assert "policy version 3" in out
