"""Pins the log-ratio guard shared by every loss that exponentiates a log-ratio.

One action token whose log-ratio is +-100 overflowed ``exp`` in float32 (the trainer's
logprob dtype) before the guard: an infinite loss, NaN gradients (0 * inf in the backward of
``exp`` even where the clipped branch wins), or an infinite ``ratio_mean``. The guard
clamps the log-ratio to +-``log_ratio_clamp`` (default 20, as verl) before ``exp``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tests.training.loss_helpers import fd_grad
from tests.training.test_loss_clipped import random_batch, ref_gmpo, ref_gspo, ref_token_clip
from tests.training.test_loss_policy_gradient import ref_cispo
from tests.training.test_loss_regularizers import ref_kl

from ludic.training.losses import (
    LOG_RATIO_CLAMP,
    CISPOLoss,
    ClippedSurrogateLoss,
    DecoupledClippedSurrogateLoss,
    GMPOLoss,
    KLPenalty,
    LossInputs,
    TokenAggregation,
    TokenClippedSurrogateLoss,
)

RATIO_LOSSES = [
    DecoupledClippedSurrogateLoss(),
    DecoupledClippedSurrogateLoss(behaviour_weight_cap=None, dual_clip_c=3.0),
    TokenClippedSurrogateLoss(),
    TokenClippedSurrogateLoss(aggregation=TokenAggregation.TOKEN_MEAN),
    ClippedSurrogateLoss(),
    GMPOLoss(),
    CISPOLoss(),
    CISPOLoss(clip_eps_low=0.2),
    KLPenalty(0.1, estimator="k3", reference="old"),
    KLPenalty(0.1, estimator="k3", reference="ref"),
]


def _name(loss) -> str:
    return (
        repr(loss).split("(")[0]
        + f"-{getattr(loss, 'aggregation', '')}"
        + (f"-{loss.reference}" if isinstance(loss, KLPenalty) else "")
    )


def extreme_inputs(log_ratio: float, advantage: float, dtype=torch.float32) -> LossInputs:
    """Row 0 has one action token with logp - old_logp = ``log_ratio`` (logp 0 and old -100
    for +100; the reverse for -100) and nothing else on its mask, so a sequence-mean
    log-ratio is +-100 too; rows 1-2 are ordinary."""
    logp = torch.tensor(
        [[-1.0, 0.0, -2.0, -0.5], [-0.3, -1.2, -0.7, -2.1], [-0.9, -0.4, -1.6, -0.2]], dtype=dtype
    )
    old = logp + torch.tensor(
        [[0.0, 0.0, 0.0, 0.0], [0.1, -0.2, 0.3, 0.0], [-0.1, 0.2, 0.0, -0.3]], dtype=dtype
    )
    if log_ratio > 0:
        old[0, 1] = logp[0, 1] - log_ratio  # logp 0, old -100
    else:
        logp[0, 1], old[0, 1] = log_ratio, 0.0  # logp -100, old 0
    mask = torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    mask = mask.to(dtype)
    return LossInputs(
        logits=torch.zeros(3, 5, 2, dtype=dtype),
        logprobs=logp.requires_grad_(),
        action_mask=mask,
        weights=torch.tensor([advantage, 0.7, -0.4], dtype=dtype),
        num_sequences=3,
        num_action_tokens=int(mask.sum()),
        old_logprobs=old * mask,
        ref_logprobs=old * mask,
        proximal_logprobs=old * mask,  # decoupled PPO: the extreme ratio is pi_theta/pi_prox
    )


@pytest.mark.parametrize("loss", RATIO_LOSSES, ids=_name)
def test_a_log_ratio_of_100_gives_a_finite_loss_gradient_and_stats(loss):
    for log_ratio in (100.0, -100.0):
        for advantage in (1.0, -1.0):
            inputs = extreme_inputs(log_ratio, advantage)
            out = loss(inputs)
            out.loss.backward()
            case = f"log_ratio={log_ratio}, advantage={advantage}"
            assert torch.isfinite(out.loss), case
            assert torch.isfinite(inputs.logprobs.grad).all(), case
            bad = {k: v for k, v in out.stats.items() if not math.isfinite(v)}
            assert not bad, f"{case}: non-finite stats {bad}"


@pytest.mark.parametrize(
    "loss",
    [DecoupledClippedSurrogateLoss(), DecoupledClippedSurrogateLoss(behaviour_weight_cap=None)],
    ids=["cap-5", "no-cap"],
)
def test_a_behaviour_log_weight_of_100_gives_a_finite_decoupled_loss(loss):
    # pi_prox / pi_behav = e^+-100 on one token, pi_theta = pi_prox
    for log_weight in (100.0, -100.0):
        for advantage in (1.0, -1.0):
            inputs = extreme_inputs(log_weight, advantage)
            inputs.proximal_logprobs = inputs.logprobs.detach() * inputs.action_mask
            out = loss(inputs)
            out.loss.backward()
            case = f"log_weight={log_weight}, advantage={advantage}"
            assert torch.isfinite(out.loss), case
            assert torch.isfinite(inputs.logprobs.grad).all(), case
            assert all(math.isfinite(v) for v in out.stats.values()), case


def test_beyond_the_clamp_the_ratio_is_e_to_the_clamp_with_no_gradient():
    # row 0's only action token has log-ratio 100 and A = -1: l = -min(r A, clip(r) A) = r
    # with r = e^20; dividing by 2 sequences (SEQ_MEAN_TOKEN_MEAN).
    inputs = extreme_inputs(100.0, -1.0, dtype=torch.float64)
    inputs.weights = torch.tensor([-1.0, 0.0, 0.0], dtype=torch.float64)
    inputs.num_sequences = 2
    out = TokenClippedSurrogateLoss()(inputs)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(math.exp(LOG_RATIO_CLAMP) / 2, rel=1e-12)
    assert torch.count_nonzero(inputs.logprobs.grad) == 0
    assert LOG_RATIO_CLAMP == 20.0


# ---------------------------------------------------------------- inside the clamp


def wide_batch(seed: int) -> dict[str, np.ndarray]:
    """``random_batch`` with log-ratios logp - old spread over (-19, 19) on the mask."""
    batch = random_batch(seed)
    rng = np.random.default_rng(1000 + seed)
    shift = rng.uniform(-19.0, 19.0, size=batch["logp"].shape)
    batch["old"] = (batch["logp"] - shift) * batch["mask"]
    return batch


def to_inputs64(batch, clamp_loss) -> LossInputs:
    mask = batch["mask"]
    logp = torch.tensor(batch["logp"], requires_grad=True)
    old = torch.tensor(batch["old"])
    return LossInputs(
        logits=torch.zeros(logp.shape[0], logp.shape[1] + 1, 2, dtype=torch.float64),
        logprobs=logp,
        action_mask=torch.tensor(mask),
        weights=torch.tensor(batch["adv"]),
        num_sequences=len(mask),
        num_action_tokens=int(mask.sum()),
        old_logprobs=old,
        ref_logprobs=old,
    )


TM = TokenAggregation.TOKEN_MEAN
UNCLAMPED_REFERENCES = {
    "token_clip": (
        lambda clamp: TokenClippedSurrogateLoss(0.2, 0.28, aggregation=TM, log_ratio_clamp=clamp),
        lambda lp, b: ref_token_clip(lp, b, 0.2, 0.28, TM),
    ),
    "gspo": (
        lambda clamp: ClippedSurrogateLoss(0.1, 0.1, log_ratio_clamp=clamp),
        lambda lp, b: ref_gspo(lp, b, 0.1, 0.1),
    ),
    "gmpo": (
        lambda clamp: GMPOLoss(log_ratio_clamp=clamp),
        lambda lp, b: ref_gmpo(lp, b, 0.4, 0.4),
    ),
    "cispo": (
        lambda clamp: CISPOLoss(None, 0.28, log_ratio_clamp=clamp),  # no lower bound: r < 1 kept
        None,  # the stop-gradient weight needs the two-argument reference, below
    ),
    "kl_k3": (
        lambda clamp: KLPenalty(0.1, reference="old", log_ratio_clamp=clamp),
        lambda lp, b: ref_kl(lp, b["old"], b["mask"], "k3", 0.1, "token_mean"),
    ),
}


@pytest.mark.parametrize("kind", list(UNCLAMPED_REFERENCES))
@pytest.mark.parametrize("seed", range(3))
def test_the_clamp_changes_nothing_when_log_ratios_are_within_it(kind, seed):
    batch = wide_batch(seed)
    make, ref = UNCLAMPED_REFERENCES[kind]
    if ref is None:  # CISPO

        def ref(lp, b):
            return ref_cispo(lp, b["logp"], b, None, 0.28, TM)

    inputs = to_inputs64(batch, make)
    out = make(LOG_RATIO_CLAMP)(inputs)
    out.loss.backward()
    expected = ref(batch["logp"], batch)
    assert out.loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    # losses reach ~1e7 here, so a wider step keeps the finite differences' rounding small
    fd = fd_grad(lambda lp: ref(lp, batch), batch["logp"], h=1e-4)
    np.testing.assert_allclose(inputs.logprobs.grad.numpy(), fd, rtol=1e-6, atol=1e-4)
    # the same loss with a bound it never reaches: identical gradient
    loose = to_inputs64(batch, make)
    make(80.0)(loose).loss.backward()
    torch.testing.assert_close(inputs.logprobs.grad, loose.logprobs.grad, rtol=1e-12, atol=0.0)


@pytest.mark.parametrize(
    "cls",
    [
        TokenClippedSurrogateLoss,
        ClippedSurrogateLoss,
        GMPOLoss,
        CISPOLoss,
        DecoupledClippedSurrogateLoss,
        lambda **kw: KLPenalty(0.1, **kw),
    ],
)
@pytest.mark.parametrize("bad", [0.0, -1.0, 100.0, float("inf"), float("nan")])
def test_a_bad_log_ratio_clamp_is_rejected_by_name(cls, bad):
    with pytest.raises(ValueError, match=r"log_ratio_clamp=.*expected 0 < log_ratio_clamp <= 80"):
        cls(log_ratio_clamp=bad)
