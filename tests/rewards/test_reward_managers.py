"""Reward managers by name: DAPO's overlong penalty against hand-computed values, a
rate-limited manager that holds its rates (measured over the test), a user manager
registered by decorator; and the built-in rule rewards (GSM8K, MATH via math-verify,
format)."""

from __future__ import annotations

import asyncio
import time

import pytest

from ludic.rewards import (
    REWARD_MANAGERS,
    RewardManager,
    RewardResult,
    RewardSample,
    make_reward_manager,
    overlong_penalty,
    register,
)
from ludic.rewards.rules import default_compute_score, format_score, gsm8k_score, math_score


def one(*_args) -> float:
    return 1.0


@pytest.mark.parametrize(
    ("length", "expected"),
    # L_max = 100, L_cache = 20: no penalty up to 80 tokens, then linear to -1 at 100
    [(0, 0.0), (80, 0.0), (81, -0.05), (90, -0.5), (99, -0.95), (100, -1.0), (101, -1.0)],
)
def test_overlong_penalty_by_hand(length, expected) -> None:
    assert overlong_penalty(length, 100, 20) == pytest.approx(expected)


def test_the_dapo_manager_adds_the_penalty_to_the_score() -> None:
    manager = make_reward_manager(
        "dapo", compute_score=one, overlong_buffer_len=20, max_response_length=100
    )
    result = asyncio.run(manager.run_single(RewardSample("s", "x", "y", response_length=90)))
    assert result.score == pytest.approx(0.5) and result.metrics["overlong_penalty"] == -0.5
    own_limit = RewardSample("s", "x", "y", response_length=90, max_response_length=200)
    assert asyncio.run(manager.run_single(own_limit)).score == 1.0  # the sample's limit wins
    with pytest.raises(ValueError, match="needs response_length"):
        asyncio.run(manager.run_single(RewardSample("s", "x", "y")))
    with pytest.raises(ValueError, match="buffer_length=0 must be in"):
        overlong_penalty(5, 10, 0)


def test_a_rate_limited_manager_holds_its_request_rate() -> None:
    rate, n = 20.0, 11
    starts: list[float] = []

    async def record(*_args) -> float:
        starts.append(time.monotonic())
        return 1.0

    manager = make_reward_manager("rate_limited", compute_score=record, requests_per_s=rate)

    async def burst() -> list[RewardResult]:
        return await asyncio.gather(
            *(manager.run_single(RewardSample("s", "x", "y")) for _ in range(n))
        )

    assert all(r.score == 1.0 for r in asyncio.run(burst()))
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert min(gaps) >= 1 / rate * 0.9  # never faster than the rate
    assert starts[-1] - starts[0] >= (n - 1) / rate * 0.95


def test_a_rate_limited_manager_holds_tokens_per_s_and_concurrency() -> None:
    in_flight, most, starts = [0], [0], []

    async def slow(*_args) -> float:
        starts.append(time.monotonic())
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        await asyncio.sleep(0.05)
        in_flight[0] -= 1
        return 1.0

    manager = make_reward_manager(
        "rate_limited", compute_score=slow, tokens_per_s=1000, max_concurrency=2
    )
    samples = [RewardSample("s", "x", "y", response_length=100) for _ in range(6)]

    async def run() -> None:
        await asyncio.gather(*(manager.run_single(s) for s in samples))

    asyncio.run(run())
    assert most[0] <= 2
    assert starts[-1] - starts[0] >= 5 * 100 / 1000 * 0.95  # 100 tokens each at 1000/s


def test_a_user_manager_registers_by_decorator() -> None:
    @register("test_doubling")
    class Doubling(RewardManager):
        async def run_single(self, sample: RewardSample) -> RewardResult:
            result = await self.score(sample)
            return RewardResult(2 * result.score, result.metrics)

    try:
        manager = make_reward_manager("test_doubling", compute_score=one)
        assert asyncio.run(manager.run_single(RewardSample("s", "x", "y"))).score == 2.0
        with pytest.raises(ValueError, match="'test_doubling' is registered already"):
            register("test_doubling")(type("Other", (RewardManager,), {}))
    finally:
        REWARD_MANAGERS.pop("test_doubling")
    with pytest.raises(ValueError, match=r"unknown reward manager 'dapoo' \(did you mean 'dapo'"):
        make_reward_manager("dapoo")


def test_gsm8k_rule() -> None:
    solution = "Natalia sold 48/2 = 24 clips in May.\n#### 72"
    assert gsm8k_score("openai/gsm8k", "48 + 24 = 72. #### 72", solution) == 1.0
    assert gsm8k_score("gsm8k", "the answer is 72", "72") == 1.0  # the last number
    assert gsm8k_score("gsm8k", "#### 71", solution) == 0.0
    assert gsm8k_score("gsm8k", "no idea", solution) == 0.0


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
        ("first \\boxed{2}, finally \\boxed{(0, 1]}", "\\left(0,1\\right]", 1.0),
        ("\\boxed{0.3}", "\\frac{1}{3}", 0.0),
        ("\\boxed{[0, 1]}", "(0, 1]", 0.0),
        ("the answer is 0.5", "0.5", 0.0),  # no box
    ],
)
def test_math_rule_through_math_verify(response, truth, score) -> None:
    pytest.importorskip("math_verify", reason="the math extra is not installed")
    assert math_score("math", response, truth) == score


def test_format_rule_and_the_dispatch() -> None:
    assert format_score("x", "\\boxed{3}") == 1.0 and format_score("x", "\\boxed{}") == 0.0
    assert format_score("x", "<answer> 3 </answer>", tag="answer") == 1.0
    assert format_score("x", "3", tag="answer") == 0.0
    assert default_compute_score("HuggingFaceH4/MATH-500", "\\boxed{4}", "4") == 1.0
    assert default_compute_score("other", "\\boxed{4}", "4", fallback=format_score) == 1.0
    with pytest.raises(ValueError, match="no built-in reward for data_source='other'"):
        default_compute_score("other", "4", "4")


def test_a_manager_and_a_reward_loop_serve_one_event_loop_after_another() -> None:
    """Their locks and semaphores belong to a loop: a second ``asyncio.run`` (a new
    loop) must get its own, not a "bound to a different event loop" error."""
    from ludic.rewards import REWARD_KEY, RewardLoop
    from ludic.types import Rollout

    async def slow(*_args) -> float:
        await asyncio.sleep(0.01)
        return 1.0

    manager = make_reward_manager(
        "rate_limited", compute_score=slow, requests_per_s=500, max_concurrency=1
    )
    reward_loop = RewardLoop(
        manager, mode="colocate", num_workers=1, to_sample=lambda r: RewardSample("s", "x", "y")
    )
    for _ in range(2):  # more samples than slots: each primitive has waiters
        rollouts = [Rollout() for _ in range(3)]
        asyncio.run(reward_loop(rollouts))
        assert [r.meta[REWARD_KEY]["score"] for r in rollouts] == [1.0] * 3
