"""Pins ``ludic.training.losses.decoupled``: decoupled PPO (AReaL, arXiv:2505.24298).

The reference is written per token with explicit loops over 0-d float64 tensors, so its
gradient comes from autograd on the reference itself, independently of the vectorized
loss; the behaviour weight is a Python float there (no gradient by construction).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ludic.training.losses import (
    CISPOLoss,
    ClippedSurrogateLoss,
    CompositeLoss,
    DecoupledClippedSurrogateLoss,
    EntropyBonus,
    GMPOLoss,
    KLPenalty,
    Loss,
    LossInputs,
    MaskedCausalLMCrossEntropyLoss,
    ReinforceLoss,
    TokenAggregation,
    TokenClippedSurrogateLoss,
)

MODES = list(TokenAggregation)
CONST = 12


def random_batch(seed: int) -> dict[str, np.ndarray]:
    """B in 5..7, T in 8..11, >=1 action token per row, advantages of both signs;
    pi_prox near pi_theta (some ratios clipped), pi_behav further off (w from ~e^-3 to
    ~e^3, so a cap of 2 is hit and missed)."""
    rng = np.random.default_rng(300 + seed)
    b, t = int(rng.integers(5, 8)), int(rng.integers(8, 12))
    mask = (rng.random((b, t - 1)) < 0.6).astype(np.float64)
    for i in range(b):
        if mask[i].sum() == 0:
            mask[i, rng.integers(t - 1)] = 1.0
    logp = -rng.uniform(0.05, 3.0, size=(b, t - 1))
    prox = (logp + rng.normal(0.0, 0.5, size=(b, t - 1))) * mask
    behav = (prox + rng.normal(0.0, 1.0, size=(b, t - 1))) * mask
    adv = rng.uniform(0.2, 2.0, size=b) * np.where(np.arange(b) % 2 == 0, 1.0, -1.0)
    return {"logp": logp, "prox": prox, "behav": behav, "mask": mask, "adv": adv}


def to_inputs(batch, rows=slice(None), *, proximal="prox") -> LossInputs:
    mask = batch["mask"]
    logp = torch.tensor(batch["logp"][rows], requires_grad=True)
    b, t1 = logp.shape
    return LossInputs(
        logits=torch.zeros(b, t1 + 1, 2, dtype=torch.float64),
        logprobs=logp,
        action_mask=torch.tensor(mask[rows]),
        weights=torch.tensor(batch["adv"][rows]),
        num_sequences=len(mask),
        num_action_tokens=int(mask.sum()),
        old_logprobs=torch.tensor(batch["behav"][rows]),
        proximal_logprobs=None if proximal is None else torch.tensor(batch[proximal][rows]),
    )


def reference(batch, *, eps=(0.2, 0.28), cap, weight_mode, dual_c, mode):
    """Decoupled PPO, token by token: returns (loss, d loss / d logp, stats)."""
    mask, adv = batch["mask"], batch["adv"]
    logp = torch.tensor(batch["logp"], requires_grad=True)
    per_token: list[list[torch.Tensor]] = []
    weights, capped = [], []
    for i in range(len(mask)):
        row = []
        for t in range(len(mask[i])):
            if mask[i][t] != 1.0:
                row.append(torch.zeros((), dtype=torch.float64))
                continue
            r = torch.exp(logp[i, t] - batch["prox"][i][t])
            w = math.exp(batch["prox"][i][t] - batch["behav"][i][t])
            over = cap is not None and w > cap
            if over:
                w = cap if weight_mode == "truncate" else 0.0
            weights.append(w)
            capped.append(over)
            a = float(adv[i])
            surrogate = torch.minimum(r * a, torch.clamp(r, 1 - eps[0], 1 + eps[1]) * a)
            if dual_c is not None and a < 0:
                surrogate = torch.maximum(surrogate, torch.tensor(dual_c * a, dtype=torch.float64))
            row.append(-w * surrogate)
        per_token.append(row)
    n_seq, n_tok = len(mask), int(mask.sum())
    total = torch.zeros((), dtype=torch.float64)
    for i, row in enumerate(per_token):
        row_sum = sum(row, torch.zeros((), dtype=torch.float64))
        if mode == TokenAggregation.SEQ_MEAN_TOKEN_MEAN:
            total = total + row_sum / mask[i].sum() / n_seq
        else:
            total = total + row_sum
    if mode == TokenAggregation.TOKEN_MEAN:
        total = total / n_tok
    elif mode == TokenAggregation.CONSTANT:
        total = total / (n_seq * CONST)
    total.backward()
    stats = {
        "behaviour_weight_mean": sum(weights) / n_tok,
        "behaviour_weight_capped_frac": sum(capped) / n_tok,
    }
    return total.item(), logp.grad.numpy(), stats


def with_const(mode):
    return CONST if mode == TokenAggregation.CONSTANT else None


# ---------------------------------------------------------------- against the reference


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("weight_mode", ["truncate", "mask"])
@pytest.mark.parametrize("cap", [None, 2.0])
@pytest.mark.parametrize("dual_c", [None, 1.3])
def test_decoupled_ppo_matches_token_loop_reference(seed, mode, weight_mode, cap, dual_c):
    batch = random_batch(seed)
    loss = DecoupledClippedSurrogateLoss(
        0.2,
        0.28,
        behaviour_weight_cap=cap,
        behaviour_weight_mode=weight_mode,
        dual_clip_c=dual_c,
        aggregation=mode,
        constant_normalizer=with_const(mode),
    )
    inputs = to_inputs(batch)
    out = loss(inputs)
    out.loss.backward()
    value, grad, ref_stats = reference(
        batch, cap=cap, weight_mode=weight_mode, dual_c=dual_c, mode=mode
    )
    assert out.loss.item() == pytest.approx(value, rel=1e-10, abs=1e-12)
    np.testing.assert_allclose(inputs.logprobs.grad.numpy(), grad, rtol=1e-10, atol=1e-12)
    for key, expected in ref_stats.items():
        assert out.stats[key] == pytest.approx(expected, rel=1e-10), key
    # the inputs exercise every branch they switch on
    assert 0.0 < out.stats["clip_frac"] < 1.0
    if cap is not None:
        assert 0.0 < out.stats["behaviour_weight_capped_frac"] < 1.0
    if dual_c is not None:
        assert out.stats["dual_clip_frac"] > 0.0


# ---------------------------------------------------------------- pi_prox = pi_behav


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "options",
    [{}, {"behaviour_weight_mode": "truncate"}, {"behaviour_weight_cap": None}],
    ids=["mask-cap5", "truncate-cap5", "no-cap"],
)
@pytest.mark.parametrize("dual_c", [None, 1.3])
def test_equals_token_clipped_surrogate_when_proximal_is_behaviour(seed, mode, options, dual_c):
    batch = random_batch(seed)
    batch["prox"] = batch["behav"]
    common = {
        "clip_eps_low": 0.2,
        "clip_eps_high": 0.28,
        "aggregation": mode,
        "constant_normalizer": with_const(mode),
        "dual_clip_c": dual_c,
    }
    decoupled_inputs, plain_inputs = to_inputs(batch), to_inputs(batch)
    decoupled = DecoupledClippedSurrogateLoss(**common, **options)(decoupled_inputs)
    plain = TokenClippedSurrogateLoss(**common)(plain_inputs)
    decoupled.loss.backward()
    plain.loss.backward()
    assert decoupled.loss.item() == plain.loss.item()
    assert torch.equal(decoupled_inputs.logprobs.grad, plain_inputs.logprobs.grad)
    for key in ("ratio_mean", "clip_frac", "approx_kl"):
        assert decoupled.stats[key] == plain.stats[key]
    assert decoupled.stats["behaviour_weight_mean"] == 1.0
    assert decoupled.stats["behaviour_weight_capped_frac"] == 0.0


# ---------------------------------------------------------------- hand-computed


def test_hand_computed_weights_in_both_modes():
    # one row, A = +1, two tokens, pi_theta = pi_prox (r = 1, no clipping):
    # token 0: w = e^0.5 ~ 1.65 (under cap 2), token 1: w = e^1 ~ 2.72 (over cap 2).
    # truncate: l = -(e^0.5 + 2) / 2;  mask: l = -(e^0.5 + 0) / 2   (TOKEN_MEAN)
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    for weight_mode, second in (("truncate", 2.0), ("mask", 0.0)):
        inputs = LossInputs(
            logits=torch.zeros(1, 3, 2),
            logprobs=logp.clone().requires_grad_(),
            action_mask=torch.ones(1, 2, dtype=torch.float64),
            weights=torch.tensor([1.0], dtype=torch.float64),
            num_sequences=1,
            num_action_tokens=2,
            old_logprobs=logp - torch.tensor([[0.5, 1.0]], dtype=torch.float64),
            proximal_logprobs=logp.clone(),
        )
        loss = DecoupledClippedSurrogateLoss(
            behaviour_weight_cap=2.0, behaviour_weight_mode=weight_mode
        )
        out = loss(inputs)
        out.loss.backward()
        w0 = math.exp(0.5)
        assert out.loss.item() == pytest.approx(-(w0 + second) / 2)
        # d(-w r A)/dlogp = -w r A = -w at r = 1, / 2 tokens
        torch.testing.assert_close(
            inputs.logprobs.grad, torch.tensor([[-w0 / 2, -second / 2]], dtype=torch.float64)
        )
        assert out.stats["behaviour_weight_mean"] == pytest.approx((w0 + second) / 2)
        assert out.stats["behaviour_weight_capped_frac"] == pytest.approx(0.5)
        assert out.stats["ratio_mean"] == pytest.approx(1.0)


def test_the_behaviour_weight_carries_no_gradient_to_proximal_logprobs():
    inputs = to_inputs(random_batch(0))
    inputs.proximal_logprobs.requires_grad_(True)
    DecoupledClippedSurrogateLoss()(inputs).loss.backward()
    assert inputs.proximal_logprobs.grad is None


# ---------------------------------------------------------------- contract and errors


def test_missing_proximal_logprobs_names_the_loss_and_the_fix():
    inputs = to_inputs(random_batch(0), proximal=None)
    with pytest.raises(ValueError) as err:
        DecoupledClippedSurrogateLoss()(inputs)
    message = str(err.value)
    assert message.startswith("DecoupledClippedSurrogateLoss needs proximal logprobs")
    assert "requires_proximal_logprobs" in message
    assert "torch.no_grad()" in message


def test_missing_behaviour_logprobs_names_the_request_option():
    inputs = to_inputs(random_batch(0))
    inputs.old_logprobs = None
    with pytest.raises(ValueError, match="ReturnSpec.for_rl()"):
        DecoupledClippedSurrogateLoss()(inputs)


def test_proximal_logprobs_with_wrong_shape_are_rejected():
    inputs = to_inputs(random_batch(0))
    inputs.proximal_logprobs = inputs.proximal_logprobs[:, :-1]
    with pytest.raises(ValueError, match="proximal_logprobs has shape"):
        DecoupledClippedSurrogateLoss()(inputs)


def test_decoupled_loss_declares_all_three_logprob_sources():
    loss = DecoupledClippedSurrogateLoss()
    assert isinstance(loss, Loss)
    assert loss.requires_old_logprobs is True
    assert loss.requires_proximal_logprobs is True
    assert loss.requires_ref_logprobs is False


def test_defaults_follow_areal():
    loss = DecoupledClippedSurrogateLoss()
    assert (loss.clip_eps_low, loss.clip_eps_high) == (0.2, 0.2)
    assert (loss.behaviour_weight_cap, loss.behaviour_weight_mode) == (5.0, "mask")
    assert loss.aggregation == TokenAggregation.TOKEN_MEAN
    assert loss.dual_clip_c is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"behaviour_weight_cap": 0.5}, r"behaviour_weight_cap=0\.5; expected a finite value >= 1"),
        ({"behaviour_weight_cap": float("inf")}, r"behaviour_weight_cap=inf"),
        ({"behaviour_weight_cap": float("nan")}, r"behaviour_weight_cap=nan"),
        ({"behaviour_weight_mode": "clip"}, r"behaviour_weight_mode='clip'; expected one of"),
        ({"dual_clip_c": 1.0}, r"dual_clip_c=1\.0; expected a finite value > 1"),
        ({"clip_eps_low": -0.1}, r"clip_eps_low=-0\.1"),
        ({"aggregation": "sum"}, r"aggregation='sum'"),
    ],
)
def test_bad_arguments_are_rejected_by_name(kwargs, match):
    with pytest.raises(ValueError, match=rf"DecoupledClippedSurrogateLoss: {match}"):
        DecoupledClippedSurrogateLoss(**kwargs)


def test_composite_loss_forwards_the_proximal_requirement():
    plain = CompositeLoss([(1.0, TokenClippedSurrogateLoss()), (0.01, EntropyBonus(0.1))])
    decoupled = CompositeLoss([(1.0, DecoupledClippedSurrogateLoss()), (0.1, KLPenalty(0.1))])
    assert plain.requires_proximal_logprobs is False
    assert decoupled.requires_proximal_logprobs is True


def test_every_other_loss_declares_it_needs_no_proximal_logprobs():
    others = [
        ReinforceLoss(),
        CISPOLoss(),
        TokenClippedSurrogateLoss(),
        ClippedSurrogateLoss(),
        GMPOLoss(),
        MaskedCausalLMCrossEntropyLoss(),
        KLPenalty(0.1),
        EntropyBonus(0.1),
    ]
    for loss in others:
        assert isinstance(loss, Loss)
        assert loss.requires_proximal_logprobs is False, type(loss).__name__


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(2))
def test_micro_batches_with_step_normalizers_sum_to_full_batch(mode, seed):
    batch = random_batch(seed)
    loss = DecoupledClippedSurrogateLoss(
        behaviour_weight_cap=2.0, aggregation=mode, constant_normalizer=with_const(mode)
    )
    full = to_inputs(batch)
    full_out = loss(full)
    full_out.loss.backward()
    split = 1 + seed % (len(batch["mask"]) - 1)
    total, grads = 0.0, []
    for rows in (slice(0, split), slice(split, None)):
        part = to_inputs(batch, rows)
        out = loss(part)
        out.loss.backward()
        total += out.loss.item()
        grads.append(part.logprobs.grad)
    assert total == pytest.approx(full_out.loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.cat(grads), full.logprobs.grad, rtol=1e-12, atol=1e-14)
