"""Pushing trainer weights to inference runtimes."""

from ludic.distributed.interfaces import PolicyPublisher
from ludic.distributed.publisher import ClientPolicyPublisher, InMemoryPublisher
from ludic.distributed.weights import check_finite, policy_state_dict

__all__ = [
    "ClientPolicyPublisher",
    "InMemoryPublisher",
    "PolicyPublisher",
    "check_finite",
    "policy_state_dict",
]
