"""Reward functions with spec 5's signature: sync and async ones from a file or a module,
dict results with metrics, extra keyword arguments, and failures (a raise, a timeout, a
non-score) reported per sample with the configured fallback, never a silent 0."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from ludic.rewards import (
    RewardFunctionError,
    RewardSample,
    call_reward_function,
    load_reward_function,
    make_reward_manager,
)

USER_FUNCTIONS = """
import asyncio, threading

def exact(data_source, solution_str, ground_truth, extra_info):
    return float(solution_str.strip() == str(ground_truth))

IN_FLIGHT = {"now": 0, "most": 0}

async def judged(data_source, solution_str, ground_truth, extra_info, reward_router_address=None):
    IN_FLIGHT["now"] += 1
    IN_FLIGHT["most"] = max(IN_FLIGHT["most"], IN_FLIGHT["now"])
    await asyncio.sleep(0.01)
    IN_FLIGHT["now"] -= 1
    return {"score": 0.5 if reward_router_address else 0.25, "judge_calls": 1, "note": "x"}

def thread_name(data_source, solution_str, ground_truth, extra_info, **kwargs):
    return {"score": 1.0, "on_main_thread": float(threading.current_thread() is threading.main_thread()), **kwargs}

def broken(data_source, solution_str, ground_truth, extra_info):
    raise RuntimeError("checker crashed")

def slow(data_source, solution_str, ground_truth, extra_info):
    import time
    time.sleep(30)
    return 1.0

def not_a_score(data_source, solution_str, ground_truth, extra_info):
    return "high"

def too_few(solution_str):
    return 1.0

THRESHOLD = 0.5
"""


@pytest.fixture
def functions(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FUNCTIONS)
    return lambda name: load_reward_function(f"{path}:{name}")


SAMPLE = RewardSample("custom", " 42 ", "42", {"question": "6*7?"}, sample_id="s1")


def test_sync_and_async_functions_from_a_file(functions) -> None:
    result = asyncio.run(call_reward_function(functions("exact"), SAMPLE))
    assert result.score == 1.0 and result.ok and result.metrics == {}
    judged = asyncio.run(call_reward_function(functions("judged"), SAMPLE))
    assert judged.score == 0.25 and judged.metrics == {"judge_calls": 1.0}  # "note": not a number
    routed = asyncio.run(
        call_reward_function(functions("judged"), SAMPLE, reward_router_address="http://r")
    )
    assert routed.score == 0.5
    # a sync function runs off the event loop's thread; **kwargs receive every extra
    threaded = asyncio.run(call_reward_function(functions("thread_name"), SAMPLE, weight=2))
    assert threaded.metrics == {"on_main_thread": 0.0, "weight": 2.0}


def test_a_module_function_and_bad_specs(functions) -> None:
    fn = load_reward_function("ludic.rewards.rules:gsm8k_score")
    assert asyncio.run(call_reward_function(fn, RewardSample("gsm8k", "so #### 7", "7"))).score == 1
    with pytest.raises(TypeError, match="reward.function: 'too_few' must accept"):
        functions("too_few")
    with pytest.raises(ValueError, match="reward.function: 'nope' must look like"):
        load_reward_function("nope")
    with pytest.raises(ValueError) as missing:
        functions("absent")
    assert "has no attribute 'absent'" in str(missing.value)
    with pytest.raises(ValueError) as not_callable:
        functions("THRESHOLD")
    assert "THRESHOLD in " in str(not_callable.value)
    assert "is not callable (a float: 0.5); name a function" in str(not_callable.value)
    assert "has no function" not in str(not_callable.value)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("broken", "raised on sample 's1': RuntimeError: checker crashed"),
        ("slow", "did not score sample 's1' within 0.2s"),
        ("not_a_score", "returned score 'high' for sample 's1'; expected a finite number"),
    ],
)
def test_failures_name_the_function_and_the_sample(functions, name, message) -> None:
    with pytest.raises(RewardFunctionError, match=message):
        asyncio.run(call_reward_function(functions(name), SAMPLE, timeout_s=0.2))


def test_a_manager_records_failures_with_the_fallback_or_drops_them(functions) -> None:
    dropped = make_reward_manager("naive", compute_score=functions("broken"))
    result = asyncio.run(dropped.run_single(SAMPLE))
    assert result.score is None and "checker crashed" in result.error
    fallback = make_reward_manager(
        "naive", compute_score=functions("slow"), timeout_s=0.2, on_error=-1.0
    )
    started = time.monotonic()
    result = asyncio.run(fallback.run_single(SAMPLE))
    assert result.score == -1.0 and "within 0.2s" in result.error
    assert time.monotonic() - started < 10  # the timeout, not the function's 30 s
    with pytest.raises(ValueError, match="on_error='zero'"):
        make_reward_manager("naive", on_error="zero")


def test_the_default_function_is_the_rules_by_data_source() -> None:
    manager = make_reward_manager("naive")
    gsm8k = RewardSample("openai/gsm8k", "3 + 4 = 7 #### 7", "She has 7. #### 7")
    assert asyncio.run(manager.run_single(gsm8k)).score == 1.0
    unknown = asyncio.run(manager.run_single(RewardSample("mystery", "1", "1")))
    assert unknown.score is None and "no built-in reward for data_source='mystery'" in unknown.error


def test_scoring_overlaps_across_samples(functions) -> None:
    """An async function scores many samples concurrently on one loop."""
    judged = functions("judged")
    manager = make_reward_manager("naive", compute_score=judged)

    async def many() -> list:
        return await asyncio.gather(*(manager.run_single(SAMPLE) for _ in range(50)))

    results = asyncio.run(many())
    assert all(r.score == 0.25 for r in results)
    assert judged.__globals__["IN_FLIGHT"]["most"] == 50  # all in flight at once


def test_an_object_with_an_async_call_is_awaited_on_the_loop() -> None:
    class Judge:
        async def __call__(self, data_source, solution_str, ground_truth, extra_info):
            return float(threading.current_thread() is threading.main_thread())

    assert asyncio.run(call_reward_function(Judge(), SAMPLE)).score == 1.0


def test_parse_judgement() -> None:
    from ludic.rewards import parse_judgement

    assert parse_judgement("Reasoning... Score: 3. On reflection, Score: 7") == 0.7
    assert parse_judgement("Score: 8.5", scale=10) == 0.85
    with pytest.raises(ValueError, match="no judgement matching"):
        parse_judgement("I cannot judge this.")
