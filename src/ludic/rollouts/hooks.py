"""Rollout hooks: async callables that annotate freshly generated rollouts in place, after
generation and before credit assignment (e.g. a reward-model scorer)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ludic.types import Rollout

RM_SCORES_KEY = "rm_scores"
"""``rollout.meta`` key of the per-turn reward-model scores a scorer hook writes."""


@runtime_checkable
class RolloutHook(Protocol):
    """Runs on every freshly generated list of rollouts, after generation and before
    credit assignment (``RolloutBatchSource``, ``RolloutEngine.generate_batch``).

    A hook annotates the rollouts in place, typically in ``rollout.meta`` (e.g.
    ``RewardModelScorer`` writes ``meta["rm_scores"]`` that ``RewardModelCreditAssigner``
    reads), and returns ``None``. It is async so it can await a backend (a reward model);
    hooks run one after another, in the order given.
    """

    async def __call__(self, rollouts: list[Rollout]) -> None: ...


def check_rollout_hooks(owner: str, hooks: Sequence[RolloutHook]) -> tuple[RolloutHook, ...]:
    """``hooks`` as a tuple; raises ``TypeError`` naming ``owner`` if one is not callable."""
    if isinstance(hooks, str) or not isinstance(hooks, Sequence):
        raise TypeError(
            f"{owner}: rollout_hooks={hooks!r}; expected a sequence of async callables "
            "(rollouts) -> None"
        )
    for i, hook in enumerate(hooks):
        if not callable(hook):
            raise TypeError(
                f"{owner}: rollout_hooks[{i}]={hook!r} is not callable; a rollout hook is an "
                "async callable (rollouts) -> None"
            )
    return tuple(hooks)


async def run_rollout_hooks(hooks: Sequence[RolloutHook], rollouts: list[Rollout]) -> None:
    """Await every hook on ``rollouts``, in order. A hook must be async and return
    ``None`` (it annotates in place); anything else raises ``TypeError``, since a
    returned value would otherwise be dropped silently."""
    for hook in hooks:
        result = hook(rollouts)
        if not inspect.isawaitable(result):
            raise TypeError(
                f"rollout hook {hook!r} returned {type(result).__name__}, not an awaitable; "
                "define it as `async def __call__(self, rollouts)`"
            )
        value = await result
        if value is not None:
            raise TypeError(
                f"rollout hook {hook!r} returned {type(value).__name__}; hooks annotate the "
                "rollouts in place (e.g. rollout.meta) and return None"
            )
