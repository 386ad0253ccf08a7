"""Evaluation: run requests through a ``RolloutEngine`` and reduce per-rollout records.

Each rollout becomes one *eval item*, a plain dict that ``Reducer`` paths read:
``rollout_id``, ``total_reward``, ``success`` (the last env step's ``info["correct"]``
where the env reports one, else ``total_reward > 0``), ``length`` (env steps),
``num_agent_steps``, ``parse_error`` (any step), ``parse_error_rate`` (of agent steps),
``terminated``, ``truncated``, ``info`` (the last env step's, e.g. ``"info.correct"``) and
``meta`` (the rollout's, e.g. ``"meta.env_seed"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ludic.rollouts.engine import RolloutEngine
from ludic.rollouts.requests import RolloutRequest
from ludic.rollouts.summary import parse_error_rate
from ludic.stats import Reducer, aggregate_stats
from ludic.types import Rollout


def eval_item(rollout: Rollout) -> dict[str, Any]:
    """The eval record of one rollout (see the module docstring for its keys)."""
    env_steps = rollout.env_steps
    total = rollout.total_reward
    info = dict(env_steps[-1].info) if env_steps else {}
    return {
        "rollout_id": rollout.id,
        "total_reward": total,
        "success": bool(info["correct"]) if "correct" in info else total > 0,
        "length": rollout.length,
        "num_agent_steps": len(rollout.agent_steps),
        "parse_error": any(s.parse_error for s in rollout.agent_steps),
        "parse_error_rate": parse_error_rate(rollout),
        "terminated": rollout.terminated,
        "truncated": rollout.truncated,
        "info": info,
        "meta": dict(rollout.meta),
    }


def default_reducers() -> list[Reducer]:
    """Mean reward, success rate (``info["correct"]``, else reward > 0), parse-error rate
    and mean length."""
    return [
        Reducer("reward_mean", "total_reward"),
        Reducer("success_rate", "success", reduce="fraction"),
        Reducer("parse_error_rate", "parse_error_rate"),
        Reducer("length_mean", "length"),
    ]


async def run_eval(
    engine: RolloutEngine,
    requests: Sequence[RolloutRequest],
    reducers: Sequence[Reducer] | None = None,
) -> tuple[dict[str, float], list[Rollout]]:
    """Run ``requests`` and reduce their eval items. Returns ``(metrics, rollouts)``;
    ``metrics["num_rollouts"]`` is always present. ``reducers=None`` uses
    :func:`default_reducers`."""
    if not requests:
        raise ValueError("run_eval: no requests; pass at least one RolloutRequest")
    rollouts = await engine.generate_rollouts(requests)
    items = [eval_item(r) for r in rollouts]
    metrics = aggregate_stats(default_reducers() if reducers is None else reducers, items)
    metrics.setdefault("num_rollouts", float(len(rollouts)))
    return metrics, rollouts
