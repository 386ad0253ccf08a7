"""Preference data for reward-model training: pairs, wrong-answer pairs from QA data,
JSONL files and a held-out evaluation split.

A :class:`PreferencePair` says ``chosen`` is a better response to ``prompt`` than ``rejected``;
a reward model learns to score ``format_reward_input(prompt, chosen)`` above the same for
``rejected`` (Bradley-Terry, ``ludic.training.losses.bradley_terry``). JSONL, one pair per
line (``margin`` and ``meta`` optional)::

    {"prompt": "3+4=", "chosen": "7", "rejected": "9", "margin": 0.0, "meta": {}}
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ludic.jsonl import iter_jsonl

FIELDS = ("prompt", "chosen", "rejected", "meta", "margin")
"""Keys of a JSONL line (``meta`` and ``margin`` may be left out)."""

Holdout = Literal["pairs", "prompts"]
HOLDOUTS: tuple[str, ...] = ("pairs", "prompts")


@dataclass(frozen=True)
class PreferencePair:
    """One comparison: ``chosen`` is preferred to ``rejected`` as a response to ``prompt``.

    * ``meta``: free-form, JSON-serialisable details (source, ids); not read by training.
    * ``margin``: how far the reward of ``chosen`` should exceed that of ``rejected``
      (Llama 2's m(r), larger for clearer preferences); 0 is the plain Bradley-Terry loss.
    """

    prompt: str
    chosen: str
    rejected: str
    meta: Mapping[str, Any] = field(default_factory=dict)
    margin: float = 0.0

    def __post_init__(self) -> None:
        for name in ("prompt", "chosen", "rejected"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(
                    f"PreferencePair.{name}: expected a str, got {type(value).__name__}"
                )
        if self.chosen == self.rejected:
            raise ValueError(
                f"PreferencePair: chosen and rejected are the same text {self.chosen!r} for "
                f"prompt {self.prompt[:60]!r}; a pair must compare two different responses"
            )
        if not isinstance(self.meta, Mapping):
            raise TypeError(
                f"PreferencePair.meta: expected a mapping, got {type(self.meta).__name__}"
            )
        object.__setattr__(self, "meta", dict(self.meta))
        if isinstance(self.margin, bool) or not isinstance(self.margin, int | float):
            raise TypeError(
                f"PreferencePair.margin: expected a number, got {type(self.margin).__name__}"
            )
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ValueError(f"PreferencePair.margin={self.margin!r}; expected a finite value >= 0")
        object.__setattr__(self, "margin", float(self.margin))

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "chosen": self.chosen,
            "rejected": self.rejected,
            "margin": self.margin,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PreferencePair:
        """The pair in ``data`` (the JSONL layout); unknown keys are refused."""
        unknown = sorted(set(data) - set(FIELDS))
        if unknown:
            raise ValueError(
                f"unknown key(s) {unknown}; a pair has {list(FIELDS)} (put extra details "
                "under 'meta')"
            )
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in data]
        if missing:
            raise ValueError(f"missing key(s) {missing}")
        return cls(
            prompt=data["prompt"],
            chosen=data["chosen"],
            rejected=data["rejected"],
            meta=data.get("meta", {}),
            margin=data.get("margin", 0.0),
        )


def wrong_answer_preferences(
    samples: Sequence[Mapping[str, Any]],
    seed: int = 0,
    *,
    max_offset: int = 9,
    prompt_template: str = "{question}=",
    source: str = "qa",
) -> list[PreferencePair]:
    """One pair per sample of integer-answer QA data (``{"question", "answer"}``): the
    prompt is ``prompt_template`` filled with the question, ``chosen`` the answer,
    ``rejected`` a wrong answer.

    The wrong answer is ``answer + k`` with ``k`` drawn from ``[-max_offset, max_offset]``
    without 0; a negative result takes ``answer + |k|`` instead, so non-negative answers
    stay non-negative. The same arguments give the same pairs; ``meta`` records
    ``source``, ``seed`` and the sample's index.
    """
    if max_offset < 1:
        raise ValueError(
            f"wrong_answer_preferences: max_offset={max_offset}; expected >= 1 (a "
            "wrong answer differs from the right one by 1..max_offset)"
        )
    rng = random.Random(f"ludic.preferences.{source}:{seed}")
    pairs: list[PreferencePair] = []
    for index, sample in enumerate(samples):
        answer = int(sample["answer"])
        offset = rng.choice([k for k in range(-max_offset, max_offset + 1) if k != 0])
        wrong = answer + offset if answer + offset >= 0 else answer + abs(offset)
        pairs.append(
            PreferencePair(
                prompt=prompt_template.format(question=sample["question"]),
                chosen=str(answer),
                rejected=str(wrong),
                meta={"source": source, "seed": seed, "index": index},
            )
        )
    return pairs


def write_preferences_jsonl(pairs: Iterable[PreferencePair], path: str | Path) -> Path:
    """Write ``pairs`` to ``path``, one JSON object per line; returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for i, pair in enumerate(pairs):
            try:
                line = json.dumps(pair.to_dict(), ensure_ascii=False)
            except TypeError as e:
                raise ValueError(f"pair {i}: meta is not JSON-serialisable ({e})") from None
            f.write(line + "\n")
    return path


def read_preferences_jsonl(path: str | Path) -> list[PreferencePair]:
    """The pairs in ``path`` (blank lines skipped); a bad line raises ``ValueError`` naming
    the file and line number."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"preference file {str(path)!r} does not exist")
    pairs: list[PreferencePair] = []
    for lineno, data in iter_jsonl(path):  # a line that is not JSON: JSONLError, file:line
        try:
            if not isinstance(data, dict):
                raise ValueError(f"expected a JSON object, got {type(data).__name__}")
            pairs.append(PreferencePair.from_dict(data))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: {e}") from None
    if not pairs:
        raise ValueError(f"preference file {str(path)!r} holds no pairs")
    return pairs


def split_preferences(
    pairs: Sequence[PreferencePair],
    eval_size: int,
    *,
    seed: int = 0,
    holdout: Holdout = "pairs",
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """``(train, eval)`` with ``eval_size`` pairs held out (both keep the input order).

    * ``holdout="pairs"``: ``eval_size`` pairs drawn at random (``seed``); pairs equal to
      a held-out one (same prompt, chosen, rejected) are dropped from training, so no
      eval pair is trained on. Eval prompts may appear in training with other responses.
    * ``holdout="prompts"``: whole prompts are held out in a seeded random order until
      the eval split has at least ``eval_size`` pairs, so no eval prompt is trained on.

    ``eval_size=0`` returns ``(all pairs, [])``. Raises if nothing is left to train on.
    """
    if eval_size < 0:
        raise ValueError(f"split_preferences: eval_size={eval_size}; expected >= 0")
    if holdout not in HOLDOUTS:
        raise ValueError(f"split_preferences: holdout={holdout!r}; expected one of {HOLDOUTS}")
    if eval_size == 0:
        return list(pairs), []
    if eval_size >= len(pairs):
        raise ValueError(
            f"split_preferences: eval_size={eval_size} leaves none of the {len(pairs)} pairs "
            "to train on; lower eval_size"
        )
    rng = random.Random(seed)
    if holdout == "pairs":
        held_index = set(rng.sample(range(len(pairs)), eval_size))
        held_keys = {_key(pairs[i]) for i in held_index}
        train = [p for i, p in enumerate(pairs) if i not in held_index and _key(p) not in held_keys]
        evals = [p for i, p in enumerate(pairs) if i in held_index]
    else:
        prompts = sorted({p.prompt for p in pairs})
        rng.shuffle(prompts)
        counts: dict[str, int] = {}
        for pair in pairs:
            counts[pair.prompt] = counts.get(pair.prompt, 0) + 1
        held: set[str] = set()
        size = 0
        for prompt in prompts:
            if size >= eval_size:
                break
            held.add(prompt)
            size += counts[prompt]
        train = [p for p in pairs if p.prompt not in held]
        evals = [p for p in pairs if p.prompt in held]
    if not train:
        raise ValueError(
            f"split_preferences: holding out {eval_size} pairs by {holdout} leaves none to "
            f"train on ({len(pairs)} pairs); lower eval_size"
        )
    return train, evals


def _key(pair: PreferencePair) -> tuple[str, str, str]:
    return (pair.prompt, pair.chosen, pair.rejected)
