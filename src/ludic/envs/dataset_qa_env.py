"""``DatasetQAEnv``: one-shot question answering over a sequence of sample dicts.

One episode = one sample: ``reset`` shows the question, the single ``step`` scores the
(already parsed) answer with a pluggable verifier and terminates. Ready verifiers:
:func:`exact_match`, :func:`numeric_match` and :func:`gsm8k_match`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any, TypeAlias

from ludic.envs.single_agent_env import DEFAULT_AGENT_ID, SingleAgentEnv
from ludic.envs.templates import fill_template
from ludic.types import AgentId, Info, Observation, StepOutcome

Verifier: TypeAlias = Callable[[str, str], float | bool]
"""``(prediction, target) -> reward``; a ``bool`` counts as 1.0 / 0.0."""


def exact_match(prediction: str, target: str) -> bool:
    """True when the two strings are equal after stripping surrounding whitespace."""
    return prediction.strip() == target.strip()


_DIGIT_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_FRACTION = re.compile(r"([+-]?\d+)\s*/\s*([+-]?\d+)")
_LATEX_FRACTION = re.compile(r"([+-]?)\\[dt]?frac\s*\{\s*([+-]?\d+)\s*\}\s*\{\s*([+-]?\d+)\s*\}")
_LATEX_NOISE = re.compile(r"\\[,!;: ]|\{,\}|\\left|\\right")


def parse_number(text: str) -> Fraction | None:
    """Parse ``text`` as an exact number, or return ``None``.

    Accepts ints, decimals, scientific notation and ``p/q`` fractions, with thousands
    commas (``1,234.5``), a leading ``$`` and a trailing ``.`` tolerated, and the LaTeX a
    ``\\boxed{}`` answer holds: ``\\frac{1}{2}`` (also ``\\dfrac``, ``\\tfrac``, with a
    sign), ``1{,}000``, thin spaces (``\\,``), ``\\$``. The whole string (after
    stripping) must be the number: ``"x = 3"`` is not parsed.
    """
    s = text.strip()
    if s.isascii() and s.isdigit():  # the common answer, without the regexes
        return Fraction(int(s))
    s = s.removeprefix("\\$").removeprefix("$").removesuffix(".").strip()
    s = _DIGIT_COMMA.sub("", _LATEX_NOISE.sub("", s))
    if _DECIMAL.fullmatch(s):
        return Fraction(s)
    m = _FRACTION.fullmatch(s)
    if m and int(m.group(2)) != 0:
        return Fraction(int(m.group(1)), int(m.group(2)))
    m = _LATEX_FRACTION.fullmatch(s)
    if m and int(m.group(3)) != 0:
        value = Fraction(int(m.group(2)), int(m.group(3)))
        return -value if m.group(1) == "-" else value
    return None


def numeric_match(prediction: str, target: str) -> bool:
    """True when both strings parse (see :func:`parse_number`) to the same exact number.

    ``"0.5"``, ``"1/2"`` and ``"0.50"`` all match. An unparsable prediction scores
    ``False``; an unparsable *target* is a dataset bug and raises ``ValueError``.
    """
    want = parse_number(target)
    if want is None:
        raise ValueError(
            f"numeric_match: target {target!r} is not a number; fix the dataset's answer "
            "field or use the exact_match verifier"
        )
    got = parse_number(prediction)
    return got is not None and got == want


_GSM8K_MARK = "####"
_LAST_NUMBER = re.compile(r"[+-]?\$?\d[\d,]*(?:\.\d+)?")


def gsm8k_answer(text: str) -> str | None:
    """The final answer of a GSM8K-style text: what follows the last ``####``, else the
    last number in the text (``None`` if there is none)."""
    if _GSM8K_MARK in text:
        return text.rsplit(_GSM8K_MARK, 1)[1].strip()
    numbers = _LAST_NUMBER.findall(text)
    return numbers[-1] if numbers else None


def gsm8k_match(prediction: str, target: str) -> bool:
    """GSM8K's convention on both sides: the answer after ``#### `` (else the last number),
    compared as numbers (:func:`numeric_match`). A target is a bare number or a whole
    GSM8K solution ending in ``#### N``; one without a number raises ``ValueError``."""
    want = gsm8k_answer(target)
    if want is None or parse_number(want) is None:
        raise ValueError(
            f"gsm8k_match: target {target!r} has no final number (#### N); fix the dataset's "
            "answer field or use the exact_match verifier"
        )
    got = gsm8k_answer(prediction)
    return got is not None and numeric_match(got, want)


