"""Live weight sync into the reward server: the policy server's worker extension
(``WeightSyncWorkerExtension``) loads a pooling model's ``score`` head alone and the whole
model, and ``/score`` then matches transformers on the new weights.

The trainer side is ``VLLMRewardClient``, whose weight sync is the policy client's (one
``WeightSyncSession``, one control plane for both servers)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import httpx  # noqa: E402
import torch  # noqa: E402
from tests.vllm_reward.helpers import API_KEY, MAX_ABS_SCORE_DIFF, max_abs_diff  # noqa: E402

from ludic.inference.vllm.reward_client import VLLMRewardClient  # noqa: E402

TEXTS = ["a", "Is 2 + 3 = 5? Yes.", "The quick brown fox jumps over the lazy dog. " * 4]


def _perturb(tensors, scale: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in tensors:
            t.add_(scale * torch.randn(t.shape, generator=generator))


def test_head_only_then_full_sync_update_the_scores(served_reward):
    """Each sync verified: the checksums, and the canary (the server's raw score of fixed
    tokens against the trained model's); a canary of other weights fails naming it."""
    import copy

    from ludic.distributed.weight_transfer.verify import SyncVerificationError
    from ludic.inference.vllm.canary import RewardCanary

    mirror = served_reward.mirror
    client = VLLMRewardClient(served_reward.url, api_key=API_KEY, timeout_s=60.0)
    try:
        client.init_weight_sync(master_port=served_reward.server.group_port)
        client.set_canary(RewardCanary(mirror), every=1)
        before = served_reward.scores(TEXTS, normalize=False)

        _perturb([mirror.score.weight], scale=0.5, seed=1)
        client.sync_weights(
            {"score.weight": mirror.score.weight}, version=7, training_mode="head_only"
        )
        after_head = served_reward.scores(TEXTS, normalize=False)
        assert max_abs_diff(after_head, before) > 1e-2  # the head really changed
        assert max_abs_diff(after_head, served_reward.reference(TEXTS)) <= MAX_ABS_SCORE_DIFF
        assert client.control.runtime_version() == 7
        # verified (the default): the server's report covers the head as received and loaded
        assert client.weight_sync.verified == 1
        (report,) = client.control.weight_report()["workers"]
        assert set(report["received"]) == {"score.weight"}
        head = report["loaded"]["score.weight"]
        assert head["checksum"] == head["expected"]

        _perturb(list(mirror.parameters()), scale=0.02, seed=2)
        client.sync_weights(mirror.state_dict(), version=8, training_mode="full")
        response = served_reward.post_score({"input": TEXTS, "normalize": False})
        scores = [d["score"] for d in response.json()["data"]]
        assert max_abs_diff(scores, after_head) > 1e-3
        assert max_abs_diff(scores, served_reward.reference(TEXTS)) <= MAX_ABS_SCORE_DIFF
        assert response.headers["x-ludic-policy-version"] == "8"
        assert httpx.get(f"{served_reward.url}/health").json()["version"] == 8
        assert client.weight_sync.verified == 2
        (report,) = client.control.weight_report()["workers"]
        loaded_parts = {p for entry in report["loaded"].values() for p in entry["parts"]}
        assert loaded_parts == set(mirror.state_dict()) - set(report["unverified"])
        assert [version for version, _ in client.weight_sync.canary_diffs] == [7, 8]

        other = copy.deepcopy(mirror)  # a trainer whose weights the server does not run
        _perturb([other.score.weight], scale=0.5, seed=3)
        client.set_canary(RewardCanary(other), every=1)
        with pytest.raises(SyncVerificationError, match="canary's 24 tokens have score"):
            client.sync_weights(
                {"score.weight": mirror.score.weight}, version=9, training_mode="head_only"
            )
    finally:
        client.close()
