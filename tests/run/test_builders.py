"""Pins ``ludic.run.builders.make_algorithm``: config -> preset arguments."""

from __future__ import annotations

import pytest

from ludic.run.builders import make_algorithm
from ludic.run.errors import RunError
from ludic.run.loading import ConfigError, load_config
from ludic.training.credit_assignment import GroupNormalizedReturn, MonteCarloReturn
from ludic.training.losses import DecoupledClippedSurrogateLoss, TokenClippedSurrogateLoss


def algorithm(*overrides: str):
    return make_algorithm(load_config(None, list(overrides)))


def test_decoupled_grpo_gets_group_size_and_every_written_field():
    algo = algorithm(
        "algorithm.name=decoupled_grpo",
        "algorithm.group_size=4",
        "algorithm.clip_eps_low=0.1",
        "algorithm.clip_eps_high=0.28",
        "algorithm.dual_clip_c=3",
        "algorithm.behaviour_weight_cap=2",
        "algorithm.behaviour_weight_mode=truncate",
    )
    loss = algo.loss
    assert algo.name == "decoupled_grpo" and algo.credit_assigner == GroupNormalizedReturn(4)
    assert type(loss) is DecoupledClippedSurrogateLoss
    assert (loss.clip_eps_low, loss.clip_eps_high, loss.dual_clip_c) == (0.1, 0.28, 3.0)
    assert (loss.behaviour_weight_cap, loss.behaviour_weight_mode) == (2.0, "truncate")


def test_unwritten_fields_keep_the_preset_defaults_and_null_cap_means_no_cap():
    default = algorithm("algorithm.name=decoupled_ppo").loss
    assert (default.behaviour_weight_cap, default.behaviour_weight_mode) == (5.0, "mask")
    assert isinstance(algorithm("algorithm.name=decoupled_ppo").credit_assigner, MonteCarloReturn)
    uncapped = algorithm("algorithm.name=decoupled_ppo", "algorithm.behaviour_weight_cap=null")
    assert uncapped.loss.behaviour_weight_cap is None
    gspo = algorithm("algorithm.name=gspo").loss
    assert (gspo.clip_eps_low, gspo.clip_eps_high) == (3e-4, 4e-4)


def test_grpo_truncated_is_cap_and_dual_clip_from_the_config():
    plain = algorithm("algorithm.dual_clip_c=3").loss
    assert type(plain) is TokenClippedSurrogateLoss and plain.dual_clip_c == 3.0
    tis = algorithm("algorithm.truncated_is_cap=2").loss
    assert type(tis) is DecoupledClippedSurrogateLoss
    assert (tis.behaviour_weight_cap, tis.behaviour_weight_mode) == (2.0, "truncate")


def test_group_std_from_the_config():
    assert algorithm().credit_assigner.std == "population"
    assert algorithm("algorithm.group_std=sample").credit_assigner.std == "sample"
    with pytest.raises(RunError, match=r"algorithm.group_std is set but algorithm.name='dr_grpo'"):
        algorithm("algorithm.name=dr_grpo", "algorithm.group_std=sample")


def test_negative_group_coef_from_the_config():
    assert algorithm().credit_assigner == GroupNormalizedReturn(group_size=8)  # default 0
    on = "algorithm.negative_group_coef=1"
    assert algorithm(on).credit_assigner.negative_group_coef == 1.0
    assert algorithm(on, "algorithm.name=gspo").credit_assigner.negative_group_coef == 1.0
    with pytest.raises(RunError, match=r"negative_group_coef=1.0 needs group-relative credit"):
        algorithm(on, "algorithm.name=decoupled_ppo")
    with pytest.raises(ConfigError, match="negative_group_coef: Input should be greater"):
        algorithm("algorithm.negative_group_coef=-1")


def test_kwargs_still_reach_the_preset():
    loss = algorithm("algorithm.kwargs.clip_eps_high=0.28").loss
    assert loss.clip_eps_high == 0.28


@pytest.mark.parametrize(
    ("overrides", "field", "takers"),
    [
        (["algorithm.name=gspo", "algorithm.dual_clip_c=3"], "dual_clip_c", "'grpo'"),
        (["algorithm.behaviour_weight_cap=2"], "behaviour_weight_cap", "'decoupled_grpo'"),
        (
            ["algorithm.name=decoupled_ppo", "algorithm.truncated_is_cap=2"],
            "truncated_is_cap",
            "'grpo'",
        ),
        (["algorithm.name=reinforce", "algorithm.clip_eps_low=0.1"], "clip_eps_low", "'cispo'"),
    ],
)
def test_a_field_the_preset_does_not_take_is_an_error_naming_it(overrides, field, takers):
    with pytest.raises(RunError) as err:
        algorithm(*overrides)
    message = str(err.value)
    assert f"algorithm.{field} is set but algorithm.name=" in message
    assert "presets that do:" in message and takers in message


def test_a_null_clip_eps_for_a_preset_that_needs_one_names_the_field():
    with pytest.raises(RunError, match=r"clip_eps_low=None; expected a finite value >= 0"):
        algorithm("algorithm.clip_eps_low=null")
    assert (
        algorithm("algorithm.name=cispo", "algorithm.clip_eps_low=null").loss.clip_eps_low is None
    )
