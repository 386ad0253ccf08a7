"""Pins ``ludic.training.reward_model.preferences``: validated pairs, synthetic arithmetic pairs, JSONL
files and the held-out split."""

from __future__ import annotations

import json
import math
import operator
from pathlib import Path

import pytest

from ludic.run.demos import synthetic_arithmetic_preferences
from ludic.training.reward_model.preferences import (
    PreferencePair,
    read_preferences_jsonl,
    split_preferences,
    write_preferences_jsonl,
)

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _solve(prompt: str) -> int:
    question = prompt.removesuffix("=")
    for symbol, fn in OPS.items():
        if symbol in question:
            a, b = question.split(symbol)
            return fn(int(a), int(b))
    raise AssertionError(f"no operator in {prompt!r}")


# ---------------------------------------------------------------- PreferencePair


def test_pair_copies_meta_and_stores_margin_as_float():
    meta = {"id": 1}
    pair = PreferencePair("q", "a", "b", meta, margin=2)
    meta["id"] = 2
    assert pair.meta == {"id": 1}
    assert pair.margin == 2.0 and isinstance(pair.margin, float)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"chosen": "7", "rejected": "7"}, ValueError, "same text '7'"),
        ({"prompt": 3}, TypeError, "PreferencePair.prompt: expected a str, got int"),
        ({"rejected": None}, TypeError, "PreferencePair.rejected: expected a str"),
        ({"margin": -1.0}, ValueError, r"PreferencePair.margin=-1.0; expected a finite value"),
        ({"margin": math.nan}, ValueError, "PreferencePair.margin=nan"),
        ({"margin": True}, TypeError, "PreferencePair.margin: expected a number, got bool"),
        ({"meta": ["x"]}, TypeError, "PreferencePair.meta: expected a mapping, got list"),
    ],
)
def test_invalid_pairs_fail_naming_the_field(kwargs, error, message):
    fields = {"prompt": "3+4=", "chosen": "7", "rejected": "9", **kwargs}
    with pytest.raises(error, match=message):
        PreferencePair(**fields)


# ---------------------------------------------------------------- synthetic arithmetic


def test_synthetic_pairs_prefer_the_right_answer_to_a_near_miss():
    pairs = synthetic_arithmetic_preferences(
        200, seed=3, operators=("+", "-", "*"), max_digits=2, max_offset=5
    )
    assert len(pairs) == 200
    for pair in pairs:
        assert pair.prompt.endswith("=")  # the arithmetic env's observation format
        right, wrong = int(pair.chosen), int(pair.rejected)
        assert right == _solve(pair.prompt)
        assert wrong != right and wrong >= 0 and abs(wrong - right) <= 5
        assert pair.margin == 0.0 and pair.meta["source"] == "arithmetic"
    offsets = {int(p.rejected) - int(p.chosen) for p in pairs}
    assert min(offsets) < 0 < max(offsets)  # wrong answers on both sides


def test_synthetic_pairs_are_a_function_of_the_seed():
    a = synthetic_arithmetic_preferences(50, seed=1)
    assert a == synthetic_arithmetic_preferences(50, seed=1)
    assert a != synthetic_arithmetic_preferences(50, seed=2)
    assert [p.meta["index"] for p in a] == list(range(50))


def test_synthetic_pairs_reject_a_zero_offset():
    with pytest.raises(ValueError, match="max_offset=0"):
        synthetic_arithmetic_preferences(4, max_offset=0)


# ---------------------------------------------------------------- JSONL


def test_jsonl_round_trip(tmp_path: Path):
    pairs = synthetic_arithmetic_preferences(5, seed=0) + [
        PreferencePair("hi", "hello!", "go away", {"lang": "en"}, margin=1.5)
    ]
    path = write_preferences_jsonl(pairs, tmp_path / "sub" / "prefs.jsonl")
    assert read_preferences_jsonl(path) == pairs
    assert len(path.read_text().splitlines()) == 6


