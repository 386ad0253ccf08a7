"""Supervised fine-tuning: masked causal-LM cross-entropy on action tokens."""

from __future__ import annotations

from dataclasses import dataclass

from ludic.training.losses.base import (
    LossInputs,
    LossOutput,
    TokenAggregated,
    TokenAggregation,
    loss_output,
)


@dataclass(frozen=True)
class MaskedCausalLMCrossEntropyLoss(TokenAggregated):
    """Next-token cross-entropy (NLL) on action tokens only.

    L = -agg_t( logp_t ),  TOKEN_MEAN by default: -sum_{i,t in actions} logp_{i,t} / N_tok
    where N_tok = ``num_action_tokens`` of the whole optimizer step. ``weights`` are
    ignored on purpose: every demonstration counts once. For weighted imitation
    (AWR-style) use ``ReinforceLoss``, which equals this loss when every weight is 1.0.
    Reads: logprobs [B, T-1], action_mask [B, T-1].
    Stats: loss, nll (= loss under TOKEN_MEAN over this micro-batch), num_tokens.
    """

    aggregation: TokenAggregation = TokenAggregation.TOKEN_MEAN
    constant_normalizer: int | None = None

    def __post_init__(self) -> None:
        self._check_aggregation("MaskedCausalLMCrossEntropyLoss")

    def __call__(self, inputs: LossInputs) -> LossOutput:
        mask = inputs.action_mask
        num_tokens = float(mask.sum())
        nll = float(-(inputs.logprobs.detach() * mask).sum()) / max(num_tokens, 1.0)
        return loss_output(
            self._aggregate(-inputs.logprobs, inputs), nll=nll, num_tokens=num_tokens
        )
