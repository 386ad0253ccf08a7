"""Pairwise preference loss for reward models: Bradley-Terry.

A reward model r scores a (prompt, response) text; a preference pair holds a chosen and a
rejected response to the same prompt. Bradley & Terry (1952) model the probability that
the chosen one wins as sigmoid(r_chosen - r_rejected); the loss is its negative log
likelihood. This is the reward-model objective of InstructGPT (Ouyang et al. 2022,
arXiv:2203.02155, eq. 1); Llama 2 (Touvron et al. 2023, arXiv:2307.09288, eq. 2) adds a
per-pair margin m(r) that asks clearer preferences to be separated by more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ludic.training.losses.base import LossOutput


@dataclass(frozen=True)
class BradleyTerryLoss:
    """Bradley-Terry pairwise loss (InstructGPT, arXiv:2203.02155, eq. 1; margin as in
    Llama 2, arXiv:2307.09288, eq. 2).

    L = -mean_i log sigmoid(r_chosen_i - r_rejected_i - m_i)

    computed as ``-F.logsigmoid(d)`` (stable for any gap: ``softplus(-d)`` never
    overflows). ``m_i`` is 0 without ``margin``.
    Reads: ``chosen`` [B], ``rejected`` [B] (one scalar reward per response, pair i =
    (chosen[i], rejected[i])); ``margin``: [B], a float, or ``None``.
    Stats: loss, accuracy (fraction of pairs with r_chosen > r_rejected; ties count as
    wrong), margin_mean (mean reward gap r_chosen - r_rejected, without ``m``),
    reward_chosen_mean, reward_rejected_mean.
    """

    def __call__(
        self,
        chosen: torch.Tensor,
        rejected: torch.Tensor,
        *,
        margin: torch.Tensor | float | None = None,
    ) -> LossOutput:
        _check_rewards(chosen, rejected)
        gap = chosen - rejected  # [B]
        target = gap if margin is None else gap - _margin_like(margin, gap)
        # float32 at least: a bf16 log-sigmoid of a small gap loses most of its digits
        dtype = torch.promote_types(target.dtype, torch.float32)
        loss = -F.logsigmoid(target.to(dtype)).mean()
        with torch.no_grad():
            stats = {
                "loss": float(loss.detach()),
                "accuracy": float((gap > 0).to(dtype).mean()),
                "margin_mean": float(gap.to(dtype).mean()),
                "reward_chosen_mean": float(chosen.detach().to(dtype).mean()),
                "reward_rejected_mean": float(rejected.detach().to(dtype).mean()),
            }
        return LossOutput(loss=loss, stats=stats)


def _check_rewards(chosen: torch.Tensor, rejected: torch.Tensor) -> None:
    if chosen.dim() != 1 or rejected.dim() != 1:
        raise ValueError(
            f"BradleyTerryLoss: chosen and rejected must be 1-D reward vectors [B], got "
            f"shapes {tuple(chosen.shape)} and {tuple(rejected.shape)} (squeeze the "
            "reward model's [B, 1] logits)"
        )
    if chosen.shape != rejected.shape:
        raise ValueError(
            f"BradleyTerryLoss: chosen has {chosen.shape[0]} rewards but rejected has "
            f"{rejected.shape[0]}; pass one chosen and one rejected reward per pair"
        )
    if chosen.shape[0] == 0:
        raise ValueError("BradleyTerryLoss: no pairs (empty reward vectors)")


def _margin_like(margin: torch.Tensor | float, gap: torch.Tensor) -> torch.Tensor:
    if not isinstance(margin, torch.Tensor):
        return torch.full_like(gap, float(margin))
    if margin.shape != gap.shape:
        raise ValueError(
            f"BradleyTerryLoss: margin has shape {tuple(margin.shape)}; expected one margin "
            f"per pair, shape {tuple(gap.shape)}, or a float"
        )
    return margin.to(device=gap.device, dtype=gap.dtype)
