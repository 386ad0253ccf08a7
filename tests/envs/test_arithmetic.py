"""ArithmeticQAEnv and make_arithmetic_samples: determinism, ranges, numeric scoring."""

from __future__ import annotations

import pytest

from ludic.envs import ArithmeticQAEnv, make_arithmetic_samples


def test_samples_are_deterministic_by_seed() -> None:
    assert make_arithmetic_samples(50, seed=1) == make_arithmetic_samples(50, seed=1)
    assert make_arithmetic_samples(50, seed=1) != make_arithmetic_samples(50, seed=2)


def test_sample_answers_are_correct() -> None:
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for s in make_arithmetic_samples(200, seed=0):
        assert s["question"] == f"{s['a']}{s['op']}{s['b']}"
        assert int(s["answer"]) == ops[s["op"]](s["a"], s["b"])


def test_samples_respect_operators_and_digit_range() -> None:
    samples = make_arithmetic_samples(300, seed=0, operators=("*",), min_digits=2, max_digits=3)
    assert {s["op"] for s in samples} == {"*"}
    assert all(10 <= s[k] <= 999 for s in samples for k in ("a", "b"))
    assert {len(str(s["a"])) for s in samples} == {2, 3}


def test_single_digit_operands_include_zero_to_nine() -> None:
    samples = make_arithmetic_samples(500, seed=0, operators=("+",), max_digits=1)
    assert {s["a"] for s in samples} == set(range(10))


def test_non_negative_subtraction_never_goes_below_zero() -> None:
    samples = make_arithmetic_samples(300, seed=0, operators=("-",))
    assert all(int(s["answer"]) >= 0 for s in samples)
    signed = make_arithmetic_samples(300, seed=0, operators=("-",), non_negative=False)
    assert any(int(s["answer"]) < 0 for s in signed)


def test_unknown_operator_lists_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"supported operators are \('\+', '-', '\*'\)"):
        make_arithmetic_samples(5, operators=("/",))


def test_bad_digit_range_raises() -> None:
    with pytest.raises(ValueError, match="min_digits=3, max_digits=2"):
        make_arithmetic_samples(5, min_digits=3, max_digits=2)


def test_env_prompt_is_short_question_with_equals_sign() -> None:
    env = ArithmeticQAEnv(num_problems=10, problem_seed=4)
    obs, info = env.reset(seed=3)["agent_0"]
    sample = make_arithmetic_samples(10, seed=4)[3]
    assert obs == f"{sample['question']}="
    assert info == {"sample_index": 3, "target": sample["answer"]}
    assert len(obs) <= 6


def test_env_is_deterministic_by_seed() -> None:
    a = ArithmeticQAEnv(num_problems=100, problem_seed=9)
    b = ArithmeticQAEnv(num_problems=100, problem_seed=9)
    assert [a.reset(seed=s) for s in range(20)] == [b.reset(seed=s) for s in range(20)]


def test_env_scores_answers_numerically() -> None:
    env = ArithmeticQAEnv(num_problems=20, operators=("+",))
    env.reset(seed=5)
    target = env.current_sample["answer"]
    assert env.step({"agent_0": f" {target}.0 "})["agent_0"].reward == 1.0
    env.reset(seed=5)
    wrong = env.step({"agent_0": str(int(target) + 1)})["agent_0"]
    assert wrong.reward == 0.0 and wrong.terminated
    env.reset(seed=5)
    assert env.step({"agent_0": "no idea"})["agent_0"].reward == 0.0
