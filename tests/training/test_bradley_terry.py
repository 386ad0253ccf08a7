"""Pins ``ludic.training.losses.bradley_terry``: the Bradley-Terry preference loss.

Checked against an independent float64 reference written from the formula with a plain
Python loop; reference gradients come from central finite differences of the reference,
not from autograd.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tests.training.loss_helpers import fd_grad

from ludic.training.losses import BradleyTerryLoss

SEEDS = range(5)


def random_pairs(seed: int) -> dict[str, np.ndarray]:
    """B in 3..8 rewards of both orders (so some pairs are ranked wrong), margins >= 0."""
    rng = np.random.default_rng(seed)
    b = int(rng.integers(3, 9))
    return {
        "chosen": rng.normal(0.0, 2.0, size=b),
        "rejected": rng.normal(0.0, 2.0, size=b),
        "margin": rng.uniform(0.0, 1.5, size=b),
    }


def ref_bt(chosen, rejected, margin=None) -> float:
    """-(1/B) sum_i log(1 / (1 + exp(-(c_i - r_i - m_i)))), one pair at a time."""
    total = 0.0
    for i in range(len(chosen)):
        d = chosen[i] - rejected[i] - (0.0 if margin is None else margin[i])
        total += math.log1p(math.exp(-d)) if d > -30 else -d + math.log1p(math.exp(d))
    return total / len(chosen)


def run(pairs, *, with_margin: bool):
    chosen = torch.tensor(pairs["chosen"], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor(pairs["rejected"], dtype=torch.float64, requires_grad=True)
    margin = torch.tensor(pairs["margin"]) if with_margin else None
    out = BradleyTerryLoss()(chosen, rejected, margin=margin)
    out.loss.backward()
    return out, chosen.grad.numpy(), rejected.grad.numpy()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("with_margin", [False, True])
def test_matches_float64_reference_in_value_and_gradient(seed, with_margin):
    pairs = random_pairs(seed)
    margin = pairs["margin"] if with_margin else None
    out, grad_c, grad_r = run(pairs, with_margin=with_margin)

    def f_chosen(c):
        return ref_bt(c, pairs["rejected"], margin)

    def f_rejected(r):
        return ref_bt(pairs["chosen"], r, margin)

    assert out.loss.item() == pytest.approx(f_chosen(pairs["chosen"]), rel=1e-12)
    np.testing.assert_allclose(grad_c, fd_grad(f_chosen, pairs["chosen"]), atol=1e-8)
    np.testing.assert_allclose(grad_r, fd_grad(f_rejected, pairs["rejected"]), atol=1e-8)


@pytest.mark.parametrize("seed", SEEDS)
def test_stats_match_reference_counts(seed):
    pairs = random_pairs(seed)
    out, _, _ = run(pairs, with_margin=True)
    c, r = pairs["chosen"], pairs["rejected"]
    wins = sum(1 for i in range(len(c)) if c[i] > r[i])
    assert out.stats["accuracy"] == pytest.approx(wins / len(c))
    assert out.stats["margin_mean"] == pytest.approx(sum(c - r) / len(c))  # gap, no m
    assert out.stats["reward_chosen_mean"] == pytest.approx(c.mean())
    assert out.stats["reward_rejected_mean"] == pytest.approx(r.mean())
    assert out.stats["loss"] == pytest.approx(out.loss.item())


def test_hand_computed_pairs_with_tie_and_float_margin():
    # gaps (2, 0, -1); margin 1 -> d = (1, -1, -2)
    # L = (log(1+e^-1) + log(1+e) + log(1+e^2)) / 3; a tie is not a win: accuracy 1/3
    chosen = torch.tensor([3.0, 1.0, 0.0], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
    out = BradleyTerryLoss()(chosen, rejected, margin=1.0)
    out.loss.backward()
    expected = (math.log1p(math.exp(-1)) + math.log1p(math.e) + math.log1p(math.exp(2))) / 3
    assert out.loss.item() == pytest.approx(expected)
    assert out.stats["accuracy"] == pytest.approx(1 / 3)
    assert out.stats["margin_mean"] == pytest.approx(1 / 3)
    # dL/dc_i = -sigmoid(-d_i) / B
    sig = [1 / (1 + math.exp(d)) for d in (1.0, -1.0, -2.0)]
    torch.testing.assert_close(
        chosen.grad, torch.tensor([-s / 3 for s in sig], dtype=torch.float64)
    )


def test_equal_rewards_cost_log_two():
    out = BradleyTerryLoss()(torch.zeros(4), torch.zeros(4))
    assert out.loss.item() == pytest.approx(math.log(2.0))
    assert out.stats["accuracy"] == 0.0


def test_extreme_gaps_stay_finite_with_exact_limits():
    chosen = torch.tensor([1000.0, -1000.0], requires_grad=True)
    rejected = torch.zeros(2)
    out = BradleyTerryLoss()(chosen, rejected)
    out.loss.backward()
    # pair 0 costs 0, pair 1 costs 1000: mean 500; gradients 0 and -1/2
    assert out.loss.item() == pytest.approx(500.0)
    torch.testing.assert_close(chosen.grad, torch.tensor([0.0, -0.5]))


def test_bfloat16_rewards_give_a_float32_loss():
    chosen = torch.tensor([0.5, 0.25], dtype=torch.bfloat16)
    out = BradleyTerryLoss()(chosen, torch.zeros(2, dtype=torch.bfloat16))
    assert out.loss.dtype == torch.float32


@pytest.mark.parametrize(
    ("chosen", "rejected", "margin", "message"),
    [
        (torch.zeros(3, 1), torch.zeros(3, 1), None, r"1-D reward vectors \[B\]"),
        (torch.zeros(3), torch.zeros(2), None, "chosen has 3 rewards but rejected has 2"),
        (torch.zeros(0), torch.zeros(0), None, "no pairs"),
        (torch.zeros(3), torch.zeros(3), torch.zeros(2), r"margin has shape \(2,\)"),
    ],
)
def test_bad_inputs_are_rejected_with_the_shape(chosen, rejected, margin, message):
    with pytest.raises(ValueError, match=message):
        BradleyTerryLoss()(chosen, rejected, margin=margin)
