"""A policy server and a reward server side by side (docs/design.md, "Reward models"): different HTTP
ports and different weight-sync groups, each synced by its own client, neither disturbing
the other. Uses the session's policy server (``served``, tests/conftest.py) and reward
server (``served_reward``)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import torch  # noqa: E402
from tests.vllm_reward.helpers import API_KEY, MAX_ABS_SCORE_DIFF, max_abs_diff  # noqa: E402

from ludic.inference.vllm.reward_client import VLLMRewardClient  # noqa: E402

TEXTS = ["2+2=\n4", "2+2=\n5"]


def test_a_reward_client_refuses_a_policy_server(served) -> None:
    with pytest.raises(ValueError, match="is a 'policy' server, not a reward model server"):
        VLLMRewardClient(served.server.url, api_key="ludic-test-key")


def test_policy_and_reward_servers_sync_independently(served, served_reward) -> None:
    assert served.server.url != served_reward.url
    rm = VLLMRewardClient(served_reward.url, api_key=API_KEY, timeout_s=60.0)
    try:
        rm.init_weight_sync()  # a second group, on its own free rendezvous port
        policy_version = served.client.get_policy_version()
        reward_version = asyncio.run(rm.get_model_version())

        # Reward head changes; the policy server is untouched.
        head = served_reward.mirror.score.weight.detach().clone()
        new_head = head + 0.3 * torch.randn(head.shape, generator=torch.Generator().manual_seed(5))
        rm.sync_weights(
            {"score.weight": new_head}, version=reward_version + 10, training_mode="head_only"
        )
        assert served.client.get_policy_version() == policy_version
        served.assert_parity()

        # Policy weights change; the reward server keeps its new head.
        with torch.no_grad():
            served.mirror.model.norm.weight.mul_(1.5)
        served.client.sync_weights(
            {"model.norm.weight": served.mirror.model.norm.weight}, version=policy_version + 1
        )
        served.assert_parity()
        assert served.client.get_policy_version() == policy_version + 1
        assert asyncio.run(rm.get_model_version()) == reward_version + 10

        with torch.no_grad():
            served_reward.mirror.score.weight.copy_(new_head)
        try:
            scores = asyncio.run(rm.score_batch(TEXTS, normalize=False))
            assert max_abs_diff(scores, served_reward.reference(TEXTS)) <= MAX_ABS_SCORE_DIFF
        finally:  # the other reward modules expect the original head
            with torch.no_grad():
                served_reward.mirror.score.weight.copy_(head)
            rm.sync_weights({"score.weight": head}, training_mode="head_only")
    finally:
        rm.close()
