"""Clipped importance-ratio surrogates: PPO/GRPO per token, GSPO per sequence, GMPO.

All three read behaviour logprobs ``old_logprobs`` [B, T-1] and form the importance
ratio r_t = pi_theta / pi_old = exp(logp_t - old_logp_t) on action tokens (off-mask log
ratios are forced to 0, so off-mask ratios are exactly 1 and never overflow).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ludic.training.losses.base import (
    LossInputs,
    LossOutput,
    TokenAggregation,
    aggregate_sequences,
    aggregate_tokens,
    check_aggregation,
    check_clip_eps,
    masked_mean,
    require_old_logprobs,
)


def _masked_log_ratio(inputs: LossInputs, owner: str) -> torch.Tensor:
    """log(pi_theta / pi_old) [B, T-1] on action tokens, 0.0 elsewhere."""
    old = require_old_logprobs(inputs, owner)
    return (inputs.logprobs - old) * inputs.action_mask


def _sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean [B] of ``values`` [B, T-1] over each row's action tokens."""
    return (values * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)


@dataclass(frozen=True)
class TokenClippedSurrogateLoss:
    """Per-token clipped surrogate: PPO (arXiv:1707.06347, eq. 7) as used by GRPO
    (arXiv:2402.03300, eq. 3) and Dr. GRPO (arXiv:2503.20783).

    L = agg_t( -min(r_t * A_i, clip(r_t, 1 - eps_low, 1 + eps_high) * A_i) ),
    r_t = exp(logp_t - old_logp_t).
    ``aggregation``: SEQ_MEAN_TOKEN_MEAN (GRPO, the default), TOKEN_MEAN (DAPO) or
    CONSTANT with ``constant_normalizer`` = generation budget (Dr. GRPO).
    Reads: logprobs, old_logprobs, action_mask [B, T-1]; weights [B] (advantages).
    Stats: loss, ratio_mean, clip_frac (action tokens where the clipped branch wins the
    min, i.e. whose gradient is zeroed), approx_kl (k3 estimate of KL(pi_old || pi_theta)).
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    aggregation: TokenAggregation = TokenAggregation.SEQ_MEAN_TOKEN_MEAN
    constant_normalizer: int | None = None

    requires_old_logprobs: ClassVar[bool] = True
    requires_ref_logprobs: ClassVar[bool] = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        check_clip_eps(name, clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high)
        mode = check_aggregation(name, self.aggregation, self.constant_normalizer)
        object.__setattr__(self, "aggregation", mode)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        mask = inputs.action_mask
        log_ratio = _masked_log_ratio(inputs, type(self).__name__)
        ratio = torch.exp(log_ratio)  # [B, T-1]
        adv = inputs.weights.unsqueeze(-1)  # [B, 1]
        unclipped = ratio * adv
        clipped = ratio.clamp(1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high) * adv
        per_token = -torch.minimum(unclipped, clipped)
        loss = aggregate_tokens(
            per_token, inputs, self.aggregation, constant_normalizer=self.constant_normalizer
        )
        with torch.no_grad():
            clip_active = (clipped < unclipped).to(mask.dtype)
            k3 = (ratio - 1.0) - log_ratio
        stats = {
            "loss": float(loss.detach()),
            "ratio_mean": masked_mean(ratio, mask),
            "clip_frac": masked_mean(clip_active, mask),
            "approx_kl": masked_mean(k3, mask),
        }
        return LossOutput(loss=loss, stats=stats)


@dataclass(frozen=True)
class ClippedSurrogateLoss:
    """Sequence-level clipped surrogate: GSPO (arXiv:2507.18071, the GSPO objective).

    s_i = exp( mean_t (logp_t - old_logp_t) )   over the action tokens of sequence i,
    L_i = -min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i),
    L = sum_i L_i / num_sequences (``aggregate_sequences``).
    Defaults eps_low=3e-4, eps_high=4e-4 are the paper's (sec. 5.1): sequence ratios sit
    much closer to 1 than token ratios, so the range is far tighter than PPO's 0.2.
    Reads: logprobs, old_logprobs, action_mask [B, T-1]; weights [B].
    Stats: loss, seq_ratio_mean, clip_frac (sequences whose clipped branch wins the min).
    """

    clip_eps_low: float = 3e-4
    clip_eps_high: float = 4e-4

    requires_old_logprobs: ClassVar[bool] = True
    requires_ref_logprobs: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_clip_eps(
            "ClippedSurrogateLoss", clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high
        )

    def __call__(self, inputs: LossInputs) -> LossOutput:
        log_ratio = _masked_log_ratio(inputs, "ClippedSurrogateLoss")
        seq_ratio = torch.exp(_sequence_mean(log_ratio, inputs.action_mask))  # [B]
        adv = inputs.weights
        unclipped = seq_ratio * adv
        clipped = seq_ratio.clamp(1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high) * adv
        per_seq = -torch.minimum(unclipped, clipped)  # [B]
        loss = aggregate_sequences(per_seq, inputs)
        with torch.no_grad():
            clip_frac = float((clipped < unclipped).float().mean())
        stats = {
            "loss": float(loss.detach()),
            "seq_ratio_mean": float(seq_ratio.detach().float().mean()),
            "clip_frac": clip_frac,
        }
        return LossOutput(loss=loss, stats=stats)


@dataclass(frozen=True)
class GMPOLoss:
    """Geometric-Mean Policy Optimization, GMPO (arXiv:2507.20673, the GMPO objective).

    J_i = (prod_t min(r_t * A_i, clip(r_t, e^-eps_low, e^eps_high) * A_i))^(1/|o_i|) * sgn(A_i)
    computed in log space: with l_t = logp_t - old_logp_t and l_c = clamp(l_t, -eps_low,
    eps_high), c_t = min(l_t, l_c) if A_i > 0 else max(l_t, l_c), and
    J_i = A_i * exp( mean_t c_t )   (mean over the |o_i| action tokens of sequence i),
    L = -sum_i J_i / num_sequences (``aggregate_sequences``).
    Defaults eps_low = eps_high = 0.4 (ratio range (e^-0.4, e^0.4)), the paper's setting.
    Reads: logprobs, old_logprobs, action_mask [B, T-1]; weights [B].
    Stats: loss, seq_ratio_mean (unclipped geometric-mean ratio), clip_frac (action
    tokens where c_t != l_t).
    """

    clip_eps_low: float = 0.4
    clip_eps_high: float = 0.4

    requires_old_logprobs: ClassVar[bool] = True
    requires_ref_logprobs: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_clip_eps("GMPOLoss", clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        mask = inputs.action_mask
        log_ratio = _masked_log_ratio(inputs, "GMPOLoss")  # [B, T-1]
        clamped = log_ratio.clamp(-self.clip_eps_low, self.clip_eps_high)
        positive = (inputs.weights > 0).unsqueeze(-1)  # [B, 1]
        chosen = torch.where(
            positive, torch.minimum(log_ratio, clamped), torch.maximum(log_ratio, clamped)
        )
        objective = inputs.weights * torch.exp(_sequence_mean(chosen, mask))  # J_i, [B]
        loss = aggregate_sequences(-objective, inputs)
        with torch.no_grad():
            clip_active = (chosen != log_ratio).to(mask.dtype)
            geo_ratio = torch.exp(_sequence_mean(log_ratio, mask))
        stats = {
            "loss": float(loss.detach()),
            "seq_ratio_mean": float(geo_ratio.float().mean()),
            "clip_frac": masked_mean(clip_active, mask),
        }
        return LossOutput(loss=loss, stats=stats)
