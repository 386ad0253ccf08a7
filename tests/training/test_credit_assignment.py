"""Pins ``ludic.training.credit_assignment``: arithmetic of every credit assigner."""

from __future__ import annotations

import math

import pytest

from ludic.training.credit_assignment import (
    ConstantCredit,
    EpisodicReturn,
    GroupNormalizedReturn,
    MonteCarloReturn,
    PerStepReward,
)
from ludic.training.types import CreditAssigner
from ludic.types import AgentStep, EnvironmentStep, Rollout


def make_rollout(
    env_rewards: list[float],
    parser_rewards: list[float] | None = None,
    *,
    obs: str = "q",
    group_id: str | None = None,
) -> Rollout:
    """One agent step + one env step per turn; turn j's reward = env + parser reward."""
    parser_rewards = parser_rewards or [0.0] * len(env_rewards)
    steps: list[AgentStep | EnvironmentStep] = []
    for j, (r_env, r_parse) in enumerate(zip(env_rewards, parser_rewards)):
        tid = f"t{j}"
        steps.append(
            AgentStep(
                index=len(steps),
                turn_id=tid,
                prompt_messages=[],
                completion="a",
                reward=r_parse,
            )
        )
        steps.append(
            EnvironmentStep(
                index=len(steps),
                turn_id=tid,
                prev_obs=obs if j == 0 else f"{obs}/{j}",
                action="a",
                next_obs="next",
                reward=r_env,
                agent_step_indices=(len(steps) - 1,),
            )
        )
    meta = {} if group_id is None else {"group_id": group_id}
    return Rollout(steps=steps, meta=meta)


def test_every_assigner_satisfies_the_credit_assigner_protocol():
    for assigner in (
        MonteCarloReturn(),
        GroupNormalizedReturn(group_size=2),
        EpisodicReturn(),
        PerStepReward(),
        ConstantCredit(),
    ):
        assert isinstance(assigner, CreditAssigner)


def test_monte_carlo_return_discounts_future_turn_rewards():
    rollout = make_rollout([1.0, 0.0, 2.0])
    (weights,) = MonteCarloReturn(gamma=0.5).compute([rollout])
    # G_0 = 1 + 0.5*0 + 0.25*2, G_1 = 0 + 0.5*2, G_2 = 2
    assert weights == pytest.approx([1.5, 1.0, 2.0])


def test_monte_carlo_return_with_gamma_one_is_reward_to_go():
    (weights,) = MonteCarloReturn(gamma=1.0).compute([make_rollout([1.0, 0.0, 2.0])])
    assert weights == pytest.approx([3.0, 2.0, 2.0])


def test_monte_carlo_return_counts_parser_rewards_in_the_turn_reward():
    rollout = make_rollout([1.0, 1.0], parser_rewards=[-0.5, 0.0])
    (weights,) = MonteCarloReturn(gamma=0.9).compute([rollout])
    assert weights == pytest.approx([0.5 + 0.9 * 1.0, 1.0])


def test_monte_carlo_return_rejects_gamma_outside_unit_interval():
    with pytest.raises(ValueError, match=r"gamma=1\.5"):
        MonteCarloReturn(gamma=1.5)


def test_weights_align_with_turns_and_rollout_order():
    rollouts = [make_rollout([1.0]), make_rollout([0.0, 2.0, 3.0]), Rollout()]
    weights = MonteCarloReturn().compute(rollouts)
    assert [len(w) for w in weights] == [1, 3, 0]


def test_group_normalized_return_uses_population_std_and_fills_every_turn():
    rewards = [1.0, 0.0, 0.0, 1.0]
    rollouts = [make_rollout([r, 0.0], group_id="g") for r in rewards]
    weights = GroupNormalizedReturn(group_size=4).compute(rollouts)
    # mean 0.5, population std 0.5 (sample std would be 0.577)
    expected = [(r - 0.5) / (0.5 + 1e-6) for r in rewards]
    assert [w[0] for w in weights] == pytest.approx(expected)
    assert all(w[0] == w[1] for w in weights)


@pytest.mark.parametrize("group_size", [2, 8])
def test_sample_std_divides_by_g_minus_one_like_torch_std(group_size: int) -> None:
    import torch

    rewards = [float(i % 3) for i in range(group_size - 1)] + [5.0]
    rollouts = [make_rollout([r], group_id="g") for r in rewards]
    population = [w[0] for w in GroupNormalizedReturn(group_size).compute(rollouts)]
    sample = [w[0] for w in GroupNormalizedReturn(group_size, std="sample").compute(rollouts)]
    r = torch.tensor(rewards, dtype=torch.float64)
    expected = ((r - r.mean()) / (r.std() + 1e-6)).tolist()  # torch.std: unbiased, as verl
    assert sample == pytest.approx(expected)
    # population advantages are sqrt(G / (G - 1)) larger: 1.41x at G = 2, 1.07x at G = 8
    ratio = math.sqrt(group_size / (group_size - 1))
    assert [p / s for p, s in zip(population, sample)] == pytest.approx([ratio] * group_size)