def test_jsonl_accepts_minimal_lines_and_skips_blank_ones(tmp_path: Path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n\n')
    assert read_preferences_jsonl(path) == [PreferencePair("p", "a", "b")]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", r"p.jsonl:2: "),
        ('["a"]', r"p.jsonl:2: expected a JSON object, got list"),
        ('{"prompt": "p", "chosen": "a"}', r"p.jsonl:2: missing key\(s\) \['rejected'\]"),
        (
            '{"prompt": "p", "chosen": "a", "rejected": "b", "score": 1}',
            r"p.jsonl:2: unknown key\(s\) \['score'\].*under 'meta'",
        ),
        ('{"prompt": "p", "chosen": "a", "rejected": "a"}', r"p.jsonl:2: .*same text"),
    ],
)
def test_bad_jsonl_lines_are_named_by_file_and_line(tmp_path: Path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        read_preferences_jsonl(path)


def test_missing_or_empty_files_are_refused(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_preferences_jsonl(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no pairs"):
        read_preferences_jsonl(tmp_path / "empty.jsonl")


def test_unserialisable_meta_is_refused_on_write(tmp_path: Path):
    with pytest.raises(ValueError, match="pair 0: meta is not JSON-serialisable"):
        write_preferences_jsonl([PreferencePair("p", "a", "b", {"x": object()})], tmp_path / "x")


def test_written_lines_are_plain_objects(tmp_path: Path):
    path = write_preferences_jsonl([PreferencePair("p", "a", "b")], tmp_path / "p.jsonl")
    assert json.loads(path.read_text()) == {
        "prompt": "p",
        "chosen": "a",
        "rejected": "b",
        "margin": 0.0,
        "meta": {},
    }


# ---------------------------------------------------------------- split


def _triples(pairs):
    return {(p.prompt, p.chosen, p.rejected) for p in pairs}


def test_pair_holdout_never_trains_on_an_eval_pair():
    pairs = synthetic_arithmetic_preferences(300, seed=0)  # 100 problems: many repeats
    train, evals = split_preferences(pairs, 40, seed=1, holdout="pairs")
    assert len(evals) == 40
    assert not _triples(train) & _triples(evals)
    # every pair not held out is trained on unless it duplicates a held-out one
    assert len(train) == sum(
        1 for p in pairs if (p.prompt, p.chosen, p.rejected) not in _triples(evals)
    )
    assert split_preferences(pairs, 40, seed=1) == (train, evals)
    assert split_preferences(pairs, 40, seed=2) != (train, evals)


def test_prompt_holdout_keeps_eval_prompts_unseen():
    pairs = synthetic_arithmetic_preferences(300, seed=0)
    train, evals = split_preferences(pairs, 40, seed=1, holdout="prompts")
    assert len(evals) >= 40
    assert not {p.prompt for p in train} & {p.prompt for p in evals}
    assert len(train) + len(evals) == len(pairs)


def test_split_keeps_input_order():
    pairs = synthetic_arithmetic_preferences(50, seed=0)
    train, evals = split_preferences(pairs, 10, seed=0)
    order = {id(p): i for i, p in enumerate(pairs)}
    assert [order[id(p)] for p in evals] == sorted(order[id(p)] for p in evals)
    assert [order[id(p)] for p in train] == sorted(order[id(p)] for p in train)


def test_split_errors_name_the_argument():
    pairs = synthetic_arithmetic_preferences(10, seed=0)
    assert split_preferences(pairs, 0) == (pairs, [])
    with pytest.raises(ValueError, match="eval_size=10 leaves none of the 10 pairs"):
        split_preferences(pairs, 10)
    with pytest.raises(ValueError, match="eval_size=-1"):
        split_preferences(pairs, -1)
    with pytest.raises(
        ValueError, match=r"holdout='random'; expected one of \('pairs', 'prompts'\)"
    ):
        split_preferences(pairs, 2, holdout="random")
