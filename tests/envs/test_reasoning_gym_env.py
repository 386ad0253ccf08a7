"""``env.kind: reasoning_gym``: reasoning-gym's procedural tasks, its scorer as the reward,
a held-out part that never shows a training problem."""

from __future__ import annotations

import pytest

from ludic.envs import ReasoningGymEnv, ReferenceAnswerEnv
from ludic.run.errors import RunError
from ludic.run.loading import load_config
from ludic.run.preflight import check_config

pytest.importorskip("reasoning_gym", reason="the envs extra (reasoning-gym) is not installed")

WORDS = {"min_word_len": 3, "max_word_len": 3}


def _act(env: ReasoningGymEnv, answer: str):
    (outcome,) = env.step({env.agent_ids[0]: answer}).values()
    return outcome


def test_an_episode_is_one_problem_scored_by_the_tasks_own_scorer() -> None:
    env = ReasoningGymEnv(task="spell_backward", config=WORDS, size=50)
    assert isinstance(env, ReferenceAnswerEnv)
    ((obs, info),) = env.reset(7).values()
    word = obs.rsplit(": ", 1)[1]
    assert obs.startswith("Spell this word backward") and len(word) == 3
    assert env.reference_answer() == word[::-1] == info["target"]
    right = _act(env, word[::-1])
    assert right.reward == 1.0 and right.terminated and right.info["correct"]
    env.reset(7)
    partial = _act(env, word[::-1][:2] + "#")  # the task gives partial credit
    assert partial.reward == pytest.approx(2 / 3) and not partial.info["correct"]
    # a seed names a problem: the same seed, the same problem, in any env built alike
    again = ReasoningGymEnv(task="spell_backward", config=WORDS, size=50)
    assert again.reset(7) == env.reset(7) and env.reset(57) == env.reset(7)


def test_the_heldout_part_has_no_training_question_even_for_a_small_task() -> None:
    arithmetic = {
        "operators": ["+"],
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 1,
        "allow_parentheses": False,
        "allow_negation": False,
    }
    train = ReasoningGymEnv(task="basic_arithmetic", config=arithmetic, size=60)
    heldout = ReasoningGymEnv(
        task="basic_arithmetic", config=arithmetic, size=60, part="heldout", heldout_size=300
    )
    trained = {e["question"] for e in train.problems}
    held = [e["question"] for e in heldout.problems]
    assert held and not trained & set(held) and len(held) == len(set(held))
    assert len(trained | set(held)) <= 121  # reasoning-gym draws one-digit terms from 0..10
    with pytest.raises(ValueError, match="too few distinct problems for a held-out part"):
        ReasoningGymEnv(task="basic_arithmetic", config=arithmetic, size=2000, part="heldout")


def test_bad_settings_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"'spell_backwards' is not a reasoning-gym dataset \(did"):
        ReasoningGymEnv(task="spell_backwards")
    with pytest.raises(ValueError, match="config for reasoning-gym task 'spell_backward': .*'foo'"):
        ReasoningGymEnv(task="spell_backward", config={"foo": 1})
    with pytest.raises(ValueError, match="config.seed: set env.kwargs.seed"):
        ReasoningGymEnv(task="spell_backward", config={"seed": 1})
    with pytest.raises(ValueError, match="placeholder 'nope'"):
        ReasoningGymEnv(task="spell_backward", prompt_template="{nope}")


def test_a_config_names_the_task_and_its_settings(tmp_path) -> None:
    base = [
        "env.kind=reasoning_gym",
        "env.kwargs={task: spell_backward, config: {min_word_len: 3, max_word_len: 3}}",
        "env.eval_kwargs={part: heldout}",
    ]
    check_config(load_config(None, base))
    with pytest.raises(RunError, match="env.kwargs: env 'reasoning_gym': config for reasoning"):
        check_config(load_config(None, [*base, "env.kwargs.config.max_word_len=x"]))
