"""``RewardLoop``: score rollouts per sample with a reward manager and N workers (spec 5).

Standalone: each rollout is scored as its episode ends (``on_episode``), and the rollout
hook (the loop itself) waits for the rest. Colocate: the hook scores the batch once it is
generated, waking sleeping ``servers`` (:class:`ScoringServers`). A ``group_scorer`` scores
a prompt's group (``meta["group_id"]``, per ``agent_id``) once all ``group_size`` arrived.
At most ``num_workers`` samples (or groups) are scored at once; each rollout gets
``meta["reward_loop"] = {"score", "metrics", "error"}`` (:func:`reward_loop_metrics`). Each
new error kind is logged once; too many failures raise :class:`RewardLoopError`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal, Protocol

from ludic._async import PerLoop, gather_or_cancel
from ludic.rewards.managers import RewardManager
from ludic.rewards.sample import RewardResult, RewardSample
from ludic.types import Rollout, rollout_group_key

log = logging.getLogger(__name__)

REWARD_KEY = "reward_loop"
"""``rollout.meta`` key of a rollout's reward-loop result."""

Mode = Literal["standalone", "colocate"]


class RewardLoopError(RuntimeError):
    """Too many samples of a batch failed to score (see ``max_failure_fraction``)."""


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


class ScoringServers(Protocol):
    """Reward servers that free their GPU between batches (colocate mode: vLLM sleep
    mode): the loop wakes them before it scores a batch and puts them back to sleep
    after, whatever the scoring did."""

    async def wake(self) -> None: ...

    async def sleep(self) -> None: ...


class GroupScorer(Protocol):
    """Scores one group's samples together (``GroupJudge``): one result per sample, in
    order; a failure is each sample's ``error``, not an exception."""

    async def score_group(self, samples: Sequence[RewardSample]) -> list[RewardResult]: ...


def group_key(rollout: Rollout) -> Hashable:
    """The group of ``rollout`` for group scoring: the one GRPO normalizes it in
    (:func:`ludic.types.rollout_group_key`: its prompt's ``group_id``, per player)."""
    return rollout_group_key(rollout, owner="RewardLoop")


