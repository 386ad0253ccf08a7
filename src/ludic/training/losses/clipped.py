"""Clipped importance-ratio surrogates: PPO/GRPO per token, GSPO per sequence, GMPO.

All three read behaviour logprobs ``old_logprobs`` [B, T-1] and form the importance
ratio r_t = pi_theta / pi_old = exp(logp_t - old_logp_t) on action tokens (off-mask log
ratios are forced to 0, so off-mask ratios are exactly 1). The log-ratio that is
exponentiated (per token, or the per-sequence mean for GSPO/GMPO) is first clamped to
+-``log_ratio_clamp`` (``clamped_exp``), so no ratio overflows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ludic.training.losses.base import (
    LOG_RATIO_CLAMP,
    LossInputs,
    LossOutput,
    TokenAggregation,
    aggregate_sequences,
    aggregate_tokens,
    check_aggregation,
    check_clip_eps,
    check_dual_clip_c,
    check_log_ratio_clamp,
    clamped_exp,
    masked_mean,
    require_old_logprobs,
)


def clipped_token_objective(
    ratio: torch.Tensor,
    advantage: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-token PPO loss and which bound is active.

    ``ratio`` [B, T-1], ``advantage`` [B, 1] (broadcast over tokens).
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


def _masked_log_ratio(inputs: LossInputs, owner: str) -> torch.Tensor:
    """log(pi_theta / pi_old) [B, T-1] on action tokens, 0.0 elsewhere."""
    old = require_old_logprobs(inputs, owner)
    return (inputs.logprobs - old) * inputs.action_mask


def _sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean [B] of ``values`` [B, T-1] over each row's action tokens."""
    return (values * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)


def clipped_token_stats(
    loss: torch.Tensor,
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    clip_active: torch.Tensor,
    dual_active: torch.Tensor | None,
    log_ratio_clamp: float,
) -> dict[str, float]:
    """The stats of a per-token clipped surrogate: loss, ratio_mean, clip_frac, approx_kl
    (k3 estimate of KL(pi_old || pi_theta) on the clamped log-ratio) and, with dual clip,
    dual_clip_frac."""
    with torch.no_grad():
        k3 = (ratio - 1.0) - log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    stats = {
        "loss": float(loss.detach()),
        "ratio_mean": masked_mean(ratio, mask),
        "clip_frac": masked_mean(clip_active.to(mask.dtype), mask),
        "approx_kl": masked_mean(k3, mask),
    }
    if dual_active is not None:
        stats["dual_clip_frac"] = masked_mean(dual_active.to(mask.dtype), mask)
    return stats


@dataclass(frozen=True)
class TokenClippedSurrogateLoss:
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
    requires_ref_logprobs: ClassVar[bool] = False
    requires_proximal_logprobs: ClassVar[bool] = False
    requires_entropy: ClassVar[bool] = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        check_clip_eps(name, clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high)
        check_dual_clip_c(name, self.dual_clip_c)
        check_log_ratio_clamp(name, self.log_ratio_clamp)
        mode = check_aggregation(name, self.aggregation, self.constant_normalizer)
        object.__setattr__(self, "aggregation", mode)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        mask = inputs.action_mask
        log_ratio = _masked_log_ratio(inputs, type(self).__name__)
        ratio = clamped_exp(log_ratio, self.log_ratio_clamp)  # [B, T-1]
        adv = inputs.weights.unsqueeze(-1)  # [B, 1]
        per_token, clip_active, dual_active = clipped_token_objective(
            ratio, adv, self.clip_eps_low, self.clip_eps_high, self.dual_clip_c
        )
        loss = aggregate_tokens(
            per_token, inputs, self.aggregation, constant_normalizer=self.constant_normalizer
        )
        stats = clipped_token_stats(
            loss, ratio, log_ratio, mask, clip_active, dual_active, self.log_ratio_clamp
        )
        return LossOutput(loss=loss, stats=stats)


@dataclass(frozen=True)
class ClippedSurrogateLoss:
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
    requires_ref_logprobs: ClassVar[bool] = False
    requires_proximal_logprobs: ClassVar[bool] = False
    requires_entropy: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_clip_eps(
            "ClippedSurrogateLoss", clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high
        )
        check_log_ratio_clamp("ClippedSurrogateLoss", self.log_ratio_clamp)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        log_ratio = _masked_log_ratio(inputs, "ClippedSurrogateLoss")
        seq_log_ratio = _sequence_mean(log_ratio, inputs.action_mask)  # [B]
        seq_ratio = clamped_exp(seq_log_ratio, self.log_ratio_clamp)
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
    requires_ref_logprobs: ClassVar[bool] = False
    requires_proximal_logprobs: ClassVar[bool] = False
    requires_entropy: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_clip_eps("GMPOLoss", clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high)
        check_log_ratio_clamp("GMPOLoss", self.log_ratio_clamp)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        mask = inputs.action_mask
        log_ratio = _masked_log_ratio(inputs, "GMPOLoss")  # [B, T-1]
        clamped = log_ratio.clamp(-self.clip_eps_low, self.clip_eps_high)
        positive = (inputs.weights > 0).unsqueeze(-1)  # [B, 1]
        chosen = torch.where(
            positive, torch.minimum(log_ratio, clamped), torch.maximum(log_ratio, clamped)
        )
        mean_chosen = _sequence_mean(chosen, mask)  # [B]
        objective = inputs.weights * clamped_exp(mean_chosen, self.log_ratio_clamp)  # J_i
        loss = aggregate_sequences(-objective, inputs)
        with torch.no_grad():
            clip_active = (chosen != log_ratio).to(mask.dtype)
            geo_ratio = clamped_exp(_sequence_mean(log_ratio, mask), self.log_ratio_clamp)
        stats = {
            "loss": float(loss.detach()),
            "seq_ratio_mean": float(geo_ratio.float().mean()),
            "clip_frac": masked_mean(clip_active, mask),
        }
        return LossOutput(loss=loss, stats=stats)
