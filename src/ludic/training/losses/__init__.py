"""Losses: ``Loss(inputs: LossInputs) -> LossOutput``, one module per family; every ratio is
``clamped_exp(log_ratio, log_ratio_clamp)``, default ``LOG_RATIO_CLAMP`` (``base``).

* ``policy_gradient``: ``ReinforceLoss``, ``CISPOLoss``
* ``clipped``: ``TokenClippedSurrogateLoss`` (PPO/GRPO), ``ClippedSurrogateLoss`` (GSPO),
  ``GMPOLoss``
* ``decoupled``: ``DecoupledClippedSurrogateLoss`` (decoupled PPO; truncated IS)
* ``sft``: ``MaskedCausalLMCrossEntropyLoss``; ``regularizers``: ``KLPenalty``, ``EntropyBonus``
* ``composite``: ``CompositeLoss``; ``bradley_terry``: ``BradleyTerryLoss`` (reward models)
"""

from ludic.training.losses.base import (
    LOG_RATIO_CLAMP,
    Loss,
    LossInputs,
    LossOutput,
    TokenAggregation,
    aggregate_sequences,
    aggregate_tokens,
    clamped_exp,
    masked_token_entropy,
)
from ludic.training.losses.bradley_terry import BradleyTerryLoss
from ludic.training.losses.clipped import (
    ClippedSurrogateLoss,
    GMPOLoss,
    TokenClippedSurrogateLoss,
)
from ludic.training.losses.composite import CompositeLoss
from ludic.training.losses.decoupled import DecoupledClippedSurrogateLoss
from ludic.training.losses.policy_gradient import CISPOLoss, ReinforceLoss
from ludic.training.losses.regularizers import EntropyBonus, KLPenalty, kl_estimate
from ludic.training.losses.sft import MaskedCausalLMCrossEntropyLoss

__all__ = [
    "LOG_RATIO_CLAMP",
    "BradleyTerryLoss",
    "CISPOLoss",
    "ClippedSurrogateLoss",
    "CompositeLoss",
    "DecoupledClippedSurrogateLoss",
    "EntropyBonus",
    "GMPOLoss",
    "KLPenalty",
    "Loss",
    "LossInputs",
    "LossOutput",
    "MaskedCausalLMCrossEntropyLoss",
    "ReinforceLoss",
    "TokenAggregation",
    "TokenClippedSurrogateLoss",
    "aggregate_sequences",
    "aggregate_tokens",
    "clamped_exp",
    "kl_estimate",
    "masked_token_entropy",
]
