"""Credit from the reward loop (:mod:`ludic.rewards`): a rollout's score ``s`` from
``meta["reward_loop"]`` (the ``RewardLoop`` hook's) combined with its env return ``R_env``::

    replace: R = s    add: R = R_env + s    weighted: R = weight * R_env + (1 - weight) * s

then handed to the ``inner`` credit assigner (a preset's) as a rollout whose last env step
carries ``R - R_env``; without ``inner``: ``GroupNormalizedReturn`` with ``group_normalize``
(GRPO), else ``EpisodicReturn``. A rollout the loop dropped (score ``None``) gets weight 0, as
does its group with a group-relative ``inner`` (no baseline; ``dropped_groups``): never a silent 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from ludic.rewards.loop import REWARD_KEY
from ludic.training.credit_assignment import (
    EpisodicReturn,
    GroupNormalizedReturn,
    rollout_group_key,
)
from ludic.training.types import CreditAssigner
from ludic.types import EnvironmentStep, Rollout

Combine = Literal["replace", "add", "weighted"]


@dataclass
class RewardLoopCreditAssigner:
    """Per-turn weights from reward-loop scores (see the module docstring)."""

    mode: Combine = "replace"
    weight: float = 0.5
    group_normalize: bool = True
    group_size: int | None = None
    eps: float = 1e-6
    inner: CreditAssigner | None = None
    """The credit assigner given the combined returns (default: see the module doc)."""
    dropped_groups: int = field(default=0, init=False)
    """Groups zeroed in the last ``compute`` because a member was dropped."""

    def __post_init__(self) -> None:
        name = "RewardLoopCreditAssigner"
        if self.mode not in ("replace", "add", "weighted"):
            raise ValueError(f"{name}: mode={self.mode!r}; choose replace, add or weighted")
        if not 0.0 <= self.weight <= 1.0:
            raise ValueError(f"{name}: weight={self.weight!r}; expected 0 <= weight <= 1")
        if self.inner is None:
            if self.group_normalize and (self.group_size is None or self.group_size < 2):
                raise ValueError(
                    f"{name}: group_normalize=True needs group_size >= 2, got "
                    f"{self.group_size!r} (or pass inner=, e.g. an algorithm's credit assigner)"
                )
            self.inner = (
                GroupNormalizedReturn(self.group_size, eps=self.eps)  # type: ignore[arg-type]
                if self.group_normalize
                else EpisodicReturn()
            )

    def combined_return(self, rollout: Rollout) -> float | None:
        """R for ``rollout``, or ``None`` when the reward loop dropped it."""
        if REWARD_KEY not in rollout.meta:
            raise ValueError(
                f"RewardLoopCreditAssigner: rollout {rollout.id!r} has no "
                f"meta['{REWARD_KEY}']; run the RewardLoop rollout hook before credit "
                "assignment (RolloutBatchSource(rollout_hooks=[reward_loop]))"
            )
        score = rollout.meta[REWARD_KEY]["score"]
        if score is None:
            return None
        env = rollout.total_reward
        if self.mode == "replace":
            return float(score)
        if self.mode == "add":
            return env + float(score)
        return self.weight * env + (1.0 - self.weight) * float(score)

    def compute(self, rollouts: Sequence[Rollout]) -> list[list[float]]:
        assert self.inner is not None
        returns = [self.combined_return(r) for r in rollouts]
        grouped = getattr(self.inner, "group_size", None) is not None
        if grouped:
            out = {rollout_group_key(r) for r, R in zip(rollouts, returns) if R is None}
            self.dropped_groups = len(out)
            kept = [i for i, r in enumerate(rollouts) if rollout_group_key(r) not in out]
        else:
            self.dropped_groups = 0
            kept = [i for i, R in enumerate(returns) if R is not None]
        weights = self.inner.compute(
            [with_return(rollouts[i], returns[i]) for i in kept]  # type: ignore[arg-type]
        )
        by_index = dict(zip(kept, weights))
        for i, rollout in enumerate(rollouts):  # their items say so (the token ledger)
            if i not in by_index:
                rollout.meta["reward_dropped"] = True
        return [by_index.get(i, [0.0] * len(r.turns())) for i, r in enumerate(rollouts)]


def with_return(rollout: Rollout, total: float) -> Rollout:
    """A copy of ``rollout`` whose ``total_reward`` is ``total``: the difference is added to
    the reward of its last environment step (steps are shared, not copied)."""
    last = max(
        (i for i, s in enumerate(rollout.steps) if isinstance(s, EnvironmentStep)), default=None
    )
    if last is None:
        raise ValueError(
            f"RewardLoopCreditAssigner: rollout {rollout.id!r} has no environment step to "
            "carry its reward-loop score"
        )
    steps = list(rollout.steps)
    step = steps[last]
    assert isinstance(step, EnvironmentStep)
    steps[last] = dataclasses.replace(step, reward=step.reward + total - rollout.total_reward)
    return dataclasses.replace(rollout, steps=steps)
