"""``examples/reward_model/rlhf_cold_start.py`` runs end to end in every training mode
(tiny budgets) against the session's real reward server, which serves the same initial
tiny reward model the example builds. Afterwards the server serves the mirror's weights
again (the other modules compare against it)."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from tests.vllm_reward.helpers import API_KEY, MAX_ABS_SCORE_DIFF, max_abs_diff  # noqa: E402

from ludic.inference.vllm.reward_client import VLLMRewardClient  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reward_model" / "rlhf_cold_start.py"


def _load():
    spec = importlib.util.spec_from_file_location("rlhf_cold_start", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["rlhf_cold_start"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode", ["head_only", "lora", "full"])
def test_rlhf_cold_start_runs_in_every_mode(served_reward, capsys, mode: str) -> None:
    example = _load()
    args = example.Args(
        mode=mode,
        rm_steps=4,
        publish_every=3,
        sft_steps=2,
        rl_steps=2,
        prompts_per_step=2,
        group_size=2,
        reward_url=served_reward.url,
        reward_api_key=API_KEY,
    )
    try:
        example.main(args)
    finally:
        _serve_the_mirror_again(served_reward)
    out = capsys.readouterr().out
    assert f"reward model ({mode}): held-out pairwise accuracy" in out
    # Published after step 3 and after the last step (4): the server serves step 4.
    gap = re.search(r"reward server at version 4: max \|served - trained\| score (\S+)", out)
    assert gap is not None, out
    assert float(gap.group(1)) <= MAX_ABS_SCORE_DIFF
    assert "policy RL on reward-model scores (2 steps)" in out


def _serve_the_mirror_again(served_reward) -> None:
    client = VLLMRewardClient(served_reward.url, api_key=API_KEY, timeout_s=60.0)
    try:
        client.init_weight_sync()
        client.sync_weights(served_reward.mirror.state_dict(), training_mode="full")
        texts = ["1+1=\n2", "some text"]
        served = asyncio.run(client.score_batch(texts, normalize=False))
        assert max_abs_diff(served, served_reward.reference(texts)) <= MAX_ABS_SCORE_DIFF
    finally:
        client.close()
