"""Pushing trainer weights to inference runtimes."""

from __future__ import annotations

from ludic._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "PolicyPublisher": "ludic.distributed.interfaces",
    "ClientPolicyPublisher": "ludic.distributed.publisher",
    "InMemoryPublisher": "ludic.distributed.publisher",
    "RewardModelPublisher": "ludic.distributed.reward_publisher",
    "create_reward_publisher": "ludic.distributed.reward_publisher",
    "reward_model_state_dict": "ludic.distributed.reward_publisher",
    "reward_sync_params": "ludic.distributed.reward_publisher",
    "check_finite": "ludic.distributed.weights",
    "policy_state_dict": "ludic.distributed.weights",
}

__getattr__, __all__ = lazy_exports(__name__, globals(), _EXPORTS)
