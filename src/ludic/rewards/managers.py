"""Reward managers: how one sample is scored (spec 5's ``run_single``), chosen by name.

Built in: ``naive`` (the function's score), ``dapo`` (plus DAPO's overlong penalty) and
``rate_limited`` (requests/s, tokens/s and concurrency limits, for functions that call an
API). Add yours with ``@register("name")`` on a :class:`RewardManager` subclass with
``run_single``. Failures never become a silent 0: a function that raises, times out or
returns a non-score gives a :class:`RewardResult` with ``error`` set and ``score`` the
``on_error`` fallback, or ``None`` (``on_error="drop"``: the sample is dropped).
"""

from __future__ import annotations

import asyncio
import difflib
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from ludic._async import PerLoop
from ludic.rewards.functions import (
    RewardFunction,
    RewardFunctionError,
    call_reward_function,
)
from ludic.rewards.rules import default_compute_score
from ludic.rewards.sample import RewardResult, RewardSample

OnError = float | Literal["drop"]

REWARD_MANAGERS: dict[str, type[RewardManager]] = {}
"""Name -> manager class; filled by :func:`register`."""

M = TypeVar("M", bound="type[RewardManager]")


def register(name: str) -> Callable[[M], M]:
    """Class decorator: make a :class:`RewardManager` subclass available by ``name``."""

    def add(cls: M) -> M:
        if name in REWARD_MANAGERS and REWARD_MANAGERS[name] is not cls:
            raise ValueError(f"reward manager {name!r} is registered already")
        REWARD_MANAGERS[name] = cls
        return cls

    return add


