"""Pins ``ludic.training.losses.clipped``: PPO/GRPO token clip, GSPO, GMPO.

Each loss is checked against an independent float64 reference written from the paper
formula with plain Python loops; reference gradients come from central finite
differences of the reference, not from autograd.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tests.training.loss_helpers import fd_grad

from ludic.training.losses import (
    ClippedSurrogateLoss,
    GMPOLoss,
    LossInputs,
    TokenAggregation,
    TokenClippedSurrogateLoss,
)

MODES = list(TokenAggregation)
SEEDS = range(5)


# ---------------------------------------------------------------- inputs and reference


def random_batch(seed: int) -> dict[str, np.ndarray]:
    """B in 3..5, T in 6..9, >=1 action token per row, advantages of both signs,
    behaviour logprobs perturbed so that some ratios fall outside every clip range."""
    rng = np.random.default_rng(seed)
    b, t = int(rng.integers(3, 6)), int(rng.integers(6, 10))
    mask = (rng.random((b, t - 1)) < 0.6).astype(np.float64)
    for i in range(b):
        if mask[i].sum() == 0:
            mask[i, rng.integers(t - 1)] = 1.0
    logp = -rng.uniform(0.05, 3.0, size=(b, t - 1))
    old = (logp + rng.normal(0.0, 0.5, size=(b, t - 1))) * mask  # 0.0 off-mask
    adv = rng.uniform(0.2, 2.0, size=b) * np.where(np.arange(b) % 2 == 0, 1.0, -1.0)
    return {"logp": logp, "old": old, "mask": mask, "adv": adv}


def to_inputs(batch, rows=slice(None), *, num_sequences=None, num_action_tokens=None):
    mask = batch["mask"]
    logp = torch.tensor(batch["logp"][rows], dtype=torch.float64, requires_grad=True)
    b, t1 = logp.shape
    return LossInputs(
        logits=torch.zeros(b, t1 + 1, 2, dtype=torch.float64),
        logprobs=logp,
        action_mask=torch.tensor(mask[rows]),
        weights=torch.tensor(batch["adv"][rows]),
        num_sequences=len(mask) if num_sequences is None else num_sequences,
        num_action_tokens=int(mask.sum()) if num_action_tokens is None else num_action_tokens,
        old_logprobs=torch.tensor(batch["old"][rows]),
    )


def run(loss, batch):
    inputs = to_inputs(batch)
    out = loss(inputs)
    out.loss.backward()
    return out.loss.item(), inputs.logprobs.grad.numpy(), out.stats


def ref_aggregate(per_token, mask, mode, n_seq, n_tok, constant=None) -> float:
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


def clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def ref_token_clip(logp, batch, eps_lo, eps_hi, mode, constant=None, dual_c=None) -> float:
    """PPO eq. 7 per token: -min(r A, clip(r, 1-eps_lo, 1+eps_hi) A); with dual clip
    (Ye et al. 2020) and A < 0, the token's loss is at most -c A."""
    mask, old, adv = batch["mask"], batch["old"], batch["adv"]
    per_token = [[0.0] * len(mask[0]) for _ in mask]
    for i in range(len(mask)):
        for t in range(len(mask[i])):
            r = math.exp(logp[i][t] - old[i][t])
            loss_t = -min(r * adv[i], clip(r, 1 - eps_lo, 1 + eps_hi) * adv[i])
            if dual_c is not None and adv[i] < 0:
                loss_t = min(loss_t, -dual_c * adv[i])
            per_token[i][t] = loss_t
    return ref_aggregate(per_token, mask, mode, len(mask), mask.sum(), constant)


def ref_dual_clip_frac(batch, eps_lo, eps_hi, dual_c) -> float:
    mask, logp, old, adv = batch["mask"], batch["logp"], batch["old"], batch["adv"]
    held = total = 0
    for i in range(len(mask)):
        for t in range(len(mask[i])):
            if mask[i][t] == 1.0:
                r = math.exp(logp[i][t] - old[i][t])
                total += 1
                loss_t = -min(r * adv[i], clip(r, 1 - eps_lo, 1 + eps_hi) * adv[i])
                held += adv[i] < 0 and loss_t > -dual_c * adv[i]
    return held / total


