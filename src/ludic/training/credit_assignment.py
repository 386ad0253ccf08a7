"""Credit assigners: rewards -> one scalar weight per turn.

Every assigner implements ``CreditAssigner.compute(rollouts) -> weights`` where
``weights[i][j]`` is the weight of turn ``j`` of ``rollouts[i].turns()``. A turn's reward
``r_j`` is ``Turn.reward`` (env reward + parser rewards of its agent steps); an episode's
return ``R`` is ``Rollout.total_reward`` (the undiscounted sum of turn rewards).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

from ludic.types import Rollout, rollout_group_key

GroupStd = Literal["population", "sample"]
"""The standard deviation of a group-relative advantage: divide by G or by G - 1."""


def check_negative_group_coef(owner: str, coef: object) -> None:
    if isinstance(coef, bool) or not isinstance(coef, int | float) or not 0 <= coef < math.inf:
        raise ValueError(
            f"{owner}: negative_group_coef={coef!r}; expected a finite value >= 0 (0: a "
            "group whose samples all fail gets no gradient, as in GRPO)"
        )


def check_group_std(owner: str, std: object) -> None:
    if std not in ("population", "sample"):
        raise ValueError(
            f"{owner}: std={std!r}; expected 'population' (divide by the group size G) or "
            "'sample' (divide by G - 1, as verl and TRL)"
        )


@dataclass(frozen=True)
class MonteCarloReturn:
    """Discounted return-to-go per turn (REINFORCE, Williams 1992).

    G_j = sum_{k>=0} gamma^k * r_{j+k},  over the turns of one rollout.
    Reads: ``Turn.reward`` of each turn. Output: ``[len(rollouts)][num_turns_i]``.
    """

    gamma: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"MonteCarloReturn: gamma={self.gamma!r}; expected 0 <= gamma <= 1")

    def compute(self, rollouts: Sequence[Rollout]) -> list[list[float]]:
        out: list[list[float]] = []
        for rollout in rollouts:
            rewards = [t.reward for t in rollout.turns()]
            returns = [0.0] * len(rewards)
            running = 0.0
            for j in range(len(rewards) - 1, -1, -1):
                running = rewards[j] + self.gamma * running
                returns[j] = running
            out.append(returns)
        return out


@dataclass(frozen=True)
class GroupNormalizedReturn:
    """Group-relative advantage (GRPO, arXiv:2402.03300, sec. 4.1.2).

    A_i = (R_i - mean_g(R)) / (std_g(R) + eps)   if normalize_std
    A_i =  R_i - mean_g(R)                        otherwise (Dr. GRPO, arXiv:2503.20783)
    where g is the group of rollout i and R = ``Rollout.total_reward``. ``std`` picks the
    divisor of the standard deviation over a group of G: ``"population"`` (G, the default)
    or ``"sample"`` (G - 1, as verl, TRL and the Dr. GRPO authors' code compute it with
    ``torch.std``). The population std gives advantages sqrt(G / (G - 1)) times larger:
    1.07x at G = 8, 1.41x at G = 2. A_i is assigned to every turn of rollout i. A group
    whose returns are all equal gets all-zero advantages (never NaN) when
    ``negative_group_coef`` is 0.

    Groups: ``rollout.meta["group_id"]`` when present (split by ``meta["agent_id"]``: in
    multi-agent self-play each player's rollouts form their own group), else
    ``rollout.initial_obs`` (same problem). Every group must hold exactly ``group_size``
    rollouts.

    ``negative_group_coef`` = c > 0 gives a failed group a signal too. A group whose returns
    are all equal and below the batch's mean return mean_B(R) (for 0/1 rewards: no sample
    right) gets, instead of 0,
        A_i = c * (R_i - mean_B(R))        (not divided by a std; mean_B over every rollout
                                            passed to ``compute``, the step's batch,
                                            delegated rollouts left out; a delegated
                                            group never gets it)
    which lowers the probability of the answers its samples gave and so moves mass to
    others, the right one among them. GRPO gives such a "negative group" no gradient
    (Feng et al. 2025, arXiv:2510.08696; Nan et al. 2025, arXiv:2509.18851, who add a
    virtual max-reward sample to every group instead); pushing down wrong samples alone
    already trains (negative sample reinforcement, Zhu et al. 2025, arXiv:2506.01347).
    Groups with a spread, and equal groups at or above the batch mean, are as in GRPO.

    Delegated sub-agent rollouts (``meta["delegated"]``, set by the delegation handler)
    carry their parent's ``group_id`` but are a different policy role: they form their own
    group per ``group_id``, are normalized among themselves, and are exempt from the
    ``group_size`` check (how many a parent spawns varies). A lone delegated rollout gets
    advantage 0.
    Output: ``[len(rollouts)][num_turns_i]``.
    """

    group_size: int
    normalize_std: bool = True
    eps: float = 1e-6
    std: GroupStd = "population"
    negative_group_coef: float = 0.0

    def __post_init__(self) -> None:
        check_group_std("GroupNormalizedReturn", self.std)
        check_negative_group_coef("GroupNormalizedReturn", self.negative_group_coef)
        if self.group_size < 2:
            raise ValueError(
                f"GroupNormalizedReturn: group_size={self.group_size!r}; a group-relative "
                "advantage needs group_size >= 2 (a group of one always has advantage 0)"
            )
        if self.eps < 0:
            raise ValueError(f"GroupNormalizedReturn: eps={self.eps!r}; expected eps >= 0")

    def compute(self, rollouts: Sequence[Rollout]) -> list[list[float]]:
        advantages = group_relative_advantages(
            rollouts,
            [r.total_reward for r in rollouts],
            group_size=self.group_size,
            normalize_std=self.normalize_std,
            eps=self.eps,
            std=self.std,
            negative_group_coef=self.negative_group_coef,
            owner="GroupNormalizedReturn",
        )
        return [[advantages[i]] * len(r.turns()) for i, r in enumerate(rollouts)]


def group_relative_advantages(
    rollouts: Sequence[Rollout],
    returns: Sequence[float],
    *,
    group_size: int,
    normalize_std: bool = True,
    eps: float = 1e-6,
    std: GroupStd = "population",
    negative_group_coef: float = 0.0,
    owner: str = "GroupNormalizedReturn",
) -> list[float]:
    """One group-relative advantage per rollout, from ``returns[i]`` (rollout i's return).

    A_i = (R_i - mean_g(R)) / (std_g(R) + eps)   if normalize_std, else R_i - mean_g(R),
    with the groups, ``std`` divisor (population: G, sample: G - 1), zero-variance,
    ``negative_group_coef`` and delegated-rollout rules of
    :class:`GroupNormalizedReturn` (which calls this with ``R_i = total_reward``).
    ``owner`` names the caller in errors. Output: ``[len(rollouts)]``.
    """
    if len(returns) != len(rollouts):
        raise ValueError(f"{owner}: {len(returns)} returns for {len(rollouts)} rollouts")
    keys = [rollout_group_key(rollout, owner=owner) for rollout in rollouts]
    groups: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)

    advantages = [0.0] * len(rollouts)
    batch_mean = 0.0  # read only with negative_group_coef
    if negative_group_coef > 0:
        policy = [r for r, key in zip(returns, keys) if key[0] != "delegated"]
        batch_mean = sum(policy) / len(policy) if policy else 0.0
    for (kind, name, *player), members in groups.items():
        if kind != "delegated" and len(members) != group_size:
            label = repr(name) if kind == "group_id" else f"initial_obs={str(name)[:40]!r}"
            if player and player[0] is not None:
                label += f" (agent {player[0]!r})"
            raise ValueError(
                f"group_size={group_size} but group {label} has {len(members)} "
                "rollouts; make rollouts per request a multiple of group_size "
                f"(GRPORequestStrategy(group_size={group_size}))"
            )
        group_returns = [returns[i] for i in members]
        if all(r == group_returns[0] for r in group_returns):
            # zero variance: no learning signal (advantages stay 0.0), except a failed
            # group's with negative_group_coef
            below = group_returns[0] - batch_mean
            if negative_group_coef > 0 and below < 0 and kind != "delegated":
                for i in members:
                    advantages[i] = negative_group_coef * below
            continue
        mean = sum(group_returns) / len(group_returns)
        divisor = len(group_returns) - (1 if std == "sample" else 0)
        spread = math.sqrt(sum((r - mean) ** 2 for r in group_returns) / divisor)
        for i, r in zip(members, group_returns):
            a = r - mean
            advantages[i] = a / (spread + eps) if normalize_std else a
    return advantages


@dataclass(frozen=True)
class EpisodicReturn:
    """Every turn gets the undiscounted episode return: w_j = R = sum_k r_k.

    Reads: ``Rollout.total_reward``. Output: ``[len(rollouts)][num_turns_i]``.
    """

    def compute(self, rollouts: Sequence[Rollout]) -> list[list[float]]:
        return [[r.total_reward] * len(r.turns()) for r in rollouts]


@dataclass(frozen=True)
class PerStepReward:
    """Each turn gets its own immediate reward: w_j = r_j (no propagation).

    Reads: ``Turn.reward``. Output: ``[len(rollouts)][num_turns_i]``.
    """

    def compute(self, rollouts: Sequence[Rollout]) -> list[list[float]]:
        return [[t.reward for t in r.turns()] for r in rollouts]


@dataclass(frozen=True)
class ConstantCredit:
    """Every turn gets the same weight: w_j = value (1.0 makes REINFORCE plain SFT/NLL).

    Reads nothing from the rollouts but their turns. Output: ``[len(rollouts)][num_turns_i]``.
    """

    value: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.value):
            raise ValueError(f"ConstantCredit: value={self.value!r}; expected a finite float")

    def compute(self, rollouts: Sequence[Rollout]) -> list[list[float]]:
        return [[float(self.value)] * len(r.turns()) for r in rollouts]


__all__ = [
    "ConstantCredit",
    "EpisodicReturn",
    "GroupNormalizedReturn",
    "GroupStd",
    "MonteCarloReturn",
    "PerStepReward",
    "check_negative_group_coef",
    "group_relative_advantages",
    "rollout_group_key",
]
