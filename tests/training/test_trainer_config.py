"""TrainerConfig validation, the optimizer and the learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch

from ludic.training.config import TrainerConfig
from ludic.training.optim import build_lr_scheduler, build_optimizer, lr_multiplier


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lr": 0.0}, "lr"),
        ({"lr": math.nan}, "lr"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"eps": 0.0}, "eps"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"lr_schedule": "step"}, "lr_schedule"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"lr_schedule": "cosine"}, "total_steps"),
        ({"lr_schedule": "linear", "total_steps": 5, "warmup_steps": 5}, "total_steps"),
        ({"max_tokens_per_microbatch": 1}, "max_tokens_per_microbatch"),
        ({"pad_token_id": -1}, "pad_token_id"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"publish_every": -1}, "publish_every"),
        ({"publish_every": 4, "max_staleness": 2}, "max_staleness"),
        ({"dtype": "float64"}, "dtype"),
    ],
)
def test_invalid_trainer_config_raises_naming_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=f"TrainerConfig.{field}="):
        TrainerConfig(**kwargs)


def test_max_staleness_may_cover_exactly_the_publish_interval() -> None:
    assert TrainerConfig(publish_every=4, max_staleness=3).max_staleness == 3
    assert TrainerConfig(publish_every=0, max_staleness=0).max_staleness == 0


def test_default_trainer_config_is_valid() -> None:
    config = TrainerConfig()
    assert config.device == "cpu" and config.max_grad_norm == 1.0 and config.max_staleness is None


def test_warmup_then_constant_schedule() -> None:
    mult = lr_multiplier(TrainerConfig(warmup_steps=4))
    assert [mult(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_schedule_decays_to_zero_at_total_steps() -> None:
    mult = lr_multiplier(TrainerConfig(lr_schedule="linear", warmup_steps=2, total_steps=6))
    assert [mult(s) for s in range(8)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]


def test_cosine_schedule_is_half_way_at_mid_decay_and_zero_at_the_end() -> None:
    mult = lr_multiplier(TrainerConfig(lr_schedule="cosine", total_steps=10))
    assert mult(0) == 1.0
    assert mult(5) == pytest.approx(0.5)
    assert mult(10) == pytest.approx(0.0)


def test_optimizer_only_holds_trainable_parameters_and_scheduler_scales_lr() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].requires_grad_(False)
    config = TrainerConfig(lr=0.1, warmup_steps=2)
    optimizer = build_optimizer(model, config)
    scheduler = build_lr_scheduler(optimizer, config)

    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in model[1].parameters()}
    assert scheduler.get_last_lr() == [pytest.approx(0.05)]
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [pytest.approx(0.1)]


def test_optimizer_for_a_fully_frozen_model_raises() -> None:
    model = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        build_optimizer(model, TrainerConfig())
