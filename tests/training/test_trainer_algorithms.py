"""Trainer with the real presets from ``ludic.training.algorithm``."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ludic.training.algorithm import make_grpo, make_sft
from ludic.training.config import TrainerConfig
from ludic.training.trainer import Trainer, token_logprobs
from ludic.training.types import SAWBatch, SAWItem


class FixedSource:
    def __init__(self, batch: SAWBatch) -> None:
        self.batch = batch

    async def next_batch(self) -> SAWBatch:
        return self.batch


def _sequences(n: int) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (n, 14), generator=g).tolist()
    return [(row, [0] * 8 + [1] * 6) for row in ids]


def _behaviour_logprobs(model: torch.nn.Module, ids: list[int], mask: list[int]) -> list[float]:
    """Chosen-token logprobs of ``model`` aligned to ``ids`` (0.0 off the action mask)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    shifted = token_logprobs(logits, torch.tensor([ids]))[0].tolist()
    return [0.0] + [lp * m for lp, m in zip(shifted, mask[1:])]


def test_make_sft_lowers_the_action_token_nll(tiny_model) -> None:
    batch = SAWBatch([SAWItem(ids, mask, weight=1.0) for ids, mask in _sequences(3)])
    trainer = Trainer(tiny_model, make_sft(), FixedSource(batch), TrainerConfig(lr=1e-3))
    metrics = trainer.train_sync(10)
    assert metrics[-1]["loss"] < 0.7 * metrics[0]["loss"]
    assert metrics[0]["loss/nll"] == pytest.approx(metrics[0]["loss"], rel=1e-5)


def test_make_grpo_on_on_policy_data_has_unit_ratio_and_no_clipping(tiny_model) -> None:
    items = []
    for k, (ids, mask) in enumerate(_sequences(4)):
        old = _behaviour_logprobs(tiny_model, ids, mask)
        items.append(SAWItem(ids, mask, weight=1.0 if k % 2 else -1.0, old_logprobs=old))
    trainer = Trainer(
        tiny_model, make_grpo(group_size=2), FixedSource(SAWBatch(items)), TrainerConfig()
    )

    m = asyncio.run(trainer.train_step())

    assert m["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["loss/clip_frac"] == 0.0
    assert m["loss"] == pytest.approx(0.0, abs=1e-5)  # -mean(A) with zero-mean advantages
    assert m["grad_norm"] > 0


def test_make_grpo_without_behaviour_logprobs_names_the_fix(tiny_model) -> None:
    batch = SAWBatch([SAWItem(ids, mask, weight=1.0) for ids, mask in _sequences(2)])
    trainer = Trainer(tiny_model, make_grpo(group_size=2), FixedSource(batch), TrainerConfig())
    with pytest.raises(ValueError, match=r"TokenClippedSurrogateLoss requires old_logprobs"):
        asyncio.run(trainer.train_step())
