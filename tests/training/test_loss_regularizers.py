"""Pins ``ludic.training.losses.regularizers``: KL penalty (k1/k2/k3) and entropy bonus.

References are plain float64 Python loops; gradients are central finite differences of
the reference (w.r.t. logprobs for KL, w.r.t. logits for the entropy bonus).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tests.training.loss_helpers import fd_grad

from ludic.training.losses import EntropyBonus, KLPenalty, LossInputs, TokenAggregation

MODES = list(TokenAggregation)
SEEDS = range(4)
CONST = 9
V = 5


def random_batch(seed: int) -> dict[str, np.ndarray]:
    """B in 3..5, T in 6..9, >=1 action token per row; reference and behaviour logprobs
    both perturbed from the policy's; logits [B, T, V]."""
    rng = np.random.default_rng(200 + seed)
    b, t = int(rng.integers(3, 6)), int(rng.integers(6, 10))
    mask = (rng.random((b, t - 1)) < 0.6).astype(np.float64)
    for i in range(b):
        if mask[i].sum() == 0:
            mask[i, rng.integers(t - 1)] = 1.0
    logp = -rng.uniform(0.05, 3.0, size=(b, t - 1))
    return {
        "logp": logp,
        "ref": (logp + rng.normal(0.0, 0.6, size=(b, t - 1))) * mask,
        "old": (logp + rng.normal(0.0, 0.3, size=(b, t - 1))) * mask,
        "mask": mask,
        "adv": rng.normal(size=b),
        "logits": rng.normal(0.0, 2.0, size=(b, t, V)),
    }


def to_inputs(batch, rows=slice(None)):
    mask = batch["mask"]
    return LossInputs(
        logits=torch.tensor(batch["logits"][rows], requires_grad=True),
        logprobs=torch.tensor(batch["logp"][rows], requires_grad=True),
        action_mask=torch.tensor(mask[rows]),
        weights=torch.tensor(batch["adv"][rows]),
        num_sequences=len(mask),
        num_action_tokens=int(mask.sum()),
        old_logprobs=torch.tensor(batch["old"][rows]),
        ref_logprobs=torch.tensor(batch["ref"][rows]),
    )


def ref_aggregate(per_token, mask, mode) -> float:
    n_seq, n_tok = len(mask), mask.sum()
    total = 0.0
    for i in range(len(mask)):
        row = [per_token[i][t] for t in range(len(mask[i])) if mask[i][t] == 1.0]
        total += sum(row) / len(row) / n_seq if mode == "seq_mean_token_mean" else sum(row)
    if mode == "token_mean":
        return total / n_tok
    if mode == "constant":
        return total / (n_seq * CONST)
    return total


def ref_kl(logp, target, mask, estimator, beta, mode) -> float:
    """Schulman's estimators of KL(pi_theta || pi_target) with r = pi_target / pi_theta."""
    per_token = []
    for i in range(len(logp)):
        row = []
        for t in range(len(logp[i])):
            r = math.exp(target[i][t] - logp[i][t])
            k = {"k1": -math.log(r), "k2": 0.5 * math.log(r) ** 2, "k3": r - 1 - math.log(r)}
            row.append(k[estimator])
        per_token.append(row)
    return beta * ref_aggregate(per_token, mask, mode)


def ref_entropy_bonus(logits, mask, coef, mode) -> float:
    """-coef * agg_t(H_t), H_t = -sum_v p log p of the distribution at position t."""
    per_token = []
    for i in range(len(mask)):
        row = []
        for t in range(len(mask[i])):
            z = [math.exp(x) for x in logits[i][t]]
            p = [x / sum(z) for x in z]
            row.append(-sum(q * math.log(q) for q in p))
        per_token.append(row)
    return -coef * ref_aggregate(per_token, mask, mode)


def with_const(mode):
    return CONST if mode == TokenAggregation.CONSTANT else None


# ---------------------------------------------------------------- KL penalty


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("reference", ["ref", "old"])
def test_kl_penalty_matches_schulman_estimators(seed, estimator, reference):
    batch = random_batch(seed)
    loss = KLPenalty(beta=0.3, estimator=estimator, reference=reference)
    inputs = to_inputs(batch)
    out = loss(inputs)
    out.loss.backward()

    def f(lp):
        return ref_kl(lp, batch[reference], batch["mask"], estimator, 0.3, "token_mean")

    assert out.loss.item() == pytest.approx(f(batch["logp"]), rel=1e-10)
    np.testing.assert_allclose(inputs.logprobs.grad.numpy(), fd_grad(f, batch["logp"]), atol=1e-7)
    assert out.stats["kl"] == pytest.approx(f(batch["logp"]) / 0.3, rel=1e-10)


