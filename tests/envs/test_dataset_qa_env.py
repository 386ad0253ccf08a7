"""DatasetQAEnv and the verifiers: sample choice by seed, scoring, errors."""

from __future__ import annotations

from fractions import Fraction

import pytest

from ludic.envs import DatasetQAEnv, exact_match, numeric_match, parse_number

SAMPLES = [
    {"question": "capital of France?", "answer": "Paris"},
    {"question": "2+2?", "answer": "4"},
    {"question": "colour of snow?", "answer": "white"},
]


def test_reset_picks_sample_seed_mod_len() -> None:
    env = DatasetQAEnv(SAMPLES)
    assert env.reset(seed=4) == {"agent_0": ("2+2?", {"sample_index": 1, "target": "4"})}
    assert env.reset(seed=2)["agent_0"][0] == "colour of snow?"


def test_reset_without_seed_is_reproducible_via_rng_seed() -> None:
    envs = [DatasetQAEnv(SAMPLES, rng_seed=3) for _ in range(2)]
    seqs = [[env.reset()["agent_0"][1]["sample_index"] for _ in range(20)] for env in envs]
    assert seqs[0] == seqs[1]
    assert len(set(seqs[0])) > 1


def test_correct_answer_terminates_with_reward_one_and_reports_target() -> None:
    env = DatasetQAEnv(SAMPLES)
    env.reset(seed=0)
    out = env.step({"agent_0": " Paris "})["agent_0"]
    assert out.reward == 1.0 and out.terminated and not out.truncated
    assert out.info == {"target": "Paris", "correct": True, "sample_index": 0}
    assert env.active_agents == []


def test_wrong_answer_scores_zero_and_is_marked_incorrect() -> None:
    env = DatasetQAEnv(SAMPLES)
    env.reset(seed=0)
    out = env.step({"agent_0": "Lyon"})["agent_0"]
    assert out.reward == 0.0 and out.terminated
    assert out.info["correct"] is False


def test_float_verifier_reward_is_passed_through() -> None:
    env = DatasetQAEnv(SAMPLES, verifier=lambda pred, target: 0.25 * len(pred))
    env.reset(seed=0)
    assert env.step({"agent_0": "ab"})["agent_0"].reward == 0.5


def test_prompt_template_formats_question_and_other_sample_keys() -> None:
    samples = [{"q": "1+1", "a": "2", "topic": "sums"}]
    env = DatasetQAEnv(
        samples, question_key="q", answer_key="a", prompt_template="[{topic}] {question} ="
    )
    assert env.reset(seed=0)["agent_0"][0] == "[sums] 1+1 ="
    assert env.step({"agent_0": "2"})["agent_0"].info["target"] == "2"


def test_prompt_template_with_unknown_placeholder_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="placeholder 'nope'"):
        DatasetQAEnv(SAMPLES, prompt_template="{nope}: {question}")


def test_empty_samples_raise() -> None:
    with pytest.raises(ValueError, match="samples is empty"):
        DatasetQAEnv([])


def test_missing_question_key_names_the_key_and_argument() -> None:
    with pytest.raises(KeyError, match="sample 1 has no key 'prompt'.*question_key="):
        DatasetQAEnv([{"prompt": "x", "answer": "y"}, {"answer": "z"}], question_key="prompt")


def test_missing_answer_key_names_the_key_and_argument() -> None:
    with pytest.raises(KeyError, match="no key 'answer'.*answer_key="):
        DatasetQAEnv([{"question": "x", "solution": "y"}])


def test_system_prompt_is_exposed_for_agents() -> None:
    assert DatasetQAEnv(SAMPLES, system_prompt="Answer briefly.").system_prompt == (
        "Answer briefly."
    )


def test_exact_match_strips_but_is_case_sensitive() -> None:
    assert exact_match(" Paris\n", "Paris")
    assert not exact_match("paris", "Paris")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("42", Fraction(42)),
        ("-7", Fraction(-7)),
        ("1,234", Fraction(1234)),
        ("1,234,567.5", Fraction(2469135, 2)),
        ("0.5", Fraction(1, 2)),
        (".25", Fraction(1, 4)),
        ("3/4", Fraction(3, 4)),
        ("-6 / 8", Fraction(-3, 4)),
        ("1e3", Fraction(1000)),
        ("$12.", Fraction(12)),
        # the LaTeX a \\boxed{} answer holds (the boxed parser returns it as is)
        ("\\frac{1}{2}", Fraction(1, 2)),
        ("-\\dfrac{3}{4}", Fraction(-3, 4)),
        ("\\tfrac{6}{3}", Fraction(2)),
        ("1{,}000", Fraction(1000)),
        ("12\\,000", Fraction(12000)),
        ("\\$5", Fraction(5)),
    ],
)
def test_parse_number_accepts_common_numeric_forms(text: str, value: Fraction) -> None:
    assert parse_number(text) == value


@pytest.mark.parametrize(
    "text", ["", "x=3", "12 apples", "1,23", "1/0", "1_000", "four", "\\frac{1}{0}", "\\frac{x}{2}"]
)
def test_parse_number_rejects_non_numbers(text: str) -> None:
    assert parse_number(text) is None


def test_numeric_match_compares_exact_values_across_forms() -> None:
    assert numeric_match("0.50", "1/2")
    assert numeric_match("1,000", "1000")
    assert not numeric_match("0.333", "1/3")
    assert not numeric_match("forty-two", "42")


def test_numeric_match_unparsable_target_raises_naming_it() -> None:
    with pytest.raises(ValueError, match="target 'about 3' is not a number.*exact_match"):
        numeric_match("3", "about 3")


def test_a_boxed_fraction_matches_its_numeric_target() -> None:
    from ludic.parsers import boxed_parser

    answer = boxed_parser()("so the answer is $\\boxed{\\frac{1}{2}}$").action
    assert answer == "\\frac{1}{2}" and numeric_match(answer, "0.5")


def test_gsm8k_match_reads_the_final_answer_on_both_sides() -> None:
    from ludic.envs.dataset_qa_env import gsm8k_match

    solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = 72\n#### 72"
    assert gsm8k_match("She sold 48 + 24 = 72 clips.\n#### 72", solution)
    assert gsm8k_match("48 + 24 = 72, so 72 clips", solution)  # no ####: the last number
    assert gsm8k_match("#### 1,000", "1000") and gsm8k_match("#### $1,000", "#### 1000")
    assert not gsm8k_match("#### 71", solution)
    assert not gsm8k_match("72 or maybe 73", solution)
    assert not gsm8k_match("I do not know", solution)
    with pytest.raises(ValueError, match=r"target 'many' has no final number \(#### N\)"):
        gsm8k_match("#### 3", "many")


def test_a_gsm8k_file_is_checked_line_by_line_and_scored(tmp_path) -> None:
    from ludic.run.parts import dataset_qa_env_from_file

    data = tmp_path / "gsm8k.jsonl"
    data.write_text(
        '{"question": "2 apples and 3 more?", "answer": "2 + 3 = 5\\n#### 5"}\n'
        '{"question": "a dozen?", "answer": "12"}\n'
    )
    env = dataset_qa_env_from_file(path=str(data), verifier="gsm8k")
    env.reset(seed=0)
    assert env.step({"agent_0": "2 + 3 = 5\n#### 5"})["agent_0"].reward == 1.0
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": "no idea"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: answer='no idea' is not a number "):
        dataset_qa_env_from_file(path=str(tmp_path / "bad.jsonl"), verifier="gsm8k")