def test_group_std_is_checked_and_reaches_the_presets() -> None:
    from ludic.training.algorithm import make_decoupled_grpo, make_grpo, make_gspo

    with pytest.raises(ValueError, match=r"std='n-1'; expected 'population'"):
        GroupNormalizedReturn(4, std="n-1")  # type: ignore[arg-type]
    for preset in (make_grpo, make_gspo, make_decoupled_grpo):
        assert preset(group_size=4).credit_assigner.std == "population"
        assert preset(group_size=4, group_std="sample").credit_assigner.std == "sample"


def test_group_normalized_return_without_std_is_mean_centred_return():
    rollouts = [make_rollout([r], group_id="g") for r in (3.0, 1.0, 2.0)]
    weights = GroupNormalizedReturn(group_size=3, normalize_std=False).compute(rollouts)
    assert [w[0] for w in weights] == pytest.approx([1.0, -1.0, 0.0])


def test_group_normalized_return_uses_total_reward_over_turns():
    rollouts = [make_rollout([1.0, 1.0], group_id="g"), make_rollout([0.0, 0.0], group_id="g")]
    weights = GroupNormalizedReturn(group_size=2, normalize_std=False).compute(rollouts)
    assert weights == [[1.0, 1.0], [-1.0, -1.0]]


def test_zero_std_group_gets_exactly_zero_advantages_not_nan():
    # 0.1 * 3 / 3 != 0.1 in floating point; the assigner must still return exact zeros
    rollouts = [make_rollout([0.1], group_id="same") for _ in range(3)]
    for normalize_std in (True, False):
        weights = GroupNormalizedReturn(3, normalize_std=normalize_std).compute(rollouts)
        assert weights == [[0.0], [0.0], [0.0]]


def test_zero_std_group_does_not_affect_other_groups():
    rollouts = [make_rollout([1.0], group_id="flat") for _ in range(2)] + [
        make_rollout([1.0], group_id="live"),
        make_rollout([0.0], group_id="live"),
    ]
    weights = GroupNormalizedReturn(group_size=2, eps=0.0).compute(rollouts)
    assert [w[0] for w in weights] == pytest.approx([0.0, 0.0, 1.0, -1.0])


def test_group_size_mismatch_names_group_and_fix():
    rollouts = [make_rollout([1.0], group_id="q17") for _ in range(6)]
    with pytest.raises(ValueError) as err:
        GroupNormalizedReturn(group_size=8).compute(rollouts)
    msg = str(err.value)
    assert "group_size=8 but group 'q17' has 6 rollouts" in msg
    assert "GRPORequestStrategy(group_size=8)" in msg


def test_groups_by_initial_observation_when_no_group_id():
    rollouts = [
        make_rollout([1.0], obs="p1"),
        make_rollout([5.0], obs="p2"),
        make_rollout([0.0], obs="p1"),
        make_rollout([3.0], obs="p2"),
    ]
    weights = GroupNormalizedReturn(group_size=2, normalize_std=False).compute(rollouts)
    assert [w[0] for w in weights] == pytest.approx([0.5, 1.0, -0.5, -1.0])


def test_group_id_takes_precedence_over_initial_observation():
    rollouts = [
        make_rollout([1.0], obs="p", group_id="a"),
        make_rollout([0.0], obs="p", group_id="a"),
        make_rollout([4.0], obs="p", group_id="b"),
        make_rollout([2.0], obs="p", group_id="b"),
    ]
    weights = GroupNormalizedReturn(group_size=2, normalize_std=False).compute(rollouts)
    assert [w[0] for w in weights] == pytest.approx([0.5, -0.5, 1.0, -1.0])


def test_initial_observation_group_mismatch_is_reported():
    rollouts = [make_rollout([1.0], obs="p1"), make_rollout([1.0], obs="p2")]
    with pytest.raises(ValueError, match=r"group_size=2 but group initial_obs='p1' has 1"):
        GroupNormalizedReturn(group_size=2).compute(rollouts)


def test_rollout_without_group_id_or_observation_is_rejected():
    with pytest.raises(ValueError, match=r"no meta\['group_id'\]"):
        GroupNormalizedReturn(group_size=2).compute([Rollout(), Rollout()])


