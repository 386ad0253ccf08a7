"""Publishing reward-model weights (docs/design.md, "Reward models"), per training mode.

What a sync in each mode carries, and under which names, is decided by
:mod:`ludic.distributed.reward_weights` (re-exported here). :class:`RewardModelPublisher` wraps
a ``BroadcastPolicyPublisher`` (the policy's extractor, sender and control plane) and announces
exactly the tensors it broadcasts, so announcement and payload cannot differ (a difference
would desynchronize the group).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ludic.distributed.interfaces import PolicyPublisher
from ludic.distributed.reward_weights import (
    HEAD_MODULES,
    PEFT_MARKERS,
    RewardModelTrainingMode,
    is_head,
    normalize_name,
    reward_model_state_dict,
    reward_sync_params,
)

__all__ = [
    "HEAD_MODULES",
    "PEFT_MARKERS",
    "RewardModelPublisher",
    "RewardModelTrainingMode",
    "create_reward_publisher",
    "is_head",
    "normalize_name",
    "reward_model_state_dict",
    "reward_sync_params",
]


class RewardModelPublisher:
    """Publishes reward-model weights through ``inner`` (normally the
    ``BroadcastPolicyPublisher`` of a :class:`VLLMRewardClient`), after
    :func:`reward_sync_params` has normalized and checked them."""

    def __init__(
        self,
        inner: PolicyPublisher,
        *,
        head_modules: Sequence[str] = HEAD_MODULES,
        training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
    ) -> None:
        self.inner = inner
        self.head_modules = tuple(head_modules)
        self.training_mode = RewardModelTrainingMode.parse(training_mode)

    def publish(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        *,
        training_mode: RewardModelTrainingMode | str | None = None,
    ) -> None:
        """Publish ``state_dict`` as reward-model ``version`` (``training_mode`` defaults
        to the one given at construction). Raises before anything is announced if the
        tensors do not fit the mode."""
        mode = self.training_mode if training_mode is None else training_mode
        params = reward_sync_params(state_dict, mode, head_modules=self.head_modules)
        self.inner.publish(params, version)


def create_reward_publisher(
    client: Any,
    *,
    head_modules: Sequence[str] = HEAD_MODULES,
    training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
    rank0_only: bool = False,
    rank: int = 0,
) -> PolicyPublisher:
    """A :class:`RewardModelPublisher` over ``client``'s weight-sync group (a
    :class:`~ludic.inference.vllm.reward_client.VLLMRewardClient` after
    ``init_weight_sync()``). ``rank0_only``: for multi-rank trainers, publish from
    ``rank`` 0 only (the others take part in gathering sharded weights)."""
    inner = getattr(client, "publisher", None)
    if inner is None:
        raise RuntimeError(
            "create_reward_publisher needs a client with a weight-sync group: call "
            "client.init_weight_sync() first"
        )
    publisher = RewardModelPublisher(inner, head_modules=head_modules, training_mode=training_mode)
    if rank0_only:
        from ludic.distributed.broadcast_publisher import Rank0OnlyPublisher

        return Rank0OnlyPublisher(publisher, rank)
    return publisher
