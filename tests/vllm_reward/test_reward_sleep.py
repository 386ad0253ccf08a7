"""Issue 27, item 2: reward servers that sleep between batches (``reward_loop.*.sleep``).

On a CUDA GPU with vLLM: a DisRM server started as the reward loop starts it (sleep mode,
and for ``reload_weights`` its model folder as a load root) frees GPU memory asleep, and
scores the same after each wake: level 1 from the weights kept in CPU memory, level 2
from the folder read again and verified against its checksums. Skipped without a GPU:
vLLM's sleep mode exists on CUDA only (the CPU refusals are in
``tests/run/test_reward_loop_job.py``; the loop's wake/score/sleep order, with a fake,
in ``tests/rewards/test_reward_loop.py``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed")

from tests.vllm.helpers import API_KEY  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="vLLM sleep mode frees GPU memory: CUDA only"
    ),
]

TEXTS = ["1+1=2", "2+2=5", "3+3=6"]


@pytest.mark.parametrize("setting", ["keep_weights", "reload_weights"])
def test_a_sleeping_reward_server_frees_the_gpu_and_scores_the_same_after_waking(
    tmp_path: Path, setting: str
) -> None:
    from ludic.inference.vllm.process import start_vllm_server
    from ludic.inference.vllm.reward_client import VLLMRewardClient
    from ludic.models.tiny import save_tiny_reward_model
    from ludic.run.reward_sleep import SLEEP_LEVELS, RewardServerSleep, sleep_server_args

    model = save_tiny_reward_model(tmp_path / "reward_model")
    server = start_vllm_server(
        model,
        kind="reward",
        api_key=API_KEY,
        extra_args=["--gpu-memory-utilization", "0.2", *sleep_server_args(setting, model)],
        cpu=False,
        log_path=tmp_path / "server.log",
    )
    client = VLLMRewardClient(server.url, api_key=API_KEY, timeout_s=120.0)
    servers = RewardServerSleep.start(
        [(server.url, SLEEP_LEVELS[setting], model)], api_key=API_KEY, timeout_s=120.0
    )
    try:
        before = asyncio.run(client.score_batch(TEXTS))
        free_awake, _ = torch.cuda.mem_get_info()
        servers.sleep_now()
        free_asleep, _ = torch.cuda.mem_get_info()
        assert free_asleep > free_awake  # its KV cache (and weights) left the GPU
        for _ in range(2):  # two batches' windows
            servers.wake_now()
            assert asyncio.run(client.score_batch(TEXTS)) == pytest.approx(before, abs=1e-5)
            servers.sleep_now()
    finally:
        servers.close()
        client.close()
        server.stop()
