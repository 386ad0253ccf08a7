"""`ludic train` with the vLLM backend: a real server, weights synced every step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ludic.run import job
from ludic.run.loading import load_config

pytestmark = pytest.mark.vllm

DEMO = Path(job.__file__).parents[1] / "configs" / "arithmetic_demo.yaml"


def test_train_with_the_vllm_backend_syncs_every_step(tmp_path: Path) -> None:
    config = load_config(
        DEMO,
        [
            f"output_dir={tmp_path}",
            "inference.backend=vllm",
            "warm_start.steps=3",
            "warm_start.num_demos=8",
            "warm_start.batch_size=8",
            "trainer.steps=3",
            "trainer.prompts_per_step=2",
            "algorithm.group_size=2",
            "eval.num_problems=4",
            "logging.console_every=1",
            "env.kwargs.num_problems=8",
        ],
    )
    run_dir = job.train(config)

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in lines if r["phase"] == "rl"]
    assert [r["policy_version"] for r in rl] == [1, 2, 3]
    # Step k's rollouts were sampled by the server holding version k-1: the trainer
    # published after the warm start (version 0) and after every step.
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    for sample in samples:
        versions = {s["trace"]["policy_version"] for s in sample["steps"] if s["kind"] == "agent"}
        assert versions == {sample["step"] - 1}
    assert (run_dir / "vllm_server.log").is_file()