def ref_gspo(logp, batch, eps_lo, eps_hi) -> float:
    """GSPO: s_i = (prod_t r_t)^(1/|o_i|); L = mean_i -min(s A, clip(s) A)."""
    mask, old, adv = batch["mask"], batch["old"], batch["adv"]
    total = 0.0
    for i in range(len(mask)):
        prod, n = 1.0, 0
        for t in range(len(mask[i])):
            if mask[i][t] == 1.0:
                prod *= math.exp(logp[i][t] - old[i][t])
                n += 1
        s = prod ** (1.0 / n)
        total += -min(s * adv[i], clip(s, 1 - eps_lo, 1 + eps_hi) * adv[i])
    return total / len(mask)


def ref_gmpo(logp, batch, eps_lo, eps_hi) -> float:
    """GMPO in product form: J_i = sgn(A) * (prod_t |min(r A, clip(r, e^-lo, e^hi) A)|)^(1/|o|)."""
    mask, old, adv = batch["mask"], batch["old"], batch["adv"]
    total = 0.0
    for i in range(len(mask)):
        a = adv[i]
        prod, n = 1.0, 0
        for t in range(len(mask[i])):
            if mask[i][t] == 1.0:
                r = math.exp(logp[i][t] - old[i][t])
                prod *= abs(min(r * a, clip(r, math.exp(-eps_lo), math.exp(eps_hi)) * a))
                n += 1
        sign = 1.0 if a > 0 else -1.0 if a < 0 else 0.0
        total += sign * prod ** (1.0 / n)
    return -total / len(mask)


def ref_token_clip_frac(batch, eps_lo, eps_hi) -> float:
    mask, logp, old, adv = batch["mask"], batch["logp"], batch["old"], batch["adv"]
    clipped = total = 0
    for i in range(len(mask)):
        for t in range(len(mask[i])):
            if mask[i][t] == 1.0:
                r = math.exp(logp[i][t] - old[i][t])
                total += 1
                clipped += clip(r, 1 - eps_lo, 1 + eps_hi) * adv[i] < r * adv[i]
    return clipped / total


# ---------------------------------------------------------------- token clip (PPO/GRPO)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
def test_token_clipped_matches_ppo_reference_in_value_and_gradient(seed, mode):
    batch = random_batch(seed)
    const = 11 if mode == TokenAggregation.CONSTANT else None
    loss = TokenClippedSurrogateLoss(0.2, 0.28, aggregation=mode, constant_normalizer=const)
    value, grad, stats = run(loss, batch)

    def f(lp):
        return ref_token_clip(lp, batch, 0.2, 0.28, mode, const)

    assert value == pytest.approx(f(batch["logp"]), rel=1e-10, abs=1e-12)
    np.testing.assert_allclose(grad, fd_grad(f, batch["logp"]), atol=1e-7)
    assert stats["clip_frac"] == pytest.approx(ref_token_clip_frac(batch, 0.2, 0.28))
    assert 0.0 < stats["clip_frac"] < 1.0  # the inputs exercise both branches


