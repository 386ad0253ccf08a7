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
    TokenAggregation,
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
    token_mean = TokenAggregation.TOKEN_MEAN  # explicit: these terms keep their own
    policy = TokenClippedSurrogateLoss()
    kl = KLPenalty(beta=1.0, aggregation=token_mean)
    ent = EntropyBonus(coef=1.0, aggregation=token_mean)
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


@pytest.mark.parametrize(
    ("aggregation", "constant_normalizer"),
    [(TokenAggregation.SEQ_MEAN_TOKEN_MEAN, None), (TokenAggregation.CONSTANT, 7)],
)
def test_regularizers_follow_the_policy_loss_aggregation_by_default(
    aggregation: TokenAggregation, constant_normalizer: int | None
) -> None:
    # GRPO eq. 3: the KL term is averaged like the surrogate (per sequence, then over them).
    policy = TokenClippedSurrogateLoss(
        aggregation=aggregation, constant_normalizer=constant_normalizer
    )
    composite = CompositeLoss(
        [(1.0, policy), ("kl", 0.1, KLPenalty(1.0)), ("ent", 0.01, EntropyBonus(1.0))]
    )
    kl, ent = composite.terms[1][2], composite.terms[2][2]
    assert (kl.aggregation, kl.constant_normalizer) == (aggregation, constant_normalizer)
    assert (ent.aggregation, ent.constant_normalizer) == (aggregation, constant_normalizer)

    inputs = make_inputs()
    same = KLPenalty(1.0, aggregation=aggregation, constant_normalizer=constant_normalizer)
    stats = composite(inputs).stats
    assert stats["kl/loss"] == pytest.approx(same(inputs).loss.item(), rel=1e-12)
    # On its own (or with an explicit choice) a regularizer keeps TOKEN_MEAN.
    token_mean = KLPenalty(1.0)(inputs).loss.item()
    assert token_mean == pytest.approx(
        KLPenalty(1.0, aggregation=TokenAggregation.TOKEN_MEAN)(inputs).loss.item()
    )
    assert stats["kl/loss"] != pytest.approx(token_mean)  # the masks differ per row
    explicit = CompositeLoss([(1.0, policy), (0.1, KLPenalty(1.0, aggregation="token_mean"))])
    assert explicit.terms[1][2].aggregation == TokenAggregation.TOKEN_MEAN


def test_a_constant_normalizer_without_an_aggregation_is_refused() -> None:
    with pytest.raises(ValueError, match="constant_normalizer=5 without aggregation='constant'"):
        KLPenalty(1.0, constant_normalizer=5)