class RewardLoop:
    """Scores rollouts with ``manager``, or groups of them with ``group_scorer`` (see the
    module docstring).

    Args:
        manager: a :class:`~ludic.rewards.managers.RewardManager` (``make_reward_manager``).
        group_scorer: instead of ``manager``, a :class:`GroupScorer` of whole groups.
        group_size: the rollouts of a complete group (with ``group_scorer``).
        mode: ``standalone`` or ``colocate``.
        num_workers: most samples scored at once.
        to_sample: rollout -> :class:`RewardSample` (default :func:`rollout_reward_sample`).
        max_failure_fraction: a batch with more failed samples than this fraction raises
            :class:`RewardLoopError` (1.0: never; 0.0: any failure does).
        servers: colocate mode only: :class:`ScoringServers` woken around each batch's
            scoring (asleep otherwise).
    """

    def __init__(
        self,
        manager: RewardManager | None = None,
        *,
        group_scorer: GroupScorer | None = None,
        group_size: int | None = None,
        mode: Mode = "standalone",
        num_workers: int = 8,
        to_sample: Callable[[Rollout], RewardSample] = rollout_reward_sample,
        max_failure_fraction: float = 0.5,
        servers: ScoringServers | None = None,
    ) -> None:
        if mode not in ("standalone", "colocate"):
            raise ValueError(f"RewardLoop: mode={mode!r}; choose 'standalone' or 'colocate'")
        if servers is not None and mode != "colocate":
            raise ValueError(
                "RewardLoop: servers that sleep between batches need mode='colocate' (a "
                "standalone loop scores while episodes run)"
            )
        if num_workers < 1:
            raise ValueError(f"RewardLoop: num_workers={num_workers}; expected >= 1")
        if (manager is None) == (group_scorer is None):
            raise ValueError("RewardLoop: pass a manager (per sample) or a group_scorer, not both")
        if group_scorer is not None and (group_size is None or group_size < 1):
            raise ValueError(f"RewardLoop: group_size={group_size!r}; a group_scorer needs >= 1")
        if not (isinstance(max_failure_fraction, int | float) and 0 <= max_failure_fraction <= 1):
            raise ValueError(
                f"RewardLoop: max_failure_fraction={max_failure_fraction!r}; expected a "
                "fraction in [0, 1]"
            )
        self.manager = manager
        self.group_scorer = group_scorer
        self.group_size = group_size
        self.mode = mode
        self.num_workers = num_workers
        self.to_sample = to_sample
        self.max_failure_fraction = float(max_failure_fraction)
        self.servers = servers
        self.failures = 0
        """Samples that failed to score so far (every batch)."""
        self._logged_errors: set[str] = set()
        self._workers = PerLoop(lambda: asyncio.Semaphore(num_workers))
        self._pending: dict[str, asyncio.Task[RewardResult]] = {}
        self._arrived: dict[Hashable, list[Rollout]] = {}
        self._groups: dict[Hashable, asyncio.Task[dict[str, RewardResult]]] = {}

    def on_episode(self, rollouts: list[Rollout]) -> None:
        """``RolloutEngine`` callback: in standalone mode, start scoring now (a group: once
        all its rollouts have arrived)."""
        if self.mode != "standalone":
            return
        loop = asyncio.get_running_loop()
        for rollout in rollouts:
            if self.group_scorer is None:
                self._pending[rollout.id] = loop.create_task(self._score(rollout))
                continue
            key = group_key(rollout)
            members = self._arrived.setdefault(key, [])
            members.append(rollout)
            if len(members) == self.group_size:
                self._groups[key] = loop.create_task(self._score_group(list(members)))

    async def __call__(self, rollouts: list[Rollout]) -> None:
        """Rollout hook: wait for (or, in colocate mode, run) every rollout's scoring and
        write its result into ``rollout.meta["reward_loop"]`` (``servers``: woken for it,
        asleep again after)."""
        if self.servers is None:
            results = await self._results(rollouts)
        else:
            await self.servers.wake()
            try:
                results = await self._results(rollouts)
            finally:
                await self.servers.sleep()
        for rollout, result in zip(rollouts, results):
            rollout.meta[REWARD_KEY] = {
                "score": result.score,
                "metrics": dict(result.metrics),
                "error": result.error,
            }
        self._check_failures(rollouts, results)

    async def _results(self, rollouts: list[Rollout]) -> list[RewardResult]:
        if self.group_scorer is not None:
            return await self._group_results(rollouts)
        tasks = [self._pending.pop(r.id, None) or self._score(r) for r in rollouts]
        return list(await gather_or_cancel(*tasks))

    def _check_failures(self, rollouts: list[Rollout], results: Sequence[RewardResult]) -> None:
        failed = [(r, res.error) for r, res in zip(rollouts, results) if res.error is not None]
        if not failed:
            return
        self.failures += len(failed)
        counts: dict[str, int] = {}
        for rollout, error in failed:  # a kind: the first line, the sample's id left out
            kind = str(error).splitlines()[0].replace(repr(rollout.id), "<sample>")[:300]
            counts[kind] = counts.get(kind, 0) + 1
        for kind, count in counts.items():
            if kind not in self._logged_errors:  # once per kind of error, not per sample
                self._logged_errors.add(kind)
                log.warning(
                    "reward loop: %d of %d samples of a batch failed to score: %s "
                    "(later failures are counted in reward_loop/errors)",
                    count,
                    len(rollouts),
                    kind,
                )
        if len(failed) > self.max_failure_fraction * len(rollouts):
            rollout, error = failed[0]
            raise RewardLoopError(
                f"{len(failed)} of {len(rollouts)} samples of a batch failed to score, more "
                f"than max_failure_fraction={self.max_failure_fraction:g} allows; the first: "
                f"{error} (sample {_describe(self.to_sample, rollout)})"
            )

    async def _score(self, rollout: Rollout) -> RewardResult:
        assert self.manager is not None
        async with self._workers.get():
            return await self.manager.run_single(self.to_sample(rollout))

    async def _group_results(self, rollouts: list[Rollout]) -> list[RewardResult]:
        """Each rollout's result from its group's scoring: the one started as the group
        completed, else (colocate, or a group that arrived otherwise) started now over the
        group's rollouts in this batch."""
        batch: dict[Hashable, list[Rollout]] = {}
        for rollout in rollouts:
            batch.setdefault(group_key(rollout), []).append(rollout)
        tasks: list[Any] = []
        for key, members in batch.items():
            started = self._groups.pop(key, None)
            arrived = self._arrived.pop(key, [])
            if started is not None and {r.id for r in arrived} == {r.id for r in members}:
                tasks.append(started)
                continue
            if started is not None:
                started.cancel()
            tasks.append(self._score_group(members))
        scored: dict[str, RewardResult] = {}
        for results in await gather_or_cancel(*tasks):
            scored.update(results)
        return [scored[r.id] for r in rollouts]

    async def _score_group(self, members: list[Rollout]) -> dict[str, RewardResult]:
        assert self.group_scorer is not None
        async with self._workers.get():
            results = await self.group_scorer.score_group([self.to_sample(r) for r in members])
        if len(results) != len(members):
            raise RewardLoopError(
                f"the group scorer returned {len(results)} results for {len(members)} samples"
            )
        return {r.id: result for r, result in zip(members, results)}

    async def aclose(self) -> None:
        """Cancel scoring started for rollouts whose batch never reached the hook."""
        groups, self._groups, self._arrived = list(self._groups.values()), {}, {}
        for task in groups:
            task.cancel()
        await asyncio.gather(*groups, return_exceptions=True)
        pending, self._pending = list(self._pending.values()), {}
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def _describe(to_sample: Callable[[Rollout], RewardSample], rollout: Rollout) -> str:
    """The failing sample as the reward function saw it, shortened."""
    try:
        sample = to_sample(rollout)
    except Exception as e:  # the conversion itself failed: that is the error then
        return f"of rollout {rollout.id!r}, not convertible: {type(e).__name__}: {e}"
    text = (
        sample.solution_str
        if len(sample.solution_str) <= 120
        else sample.solution_str[:117] + "..."
    )
    return (
        f"{sample.sample_id!r}: data_source={sample.data_source!r}, "
        f"ground_truth={sample.ground_truth!r}, solution_str={text!r}"
    )


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