def make_reward_manager(name: str, **kwargs: Any) -> RewardManager:
    """The registered manager ``name`` built with ``kwargs``."""
    if name not in REWARD_MANAGERS:
        close = difflib.get_close_matches(name, list(REWARD_MANAGERS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"unknown reward manager {name!r}{hint}; choose one of {sorted(REWARD_MANAGERS)}"
        )
    return REWARD_MANAGERS[name](**kwargs)


class RewardManager:
    """Scores one sample at a time with ``compute_score`` (default: the built-in rules by
    ``data_source``, :func:`ludic.rewards.rules.default_compute_score`).

    Args:
        compute_score: the reward function (spec 5's signature; sync or async).
        timeout_s: most seconds one call may take; longer is a failure.
        on_error: the score of a sample whose scoring failed, or ``"drop"``.
        function_kwargs: extra keyword arguments for the function (e.g.
            ``reward_router_address``), passed when it accepts them.
    """

    def __init__(
        self,
        compute_score: RewardFunction | None = None,
        *,
        timeout_s: float | None = None,
        on_error: OnError = "drop",
        function_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s!r}; expected > 0 or None")
        if on_error != "drop" and not isinstance(on_error, int | float):
            raise ValueError(f"on_error={on_error!r}; expected a fallback score or 'drop'")
        self.compute_score = compute_score or default_compute_score
        self.timeout_s = timeout_s
        self.on_error = on_error
        self.function_kwargs = dict(function_kwargs or {})

    async def score(self, sample: RewardSample) -> RewardResult:
        """The function's result for ``sample``; a failure is returned, not raised."""
        try:
            return await call_reward_function(
                self.compute_score, sample, timeout_s=self.timeout_s, **self.function_kwargs
            )
        except RewardFunctionError as e:
            fallback = None if self.on_error == "drop" else float(self.on_error)
            return RewardResult(fallback, error=str(e))

    async def run_single(self, sample: RewardSample) -> RewardResult:
        raise NotImplementedError


@register("naive")
class NaiveRewardManager(RewardManager):
    """The reward function's score, as is."""

    async def run_single(self, sample: RewardSample) -> RewardResult:
        return await self.score(sample)


def overlong_penalty(length: int, max_length: int, buffer_length: int) -> float:
    """DAPO's soft overlong punishment (Yu et al., 2025, arXiv:2503.14476, eq. 13)::

        R(y) = 0                          if |y| <= L_max - L_cache
               ((L_max - L_cache) - |y|) / L_cache
                                          if L_max - L_cache < |y| <= L_max
               -1                         if |y| > L_max

    with ``L_max = max_length`` and ``L_cache = buffer_length``: linear from 0 to -1 over
    the last ``buffer_length`` tokens before the limit."""
    if not 0 < buffer_length <= max_length:
        raise ValueError(
            f"overlong_penalty: buffer_length={buffer_length} must be in (0, max_length="
            f"{max_length}]"
        )
    expected = max_length - buffer_length
    if length <= expected:
        return 0.0
    if length <= max_length:
        return (expected - length) / buffer_length
    return -1.0


@register("dapo")
class DAPORewardManager(RewardManager):
    """The function's score plus ``penalty_factor`` x :func:`overlong_penalty` of the
    response length (``sample.response_length`` tokens; ``max_response_length`` from
    the sample, else this manager's). Metric ``overlong_penalty``."""

    def __init__(
        self,
        compute_score: RewardFunction | None = None,
        *,
        overlong_buffer_len: int,
        max_response_length: int | None = None,
        penalty_factor: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(compute_score, **kwargs)
        if overlong_buffer_len < 1:
            raise ValueError(f"overlong_buffer_len={overlong_buffer_len}; expected >= 1")
        self.overlong_buffer_len = overlong_buffer_len
        self.max_response_length = max_response_length
        self.penalty_factor = penalty_factor

    async def run_single(self, sample: RewardSample) -> RewardResult:
        result = await self.score(sample)
        if result.score is None:
            return result
        max_length = sample.max_response_length or self.max_response_length
        if sample.response_length is None or max_length is None:
            raise ValueError(
                "dapo reward manager: the sample needs response_length, and a "
                "max_response_length (on the sample or the manager)"
            )
        penalty = self.penalty_factor * overlong_penalty(
            sample.response_length, max_length, self.overlong_buffer_len
        )
        return RewardResult(
            result.score + penalty,
            {**result.metrics, "overlong_penalty": penalty},
            result.error,
        )


class _Pace:
    """Spaces acquisitions so that ``rate`` units/s are never exceeded: one of ``cost``
    units lets the next one through ``cost / rate`` s after it returned (measured once it
    has, so a late wake-up under load never lets the next come early)."""

    def __init__(self, rate: float) -> None:
        if rate <= 0:
            raise ValueError(f"rate={rate!r}; expected > 0")
        self.rate = rate
        self._next = 0.0
        self._lock = PerLoop(asyncio.Lock)

    async def acquire(self, cost: float = 1.0) -> None:
        async with self._lock.get():
            wait = self._next - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._next = time.monotonic() + cost / self.rate


@register("rate_limited")
class RateLimitedRewardManager(RewardManager):
    """The function's score, called at most ``requests_per_s`` times a second, for at most
    ``tokens_per_s`` response tokens a second (``sample.response_length``, else
    ``len(solution_str) // 4``), with at most ``max_concurrency`` calls in flight: for
    reward functions that call an external API with limits."""

    def __init__(
        self,
        compute_score: RewardFunction | None = None,
        *,
        requests_per_s: float | None = None,
        tokens_per_s: float | None = None,
        max_concurrency: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(compute_score, **kwargs)
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency}; expected >= 1")
        self._requests = None if requests_per_s is None else _Pace(requests_per_s)
        self._tokens = None if tokens_per_s is None else _Pace(tokens_per_s)
        self._slots = (
            None if max_concurrency is None else PerLoop(lambda: asyncio.Semaphore(max_concurrency))
        )

    async def run_single(self, sample: RewardSample) -> RewardResult:
        if self._requests is not None:
            await self._requests.acquire()
        if self._tokens is not None:
            tokens = sample.response_length
            await self._tokens.acquire(len(sample.solution_str) // 4 if tokens is None else tokens)
        if self._slots is None:
            return await self.score(sample)
        async with self._slots.get():
            return await self.score(sample)