def test_token_clipped_hand_computed_two_sequences():
    # r = (1.5, 0.7) in both rows; row 0 has A=+1, row 1 has A=-1; eps 0.2.
    # row 0: -min(1.5, 1.2) = -1.2 (clipped), -min(0.7, 0.8) = -0.7 (unclipped)
    # row 1: -min(-1.5, -1.2) = 1.5 (unclipped), -min(-0.7, -0.8) = 0.8 (clipped)
    # SEQ_MEAN_TOKEN_MEAN: ((-1.2 - 0.7)/2 + (1.5 + 0.8)/2) / 2 = 0.1
    log_r = torch.log(torch.tensor([[1.5, 0.7], [1.5, 0.7]], dtype=torch.float64))
    logp = torch.full((2, 2), -1.0, dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(
        logits=torch.zeros(2, 3, 2),
        logprobs=logp,
        action_mask=torch.ones(2, 2, dtype=torch.float64),
        weights=torch.tensor([1.0, -1.0], dtype=torch.float64),
        num_sequences=2,
        num_action_tokens=4,
        old_logprobs=(logp - log_r).detach(),
    )
    out = TokenClippedSurrogateLoss()(inputs)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.1)
    # d/dlogp of -r*A = -r*A, scaled by 1/(2 tokens * 2 sequences); clipped tokens get 0
    expected = torch.tensor([[0.0, -0.7 / 4], [1.5 / 4, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected)
    assert out.stats["clip_frac"] == pytest.approx(0.5)
    assert out.stats["ratio_mean"] == pytest.approx(1.1)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
def test_dual_clip_matches_reference_in_value_and_gradient(seed, mode):
    batch = random_batch(seed)
    const = 11 if mode == TokenAggregation.CONSTANT else None
    c = 1.3  # low enough that these inputs have tokens held at -c A
    loss = TokenClippedSurrogateLoss(
        0.2, 0.28, aggregation=mode, constant_normalizer=const, dual_clip_c=c
    )
    value, grad, stats = run(loss, batch)

    def f(lp):
        return ref_token_clip(lp, batch, 0.2, 0.28, mode, const, dual_c=c)

    assert value == pytest.approx(f(batch["logp"]), rel=1e-10, abs=1e-12)
    np.testing.assert_allclose(grad, fd_grad(f, batch["logp"]), atol=1e-7)
    assert stats["dual_clip_frac"] == pytest.approx(ref_dual_clip_frac(batch, 0.2, 0.28, c))
    assert stats["dual_clip_frac"] > 0.0
    assert value != pytest.approx(ref_token_clip(batch["logp"], batch, 0.2, 0.28, mode, const))


def test_dual_clip_hand_computed_holds_negative_advantages_at_c():
    # r = (5, 2) in both rows; row 0 has A=+1, row 1 has A=-1; eps 0.2, c = 3.
    # row 0: -min(5, 1.2) = -1.2, -min(2, 1.2) = -1.2 (both clipped; dual clip ignores A > 0)
    # row 1: -min(-5, -1.2) = 5 -> min(5, 3) = 3 (dual), -min(-2, -1.2) = 2 (< 3, kept)
    # TOKEN_MEAN: (-1.2 - 1.2 + 3 + 2) / 4 = 0.65
    log_r = torch.log(torch.tensor([[5.0, 2.0], [5.0, 2.0]], dtype=torch.float64))
    logp = torch.full((2, 2), -1.0, dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(
        logits=torch.zeros(2, 3, 2),
        logprobs=logp,
        action_mask=torch.ones(2, 2, dtype=torch.float64),
        weights=torch.tensor([1.0, -1.0], dtype=torch.float64),
        num_sequences=2,
        num_action_tokens=4,
        old_logprobs=(logp - log_r).detach(),
    )
    out = TokenClippedSurrogateLoss(aggregation=TokenAggregation.TOKEN_MEAN, dual_clip_c=3.0)(
        inputs
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.65)
    # only row 1's r = 2 token keeps a gradient: d(-r A)/dlogp = r = 2, / 4 tokens
    expected = torch.tensor([[0.0, 0.0], [0.0, 0.5]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected)
    assert out.stats["dual_clip_frac"] == pytest.approx(0.25)
    assert out.stats["clip_frac"] == pytest.approx(0.5)


def test_without_dual_clip_there_is_no_dual_clip_stat():
    _, _, stats = run(TokenClippedSurrogateLoss(), random_batch(0))
    assert "dual_clip_frac" not in stats


@pytest.mark.parametrize("bad", [1.0, 0.5, -3.0, float("inf"), float("nan")])
def test_dual_clip_c_must_exceed_one(bad):
    with pytest.raises(ValueError, match=r"TokenClippedSurrogateLoss: dual_clip_c=.*> 1"):
        TokenClippedSurrogateLoss(dual_clip_c=bad)


def test_token_clipped_ratio_is_one_off_mask_even_with_extreme_logprobs():
    batch = random_batch(0)
    batch["logp"] = np.where(batch["mask"] == 1.0, batch["logp"], -1e4)
    value, grad, _ = run(TokenClippedSurrogateLoss(), batch)
    assert math.isfinite(value)
    assert np.all(grad[batch["mask"] == 0.0] == 0.0)


# ---------------------------------------------------------------- GSPO


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("eps", [(0.1, 0.15), (3e-4, 4e-4)])
def test_gspo_matches_sequence_ratio_reference_in_value_and_gradient(seed, eps):
    batch = random_batch(seed)
    value, grad, stats = run(ClippedSurrogateLoss(*eps), batch)

    def f(lp):
        return ref_gspo(lp, batch, *eps)

    assert value == pytest.approx(f(batch["logp"]), rel=1e-10, abs=1e-12)
    np.testing.assert_allclose(grad, fd_grad(f, batch["logp"]), atol=1e-7)
    assert 0.0 <= stats["clip_frac"] <= 1.0


def test_gspo_defaults_are_the_paper_clip_range():
    loss = ClippedSurrogateLoss()
    assert (loss.clip_eps_low, loss.clip_eps_high) == (3e-4, 4e-4)


def test_gspo_sequence_clip_fraction_counts_sequences():
    # one sequence at s = e^0.5 with A > 0 (clipped), one at s = 1 (not clipped)
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.5, -1.5], [-1.0, -1.0]], dtype=torch.float64)
    inputs = LossInputs(
        logits=torch.zeros(2, 3, 2),
        logprobs=logp,
        action_mask=torch.ones(2, 2, dtype=torch.float64),
        weights=torch.tensor([1.0, 1.0], dtype=torch.float64),
        num_sequences=2,
        num_action_tokens=4,
        old_logprobs=old,
    )
    out = ClippedSurrogateLoss(0.2, 0.2)(inputs)
    assert out.stats["clip_frac"] == pytest.approx(0.5)
    assert out.loss.item() == pytest.approx(-(1.2 + 1.0) / 2)


# ---------------------------------------------------------------- GMPO


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("eps", [(0.4, 0.4), (0.1, 0.3)])
def test_gmpo_matches_geometric_mean_product_reference(seed, eps):
    batch = random_batch(seed)
    value, grad, stats = run(GMPOLoss(*eps), batch)

    def f(lp):
        return ref_gmpo(lp, batch, *eps)

    assert value == pytest.approx(f(batch["logp"]), rel=1e-10, abs=1e-12)
    np.testing.assert_allclose(grad, fd_grad(f, batch["logp"]), atol=1e-7)
    assert 0.0 < stats["clip_frac"] < 1.0


def test_gmpo_hand_computed_both_advantage_signs():
    # row 0: A=+2, l=(0.6, -0.2) -> c = min(l, clamp(l)) = (0.4, -0.2), J = 2 e^0.1
    # row 1: A=-1, l=(0.6, -0.6) -> c = max(l, clamp(l)) = (0.6, -0.4), J = -e^0.1
    # L = -(2 e^0.1 - e^0.1) / 2 = -e^0.1 / 2
    log_r = torch.tensor([[0.6, -0.2], [0.6, -0.6]], dtype=torch.float64)
    logp = torch.full((2, 2), -1.0, dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(
        logits=torch.zeros(2, 3, 2),
        logprobs=logp,
        action_mask=torch.ones(2, 2, dtype=torch.float64),
        weights=torch.tensor([2.0, -1.0], dtype=torch.float64),
        num_sequences=2,
        num_action_tokens=4,
        old_logprobs=(logp - log_r).detach(),
    )
    out = GMPOLoss()(inputs)
    out.loss.backward()
    e = math.exp(0.1)
    assert out.loss.item() == pytest.approx(-e / 2)
    # dL/dl = -A_i e^{mean c} / (|o| * num_sequences) on unclipped tokens, 0 on clipped
    expected = torch.tensor([[0.0, -2 * e / 4], [e / 4, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected)
    assert out.stats["clip_frac"] == pytest.approx(0.5)


def test_gmpo_zero_advantage_sequence_contributes_nothing():
    batch = random_batch(1)
    batch["adv"][:] = 0.0
    value, grad, _ = run(GMPOLoss(), batch)
    assert value == 0.0
    assert np.all(grad == 0.0)


# ---------------------------------------------------------------- shared behaviour


@pytest.mark.parametrize(
    "loss",
    [
        TokenClippedSurrogateLoss(aggregation=TokenAggregation.TOKEN_MEAN),
        TokenClippedSurrogateLoss(aggregation=TokenAggregation.SEQ_MEAN_TOKEN_MEAN),
        TokenClippedSurrogateLoss(aggregation=TokenAggregation.CONSTANT, constant_normalizer=16),
        TokenClippedSurrogateLoss(dual_clip_c=1.3),
        ClippedSurrogateLoss(0.1, 0.1),
        GMPOLoss(),
    ],
    ids=lambda x: f"{type(x).__name__}-{getattr(x, 'aggregation', 'seq')}",
)
@pytest.mark.parametrize("seed", range(3))
def test_micro_batches_with_step_normalizers_sum_to_full_batch(loss, seed):
    batch = random_batch(seed)
    full = to_inputs(batch)
    full_out = loss(full)
    full_out.loss.backward()
    split = 1 + seed % (len(batch["mask"]) - 1)
    total = 0.0
    grads = []
    for rows in (slice(0, split), slice(split, None)):
        part = to_inputs(batch, rows)  # normalizers still count the whole step
        out = loss(part)
        out.loss.backward()
        total += out.loss.item()
        grads.append(part.logprobs.grad)
    assert total == pytest.approx(full_out.loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.cat(grads), full.logprobs.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("loss", [TokenClippedSurrogateLoss(), ClippedSurrogateLoss(), GMPOLoss()])
def test_missing_behaviour_logprobs_names_loss_and_request_option(loss):
    inputs = to_inputs(random_batch(0))
    inputs.old_logprobs = None
    name = type(loss).__name__
    with pytest.raises(ValueError, match=rf"{name} needs behaviour logprobs") as err:
        loss(inputs)
    assert "InferenceSpec(returns=ReturnSpec.for_rl())" in str(err.value)


def test_clipped_losses_declare_that_they_read_old_logprobs():
    for loss in (TokenClippedSurrogateLoss(), ClippedSurrogateLoss(), GMPOLoss()):
        assert loss.requires_old_logprobs is True
        assert loss.requires_ref_logprobs is False
        assert loss.requires_proximal_logprobs is False


@pytest.mark.parametrize("cls", [TokenClippedSurrogateLoss, ClippedSurrogateLoss, GMPOLoss])
def test_negative_clip_eps_is_rejected_by_name(cls):
    with pytest.raises(ValueError, match=r"clip_eps_low=-0\.1"):
        cls(clip_eps_low=-0.1)
    with pytest.raises(ValueError, match=r"clip_eps_high=-1"):
        cls(clip_eps_high=-1.0)


def test_constant_aggregation_without_normalizer_is_rejected_at_construction():
    with pytest.raises(ValueError, match="constant_normalizer"):
        TokenClippedSurrogateLoss(aggregation=TokenAggregation.CONSTANT)


def test_unknown_aggregation_lists_the_valid_ones():
    with pytest.raises(ValueError, match="seq_mean_token_mean"):
        TokenClippedSurrogateLoss(aggregation="sum")


def test_old_logprobs_with_wrong_shape_are_rejected():
    inputs = to_inputs(random_batch(0))
    inputs.old_logprobs = inputs.old_logprobs[:, :-1]
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        TokenClippedSurrogateLoss()(inputs)
