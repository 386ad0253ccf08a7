"""``ArithmeticQAEnv``: procedurally generated arithmetic questions, checked numerically.

Problems are tiny on purpose (``"12+7"`` -> ``"19"``) so tests and demos with tiny models
and a byte-level tokenizer keep prompts short. Generation is deterministic: the same
``problem_seed`` gives the same problem list, and ``reset(seed)`` picks problem
``seed % num_problems``.
"""

from __future__ import annotations

import functools
import operator
import random
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from ludic.envs.dataset_qa_env import DatasetQAEnv, Verifier, numeric_match
from ludic.envs.single_agent_env import DEFAULT_AGENT_ID
from ludic.types import AgentId

OPERATORS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}
"""The supported operators, by symbol."""


def _operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def make_arithmetic_samples(
    n: int,
    seed: int = 0,
    *,
    operators: Sequence[str] = ("+", "-", "*"),
    min_digits: int = 1,
    max_digits: int = 2,
    non_negative: bool = True,
    distinct: bool = False,
) -> list[dict[str, Any]]:
    """``n`` problems ``a <op> b`` as dicts with ``question``, ``answer``, ``a``, ``op``, ``b``.

    Each operand first draws a digit count in ``[min_digits, max_digits]``, then a value
    with that many digits (1 digit includes 0). ``non_negative=True`` orders the operands
    of ``-`` so the answer is never negative. ``distinct=True`` redraws a problem already
    in the list, so problems at different indices differ (a split by index, e.g. demos on
    the first ones and evaluation on the rest, then holds problems out); ``n`` must not
    exceed the number of distinct problems. The same arguments give the same list.
    """
    samples = _generated(n, seed, tuple(operators), min_digits, max_digits, non_negative, distinct)
    return [dict(sample) for sample in samples]  # the caller's own copies


@functools.lru_cache(maxsize=32)
def _generated(
    n: int,
    seed: int,
    operators: tuple[str, ...],
    min_digits: int,
    max_digits: int,
    non_negative: bool,
    distinct: bool,
) -> tuple[Mapping[str, Any], ...]:
    """The problems of :func:`make_arithmetic_samples`, read-only, generated once per
    argument set: a run builds an env per episode, and drawing ``distinct`` problems up to
    the last few possible ones takes many draws."""
    if n < 1:
        raise ValueError(f"make_arithmetic_samples: n={n}; pass a positive number of problems")
    unknown = [op for op in operators if op not in OPERATORS]
    if unknown or not operators:
        raise ValueError(
            f"make_arithmetic_samples: operators={tuple(operators)!r}; supported operators "
            f"are {tuple(OPERATORS)}"
        )
    if not 1 <= min_digits <= max_digits:
        raise ValueError(
            f"make_arithmetic_samples: min_digits={min_digits}, max_digits={max_digits}; "
            "need 1 <= min_digits <= max_digits"
        )
    if distinct:
        _check_distinct_count(n, operators, min_digits, max_digits, non_negative)
    rng = random.Random(seed)
    samples: list[Mapping[str, Any]] = []
    seen: set[tuple[int, str, int]] = set()
    while len(samples) < n:
        op = rng.choice(list(operators))
        a = _operand(rng, min_digits, max_digits)
        b = _operand(rng, min_digits, max_digits)
        if op == "-" and non_negative and a < b:
            a, b = b, a
        if distinct and (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        samples.append(
            MappingProxyType(
                {
                    "question": f"{a}{op}{b}",
                    "answer": str(OPERATORS[op](a, b)),
                    "a": a,
                    "op": op,
                    "b": b,
                }
            )
        )
    return tuple(samples)


def _check_distinct_count(
    n: int, operators: Sequence[str], min_digits: int, max_digits: int, non_negative: bool
) -> None:
    values = len(range(0 if min_digits == 1 else 10 ** (min_digits - 1), 10**max_digits))
    pairs = values * values
    ordered = (values * (values + 1)) // 2  # "-" with non_negative: a >= b
    possible = sum(ordered if op == "-" and non_negative else pairs for op in set(operators))
    if n > possible:
        raise ValueError(
            f"make_arithmetic_samples: num_problems={n} with distinct=True, but only "
            f"{possible} distinct problems exist for operators={tuple(operators)}, "
            f"min_digits={min_digits}, max_digits={max_digits}"
        )


class ArithmeticQAEnv(DatasetQAEnv):
    """One-shot arithmetic QA over ``num_problems`` generated problems.

    The default observation is ``"<a><op><b>="`` (e.g. ``"12+7="``); the answer is checked
    with :func:`numeric_match`, so ``"19"``, ``" 19 "`` and ``"19.0"`` all score 1.0.
    See :func:`make_arithmetic_samples` for the generation arguments.
    """

    def __init__(
        self,
        *,
        num_problems: int = 1000,
        problem_seed: int = 0,
        operators: Sequence[str] = ("+", "-", "*"),
        min_digits: int = 1,
        max_digits: int = 2,
        non_negative: bool = True,
        distinct: bool = False,
        prompt_template: str | None = "{question}=",
        system_prompt: str | None = None,
        verifier: Verifier = numeric_match,
        agent_id: AgentId = DEFAULT_AGENT_ID,
        rng_seed: int | None = None,
    ) -> None:
        samples = _generated(  # read-only and shared: a run builds an env per episode
            num_problems,
            problem_seed,
            tuple(operators),
            min_digits,
            max_digits,
            non_negative,
            distinct,
        )
        super().__init__(
            samples,
            verifier=verifier,
            prompt_template=prompt_template,
            system_prompt=system_prompt,
            agent_id=agent_id,
            rng_seed=rng_seed,
        )
