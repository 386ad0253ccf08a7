"""Trainer with a peft LoRA policy: only adapters train; published weights are merged."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from ludic.distributed.publisher import InMemoryPublisher
from ludic.models.tiny import build_tiny_causal_lm
from ludic.training.config import TrainerConfig
from ludic.training.losses.base import LossInputs, LossOutput
from ludic.training.trainer import Trainer
from ludic.training.types import SAWBatch, SAWItem

peft = pytest.importorskip("peft")


@dataclass
class TokenMeanNLL:
    requires_old_logprobs: bool = False
    requires_ref_logprobs: bool = False
    requires_proximal_logprobs: bool = False
    requires_entropy: bool = False

    def __call__(self, inputs: LossInputs) -> LossOutput:
        loss = -(inputs.logprobs * inputs.action_mask).sum() / inputs.num_action_tokens
        return LossOutput(loss)


class FixedSource:
    def __init__(self, batch: SAWBatch) -> None:
        self.batch = batch

    async def next_batch(self) -> SAWBatch:
        return self.batch


def _batch() -> SAWBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (3, 16), generator=g).tolist()
    return SAWBatch([SAWItem(row, [0] * 10 + [1] * 6, weight=1.0) for row in ids])


def test_lora_policy_trains_adapters_only_and_publishes_merged_base_named_weights(
    tiny_tokenizer,
) -> None:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(build_tiny_causal_lm(tiny_tokenizer, seed=0), config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    publisher = InMemoryPublisher()
    trainer = Trainer(
        model,
        SimpleNamespace(name="sft", loss=TokenMeanNLL(), preprocess=None),
        FixedSource(_batch()),
        TrainerConfig(lr=1e-2, publish_every=3),
        publisher=publisher,
    )
    losses = [m["loss"] for m in trainer.train_sync(3)]

    assert losses[-1] < losses[0]
    for name, param in model.named_parameters():
        changed = not torch.equal(before[name], param.detach())
        assert changed == ("lora_" in name), name  # base weights stay frozen

    assert publisher.versions == [3]
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    base_names = build_tiny_causal_lm(tiny_tokenizer, seed=0).state_dict().keys()
    assert publisher.state_dict.keys() == base_names
    for name in base_names:
        torch.testing.assert_close(publisher.state_dict[name], expected[name], msg=name)
