"""Pins ``ludic.training.algorithm``: presets assemble the documented parts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ludic.training.algorithm import (
    BatchMeanBaseline,
    RLAlgorithm,
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
from ludic.training.credit_assignment import (
    ConstantCredit,
    GroupNormalizedReturn,
    MonteCarloReturn,
)
from ludic.training.losses import (
    CISPOLoss,
    ClippedSurrogateLoss,
    DecoupledClippedSurrogateLoss,
    GMPOLoss,
    LossInputs,
    MaskedCausalLMCrossEntropyLoss,
    ReinforceLoss,
    TokenAggregation,
    TokenClippedSurrogateLoss,
)
from ludic.training.types import SAWBatch, SAWItem
from ludic.types import AgentStep, EnvironmentStep, Rollout


def make_inputs(seed: int = 0, with_old: bool = True) -> LossInputs:
    g = torch.Generator().manual_seed(seed)
    b, t = 4, 8
    mask = (torch.rand(b, t - 1, generator=g) < 0.5).double()
    mask[:, -1] = 1.0
    logp = -torch.rand(b, t - 1, generator=g, dtype=torch.float64) * 2
    return LossInputs(
        logits=torch.zeros(b, t, 3),
        logprobs=logp.requires_grad_(),
        action_mask=mask,
        weights=torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=torch.float64),
        num_sequences=b,
        num_action_tokens=int(mask.sum()),
        old_logprobs=(logp.detach() * mask) if with_old else None,
    )


def item(weight: float, **meta) -> SAWItem:
    return SAWItem(
        input_ids=(1, 2, 3),
        action_mask=(0, 1, 1),
        weight=weight,
        old_logprobs=(0.0, -0.5, -0.25),
        policy_version=3,
        meta=meta,
    )


# ---------------------------------------------------------------- preset parts


@pytest.mark.parametrize(
    ("algo", "credit", "loss_cls", "aggregation"),
    [
        (make_reinforce(), MonteCarloReturn, ReinforceLoss, TokenAggregation.TOKEN_MEAN),
        (make_reinforce_baseline(), MonteCarloReturn, ReinforceLoss, TokenAggregation.TOKEN_MEAN),
        (
            make_grpo(8),
            GroupNormalizedReturn,
            TokenClippedSurrogateLoss,
            TokenAggregation.SEQ_MEAN_TOKEN_MEAN,
        ),
        (
            make_dr_grpo(8, max_tokens=512),
            GroupNormalizedReturn,
            TokenClippedSurrogateLoss,
            TokenAggregation.CONSTANT,
        ),
        (make_gspo(8), GroupNormalizedReturn, ClippedSurrogateLoss, None),
        (make_cispo(8), GroupNormalizedReturn, CISPOLoss, TokenAggregation.TOKEN_MEAN),
        (make_gmpo(), GroupNormalizedReturn, GMPOLoss, None),
        (
            make_decoupled_ppo(),
            MonteCarloReturn,
            DecoupledClippedSurrogateLoss,
            TokenAggregation.TOKEN_MEAN,
        ),
        (
            make_decoupled_grpo(8),
            GroupNormalizedReturn,
            DecoupledClippedSurrogateLoss,
            TokenAggregation.TOKEN_MEAN,
        ),
        (make_sft(), ConstantCredit, MaskedCausalLMCrossEntropyLoss, TokenAggregation.TOKEN_MEAN),
    ],
    ids=lambda x: x.name if isinstance(x, RLAlgorithm) else None,
)
def test_preset_assembles_credit_loss_and_aggregation(algo, credit, loss_cls, aggregation):
    assert isinstance(algo, RLAlgorithm)
    assert type(algo.credit_assigner) is credit
    assert type(algo.loss) is loss_cls
    assert getattr(algo.loss, "aggregation", None) == aggregation


def test_grpo_preset_passes_group_size_clip_and_std_flag():
    algo = make_grpo(16, clip_eps_low=0.1, clip_eps_high=0.3, normalize_std=False)
    assert algo.credit_assigner == GroupNormalizedReturn(16, normalize_std=False)
    assert (algo.loss.clip_eps_low, algo.loss.clip_eps_high) == (0.1, 0.3)
    assert algo.preprocess is None


def test_dr_grpo_drops_std_and_normalizes_by_the_token_budget():
    algo = make_dr_grpo(4, max_tokens=256)
    assert algo.credit_assigner.normalize_std is False
    assert algo.loss.constant_normalizer == 256


def test_gspo_gmpo_cispo_defaults_follow_their_papers():
    gspo, gmpo, cispo = make_gspo(4).loss, make_gmpo().loss, make_cispo(4).loss
    assert (gspo.clip_eps_low, gspo.clip_eps_high) == (3e-4, 4e-4)
    assert (gmpo.clip_eps_low, gmpo.clip_eps_high) == (0.4, 0.4)
    assert make_gmpo().credit_assigner.group_size == 4
    assert cispo.clip_eps_low is None


def test_grpo_and_dr_grpo_pass_dual_clip():
    assert make_grpo(4).loss.dual_clip_c is None
    assert make_grpo(4, dual_clip_c=3.0).loss.dual_clip_c == 3.0
    assert make_dr_grpo(4, max_tokens=64, dual_clip_c=2.5).loss.dual_clip_c == 2.5


def test_grpo_truncated_is_cap_swaps_in_the_decoupled_loss_with_truncation():
    algo = make_grpo(4, clip_eps_low=0.1, clip_eps_high=0.3, truncated_is_cap=2.0)
    loss = algo.loss
    assert algo.name == "grpo" and algo.credit_assigner == GroupNormalizedReturn(4)
    assert type(loss) is DecoupledClippedSurrogateLoss
    assert (loss.behaviour_weight_cap, loss.behaviour_weight_mode) == (2.0, "truncate")
    assert (loss.clip_eps_low, loss.clip_eps_high) == (0.1, 0.3)
    assert loss.aggregation == TokenAggregation.SEQ_MEAN_TOKEN_MEAN
    assert loss.requires_proximal_logprobs is True


def test_grpo_truncated_is_equals_plain_grpo_without_a_mismatch():
    # trainer and server agree (proximal = behaviour): the IS weight is 1 everywhere
    plain_inputs, tis_inputs = make_inputs(), make_inputs()
    tis_inputs.proximal_logprobs = tis_inputs.old_logprobs
    plain = make_grpo(4, dual_clip_c=3.0).loss(plain_inputs)
    tis = make_grpo(4, dual_clip_c=3.0, truncated_is_cap=2.0).loss(tis_inputs)
    plain.loss.backward()
    tis.loss.backward()
    assert tis.loss.item() == plain.loss.item()
    assert torch.equal(tis_inputs.logprobs.grad, plain_inputs.logprobs.grad)


def test_grpo_truncated_is_truncates_the_server_mismatch_at_the_cap():
    # one action token, r = pi_theta / pi_prox = 1, pi_prox / pi_behav = e > cap 2:
    # l = -min(w, 2) * 1 * A with A = 1; SEQ_MEAN_TOKEN_MEAN over one sequence
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(
        logits=torch.zeros(1, 2, 2),
        logprobs=logp,
        action_mask=torch.ones(1, 1, dtype=torch.float64),
        weights=torch.tensor([1.0], dtype=torch.float64),
        num_sequences=1,
        num_action_tokens=1,
        old_logprobs=torch.tensor([[-2.0]], dtype=torch.float64),
        proximal_logprobs=torch.tensor([[-1.0]], dtype=torch.float64),
    )
    out = make_grpo(4, truncated_is_cap=2.0).loss(inputs)
    assert out.loss.item() == pytest.approx(-2.0)
    assert out.stats["behaviour_weight_capped_frac"] == 1.0


@pytest.mark.parametrize("cap", [0.5, float("inf"), float("nan")])
def test_grpo_rejects_a_truncated_is_cap_below_one_by_name(cap):
    with pytest.raises(ValueError, match=r"make_grpo: truncated_is_cap=.*>= 1"):
        make_grpo(4, truncated_is_cap=cap)


def test_decoupled_ppo_uses_batch_normalized_returns():
    algo = make_decoupled_ppo(gamma=0.9)
    assert algo.name == "decoupled_ppo"
    assert algo.credit_assigner == MonteCarloReturn(gamma=0.9)
    assert algo.preprocess == BatchMeanBaseline(normalize_std=True)
    batch = algo.preprocess(SAWBatch(items=[item(1.0), item(0.0), item(0.0), item(1.0)]))
    assert [i.weight for i in batch.items] == pytest.approx([1.0, -1.0, -1.0, 1.0], rel=1e-5)


@pytest.mark.parametrize("make", [make_decoupled_ppo, lambda **kw: make_decoupled_grpo(4, **kw)])
def test_decoupled_presets_pass_clip_cap_mode_and_dual_clip(make):
    default = make().loss
    assert (default.behaviour_weight_cap, default.behaviour_weight_mode) == (5.0, "mask")
    assert default.dual_clip_c is None
    loss = make(
        clip_eps_low=0.1,
        clip_eps_high=0.28,
        dual_clip_c=3.0,
        behaviour_weight_cap=None,
        behaviour_weight_mode="truncate",
    ).loss
    assert (loss.clip_eps_low, loss.clip_eps_high, loss.dual_clip_c) == (0.1, 0.28, 3.0)
    assert (loss.behaviour_weight_cap, loss.behaviour_weight_mode) == (None, "truncate")
    assert loss.requires_old_logprobs and loss.requires_proximal_logprobs


def test_decoupled_grpo_passes_group_size_and_std_flag():
    algo = make_decoupled_grpo(16, normalize_std=False)
    assert algo.name == "decoupled_grpo"
    assert algo.credit_assigner == GroupNormalizedReturn(16, normalize_std=False)
    assert algo.preprocess is None


@pytest.mark.parametrize("make", [make_decoupled_ppo, make_decoupled_grpo])
def test_decoupled_presets_report_missing_proximal_logprobs(make):
    algo = make() if make is make_decoupled_ppo else make(4)
    with pytest.raises(ValueError, match="DecoupledClippedSurrogateLoss needs proximal logprobs"):
        algo.loss(make_inputs())


def test_sft_credit_gives_every_turn_weight_one():
    rollout = Rollout(
        steps=[
            AgentStep(index=0, turn_id="a", prompt_messages=[], completion="x"),
            EnvironmentStep(
                index=1, turn_id="a", prev_obs="o", action="x", next_obs=None, reward=-3.0
            ),
        ]
    )
    assert make_sft().credit_assigner.compute([rollout]) == [[1.0]]


def test_sft_loss_equals_reinforce_with_unit_weights_under_token_mean():
    sft_inputs = make_inputs(with_old=False)
    sft = make_sft().loss(sft_inputs)
    sft.loss.backward()

    pg_inputs = make_inputs(with_old=False)
    pg_inputs.weights = torch.ones_like(pg_inputs.weights)
    pg = ReinforceLoss(aggregation=TokenAggregation.TOKEN_MEAN)(pg_inputs)
    pg.loss.backward()

    assert sft.loss.item() == pytest.approx(pg.loss.item(), rel=1e-12)
    torch.testing.assert_close(sft_inputs.logprobs.grad, pg_inputs.logprobs.grad)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("make", [make_grpo, make_gspo, make_cispo, make_gmpo])
def test_off_policy_presets_report_missing_behaviour_logprobs(make):
    algo = make(4)
    assert algo.loss.requires_old_logprobs
    with pytest.raises(ValueError, match="needs behaviour logprobs but the batch has none") as e:
        algo.loss(make_inputs(with_old=False))
    assert "InferenceSpec(returns=ReturnSpec.for_rl())" in str(e.value)


def test_grpo_missing_old_logprobs_message_is_exact():
    with pytest.raises(ValueError) as e:
        make_grpo(4).loss(make_inputs(with_old=False))
    assert str(e.value) == (
        "TokenClippedSurrogateLoss needs behaviour logprobs but the batch has none; "
        "request them with InferenceSpec(returns=ReturnSpec.for_rl())"
    )


@pytest.mark.parametrize(
    "make",
    [
        make_grpo,
        make_gspo,
        make_cispo,
        make_gmpo,
        make_decoupled_grpo,
        lambda g: make_dr_grpo(g, 128),
    ],
)
@pytest.mark.parametrize("group_size", [0, 1])
def test_group_presets_reject_group_size_below_two(make, group_size):
    with pytest.raises(ValueError, match=rf"group_size={group_size}"):
        make(group_size)


@pytest.mark.parametrize(
    "make", [make_grpo, make_gspo, make_gmpo, make_cispo, make_dr_grpo, make_decoupled_grpo]
)
def test_group_presets_reject_negative_clip_eps_by_name(make):
    extra = {"max_tokens": 64} if make is make_dr_grpo else {}
    with pytest.raises(ValueError, match=r"clip_eps_high=-0\.2"):
        make(4, clip_eps_high=-0.2, **extra)
    if make is not make_cispo:
        with pytest.raises(ValueError, match=r"clip_eps_low=-0\.2"):
            make(4, clip_eps_low=-0.2, **extra)


@pytest.mark.parametrize("max_tokens", [0, -5])
def test_dr_grpo_rejects_non_positive_max_tokens(max_tokens):
    with pytest.raises(ValueError, match=rf"max_tokens={max_tokens}"):
        make_dr_grpo(4, max_tokens=max_tokens)


def test_reinforce_rejects_gamma_above_one():
    with pytest.raises(ValueError, match="gamma=2"):
        make_reinforce(gamma=2.0)


def test_rl_algorithm_rejects_a_loss_without_the_loss_contract():
    with pytest.raises(TypeError, match="is not a Loss"):
        RLAlgorithm("bad", MonteCarloReturn(), loss=lambda inputs: inputs)  # type: ignore[arg-type]


# ---------------------------------------------------------------- batch-mean baseline


def test_reinforce_baseline_preset_subtracts_batch_mean_weight():
    algo = make_reinforce_baseline()
    assert isinstance(algo.preprocess, BatchMeanBaseline)
    out = algo.preprocess(SAWBatch(items=[item(1.0), item(2.0), item(6.0)]))
    assert [i.weight for i in out.items] == pytest.approx([-2.0, -1.0, 3.0])


def test_batch_mean_baseline_can_divide_by_population_std():
    batch = SAWBatch(items=[item(1.0), item(3.0)], meta={"step": 7})
    out = BatchMeanBaseline(normalize_std=True, eps=0.0)(batch)
    assert [i.weight for i in out.items] == pytest.approx([-1.0, 1.0])
    assert out.meta == {"step": 7}


def test_batch_mean_baseline_returns_new_items_and_keeps_other_fields():
    original = [item(1.0, rollout_id="r0"), item(3.0, rollout_id="r1")]
    batch = SAWBatch(items=list(original))
    out = BatchMeanBaseline()(batch)
    assert [i.weight for i in batch.items] == [1.0, 3.0]  # input untouched
    assert out.items[0] == dataclasses.replace(original[0], weight=-1.0)
    assert out.items[1].meta == {"rollout_id": "r1"}


def test_batch_mean_baseline_of_equal_weights_is_zero():
    out = BatchMeanBaseline(normalize_std=True)(SAWBatch(items=[item(0.1)] * 3))
    assert [i.weight for i in out.items] == [0.0, 0.0, 0.0]
    assert BatchMeanBaseline()(SAWBatch(items=[])).items == []


@pytest.mark.parametrize(
    "algorithm",
    [
        make_grpo(3),
        make_dr_grpo(3, max_tokens=16),
        make_gspo(3),
        make_cispo(3),
        make_gmpo(3),
        make_decoupled_grpo(3),
        make_reinforce(group_size=3),
        make_reinforce_baseline(group_size=3),
        make_decoupled_ppo(group_size=3),
    ],
    ids=lambda a: a.name,
)
def test_a_preset_carries_the_request_strategy_its_groups_need(algorithm) -> None:
    from ludic.rollouts.requests import EnvSpec, ProtocolSpec, RolloutRequest

    request = RolloutRequest(EnvSpec("env"), ProtocolSpec("p"), env_seed=7)
    expanded = algorithm.request_strategy.expand([request])
    assert [r.env_seed for r in expanded] == [7, 7, 7]
    assert len({r.meta["group_id"] for r in expanded}) == 1
    group_size = getattr(algorithm.credit_assigner, "group_size", 3)
    assert group_size == 3  # the credit assigner's groups are the strategy's


def test_sft_and_an_ungrouped_reinforce_run_requests_as_given() -> None:
    assert make_sft().request_strategy is None
    assert make_reinforce().request_strategy.group_size == 1
    with pytest.raises(ValueError, match="make_reinforce: group_size=0"):
        make_reinforce(group_size=0)


def test_an_algorithm_with_a_request_strategy_without_expand_is_refused() -> None:
    with pytest.raises(TypeError, match="request_strategy=.* has no expand"):
        RLAlgorithm("x", MonteCarloReturn(), make_sft().loss, request_strategy=object())


def test_from_algorithm_hands_the_batch_source_every_part() -> None:
    from ludic.training.batching import RolloutBatchSource

    hook = _async_noop
    algorithm = dataclasses.replace(make_grpo(4), rollout_hooks=(hook,))
    source = RolloutBatchSource.from_algorithm(object(), list, algorithm, max_empty_batches=2)
    assert source.credit_assigner is algorithm.credit_assigner
    assert source.request_strategy is algorithm.request_strategy
    assert source.rollout_hooks == (hook,) and source.max_empty_batches == 2


async def _async_noop(rollouts) -> None:
    return None
