"""Statistics of a list of rollouts (reward, length, truncation, parse errors)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ludic.rewards.loop import REWARD_KEY, reward_loop_metrics
from ludic.rollouts.hooks import RM_SCORES_KEY
from ludic.types import Rollout


def parse_error_rate(rollout: Rollout) -> float:
    """Fraction of the rollout's agent steps whose completion did not parse (0.0 if none)."""
    steps = rollout.agent_steps
    return sum(s.parse_error for s in steps) / len(steps) if steps else 0.0


def summarize_rollouts(rollouts: Sequence[Rollout]) -> dict[str, Any]:
    """Batch-level rollout statistics (reward, length, truncation, parse errors).

    ``parse_error_rate`` is the mean over rollouts of :func:`parse_error_rate`;
    ``total_rewards`` lists every rollout's total reward in order.
    ``zero_variance_group_frac`` (when rollouts carry ``meta["group_id"]``): the fraction
    of groups of two or more whose rewards are all equal, so that group-relative
    advantages give them no learning signal. When a reward model
    scored the rollouts (``RewardModelScorer``), ``rm_score_mean`` is the mean of its
    scores; when a reward loop did (``ludic.rewards.RewardLoop``), the
    ``reward_loop/...`` figures of :func:`ludic.rewards.loop.reward_loop_metrics`.
    """
    n = len(rollouts)
    rewards = [r.total_reward for r in rollouts]
    if n == 0:
        return {"num_rollouts": 0, "total_rewards": []}
    scores = [s for r in rollouts for s in r.meta.get(RM_SCORES_KEY) or () if s is not None]
    extra = {"rm_score_mean": sum(scores) / len(scores)} if scores else {}
    groups: dict[Any, list[float]] = {}
    for r in rollouts:
        if r.meta.get("group_id") is not None and not r.meta.get("delegated"):
            key = (r.meta["group_id"], r.meta.get("agent_id"))  # per player, as GRPO groups
            groups.setdefault(key, []).append(r.total_reward)
    if any(REWARD_KEY in r.meta for r in rollouts):  # scored by a reward loop
        extra.update(reward_loop_metrics(rollouts))
    sized = [g for g in groups.values() if len(g) >= 2]
    if sized:
        flat = sum(all(x == g[0] for x in g) for g in sized)
        extra["zero_variance_group_frac"] = flat / len(sized)
    return {
        **extra,
        "num_rollouts": n,
        "reward_mean": sum(rewards) / n,
        "reward_min": min(rewards),
        "reward_max": max(rewards),
        "length_mean": sum(r.length for r in rollouts) / n,
        "truncated_frac": sum(r.truncated for r in rollouts) / n,
        "terminated_frac": sum(r.terminated for r in rollouts) / n,
        "parse_error_rate": sum(parse_error_rate(r) for r in rollouts) / n,
        "total_rewards": rewards,
    }
