"""Credit from the reward loop (:mod:`ludic.rewards`): a rollout's score from
``meta["reward_loop"]`` (written by the ``RewardLoop`` rollout hook), combined with its env
return, into per-turn weights.

For rollout i with env return R_env and reward-loop score s::

    replace:  R = s
    add:      R = R_env + s
    weighted: R = weight * R_env + (1 - weight) * s

then, with ``group_normalize`` (GRPO), every turn gets A_i = (R_i - mean_g(R)) / (std_g(R)
+ eps) over its group (as :class:`~ludic.training.credit_assignment.GroupNormalizedReturn`),
else every turn gets R_i.

A rollout the reward loop dropped (score ``None``: its reward function failed and the
manager has no fallback) trains on nothing: weight 0 for all its turns, and with
``group_normalize`` its whole group gets 0 too, since the group's baseline is unknown
without it. Never a silent 0 reward: the group is out, and ``dropped_groups`` counts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from ludic.rewards.loop import REWARD_KEY
from ludic.training.credit_assignment import group_relative_advantages, rollout_group_key
from ludic.types import Rollout

Combine = Literal["replace", "add", "weighted"]


@dataclass
class RewardLoopCreditAssigner:
    """Per-turn weights from reward-loop scores (see the module docstring)."""

    mode: Combine = "replace"
    weight: float = 0.5
    group_normalize: bool = True
    group_size: int | None = None
    eps: float = 1e-6
    dropped_groups: int = field(default=0, init=False)
    """Groups zeroed in the last ``compute`` because a member was dropped."""

    def __post_init__(self) -> None:
        name = "RewardLoopCreditAssigner"
        if self.mode not in ("replace", "add", "weighted"):
            raise ValueError(f"{name}: mode={self.mode!r}; choose replace, add or weighted")
        if not 0.0 <= self.weight <= 1.0:
            raise ValueError(f"{name}: weight={self.weight!r}; expected 0 <= weight <= 1")
        if self.group_normalize and (self.group_size is None or self.group_size < 2):
            raise ValueError(
                f"{name}: group_normalize=True needs group_size >= 2, got {self.group_size!r}"
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
        returns = [self.combined_return(r) for r in rollouts]
        self.dropped_groups = 0
        if not self.group_normalize:
            return [[0.0 if R is None else R] * len(r.turns()) for r, R in zip(rollouts, returns)]
        dropped = {rollout_group_key(r) for r, R in zip(rollouts, returns) if R is None}
        self.dropped_groups = len(dropped)
        kept = [i for i, r in enumerate(rollouts) if rollout_group_key(r) not in dropped]
        assert self.group_size is not None
        advantages = group_relative_advantages(
            [rollouts[i] for i in kept],
            [returns[i] for i in kept],  # type: ignore[misc]  # None only in dropped groups
            group_size=self.group_size,
            eps=self.eps,
            owner="RewardLoopCreditAssigner",
        )
        by_index = dict(zip(kept, advantages))
        return [[by_index.get(i, 0.0)] * len(r.turns()) for i, r in enumerate(rollouts)]