class DatasetQAEnv(SingleAgentEnv):
    """One-shot QA on dataset samples, scored by a verifier.

    * ``reset(seed)`` picks sample ``seed % len(samples)``; ``seed=None`` draws one from
      the env's own RNG (seeded by ``rng_seed``). The observation is
      ``prompt_template.format(**sample, question=sample[question_key])`` (or the bare
      question when no template is given). Reset info: ``sample_index``.
    * ``step(answer)`` returns ``reward = float(verifier(answer, target))``,
      ``terminated=True``, and info ``target``, ``correct`` (reward > 0) and
      ``sample_index``.
    """

    def __init__(
        self,
        samples: Sequence[Mapping[str, Any]],
        *,
        question_key: str = "question",
        answer_key: str = "answer",
        verifier: Verifier = exact_match,
        prompt_template: str | None = None,
        system_prompt: str | None = None,
        agent_id: AgentId = DEFAULT_AGENT_ID,
        rng_seed: int | None = None,
    ) -> None:
        super().__init__(agent_id=agent_id, system_prompt=system_prompt)
        if len(samples) == 0:
            raise ValueError(f"{type(self).__name__}: samples is empty; pass at least one sample")
        # one pass in a comprehension (an env is built per episode, over every sample)
        lacking = [i for i, s in enumerate(samples) if question_key not in s or answer_key not in s]
        if lacking:
            sample = samples[lacking[0]]
            key, arg = (
                (question_key, "question_key")
                if question_key not in sample
                else (answer_key, "answer_key")
            )
            raise KeyError(
                f"{type(self).__name__}: sample {lacking[0]} has no key {key!r} (keys: "
                f"{sorted(sample)}); set {arg}= to the right field name"
            )
        if not callable(verifier):
            raise TypeError(f"verifier={verifier!r} is not callable (prediction, target) -> reward")
        self.samples = samples
        self.question_key = question_key
        self.answer_key = answer_key
        self.verifier = verifier
        self.prompt_template = prompt_template
        self._rng_seed = rng_seed
        self._rng: random.Random | None = None  # made at the first unseeded reset
        self._index: int | None = None
        self.render_prompt(samples[0])  # fail at construction on a bad template

    @property
    def current_sample(self) -> Mapping[str, Any]:
        """The sample of the current episode (after ``reset``)."""
        if self._index is None:
            raise RuntimeError(f"{type(self).__name__}: no current sample; call reset() first")
        return self.samples[self._index]

    def reference_answer(self) -> str:
        """The current sample's answer (``ReferenceAnswerEnv``)."""
        return str(self.current_sample[self.answer_key])

    def render_prompt(self, sample: Mapping[str, Any]) -> str:
        """The observation shown for ``sample``."""
        question = str(sample[self.question_key])
        if self.prompt_template is None:
            return question
        fields = {**sample, "question": question}
        return fill_template(
            f"{type(self).__name__}: prompt_template", self.prompt_template, fields, "the sample"
        )

    def env_reset(self, seed: int | None = None) -> tuple[Observation, Info]:
        n = len(self.samples)
        if seed is not None:
            self._index = seed % n
        else:
            if self._rng is None:
                self._rng = random.Random(self._rng_seed)
            self._index = self._rng.randrange(n)
        sample = self.samples[self._index]
        info = {"sample_index": self._index, "target": str(sample[self.answer_key])}
        return self.render_prompt(sample), info

    def env_step(self, action: str) -> StepOutcome:
        target = str(self.current_sample[self.answer_key])
        reward = float(self.verifier(action, target))
        correct = reward > 0
        return StepOutcome(
            obs="Correct." if correct else "Incorrect.",
            reward=reward,
            terminated=True,
            info={"target": target, "correct": correct, "sample_index": self._index},
        )
