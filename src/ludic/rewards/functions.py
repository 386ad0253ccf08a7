"""User reward functions: spec 5's ``compute_score`` signature, sync or async.

``compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)`` returns a
number, or a dict with a ``score`` whose other numeric entries are logged as metrics.
``async def`` functions are awaited; plain ones run in a daemon thread, so a slow checker
never blocks generation and one that hangs past its timeout is abandoned. Extra keyword
arguments (e.g. ``reward_router_address``) go only to functions that accept them: by
name, or all of them with ``**kwargs``.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Mapping
from numbers import Real
from typing import Any

from ludic._async import in_daemon_thread
from ludic._imports import load_function
from ludic.rewards.sample import RewardResult, RewardSample

RewardFunction = Callable[..., Any]
"""``(data_source, solution_str, ground_truth, extra_info, **kwargs) -> float | dict``."""

SPEC_PARAMETERS = ("data_source", "solution_str", "ground_truth", "extra_info")


class RewardFunctionError(Exception):
    """A reward function raised, timed out or returned something that is not a score."""


def load_reward_function(spec: str, *, field: str = "reward.function") -> RewardFunction:
    """The function ``spec`` names (``path/to/file.py:function`` or
    ``package.module:function``), checked to take spec 5's four arguments."""
    fn = load_function(spec, field=field)
    check_signature(fn, field=field)
    return fn


def check_signature(fn: RewardFunction, *, field: str = "reward function") -> None:
    """Raise ``TypeError`` naming ``field`` unless ``fn`` accepts the four arguments."""
    try:
        inspect.signature(fn).bind(*SPEC_PARAMETERS)
    except TypeError:
        raise TypeError(
            f"{field}: {getattr(fn, '__name__', fn)!r} must accept (data_source, "
            "solution_str, ground_truth, extra_info, **kwargs)"
        ) from None
    except ValueError:  # no signature (a builtin): let the call tell
        return


def _is_async(fn: RewardFunction) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    call = inspect.getattr_static(type(fn), "__call__", None)
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


def _accepted(fn: RewardFunction, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    try:
        params = inspect.signature(fn).parameters
    except ValueError:
        return dict(kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


async def call_reward_function(
    fn: RewardFunction,
    sample: RewardSample,
    *,
    timeout_s: float | None = None,
    **kwargs: Any,
) -> RewardResult:
    """Score ``sample`` with ``fn`` (awaited if async, in a thread if not) within
    ``timeout_s``. Raises :class:`RewardFunctionError` naming the sample when ``fn``
    raises, times out or returns something that is not a finite score."""
    args = (sample.data_source, sample.solution_str, sample.ground_truth, sample.extra_info)
    extra = _accepted(fn, kwargs)
    where = f"sample {sample.sample_id!r}" if sample.sample_id else "a sample"
    name = getattr(fn, "__name__", repr(fn))
    try:
        async with asyncio.timeout(timeout_s):
            if _is_async(fn):
                value = await fn(*args, **extra)
            else:
                value = await in_daemon_thread(fn, *args, **extra)
                if inspect.isawaitable(value):  # e.g. a partial of an async function
                    value = await value
    except TimeoutError:
        raise RewardFunctionError(
            f"reward function {name} did not score {where} within {timeout_s}s"
        ) from None
    except Exception as e:
        raise RewardFunctionError(
            f"reward function {name} raised on {where}: {type(e).__name__}: {e}"
        ) from e
    return as_result(value, name=name, where=where)


def as_result(
    value: Any, *, name: str = "reward function", where: str = "a sample"
) -> RewardResult:
    """A function's return value as a :class:`RewardResult`: a number, or a dict with a
    numeric ``score`` (its other numeric entries become metrics)."""
    metrics: dict[str, float] = {}
    score = value
    if isinstance(value, Mapping):
        if "score" not in value:
            raise RewardFunctionError(
                f"{name} returned a dict without 'score' for {where} (keys: {sorted(value)})"
            )
        score = value["score"]
        metrics = {
            str(k): float(v)
            for k, v in value.items()
            if k != "score" and isinstance(v, Real) and not isinstance(v, bool)
        }
    if isinstance(score, bool) or not isinstance(score, Real) or not math.isfinite(score):
        raise RewardFunctionError(
            f"{name} returned score {score!r} for {where}; expected a finite number"
        )
    return RewardResult(float(score), metrics)
