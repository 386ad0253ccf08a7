"""Every loss preset trained through the Trainer's forward (output head a chunk at a
time, packed or shared-prefix micro-batches) has the loss and gradients of the naive
computation (whole logits, log-softmax over the vocabulary, one padded batch), to 1e-6
in float64."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.training.test_shared_prefix import FixedSource, grpo_like_items

from ludic.models.tiny import build_tiny_causal_lm
from ludic.training.algorithm import (
    make_cispo,
    make_decoupled_grpo,
    make_decoupled_ppo,
    make_dr_grpo,
    make_gmpo,
    make_grpo,
    make_gspo,
    make_reinforce,
    make_reinforce_baseline,
    make_sft,
)
from ludic.training.collate import collate
from ludic.training.config import TrainerConfig
from ludic.training.logprobs import token_logprobs
from ludic.training.losses import CompositeLoss, EntropyBonus, KLPenalty, LossInputs
from ludic.training.losses.base import masked_token_entropy
from ludic.training.policy_update import StepTotals
from ludic.training.trainer import Trainer
from ludic.training.types import SAWBatch

PRESETS = {
    "reinforce": make_reinforce,
    "reinforce_baseline": make_reinforce_baseline,
    "grpo": lambda: make_grpo(group_size=2),
    "grpo_truncated_is": lambda: make_grpo(group_size=2, truncated_is_cap=2.0),
    "dr_grpo": lambda: make_dr_grpo(group_size=2, max_tokens=16),
    "gspo": lambda: make_gspo(group_size=2),
    "cispo": lambda: make_cispo(group_size=2),
    "gmpo": lambda: make_gmpo(group_size=2),
    "decoupled_ppo": make_decoupled_ppo,
    "decoupled_grpo": lambda: make_decoupled_grpo(group_size=2),
    "sft": make_sft,
    "grpo_kl_entropy": lambda: make_grpo(group_size=2),  # + KL to a reference + entropy
}


def with_regularizers(algorithm):
    loss = CompositeLoss(
        [
            ("policy", 1.0, algorithm.loss),
            ("kl", 1.0, KLPenalty(beta=0.1)),
            ("ent", 1.0, EntropyBonus(0.01)),
        ]
    )
    return type(algorithm)(algorithm.name, algorithm.credit_assigner, loss, algorithm.preprocess)


def naive_step(model, reference, algorithm, items) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and gradients the old way: one padded batch, whole logits."""
    mb = collate(items, pad_token_id=0, device=torch.device("cpu"))
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    logprobs = token_logprobs(logits, mb.input_ids)
    mask = mb.action_mask
    extra = {}
    if getattr(algorithm.loss, "requires_proximal_logprobs", False):
        extra["proximal_logprobs"] = logprobs.detach() * mask
    if reference is not None:
        with torch.no_grad():
            ref_logits = reference(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        extra["ref_logprobs"] = token_logprobs(ref_logits, mb.input_ids) * mask
    if getattr(algorithm.loss, "requires_entropy", False):
        extra["entropy"] = masked_token_entropy(logits)
    inputs = LossInputs(
        logprobs=logprobs,
        action_mask=mask,
        weights=mb.weights,
        num_sequences=len(items),
        num_action_tokens=int(mask.sum()),
        old_logprobs=mb.old_logprobs,
        logits=logits,
        **extra,
    )
    out = algorithm.loss(inputs)
    model.zero_grad()
    out.loss.backward()
    return float(out.loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def setup(tiny_tokenizer):
    model = build_tiny_causal_lm(tiny_tokenizer, seed=21).double()
    behaviour = build_tiny_causal_lm(tiny_tokenizer, seed=22).double()  # old != current
    return model, grpo_like_items(behaviour)


@pytest.mark.parametrize("name", list(PRESETS))
def test_a_preset_has_the_naive_loss_and_gradients_in_float64(setup, name) -> None:
    model, items = setup
    algorithm = PRESETS[name]()
    reference = None
    if name == "grpo_kl_entropy":
        algorithm = with_regularizers(algorithm)
        reference = copy.deepcopy(model).requires_grad_(False)
        with torch.no_grad():
            for p in reference.parameters():
                p.mul_(0.9)  # a reference that differs from the policy
    if algorithm.preprocess is not None:
        items = algorithm.preprocess(SAWBatch(items)).items
    naive_model = copy.deepcopy(model)
    loss_naive, grads_naive = naive_step(naive_model, reference, algorithm, items)

    policy = copy.deepcopy(model)
    config = TrainerConfig(
        pad_token_id=0, max_tokens_per_microbatch=60, logprob_chunk_tokens=3, max_grad_norm=None
    )
    trainer = Trainer(
        policy, algorithm, FixedSource(SAWBatch(items)), config, reference_model=reference
    )
    microbatches = trainer.update.microbatches(items)
    assert len(microbatches) > 1
    totals = StepTotals(len(items), sum(i.num_action_tokens for i in items))
    reference_logprobs = trainer.update.reference_logprobs(items)
    policy.zero_grad()
    loss, _, run = trainer.update.accumulate_gradients(
        microbatches, totals, None, reference_logprobs
    )
    assert run < sum(len(mb) * max(i.num_tokens for i in mb) for mb in microbatches)
    assert loss == pytest.approx(loss_naive, abs=1e-9, rel=1e-9)
    grads = {n: p.grad for n, p in policy.named_parameters()}
    norm = sum(float(g.norm()) ** 2 for g in grads_naive.values()) ** 0.5
    assert norm > 1e-4  # a real gradient: the comparison is not vacuous
    for n, g in grads_naive.items():
        torch.testing.assert_close(grads[n], g, atol=1e-6, rtol=0)
