"""Hybrid rewards: a discriminative reward model (a real tiny sequence classifier through
the in-process reward client) as a reward function, and a weighted sum of components with
each component's score logged."""

from __future__ import annotations

import asyncio

import pytest

from ludic.inference.reward_client import format_reward_input
from ludic.inference.transformers_reward_client import TransformersRewardClient
from ludic.models.tiny import build_tiny_reward_model
from ludic.rewards import (
    DisRMScore,
    RewardSample,
    WeightedReward,
    call_reward_function,
    make_reward_manager,
)
from ludic.rewards.rules import format_score, math_score


@pytest.fixture
def reward_client(tiny_tokenizer):
    return TransformersRewardClient(build_tiny_reward_model(tiny_tokenizer, seed=0), tiny_tokenizer)


SAMPLE = RewardSample("math", "so \\boxed{\\frac{1}{2}}", "0.5", {"question": "1/2 as a decimal?"})


def test_disrm_scores_what_the_reward_model_scores(reward_client) -> None:
    result = asyncio.run(call_reward_function(DisRMScore(reward_client), SAMPLE))
    text = format_reward_input("1/2 as a decimal?", SAMPLE.solution_str)
    (direct,) = asyncio.run(reward_client.score_batch([text], normalize=False))
    assert result.score == pytest.approx(direct)


def test_a_weighted_sum_of_rule_and_reward_model(reward_client) -> None:
    disrm = DisRMScore(reward_client)
    hybrid = WeightedReward(
        {"math": (math_score, 0.7), "format": (format_score, 0.1), "rm": (disrm, 0.2)}
    )
    result = asyncio.run(call_reward_function(hybrid, SAMPLE))
    rm = asyncio.run(call_reward_function(disrm, SAMPLE)).score
    assert result.metrics == {"math": 1.0, "format": 1.0, "rm": pytest.approx(rm)}
    assert result.score == pytest.approx(0.7 * 1.0 + 0.1 * 1.0 + 0.2 * rm)


def test_a_failing_component_fails_the_hybrid_score() -> None:
    def broken(data_source, solution_str, ground_truth, extra_info):
        raise RuntimeError("judge down")

    hybrid = WeightedReward({"math": (math_score, 1.0), "judge": (broken, 1.0)})
    manager = make_reward_manager("naive", compute_score=hybrid)
    result = asyncio.run(manager.run_single(SAMPLE))
    assert result.score is None and "judge down" in result.error
    with pytest.raises(ValueError, match="component 'x' must be"):
        WeightedReward({"x": (math_score, "high")})
