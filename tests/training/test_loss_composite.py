"""Pins ``ludic.training.losses.composite``: weighted sums of losses."""

from __future__ import annotations

import pytest
import torch

from ludic.training.losses import (
    CompositeLoss,
    EntropyBonus,
    KLPenalty,
    Loss,
    LossInputs,
    ReinforceLoss,
    TokenClippedSurrogateLoss,
)


def make_inputs(seed: int = 0) -> LossInputs:
    g = torch.Generator().manual_seed(seed)
    b, t, v = 4, 7, 5
    mask = (torch.rand(b, t - 1, generator=g) < 0.6).double()
    mask[:, 0] = 1.0
    logp = -torch.rand(b, t - 1, generator=g, dtype=torch.float64) * 3
    return LossInputs(
        logits=torch.randn(b, t, v, generator=g, dtype=torch.float64).requires_grad_(),
        logprobs=logp.requires_grad_(),
        action_mask=mask,
        weights=torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64),
        num_sequences=b,
        num_action_tokens=int(mask.sum()),
        old_logprobs=(logp.detach() + 0.3 * torch.randn(b, t - 1, generator=g)) * mask,
        ref_logprobs=(logp.detach() + 0.3 * torch.randn(b, t - 1, generator=g)) * mask,
    )


def test_composite_is_the_weighted_sum_of_its_terms_in_value_and_gradient():
    policy, kl, ent = TokenClippedSurrogateLoss(), KLPenalty(beta=1.0), EntropyBonus(coef=1.0)
    composite = CompositeLoss([(1.0, policy), (0.04, kl), (0.01, ent)])

    inputs = make_inputs()
    out = composite(inputs)
    out.loss.backward()

    expected_inputs = make_inputs()
    expected = (
        policy(expected_inputs).loss
        + 0.04 * kl(expected_inputs).loss
        + 0.01 * ent(expected_inputs).loss
    )
    expected.backward()
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-12)
    torch.testing.assert_close(inputs.logprobs.grad, expected_inputs.logprobs.grad)
    torch.testing.assert_close(inputs.logits.grad, expected_inputs.logits.grad)


def test_composite_prefixes_term_stats_with_term_names():
    composite = CompositeLoss([(1.0, TokenClippedSurrogateLoss()), ("kl", 0.1, KLPenalty(1.0))])
    stats = composite(make_inputs()).stats
    assert {"token_clipped_surrogate/clip_frac", "token_clipped_surrogate/loss"} <= set(stats)
    assert {"kl/kl", "kl/loss", "loss"} <= set(stats)
    assert stats["loss"] == pytest.approx(
        stats["token_clipped_surrogate/loss"] + 0.1 * stats["kl/loss"]
    )


def test_composite_names_repeated_terms_uniquely():
    composite = CompositeLoss([(1.0, ReinforceLoss()), (0.5, ReinforceLoss())])
    assert [name for name, _, _ in composite.terms] == ["reinforce", "reinforce_1"]


def test_composite_requires_what_any_term_requires():
    plain = CompositeLoss([(1.0, ReinforceLoss()), (0.1, EntropyBonus(0.1))])
    assert not plain.requires_old_logprobs and not plain.requires_ref_logprobs
    rl = CompositeLoss([(1.0, TokenClippedSurrogateLoss()), (0.1, KLPenalty(0.1))])
    assert rl.requires_old_logprobs and rl.requires_ref_logprobs
    assert isinstance(rl, Loss)


def test_composite_rejects_an_object_that_is_not_a_loss():
    with pytest.raises(TypeError, match=r"term 1 .* is not a Loss"):
        CompositeLoss([(1.0, ReinforceLoss()), (1.0, lambda inputs: inputs)])


def test_composite_rejects_duplicate_explicit_names():
    with pytest.raises(ValueError, match="two terms are named 'pg'"):
        CompositeLoss([("pg", 1.0, ReinforceLoss()), ("pg", 1.0, ReinforceLoss())])


def test_composite_rejects_empty_terms_and_bad_weights():
    with pytest.raises(ValueError, match="terms is empty"):
        CompositeLoss([])
    with pytest.raises(ValueError, match="weight=inf"):
        CompositeLoss([(float("inf"), ReinforceLoss())])
    with pytest.raises(TypeError, match="weight='1'"):
        CompositeLoss([("1", ReinforceLoss())])
