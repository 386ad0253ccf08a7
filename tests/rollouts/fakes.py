"""Fakes for rollout and batching tests, exposed through the ``fakes`` fixture (see the
``conftest.py`` of tests/rollouts and tests/batching).

A fake env (one agent, one step), a fake protocol that builds a one-turn rollout with a
token trace, step/rollout builders and a trivial credit assigner (weight = turn reward).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from ludic.envs.env import LudicEnv
from ludic.inference.request import InferenceSpec
from ludic.types import AgentStep, EnvironmentStep, Rollout, StepOutcome, TokenTrace


class FakeEnv(LudicEnv):
    """One agent, one step. The observation names the seed; reward ``reward``."""

    closed: list[int | None] = []

    def __init__(self, reward: float = 1.0) -> None:
        self.reward = reward
        self.seed: int | None = None

    @property
    def agent_ids(self) -> list[str]:
        return ["a"]

    def reset(self, seed: int | None = None) -> dict[str, tuple[str, dict[str, Any]]]:
        self.seed = seed
        return {"a": (f"problem {seed}", {})}

    def step(self, actions: dict[str, str]) -> dict[str, StepOutcome]:
        return {"a": StepOutcome(obs="done", reward=self.reward, terminated=True)}

    def close(self) -> None:
        FakeEnv.closed.append(self.seed)


class Tracker:
    """Counts episodes in flight."""

    def __init__(self) -> None:
        self.running = 0
        self.max_running = 0
        self.started = 0


class FakeProtocol:
    """Runs one turn: one agent step (prompt [1, 2, 3], completion [4, 5]) + one env step.

    Records the sampling seed it was given in ``meta["seen_sampling_seed"]``.
    """

    def __init__(
        self,
        delay: float = 0.0,
        tracker: Tracker | None = None,
        parse_error: bool = False,
        completion: Sequence[int] = (4, 5),
        error: BaseException | None = None,
    ) -> None:
        self.delay = delay
        self.tracker = tracker or Tracker()
        self.parse_error = parse_error
        self.completion = tuple(completion)
        self.error = error

    async def run(
        self,
        *,
        env: LudicEnv,
        max_steps: int,
        env_seed: int | None = None,
        inference: InferenceSpec | None = None,
        meta: dict[str, Any] | None = None,
    ) -> list[Rollout]:
        t = self.tracker
        t.started += 1
        t.running += 1
        t.max_running = max(t.max_running, t.running)
        try:
            obs = env.reset(seed=env_seed)["a"][0]
            await asyncio.sleep(self.delay)
            if self.error is not None:
                raise self.error
            outcome = env.step({"a": "x"})["a"]
        finally:
            t.running -= 1
        seed = None if inference is None else inference.sampling.seed
        steps = [
            agent_step(0, "t0", [1, 2, 3], self.completion, parse_error=self.parse_error),
            env_step(1, "t0", outcome.reward, prev_obs=obs, terminated=outcome.terminated),
        ]
        rollout = Rollout(
            steps=steps,
            meta={**(meta or {}), "seen_sampling_seed": seed},
            terminated=outcome.terminated,
        )
        return [rollout]


def agent_step(
    index: int,
    turn_id: str,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    *,
    logprobs: Sequence[float] | None | str = "auto",
    version: int | None = None,
    version_end: int | None = None,
    finish_reason: str | None = "stop",
    reward: float = 0.0,
    parse_error: bool = False,
    messages: list[dict[str, Any]] | None = None,
    completion: str = "",
    trace: bool = True,
    temperature: float = 1.0,
) -> AgentStep:
    """An agent step; ``logprobs="auto"`` gives -0.1 * (position + 1) per token;
    ``temperature``: the trace's ``logprob_temperature``."""
    if logprobs == "auto":
        logprobs = [-0.1 * (i + 1) for i in range(len(completion_ids))]
    tr = (
        TokenTrace(
            prompt_token_ids=tuple(prompt_ids),
            completion_token_ids=tuple(completion_ids),
            completion_logprobs=None if logprobs is None else tuple(logprobs),
            finish_reason=finish_reason,
            policy_version=version,
            version_end=version_end,
            logprob_temperature=temperature,
        )
        if trace
        else None
    )
    return AgentStep(
        index=index,
        turn_id=turn_id,
        prompt_messages=messages or [{"role": "user", "content": "q"}],
        completion=completion,
        trace=tr,
        reward=reward,
        parse_error=parse_error,
    )


def env_step(
    index: int,
    turn_id: str,
    reward: float,
    *,
    prev_obs: str = "obs",
    terminated: bool = False,
    truncated: bool = False,
    agent_step_indices: tuple[int, ...] = (),
    info: dict[str, Any] | None = None,
) -> EnvironmentStep:
    return EnvironmentStep(
        index=index,
        turn_id=turn_id,
        prev_obs=prev_obs,
        action="x",
        next_obs="next",
        reward=reward,
        terminated=terminated,
        truncated=truncated,
        agent_step_indices=agent_step_indices,
        info=info or {},
    )


def one_turn_rollout(
    reward: float = 1.0, *, rid: str | None = None, meta: dict[str, Any] | None = None, **kw: Any
) -> Rollout:
    """A rollout with one turn: agent step (prompt [1, 2, 3], completion [4, 5]) + env step."""
    steps = [agent_step(0, "t0", [1, 2, 3], [4, 5], **kw), env_step(1, "t0", reward)]
    r = Rollout(steps=steps, meta=dict(meta or {}), terminated=True)
    if rid is not None:
        r.id = rid
    return r


class TurnRewardCredit:
    """Trivial credit assigner for tests: weight of a turn = that turn's reward."""

    def compute(self, rollouts: Sequence[Rollout]) -> list[list[float]]:
        return [[t.reward for t in r.turns()] for r in rollouts]


def make_fakes() -> SimpleNamespace:
    FakeEnv.closed = []
    return SimpleNamespace(
        FakeEnv=FakeEnv,
        FakeProtocol=FakeProtocol,
        Tracker=Tracker,
        TurnRewardCredit=TurnRewardCredit,
        agent_step=agent_step,
        env_step=env_step,
        one_turn_rollout=one_turn_rollout,
    )
