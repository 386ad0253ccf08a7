"""Pins ``ludic.training.losses.policy_gradient`` (REINFORCE, CISPO) and
``ludic.training.losses.sft`` (masked causal-LM cross-entropy).

Each loss is checked against an independent float64 reference written from the paper
formula with plain Python loops; reference gradients come from central finite
differences of the reference (with the stop-gradient factor held fixed for CISPO).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tests.training.loss_helpers import fd_grad

from ludic.training.losses import (
    CISPOLoss,
    LossInputs,
    MaskedCausalLMCrossEntropyLoss,
    ReinforceLoss,
    TokenAggregation,
)

MODES = list(TokenAggregation)
SEEDS = range(5)
CONST = 13


# ---------------------------------------------------------------- inputs and reference


def random_batch(seed: int) -> dict[str, np.ndarray]:
    """B in 3..5, T in 6..9, >=1 action token per row, advantages of both signs,
    behaviour logprobs perturbed so that some importance ratios get truncated."""
    rng = np.random.default_rng(100 + seed)
    b, t = int(rng.integers(3, 6)), int(rng.integers(6, 10))
    mask = (rng.random((b, t - 1)) < 0.6).astype(np.float64)
    for i in range(b):
        if mask[i].sum() == 0:
            mask[i, rng.integers(t - 1)] = 1.0
    logp = -rng.uniform(0.05, 3.0, size=(b, t - 1))
    old = (logp + rng.normal(0.0, 0.5, size=(b, t - 1))) * mask  # 0.0 off-mask
    adv = rng.uniform(0.2, 2.0, size=b) * np.where(np.arange(b) % 2 == 0, 1.0, -1.0)
    return {"logp": logp, "old": old, "mask": mask, "adv": adv}


def to_inputs(batch, rows=slice(None)):
    mask = batch["mask"]
    logp = torch.tensor(batch["logp"][rows], dtype=torch.float64, requires_grad=True)
    b, t1 = logp.shape
    return LossInputs(
        logits=torch.zeros(b, t1 + 1, 2, dtype=torch.float64),
        logprobs=logp,
        action_mask=torch.tensor(mask[rows]),
        weights=torch.tensor(batch["adv"][rows]),
        num_sequences=len(mask),
        num_action_tokens=int(mask.sum()),
        old_logprobs=torch.tensor(batch["old"][rows]),
    )


def run(loss, batch):
    inputs = to_inputs(batch)
    out = loss(inputs)
    out.loss.backward()
    return out.loss.item(), inputs.logprobs.grad.numpy(), out.stats


def ref_aggregate(per_token, mask, mode, constant=None) -> float:
    n_seq, n_tok = len(mask), mask.sum()
    total = 0.0
    for i in range(len(mask)):
        row = [per_token[i][t] for t in range(len(mask[i])) if mask[i][t] == 1.0]
        if mode == TokenAggregation.SEQ_MEAN_TOKEN_MEAN:
            total += sum(row) / len(row) / n_seq
        else:
            total += sum(row)
    if mode == TokenAggregation.TOKEN_MEAN:
        return total / n_tok
    if mode == TokenAggregation.CONSTANT:
        return total / (n_seq * constant)
    return total


def ref_reinforce(logp, batch, mode) -> float:
    """-agg_t(A_i * logp_t)."""
    per_token = [
        [-batch["adv"][i] * logp[i][t] for t in range(len(logp[i]))] for i in range(len(logp))
    ]
    return ref_aggregate(per_token, batch["mask"], mode, CONST)


def ref_cispo(logp, logp_for_weight, batch, eps_lo, eps_hi, mode) -> float:
    """MiniMax-M1 eq. 4: -agg_t(sg(clip(r_t, 1-eps_lo, 1+eps_hi)) * A_i * logp_t).

    The IS weight is computed from ``logp_for_weight``; differentiating w.r.t. ``logp``
    alone is exactly the stop-gradient."""
    old, adv = batch["old"], batch["adv"]
    per_token = []
    for i in range(len(logp)):
        row = []
        for t in range(len(logp[i])):
            r = math.exp(logp_for_weight[i][t] - old[i][t])
            w = min(r, 1 + eps_hi) if eps_lo is None else min(max(r, 1 - eps_lo), 1 + eps_hi)
            row.append(-w * adv[i] * logp[i][t])
        per_token.append(row)
    return ref_aggregate(per_token, batch["mask"], mode, CONST)


def ref_nll(logp, batch) -> float:
    mask = batch["mask"]
    total = sum(-logp[i][t] for i in range(len(mask)) for t in range(len(mask[i])) if mask[i][t])
    return total / mask.sum()


def with_const(mode):
    return CONST if mode == TokenAggregation.CONSTANT else None


# ---------------------------------------------------------------- REINFORCE


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
def test_reinforce_matches_reference_in_value_and_gradient(seed, mode):
    batch = random_batch(seed)
    loss = ReinforceLoss(aggregation=mode, constant_normalizer=with_const(mode))
    value, grad, stats = run(loss, batch)

    def f(lp):
        return ref_reinforce(lp, batch, mode)

    assert value == pytest.approx(f(batch["logp"]), rel=1e-10)
    np.testing.assert_allclose(grad, fd_grad(f, batch["logp"]), atol=1e-7)
    assert stats["weight_mean"] == pytest.approx(batch["adv"].mean())


def test_reinforce_hand_computed_token_and_sequence_means():
    # row 0: A=2, action logps (-2, -3); row 1: A=-1, action logp (-4,)
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], requires_grad=True)
    inputs = LossInputs(
        logits=torch.zeros(2, 4, 2),
        logprobs=logp,
        action_mask=torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]),
        weights=torch.tensor([2.0, -1.0]),
        num_sequences=2,
        num_action_tokens=3,
    )
    # TOKEN_MEAN: -(2*-2 + 2*-3 + -1*-4) / 3 = 6 / 3 = 2
    out = ReinforceLoss()(inputs)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(2.0)
    expected = torch.tensor([[0.0, -2 / 3, -2 / 3], [1 / 3, 0.0, 0.0]])
    torch.testing.assert_close(logp.grad, expected)
    # SEQ_MEAN_TOKEN_MEAN: (-(2*-2 + 2*-3)/2 + -(-1*-4)/1) / 2 = (5 - 4) / 2 = 0.5
    seq = ReinforceLoss(aggregation=TokenAggregation.SEQ_MEAN_TOKEN_MEAN)(inputs)
    assert seq.loss.item() == pytest.approx(0.5)


def test_reinforce_does_not_need_old_logprobs():
    inputs = to_inputs(random_batch(0))
    inputs.old_logprobs = None
    assert ReinforceLoss.requires_old_logprobs is False
    assert math.isfinite(ReinforceLoss()(inputs).loss.item())


# ---------------------------------------------------------------- CISPO


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("eps", [(None, 0.28), (0.2, 0.2)])
def test_cispo_matches_reference_with_stop_gradient_weight(seed, mode, eps):
    batch = random_batch(seed)
    loss = CISPOLoss(*eps, aggregation=mode, constant_normalizer=with_const(mode))
    value, grad, stats = run(loss, batch)
    lp0 = batch["logp"]

    def f(lp):
        return ref_cispo(lp, lp0, batch, *eps, mode)

    assert value == pytest.approx(f(lp0), rel=1e-10)
    np.testing.assert_allclose(grad, fd_grad(f, lp0), atol=1e-7)
    assert 0.0 < stats["clip_frac"] < 1.0


def test_cispo_without_lower_bound_keeps_small_ratios():
    # r = 0.5 and r = 2.0 with A = 1: weights 0.5 (no lower clip) and 1.28 (upper clip)
    logp = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, -1.0 - math.log(0.5), -1.0 - math.log(2.0)]], dtype=torch.float64)
    inputs = LossInputs(
        logits=torch.zeros(1, 4, 2),
        logprobs=logp,
        action_mask=torch.tensor([[0.0, 1.0, 1.0]], dtype=torch.float64),
        weights=torch.tensor([1.0], dtype=torch.float64),
        num_sequences=1,
        num_action_tokens=2,
        old_logprobs=old,
    )
    out = CISPOLoss()(inputs)
    out.loss.backward()
    # L = -(0.5 * -1 + 1.28 * -1) / 2; gradient = -w * A / 2 (the weight carries none)
    assert out.loss.item() == pytest.approx(1.78 / 2)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.25, -0.64]], dtype=torch.float64))
    assert out.stats["clip_frac"] == pytest.approx(0.5)


def test_cispo_defaults_have_no_lower_bound():
    loss = CISPOLoss()
    assert loss.clip_eps_low is None
    assert loss.aggregation == TokenAggregation.TOKEN_MEAN


def test_cispo_missing_behaviour_logprobs_names_the_request_option():
    inputs = to_inputs(random_batch(0))
    inputs.old_logprobs = None
    with pytest.raises(ValueError, match=r"CISPOLoss needs behaviour logprobs") as err:
        CISPOLoss()(inputs)
    assert "InferenceSpec(returns=ReturnSpec.for_rl())" in str(err.value)


def test_cispo_rejects_negative_eps_by_name():
    with pytest.raises(ValueError, match=r"clip_eps_high=-0\.5"):
        CISPOLoss(clip_eps_high=-0.5)


# ---------------------------------------------------------------- SFT


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_cross_entropy_is_token_mean_nll_of_action_tokens(seed):
    batch = random_batch(seed)
    value, grad, stats = run(MaskedCausalLMCrossEntropyLoss(), batch)

    def f(lp):
        return ref_nll(lp, batch)

    assert value == pytest.approx(f(batch["logp"]), rel=1e-10)
    np.testing.assert_allclose(grad, fd_grad(f, batch["logp"]), atol=1e-7)
    assert stats["nll"] == pytest.approx(value)
    assert stats["num_tokens"] == batch["mask"].sum()


def test_masked_cross_entropy_ignores_weights():
    batch = random_batch(0)
    plain, _, _ = run(MaskedCausalLMCrossEntropyLoss(), batch)
    batch["adv"] = batch["adv"] * 100.0
    assert run(MaskedCausalLMCrossEntropyLoss(), batch)[0] == pytest.approx(plain)


# ---------------------------------------------------------------- gradient accumulation


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("make", [ReinforceLoss, CISPOLoss, MaskedCausalLMCrossEntropyLoss])
@pytest.mark.parametrize("seed", range(3))
def test_micro_batches_with_step_normalizers_sum_to_full_batch(make, mode, seed):
    loss = make(aggregation=mode, constant_normalizer=with_const(mode))
    batch = random_batch(seed)
    full = to_inputs(batch)
    full_out = loss(full)
    full_out.loss.backward()
    split = 1 + seed % (len(batch["mask"]) - 1)
    total, grads = 0.0, []
    for rows in (slice(0, split), slice(split, None)):
        part = to_inputs(batch, rows)  # normalizers still count the whole step
        out = loss(part)
        out.loss.backward()
        total += out.loss.item()
        grads.append(part.logprobs.grad)
    assert total == pytest.approx(full_out.loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.cat(grads), full.logprobs.grad, rtol=1e-12, atol=1e-14)
