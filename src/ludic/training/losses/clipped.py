"""Clipped importance-ratio surrogates: PPO/GRPO per token, GSPO per sequence, GMPO.

All three read behaviour logprobs ``old_logprobs`` [B, T-1] and form the importance
ratio r_t = pi_theta / pi_old = exp(logp_t - old_logp_t) on action tokens (off-mask log
ratios are forced to 0, so off-mask ratios are exactly 1). The log-ratio that is
exponentiated (per token, or the per-sequence mean for GSPO/GMPO) is first clamped to
+-``log_ratio_clamp`` (``clamped_exp``), so no ratio overflows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ludic.training.losses.base import (
    LOG_RATIO_CLAMP,
    LossFlags,
    LossInputs,
    LossOutput,
    TokenAggregated,
    TokenAggregation,
    aggregate_sequences,
    check_ratio_loss,
    clamped_exp,
    loss_output,
    masked_mean,
    old_log_ratio,
)

if TYPE_CHECKING:
    from ludic.training.losses.decoupled import DecoupledClippedSurrogateLoss


def clipped_token_objective(
    ratio: torch.Tensor,
    advantage: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-token PPO loss and which bound is active.

    ``ratio`` [B, T-1], ``advantage`` [B, 1] (broadcast over tokens); GSPO passes per-sequence
    ``ratio`` and ``advantage`` [B].
    l_t = -min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A)   (arXiv:1707.06347, eq. 7),
    and with ``dual_clip_c`` = c, for A < 0 only: l_t = min(l_t, -c * A) (dual clip,
    Ye et al. 2020, arXiv:1912.09729), which bounds the loss of a token whose ratio exploded.
    Returns (l [B, T-1], clip_active [B, T-1] bool: the clipped branch wins the min,
    dual_active [B, T-1] bool or None: the dual bound wins).
    """
    unclipped = ratio * advantage
    clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantage
    per_token = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        clip_active = clipped < unclipped
    if dual_clip_c is None:
        return per_token, clip_active, None
    bound = -dual_clip_c * advantage  # [B, 1]; > 0 where A < 0
    negative = advantage < 0
    with torch.no_grad():
        dual_active = negative & (per_token > bound)
    per_token = torch.where(negative, torch.minimum(per_token, bound), per_token)
    return per_token, clip_active, dual_active


def _sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean [B] of ``values`` [B, T-1] over each row's action tokens."""
    return (values * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)


def clipped_token_surrogate(
    loss_fn: TokenClippedSurrogateLoss | DecoupledClippedSurrogateLoss,
    inputs: LossInputs,
    log_ratio: torch.Tensor,
    token_weight: torch.Tensor | None = None,
) -> LossOutput:
    """The per-token clipped surrogate of ``log_ratio`` [B, T-1] (0 off-mask) under
    ``loss_fn``'s clip range, dual clip, log-ratio clamp and aggregation, each token's loss
    times ``token_weight`` (no gradient) when given. Stats: loss, ratio_mean, clip_frac,
    approx_kl (k3 estimate of KL(pi_old || pi_theta) on the clamped log-ratio) and, with
    dual clip, dual_clip_frac."""
    mask, bound = inputs.action_mask, loss_fn.log_ratio_clamp
    ratio = clamped_exp(log_ratio, bound)  # [B, T-1]
    per_token, clip_active, dual_active = clipped_token_objective(
        ratio,
        inputs.weights.unsqueeze(-1),
        loss_fn.clip_eps_low,
        loss_fn.clip_eps_high,
        loss_fn.dual_clip_c,
    )
    if token_weight is not None:
        per_token = token_weight * per_token
    loss = loss_fn._aggregate(per_token, inputs)
    with torch.no_grad():
        k3 = (ratio - 1.0) - log_ratio.clamp(-bound, bound)
    out = loss_output(
        loss,
        ratio_mean=masked_mean(ratio, mask),
        clip_frac=masked_mean(clip_active.to(mask.dtype), mask),
        approx_kl=masked_mean(k3, mask),
    )
    if dual_active is not None:
        out.stats["dual_clip_frac"] = masked_mean(dual_active.to(mask.dtype), mask)
    return out


