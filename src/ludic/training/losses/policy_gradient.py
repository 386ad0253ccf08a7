"""Log-likelihood policy-gradient losses: REINFORCE and CISPO.

Both are ``-agg_t(coef_t * logp_t)`` with a coefficient that carries no gradient: the
advantage for REINFORCE, the truncated importance weight times the advantage for CISPO.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ludic.training.losses.base import (
    LOG_RATIO_CLAMP,
    LossInputs,
    LossOutput,
    TokenAggregated,
    TokenAggregation,
    check_ratio_loss,
    clamped_exp,
    loss_output,
    masked_mean,
    old_log_ratio,
)


@dataclass(frozen=True)
class ReinforceLoss(TokenAggregated):
    """REINFORCE (Williams 1992), the score-function policy gradient.

    L = -agg_t( A_i * logp_t )
    where A_i = ``weights[i]`` (return, advantage or 1.0) and agg_t is ``aggregation``
    over action tokens. With A_i = 1 and TOKEN_MEAN this is the token-mean NLL (SFT). A
    baseline is subtracted upstream (credit assigner or ``BatchMeanBaseline``).
    Reads: logprobs [B, T-1], action_mask [B, T-1], weights [B].
    Stats: loss, logp_mean (action tokens), weight_mean (micro-batch).
    """

    aggregation: TokenAggregation = TokenAggregation.TOKEN_MEAN
    constant_normalizer: int | None = None

    def __post_init__(self) -> None:
        self._check_aggregation("ReinforceLoss")

    def __call__(self, inputs: LossInputs) -> LossOutput:
        per_token = -inputs.weights.unsqueeze(-1) * inputs.logprobs  # [B, T-1]
        return loss_output(
            self._aggregate(per_token, inputs),
            logp_mean=masked_mean(inputs.logprobs, inputs.action_mask),
            weight_mean=float(inputs.weights.detach().float().mean()),
        )


@dataclass(frozen=True)
class CISPOLoss(TokenAggregated):
    """CISPO: clipped importance-sampling-weight policy optimization (MiniMax-M1,
    arXiv:2506.13585, eq. 4).

    L = -agg_t( sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_i * logp_t ),
    r_t = exp(clamp(logp_t - old_logp_t, -log_ratio_clamp, log_ratio_clamp)),
    sg = stop-gradient (the clamp only keeps the ratio and its stats finite).
    Unlike PPO no token loses its gradient: the IS weight is truncated, not the update.
    ``clip_eps_low=None`` imposes no lower bound (the paper's setting: "we did not impose
    a lower bound ... only tuned eps_high"). The paper does not publish eps_high; the
    default 0.28 is the clip-higher value of DAPO (arXiv:2503.14476) that verl-style
    CISPO implementations use. Aggregation TOKEN_MEAN (eq. 4 divides by sum_i |o_i|).
    Reads: logprobs, old_logprobs, action_mask [B, T-1]; weights [B].
    Stats: loss, ratio_mean, clip_frac (tokens whose weight was truncated).
    """

    clip_eps_low: float | None = None
    clip_eps_high: float = 0.28
    aggregation: TokenAggregation = TokenAggregation.TOKEN_MEAN
    constant_normalizer: int | None = None
    log_ratio_clamp: float = LOG_RATIO_CLAMP

    requires_old_logprobs: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_ratio_loss(self, "CISPOLoss", nullable=("clip_eps_low",))
        self._check_aggregation("CISPOLoss")

    def __call__(self, inputs: LossInputs) -> LossOutput:
        mask = inputs.action_mask
        with torch.no_grad():  # ratio 1 off-mask
            ratio = clamped_exp(old_log_ratio(inputs, "CISPOLoss"), self.log_ratio_clamp)
            low = None if self.clip_eps_low is None else 1.0 - self.clip_eps_low
            is_weight = ratio.clamp(min=low, max=1.0 + self.clip_eps_high)
            clipped = (is_weight != ratio).to(mask.dtype)
        per_token = -is_weight * inputs.weights.unsqueeze(-1) * inputs.logprobs
        return loss_output(
            self._aggregate(per_token, inputs),
            ratio_mean=masked_mean(ratio, mask),
            clip_frac=masked_mean(clipped, mask),
        )