@pytest.mark.parametrize("group_size", [0, 1])
def test_group_size_below_two_is_rejected(group_size):
    with pytest.raises(ValueError, match=rf"group_size={group_size}"):
        GroupNormalizedReturn(group_size=group_size)


def test_episodic_return_gives_every_turn_the_undiscounted_return():
    weights = EpisodicReturn().compute([make_rollout([1.0, -2.0, 4.0], [0.5, 0.0, 0.0])])
    assert weights == [[3.5, 3.5, 3.5]]


def test_per_step_reward_gives_each_turn_its_own_reward():
    weights = PerStepReward().compute([make_rollout([1.0, -2.0, 4.0], [0.5, 0.0, 0.25])])
    assert weights == [[1.5, -2.0, 4.25]]


def test_constant_credit_gives_every_turn_the_value():
    rollouts = [make_rollout([9.0, 9.0]), make_rollout([-1.0])]
    assert ConstantCredit().compute(rollouts) == [[1.0, 1.0], [1.0]]
    assert ConstantCredit(value=0.25).compute(rollouts) == [[0.25, 0.25], [0.25]]


def test_constant_credit_rejects_non_finite_value():
    with pytest.raises(ValueError, match="value=nan"):
        ConstantCredit(value=math.nan)


def test_delegated_rollouts_form_their_own_group_outside_the_size_check():
    parents = [make_rollout([r], group_id="g") for r in (1.0, 0.0)]
    subs = [make_rollout([r], group_id="g") for r in (2.0, 0.0, 1.0)]
    for s in subs:
        s.meta["delegated"] = True
    weights = GroupNormalizedReturn(group_size=2, normalize_std=False).compute(parents + subs)
    # Parents are normalized among themselves, sub-agents among themselves (3 of them).
    assert [w[0] for w in weights] == pytest.approx([0.5, -0.5, 1.0, -1.0, 0.0])


def test_negative_group_coef_pushes_down_a_group_whose_samples_all_fail():
    # batch of 4 groups of 2: mean return (0 + 0 + 1 + 1 + 1 + 0 + 0.5 + 0.5) / 8 = 0.5
    returns = {"failed": [0.0, 0.0], "solved": [1.0, 1.0], "mixed": [1.0, 0.0], "half": [0.5] * 2}
    rollouts = [make_rollout([r], group_id=g) for g, rs in returns.items() for r in rs]
    weights = GroupNormalizedReturn(2, eps=0.0, negative_group_coef=2.0).compute(rollouts)
    # failed: 2 * (0 - 0.5); solved and half (at or above the batch mean): 0; mixed: GRPO's
    assert [w[0] for w in weights] == pytest.approx([-1.0, -1.0, 0.0, 0.0, 1.0, -1.0, 0.0, 0.0])
    grpo = GroupNormalizedReturn(2, eps=0.0).compute(rollouts)
    assert [w[0] for w in grpo] == pytest.approx([0.0, 0.0, 0.0, 0.0, 1.0, -1.0, 0.0, 0.0])
    # an all-failed batch has no mean to fall below: no signal, as in GRPO
    failed = [make_rollout([0.0], group_id=g) for g in "ab" for _ in range(2)]
    assert GroupNormalizedReturn(2, negative_group_coef=1.0).compute(failed) == [[0.0]] * 4


def test_negative_group_coef_leaves_delegated_rollouts_out_and_is_checked():
    parents = [
        make_rollout([r], group_id=g) for g, r in (("a", 1.0), ("a", 1.0), ("b", 0.0), ("b", 0.0))
    ]
    lone = make_rollout([-5.0], group_id="a")
    lone.meta["delegated"] = True
    weights = GroupNormalizedReturn(2, negative_group_coef=1.0).compute([*parents, lone])
    # the batch mean is the parents' 0.5 (not pulled down by -5); the lone sub-agent gets 0
    assert [w[0] for w in weights] == pytest.approx([0.0, 0.0, -0.5, -0.5, 0.0])
    for bad in (-0.1, math.inf, True):
        with pytest.raises(ValueError, match="negative_group_coef="):
            GroupNormalizedReturn(2, negative_group_coef=bad)
    from ludic.training.algorithm import make_grpo

    assert (
        make_grpo(group_size=2, negative_group_coef=0.5).credit_assigner.negative_group_coef == 0.5
    )
    with pytest.raises(ValueError, match="make_grpo: negative_group_coef=-1"):
        make_grpo(group_size=2, negative_group_coef=-1)
