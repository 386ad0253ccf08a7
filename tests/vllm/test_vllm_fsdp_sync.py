"""A data-parallel (FSDP2, two gloo ranks) trainer publishes to a real vLLM CPU server:
rank 0 gathers the sharded weights and syncs them every step; the server then serves
exactly the trained weights (greedy tokens and logprobs against a transformers mirror)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ludic.inference.vllm.client import VLLMChatClient

pytestmark = pytest.mark.vllm

WORKER = Path(__file__).parents[1] / "distributed" / "fsdp_worker.py"


def test_a_two_rank_fsdp_trainer_syncs_the_server_to_parity(served, tmp_path: Path) -> None:
    """Replaces the session client: the trainer ranks form the server's group meanwhile."""
    old = served.client
    old.close()  # leave the group: rank 0 of the trainer forms its own
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node=2", str(WORKER), str(tmp_path), "grpo", "float32"]
    command += ["--server", served.server.url]
    done = subprocess.run(
        command,
        env={**os.environ, "LUDIC_API_KEY": old.api_key},
        capture_output=True,
        text=True,
        timeout=300,
    )
    new = VLLMChatClient(served.server.url, api_key=old.api_key, timeout_s=60.0)
    new.init_weight_sync()
    served.client = new
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    result = torch.load(tmp_path / "result.pt", weights_only=True)
    assert new.get_policy_version() == 2  # one publish per trainer step, named by the step
    served.mirror.load_state_dict(result["weights"])
    served.assert_parity()
