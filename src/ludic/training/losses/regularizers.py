"""Regularizers added to a policy loss with ``CompositeLoss``: KL penalty, entropy bonus."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from ludic.training.losses.base import (
    LOG_RATIO_CLAMP,
    LossInputs,
    LossOutput,
    TokenAggregated,
    TokenAggregation,
    check_log_ratio_clamp,
    loss_output,
    masked_mean,
    require_old_logprobs,
    require_ref_logprobs,
    token_entropy,
)

KLEstimator = Literal["k1", "k2", "k3"]
KLReference = Literal["ref", "old"]
_ESTIMATORS = ("k1", "k2", "k3")
_REFERENCES = ("ref", "old")


def kl_estimate(
    log_rho: torch.Tensor, estimator: str, log_ratio_clamp: float = LOG_RATIO_CLAMP
) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled by pi_theta.

    ``log_rho`` = log(pi_ref / pi_theta) = ref_logp - logp per token (mask it first: 0.0
    off-mask gives an estimate of exactly 0 there).
    k1 = -log_rho, k2 = log_rho^2 / 2, k3 = exp(l) - 1 - l with
    l = clamp(log_rho, -log_ratio_clamp, log_ratio_clamp)
    (Schulman, http://joschu.net/blog/kl-approx.html; k3 is GRPO's, arXiv:2402.03300 eq. 4).
    Only k3 exponentiates, so only k3 is clamped: both of its terms use the clamped l, so a
    token beyond the bound adds a finite constant and no gradient (as verl's low_var_kl).
    """
    if estimator == "k1":
        return -log_rho
    if estimator == "k2":
        return 0.5 * log_rho**2
    if estimator == "k3":
        bounded = log_rho.clamp(-log_ratio_clamp, log_ratio_clamp)
        return torch.exp(bounded) - 1.0 - bounded
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {_ESTIMATORS}")


@dataclass(frozen=True)
class KLPenalty(TokenAggregated):
    """KL penalty towards a reference policy (Schulman's estimators,
    http://joschu.net/blog/kl-approx.html; GRPO uses k3 with beta=0.04, arXiv:2402.03300).

    L = beta * agg_t( k(logp_t, ref_logp_t) ),
    k1 = logp - ref,  k2 = (logp - ref)^2 / 2,  k3 = exp(l) - 1 - l,
    l = clamp(ref - logp, -log_ratio_clamp, log_ratio_clamp) (see ``kl_estimate``).
    ``reference="ref"`` reads ``ref_logprobs`` (a frozen reference model); ``"old"`` reads
    ``old_logprobs`` (the behaviour policy). The tokens come from the behaviour policy, so
    the estimate is exact on-policy and approximate off-policy.
    ``aggregation`` None (the default) follows the policy loss: in a ``CompositeLoss`` it
    takes the aggregation (and constant normalizer) of the first term that has one, so
    GRPO's KL is averaged per sequence like its surrogate (arXiv:2402.03300, eq. 3); on
    its own it is TOKEN_MEAN.
    Reads: logprobs, action_mask [B, T-1]; ref_logprobs or old_logprobs [B, T-1].
    Stats: loss, kl (unweighted estimate, micro-batch token mean).
    """

    beta: float
    estimator: KLEstimator = "k3"
    reference: KLReference = "ref"
    aggregation: TokenAggregation | None = None
    constant_normalizer: int | None = None
    log_ratio_clamp: float = LOG_RATIO_CLAMP

    def __post_init__(self) -> None:
        if not (self.beta >= 0 and self.beta < float("inf")):
            raise ValueError(f"KLPenalty: beta={self.beta!r}; expected a finite value >= 0")
        if self.estimator not in _ESTIMATORS:
            raise ValueError(
                f"KLPenalty: estimator={self.estimator!r}; expected one of {_ESTIMATORS}"
            )
        if self.reference not in _REFERENCES:
            raise ValueError(
                f"KLPenalty: reference={self.reference!r}; expected 'ref' (reference model) "
                "or 'old' (behaviour policy)"
            )
        check_log_ratio_clamp("KLPenalty", self.log_ratio_clamp)
        _check_follower_aggregation(self, "KLPenalty")

    @property
    def requires_ref_logprobs(self) -> bool:  # type: ignore[override]
        return self.reference == "ref"

    @property
    def requires_old_logprobs(self) -> bool:  # type: ignore[override]
        return self.reference == "old"

    def __call__(self, inputs: LossInputs) -> LossOutput:
        owner = f"KLPenalty(reference={self.reference!r})"
        if self.reference == "ref":
            ref = require_ref_logprobs(inputs, owner)
        else:
            ref = require_old_logprobs(inputs, owner)
        log_rho = (ref - inputs.logprobs) * inputs.action_mask  # 0.0 off-mask
        kl = kl_estimate(log_rho, self.estimator, self.log_ratio_clamp)  # [B, T-1]
        loss = self.beta * self._aggregate(kl, inputs)
        return loss_output(loss, kl=masked_mean(kl, inputs.action_mask))


@dataclass(frozen=True)
class EntropyBonus(TokenAggregated):
    """Entropy bonus (arXiv:1707.06347, eq. 9 uses c2 * S[pi]).

    L = -coef * agg_t( H_t ),  H_t = -sum_v p_t(v) log p_t(v)  (next-token entropy).
    Minimizing L raises the policy's entropy on action positions. ``aggregation`` None
    (the default) follows the policy loss in a ``CompositeLoss``, as for ``KLPenalty``;
    on its own it is TOKEN_MEAN.
    Reads: entropy [B, T-1] (else the entropy of logits [B, T, V]), action_mask [B, T-1].
    Stats: loss, entropy (micro-batch token mean).
    """

    coef: float
    aggregation: TokenAggregation | None = None
    constant_normalizer: int | None = None

    requires_entropy: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not (self.coef >= 0 and self.coef < float("inf")):
            raise ValueError(f"EntropyBonus: coef={self.coef!r}; expected a finite value >= 0")
        _check_follower_aggregation(self, "EntropyBonus")

    def __call__(self, inputs: LossInputs) -> LossOutput:
        entropy = token_entropy(inputs, "EntropyBonus")  # [B, T-1]
        loss = -self.coef * self._aggregate(entropy, inputs)
        return loss_output(loss, entropy=masked_mean(entropy, inputs.action_mask))


def _check_follower_aggregation(loss: KLPenalty | EntropyBonus, owner: str) -> None:
    """Validate ``aggregation`` / ``constant_normalizer``; None follows the policy loss."""
    if loss.aggregation is None:
        if loss.constant_normalizer is not None:
            raise ValueError(
                f"{owner}: constant_normalizer={loss.constant_normalizer} without "
                "aggregation='constant'; set both, or neither to follow the policy loss"
            )
        return
    loss._check_aggregation(owner)
