"""`ludic train` with `task: reward_model` and a reward server: the job starts a real vLLM
reward server on the initial model, publishes every `publish_every` steps and after the
last one, and the server ends up scoring exactly like the trained model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from ludic import jobs  # noqa: E402
from ludic.run.loading import load_config  # noqa: E402

CONFIG = Path(__file__).parents[2] / "examples" / "configs" / "reward_model_tiny.yaml"


@pytest.mark.parametrize("mode", ["lora"])
def test_reward_model_training_keeps_the_reward_server_in_sync(tmp_path: Path, mode: str):
    config = load_config(
        CONFIG,
        [
            f"output_dir={tmp_path}",
            f"reward_model.training_mode={mode}",
            "reward_model.steps=5",
            "reward_model.publish_every=2",
            "reward_model.server.timeout_s=120",
            "reward_model.data.synthetic.num_pairs=64",
            "reward_model.data.eval_size=8",
            "reward_model.eval_every=0",
        ],
    )
    run_dir = jobs.train(config)

    summary = json.loads((run_dir / "summary.json").read_text())
    # Published after steps 2 and 4, then after the last step (5), which it now serves.
    assert summary["server_model_version"] == 5
    assert summary["server_max_abs_score_diff"] <= 1e-4
    assert (run_dir / "vllm_reward_server.log").is_file()