@dataclass(frozen=True)
class TokenClippedSurrogateLoss(TokenAggregated):
    """Per-token clipped surrogate: PPO (arXiv:1707.06347, eq. 7) as used by GRPO
    (arXiv:2402.03300, eq. 3) and Dr. GRPO (arXiv:2503.20783).

    l_t = -min(r_t * A_i, clip(r_t, 1 - eps_low, 1 + eps_high) * A_i),
    r_t = exp(clamp(logp_t - old_logp_t, -log_ratio_clamp, log_ratio_clamp)),
    with ``dual_clip_c`` = c (verl's ``clip_ratio_c``; dual-clip PPO, Ye et al. 2020,
    arXiv:1912.09729), for A_i < 0 only: l_t = min(l_t, -c * A_i);
    L = agg_t(l_t).
    ``aggregation``: SEQ_MEAN_TOKEN_MEAN (GRPO, the default), TOKEN_MEAN (DAPO) or
    CONSTANT with ``constant_normalizer`` = generation budget (Dr. GRPO).
    ``log_ratio_clamp``: bound on the log-ratio before exp (base ``LOG_RATIO_CLAMP``).
    Reads: logprobs, old_logprobs, action_mask [B, T-1]; weights [B] (advantages).
    Stats: loss, ratio_mean, clip_frac (action tokens where the clipped branch wins the
    min, i.e. whose gradient is zeroed), approx_kl (k3 estimate of KL(pi_old || pi_theta)),
    and with dual clip dual_clip_frac (action tokens held at -c * A).
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    aggregation: TokenAggregation = TokenAggregation.SEQ_MEAN_TOKEN_MEAN
    constant_normalizer: int | None = None
    dual_clip_c: float | None = None
    log_ratio_clamp: float = LOG_RATIO_CLAMP

    requires_old_logprobs: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_ratio_loss(self, type(self).__name__)
        self._check_aggregation(type(self).__name__)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        return clipped_token_surrogate(self, inputs, old_log_ratio(inputs, type(self).__name__))


@dataclass(frozen=True)
class ClippedSurrogateLoss(LossFlags):
    """Sequence-level clipped surrogate: GSPO (arXiv:2507.18071, the GSPO objective).

    s_i = exp( clamp(mean_t (logp_t - old_logp_t), -log_ratio_clamp, log_ratio_clamp) )
    over the action tokens of sequence i,
    L_i = -min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i),
    L = sum_i L_i / num_sequences (``aggregate_sequences``).
    Defaults eps_low=3e-4, eps_high=4e-4 are the paper's (sec. 5.1): sequence ratios sit
    much closer to 1 than token ratios, so the range is far tighter than PPO's 0.2.
    Reads: logprobs, old_logprobs, action_mask [B, T-1]; weights [B].
    Stats: loss, seq_ratio_mean, clip_frac (sequences whose clipped branch wins the min).
    """

    clip_eps_low: float = 3e-4
    clip_eps_high: float = 4e-4
    log_ratio_clamp: float = LOG_RATIO_CLAMP

    requires_old_logprobs: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_ratio_loss(self, "ClippedSurrogateLoss")

    def __call__(self, inputs: LossInputs) -> LossOutput:
        log_ratio = old_log_ratio(inputs, "ClippedSurrogateLoss")
        seq_log_ratio = _sequence_mean(log_ratio, inputs.action_mask)  # [B]
        seq_ratio = clamped_exp(seq_log_ratio, self.log_ratio_clamp)
        per_seq, clip_active, _ = clipped_token_objective(
            seq_ratio, inputs.weights, self.clip_eps_low, self.clip_eps_high
        )
        return loss_output(
            aggregate_sequences(per_seq, inputs),
            seq_ratio_mean=float(seq_ratio.detach().float().mean()),
            clip_frac=float(clip_active.float().mean()),
        )


@dataclass(frozen=True)
class GMPOLoss(LossFlags):
    """Geometric-Mean Policy Optimization, GMPO (arXiv:2507.20673, the GMPO objective).

    J_i = (prod_t min(r_t * A_i, clip(r_t, e^-eps_low, e^eps_high) * A_i))^(1/|o_i|) * sgn(A_i)
    computed in log space: with l_t = logp_t - old_logp_t and l_c = clamp(l_t, -eps_low,
    eps_high), c_t = min(l_t, l_c) if A_i > 0 else max(l_t, l_c), and
    J_i = A_i * exp( mean_t c_t )   (mean over the |o_i| action tokens of sequence i; the
    mean is clamped to +-``log_ratio_clamp`` before exp: for A_i < 0, c_t is unbounded above),
    L = -sum_i J_i / num_sequences (``aggregate_sequences``).
    Defaults eps_low = eps_high = 0.4 (ratio range (e^-0.4, e^0.4)), the paper's setting.
    Reads: logprobs, old_logprobs, action_mask [B, T-1]; weights [B].
    Stats: loss, seq_ratio_mean (unclipped geometric-mean ratio), clip_frac (action
    tokens where c_t != l_t).
    """

    clip_eps_low: float = 0.4
    clip_eps_high: float = 0.4
    log_ratio_clamp: float = LOG_RATIO_CLAMP

    requires_old_logprobs: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_ratio_loss(self, "GMPOLoss")

    def __call__(self, inputs: LossInputs) -> LossOutput:
        mask = inputs.action_mask
        log_ratio = old_log_ratio(inputs, "GMPOLoss")  # [B, T-1]
        clamped = log_ratio.clamp(-self.clip_eps_low, self.clip_eps_high)
        positive = (inputs.weights > 0).unsqueeze(-1)  # [B, 1]
        chosen = torch.where(
            positive, torch.minimum(log_ratio, clamped), torch.maximum(log_ratio, clamped)
        )
        mean_chosen = _sequence_mean(chosen, mask)  # [B]
        objective = inputs.weights * clamped_exp(mean_chosen, self.log_ratio_clamp)  # J_i
        with torch.no_grad():
            clip_active = (chosen != log_ratio).to(mask.dtype)
            geo_ratio = clamped_exp(_sequence_mean(log_ratio, mask), self.log_ratio_clamp)
        return loss_output(
            aggregate_sequences(-objective, inputs),
            seq_ratio_mean=float(geo_ratio.float().mean()),
            clip_frac=masked_mean(clip_active, mask),
        )
