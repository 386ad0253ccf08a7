"""``RewardLoop``: score rollouts per sample with a reward manager and N workers.

Two modes (spec 5):

* **standalone**: each rollout is scored as soon as its episode ends
  (``RolloutEngine(on_episode=[loop.on_episode])``), overlapping the episodes still
  generating; the rollout hook (``loop`` itself, in ``rollout_hooks``) then only waits for
  what is left.
* **colocate**: nothing starts until the whole batch is generated; the rollout hook scores
  every rollout then (a reward model that shares the policy's hardware).

Either way at most ``num_workers`` samples are scored at once, and each rollout gets
``rollout.meta["reward_loop"] = {"score", "metrics", "error"}`` (``score`` ``None``: the
manager dropped the sample after an error). :func:`reward_loop_metrics` sums a batch up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Literal

from ludic._async import PerLoop, gather_or_cancel
from ludic.rewards.managers import RewardManager
from ludic.rewards.sample import RewardResult, RewardSample
from ludic.types import Rollout

REWARD_KEY = "reward_loop"
"""``rollout.meta`` key of a rollout's reward-loop result."""

Mode = Literal["standalone", "colocate"]


def rollout_reward_sample(rollout: Rollout, *, data_source: str | None = None) -> RewardSample:
    """The reward-function view of a single-turn QA rollout: the last model call's text
    (``solution_str``) and token count, the env's ``target`` (``ground_truth``, from the
    last env step's info, else the reset info: a parse failure never reaches the env),
    ``data_source`` (argument, else ``meta["data_source"]``, else
    the env kind) and the first observation as ``extra_info["question"]``."""
    agent_steps = rollout.agent_steps
    if not agent_steps:
        raise ValueError(f"rollout {rollout.id!r} has no model call to score")
    last = agent_steps[-1]
    env_steps = rollout.env_steps
    info = env_steps[-1].info if env_steps else {}
    trace = last.trace
    return RewardSample(
        data_source=data_source
        or rollout.meta.get("data_source")
        or rollout.meta.get("env_kind", ""),
        solution_str=last.completion,
        ground_truth=info.get("target", rollout.meta.get("reset_info", {}).get("target")),
        extra_info={"question": rollout.initial_obs, **rollout.meta.get("extra_info", {})},
        response_length=None if trace is None else len(trace.completion_token_ids),
        sample_id=rollout.id,
    )


class RewardLoop:
    """Scores rollouts with ``manager`` (see the module docstring).

    Args:
        manager: a :class:`~ludic.rewards.managers.RewardManager` (``make_reward_manager``).
        mode: ``standalone`` or ``colocate``.
        num_workers: most samples scored at once.
        to_sample: rollout -> :class:`RewardSample` (default :func:`rollout_reward_sample`).
    """

    def __init__(
        self,
        manager: RewardManager,
        *,
        mode: Mode = "standalone",
        num_workers: int = 8,
        to_sample: Callable[[Rollout], RewardSample] = rollout_reward_sample,
    ) -> None:
        if mode not in ("standalone", "colocate"):
            raise ValueError(f"RewardLoop: mode={mode!r}; choose 'standalone' or 'colocate'")
        if num_workers < 1:
            raise ValueError(f"RewardLoop: num_workers={num_workers}; expected >= 1")
        self.manager = manager
        self.mode = mode
        self.num_workers = num_workers
        self.to_sample = to_sample
        self._workers = PerLoop(lambda: asyncio.Semaphore(num_workers))
        self._pending: dict[str, asyncio.Task[RewardResult]] = {}

    def on_episode(self, rollouts: list[Rollout]) -> None:
        """``RolloutEngine`` callback: in standalone mode, start scoring now."""
        if self.mode != "standalone":
            return
        for rollout in rollouts:
            self._pending[rollout.id] = asyncio.get_running_loop().create_task(self._score(rollout))

    async def __call__(self, rollouts: list[Rollout]) -> None:
        """Rollout hook: wait for (or, in colocate mode, run) every rollout's scoring and
        write its result into ``rollout.meta["reward_loop"]``."""
        tasks = [self._pending.pop(r.id, None) or self._score(r) for r in rollouts]
        results = await gather_or_cancel(*tasks)
        for rollout, result in zip(rollouts, results):
            rollout.meta[REWARD_KEY] = {
                "score": result.score,
                "metrics": dict(result.metrics),
                "error": result.error,
            }

    async def _score(self, rollout: Rollout) -> RewardResult:
        async with self._workers.get():
            return await self.manager.run_single(self.to_sample(rollout))

    async def aclose(self) -> None:
        """Cancel scoring started for rollouts whose batch never reached the hook."""
        pending, self._pending = list(self._pending.values()), {}
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def reward_loop_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """``reward_loop/score_mean`` (over scored samples), ``reward_loop/errors`` (samples
    whose scoring failed), ``reward_loop/dropped`` (failed without a fallback) and the mean
    of every metric the functions returned (``reward_loop/<name>``)."""
    results = [r.meta[REWARD_KEY] for r in rollouts if REWARD_KEY in r.meta]
    scores = [x["score"] for x in results if x["score"] is not None]
    out: dict[str, Any] = {
        "reward_loop/errors": sum(x["error"] is not None for x in results),
        "reward_loop/dropped": sum(x["score"] is None for x in results),
    }
    if scores:
        out["reward_loop/score_mean"] = sum(scores) / len(scores)
    named: dict[str, list[float]] = {}
    for x in results:
        for name, value in x["metrics"].items():
            named.setdefault(name, []).append(value)
    out.update({f"reward_loop/{k}": sum(v) / len(v) for k, v in named.items()})
    return out
