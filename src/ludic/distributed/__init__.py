"""Pushing trainer weights to inference runtimes."""

from ludic.distributed.interfaces import PolicyPublisher
from ludic.distributed.publisher import ClientPolicyPublisher, InMemoryPublisher
from ludic.distributed.reward_publisher import (
    RewardModelPublisher,
    create_reward_publisher,
    reward_model_state_dict,
    reward_sync_params,
)
from ludic.distributed.weights import check_finite, policy_state_dict

__all__ = [
    "ClientPolicyPublisher",
    "InMemoryPublisher",
    "PolicyPublisher",
    "RewardModelPublisher",
    "create_reward_publisher",
    "reward_model_state_dict",
    "reward_sync_params",
    "check_finite",
    "policy_state_dict",
]