@pytest.mark.parametrize("mode", MODES)
def test_kl_penalty_honours_aggregation(mode):
    batch = random_batch(0)
    loss = KLPenalty(beta=1.0, aggregation=mode, constant_normalizer=with_const(mode))
    expected = ref_kl(batch["logp"], batch["ref"], batch["mask"], "k3", 1.0, mode.value)
    assert loss(to_inputs(batch)).loss.item() == pytest.approx(expected, rel=1e-10)


def test_kl_penalty_k3_hand_computed():
    # logp = log 0.5, ref = log 0.25: r = 0.5, k3 = 0.5 - 1 - log 0.5 = log 2 - 0.5
    inputs = LossInputs(
        logits=torch.zeros(1, 3, 2),
        logprobs=torch.tensor([[0.0, math.log(0.5)]]),
        action_mask=torch.tensor([[0.0, 1.0]]),
        weights=torch.tensor([1.0]),
        num_sequences=1,
        num_action_tokens=1,
        ref_logprobs=torch.tensor([[0.0, math.log(0.25)]]),
    )
    out = KLPenalty(beta=2.0)(inputs)
    assert out.loss.item() == pytest.approx(2.0 * (math.log(2.0) - 0.5), rel=1e-6)


def test_kl_penalty_declares_the_logprobs_it_reads():
    assert KLPenalty(0.1, reference="ref").requires_ref_logprobs is True
    assert KLPenalty(0.1, reference="ref").requires_old_logprobs is False
    assert KLPenalty(0.1, reference="old").requires_old_logprobs is True
    assert KLPenalty(0.1, reference="old").requires_ref_logprobs is False


def test_kl_penalty_without_reference_logprobs_says_how_to_fix():
    inputs = to_inputs(random_batch(0))
    inputs.ref_logprobs = None
    with pytest.raises(ValueError, match="needs reference-model logprobs") as err:
        KLPenalty(0.1)(inputs)
    assert "reference='old'" in str(err.value)


def test_kl_penalty_against_old_without_old_logprobs_names_request_option():
    inputs = to_inputs(random_batch(0))
    inputs.old_logprobs = None
    with pytest.raises(ValueError, match=r"ReturnSpec\.for_rl\(\)"):
        KLPenalty(0.1, reference="old")(inputs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"beta": -1.0}, "beta=-1.0"),
        ({"beta": 0.1, "estimator": "k4"}, "estimator='k4'"),
        ({"beta": 0.1, "reference": "base"}, "reference='base'"),
    ],
)
def test_kl_penalty_rejects_bad_arguments_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KLPenalty(**kwargs)


# ---------------------------------------------------------------- entropy bonus


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
def test_entropy_bonus_matches_reference_in_value_and_logit_gradient(seed, mode):
    batch = random_batch(seed)
    loss = EntropyBonus(coef=0.05, aggregation=mode, constant_normalizer=with_const(mode))
    inputs = to_inputs(batch)
    out = loss(inputs)
    out.loss.backward()

    def f(logits):
        return ref_entropy_bonus(logits, batch["mask"], 0.05, mode.value)

    # masked_token_entropy computes in float32
    assert out.loss.item() == pytest.approx(f(batch["logits"]), rel=1e-5)
    np.testing.assert_allclose(
        inputs.logits.grad.numpy(), fd_grad(f, batch["logits"]), rtol=1e-4, atol=1e-6
    )
    assert np.all(inputs.logits.grad.numpy()[:, -1] == 0.0)  # last position predicts nothing


def test_entropy_bonus_of_uniform_distribution_is_minus_coef_log_v():
    inputs = LossInputs(
        logits=torch.zeros(2, 4, V),
        logprobs=torch.zeros(2, 3),
        action_mask=torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]),
        weights=torch.ones(2),
        num_sequences=2,
        num_action_tokens=3,
    )
    out = EntropyBonus(coef=0.1)(inputs)
    assert out.loss.item() == pytest.approx(-0.1 * math.log(V), rel=1e-6)
    assert out.stats["entropy"] == pytest.approx(math.log(V), rel=1e-6)


def test_entropy_bonus_rejects_negative_coef():
    with pytest.raises(ValueError, match="coef=-0.1"):
        EntropyBonus(coef=-0.1)


# ---------------------------------------------------------------- gradient accumulation


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["kl", "entropy"])
@pytest.mark.parametrize("seed", range(3))
def test_micro_batches_with_step_normalizers_sum_to_full_batch(kind, mode, seed):
    const = with_const(mode)
    if kind == "kl":
        loss = KLPenalty(0.2, aggregation=mode, constant_normalizer=const)
        wrt = "logprobs"
    else:
        loss = EntropyBonus(0.2, aggregation=mode, constant_normalizer=const)
        wrt = "logits"
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
        grads.append(getattr(part, wrt).grad)
    assert total == pytest.approx(full_out.loss.item(), rel=1e-6)
    torch.testing.assert_close(torch.cat(grads), getattr(full, wrt).grad)
