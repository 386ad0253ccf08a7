"""Decoupled PPO: clip against the proximal policy, reweight by the behaviour policy.

Three policies score each action token: pi_behav sampled it (its logprobs are
``old_logprobs``, from the inference server), pi_prox is the trainer's policy at the start
of the optimizer step (``proximal_logprobs``, recomputed by the trainer without gradient),
and pi_theta is being optimized (``logprobs``).
"""

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
    check_ratio_loss,
    clamped_exp,
    masked_mean,
    require_old_logprobs,
    require_proximal_logprobs,
)
from ludic.training.losses.clipped import clipped_token_surrogate

BehaviourWeightMode = Literal["truncate", "mask"]
BEHAVIOUR_WEIGHT_MODES: tuple[str, ...] = ("truncate", "mask")


@dataclass(frozen=True)
class DecoupledClippedSurrogateLoss(TokenAggregated):
    """Decoupled PPO (AReaL, Fu et al. 2025, arXiv:2505.24298, the decoupled PPO objective).

    Per action token t of sequence i, with every log-ratio clamped to +-``log_ratio_clamp``
    before exp (``clamped_exp``):
      r_t = pi_theta / pi_prox = exp(logp_t - prox_logp_t)        (trust region, clipped)
      w_t = pi_prox / pi_behav = exp(prox_logp_t - old_logp_t)    (off-policy correction)
      w_t <- min(w_t, cap)            ``behaviour_weight_mode="truncate"``: truncated IS
                                      (Yao et al. 2025, "Your Efficient RL Framework
                                      Secretly Brings You Off-Policy RL Training")
      w_t <- w_t if w_t <= cap else 0 ``"mask"``: the token is dropped (AReaL)
      (cap = ``behaviour_weight_cap``; None leaves w_t uncapped)
      l_t = -w_t * min(r_t * A_i, clip(r_t, 1 - eps_low, 1 + eps_high) * A_i),
      with ``dual_clip_c`` = c, for A_i < 0: l_t = -w_t * max(min(r A, clip(r) A), c A)
      (dual clip, arXiv:1912.09729, as ``TokenClippedSurrogateLoss``);
      L = agg_t(l_t), TOKEN_MEAN by default (as AReaL). w_t carries no gradient.
    With pi_prox = pi_behav (w = 1) this is exactly ``TokenClippedSurrogateLoss``.

    Uses: (1) async / stale training: pi_behav is whatever version generated the token,
    pi_prox the step-start weights, so the clip range bounds each update and not the
    staleness. (2) Sync training with a train/inference mismatch (vLLM's logprobs differ
    from the trainer's for the same weights): pi_prox is the trainer's own recompute at
    step start and the capped w_t is the truncated importance-sampling correction
    (``make_grpo(truncated_is_cap=...)``).

    Reads: logprobs, old_logprobs (behaviour), proximal_logprobs, action_mask [B, T-1];
    weights [B] (advantages). ``requires_proximal_logprobs`` asks the trainer for
    ``proximal_logprobs``.
    Stats: loss, ratio_mean (r), clip_frac (action tokens where the clipped branch wins),
    behaviour_weight_mean (w after the cap), behaviour_weight_capped_frac (action tokens
    with w > cap), approx_kl (k3 estimate of KL(pi_prox || pi_theta)), and with dual clip
    dual_clip_frac.
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    behaviour_weight_cap: float | None = 5.0
    behaviour_weight_mode: BehaviourWeightMode = "mask"
    dual_clip_c: float | None = None
    aggregation: TokenAggregation = TokenAggregation.TOKEN_MEAN
    constant_normalizer: int | None = None
    log_ratio_clamp: float = LOG_RATIO_CLAMP

    requires_old_logprobs: ClassVar[bool] = True
    requires_proximal_logprobs: ClassVar[bool] = True

    def __post_init__(self) -> None:
        name = type(self).__name__
        check_ratio_loss(self, name)
        cap = self.behaviour_weight_cap
        if cap is not None and (isinstance(cap, bool) or not (1 <= cap < float("inf"))):
            raise ValueError(
                f"{name}: behaviour_weight_cap={cap!r}; expected a finite value >= 1 (an "
                "on-policy token has weight 1), e.g. 5.0, or None for no cap"
            )
        if self.behaviour_weight_mode not in BEHAVIOUR_WEIGHT_MODES:
            raise ValueError(
                f"{name}: behaviour_weight_mode={self.behaviour_weight_mode!r}; expected one "
                f"of {BEHAVIOUR_WEIGHT_MODES}"
            )
        self._check_aggregation(name)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        name = type(self).__name__
        mask = inputs.action_mask
        behaviour = require_old_logprobs(inputs, name)
        proximal = require_proximal_logprobs(inputs, name).detach()
        with torch.no_grad():
            weight = clamped_exp((proximal - behaviour) * mask, self.log_ratio_clamp)
            capped = torch.zeros_like(weight, dtype=torch.bool)
            if self.behaviour_weight_cap is not None:
                capped = weight > self.behaviour_weight_cap
                if self.behaviour_weight_mode == "truncate":
                    weight = weight.clamp(max=self.behaviour_weight_cap)
                else:
                    weight = torch.where(capped, torch.zeros_like(weight), weight)
        log_ratio = (inputs.logprobs - proximal) * mask  # log r, 0 off-mask
        out = clipped_token_surrogate(self, inputs, log_ratio, token_weight=weight)
        out.stats["behaviour_weight_mean"] = masked_mean(weight, mask)
        out.stats["behaviour_weight_capped_frac"] = masked_mean(capped.to(mask.dtype), mask)
        return out
