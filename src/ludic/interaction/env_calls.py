"""How the protocols call env code: on the event loop (the default), or in threads.

``LudicEnv.reset``/``step`` are synchronous and may block. Inline (the default) every
episode's reset returns in the same loop tick, so an in-process backend batches the first
requests the same way each run (deterministic outputs), but a blocking call delays the
episode timeout until it returns. With :func:`env_calls_in_threads`
(``RolloutEngine(env_calls="thread")``, config ``env.run_in_thread``), :func:`call_env` runs
each call in a daemon thread; a timed-out call is abandoned there. A per-env lock, also
taken by :func:`close_env`, keeps an abandoned call from overlapping another or ``close()``.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ludic._async import in_daemon_thread
from ludic.timing import timed
from ludic.types import AgentId, ContractError, Info, Observation, StepOutcome

T = TypeVar("T")

_IN_THREADS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "ludic_env_calls_in_threads", default=False
)


@contextlib.contextmanager
def env_calls_in_threads(enabled: bool = True) -> Iterator[None]:
    """Within this context (of the current task), :func:`call_env` runs env calls in a
    daemon thread (``enabled``) or on the event loop."""
    token = _IN_THREADS.set(enabled)
    try:
        yield
    finally:
        _IN_THREADS.reset(token)


_locks: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


def _env_lock(env: object) -> threading.Lock:
    with _locks_guard:
        try:
            lock = _locks.get(env)
            if lock is None:
                lock = _locks[env] = threading.Lock()
        except TypeError:  # an env that cannot be weakly referenced: its own lock
            lock = env.__dict__.setdefault("_ludic_env_lock", threading.Lock())
        return lock


async def call_env(env: object, method: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``method(*args, **kwargs)`` (a method of ``env``) holding ``env``'s lock: in a
    daemon thread inside :func:`env_calls_in_threads`, else on the event loop."""
    lock = _env_lock(env)

    def locked() -> T:
        with lock, timed("env"):
            return method(*args, **kwargs)

    if _IN_THREADS.get():
        return await in_daemon_thread(locked)
    return locked()


async def reset_env(env: Any, seed: int | None) -> dict[AgentId, tuple[Observation, Info]]:
    """``env.reset(seed=seed)`` through :func:`call_env`, checked: a mapping of agent id ->
    ``(observation, info)``; anything else raises :class:`ContractError` naming the env."""
    resets = await _contract(env, "reset", call_env(env, env.reset, seed=seed))
    if not isinstance(resets, dict) or not all(
        isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) for v in resets.values()
    ):
        raise ContractError(
            f"{type(env).__name__}.reset(seed={seed}) returned {_short(resets)}; it must return "
            "{agent_id: (observation str, info dict)}"
        )
    return resets


async def step_env(env: Any, actions: dict[AgentId, str]) -> dict[AgentId, StepOutcome]:
    """``env.step(actions)`` through :func:`call_env`, checked: a mapping of agent id ->
    ``StepOutcome``; anything else raises :class:`ContractError` naming the env."""
    outcomes = await _contract(env, "step", call_env(env, env.step, actions))
    if not isinstance(outcomes, dict) or not all(
        isinstance(o, StepOutcome) for o in outcomes.values()
    ):
        raise ContractError(
            f"{type(env).__name__}.step({_short(actions)}) returned {_short(outcomes)}; it "
            "must return {agent_id: StepOutcome(obs, reward, ...)}"
        )
    return outcomes


async def _contract(env: Any, method: str, call: Any) -> Any:
    """Await ``call``; a :class:`ContractError` raised inside the env (e.g. building a
    ``StepOutcome`` with a ``None`` reward) gets the env's name in front."""
    try:
        return await call
    except ContractError as e:
        raise ContractError(f"{type(env).__name__}.{method}(): {e}") from e


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def close_env(env: object) -> None:
    """``env.close()`` if it has one: now when no call on ``env`` is running, else in a
    background thread as soon as the (timed-out, abandoned) call returns."""
    close = getattr(env, "close", None)
    if not callable(close):
        return
    lock = _env_lock(env)
    if lock.acquire(blocking=False):
        try:
            close()
        finally:
            lock.release()
        return

    def close_when_free() -> None:
        with lock:
            close()

    name = f"ludic-close-{type(env).__name__}"
    threading.Thread(target=close_when_free, name=name, daemon=True).start()
