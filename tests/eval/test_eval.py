"""run_eval / EngineEvaluator (ludic.eval)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ludic.envs.env import LudicEnv
from ludic.eval import EngineEvaluator, Evaluator, eval_item, run_eval
from ludic.inference.request import InferenceSpec
from ludic.rollouts.engine import RolloutEngine
from ludic.rollouts.requests import EnvSpec, ProtocolSpec, RolloutRequest
from ludic.stats import Reducer
from ludic.types import AgentStep, EnvironmentStep, Rollout, StepOutcome


class AnswerEnv(LudicEnv):
    """One step; reward 1 if the action equals ``answer``, else 0."""

    def __init__(self, answer: str) -> None:
        self.answer = answer

    @property
    def agent_ids(self) -> list[str]:
        return ["a"]

    def reset(self, seed: int | None = None) -> dict[str, tuple[str, dict[str, Any]]]:
        return {"a": ("q", {})}

    def step(self, actions: dict[str, str]) -> dict[str, StepOutcome]:
        ok = actions["a"] == self.answer
        return {"a": StepOutcome("done", reward=float(ok), terminated=True, info={"correct": ok})}


class GuessProtocol:
    """Plays ``guess``; a ``None`` guess is a parse error (synthetic step, no env.step)."""

    def __init__(self, guess: str | None) -> None:
        self.guess = guess

    async def run(
        self,
        *,
        env: LudicEnv,
        max_steps: int,
        env_seed: int | None = None,
        inference: InferenceSpec | None = None,
        meta: dict[str, Any] | None = None,
    ) -> list[Rollout]:
        obs = env.reset(seed=env_seed)["a"][0]
        bad = self.guess is None
        agent = AgentStep(0, "t0", [{"role": "user", "content": obs}], "...", parse_error=bad)
        if bad:
            env_step = EnvironmentStep(1, "t0", obs, "", "bad format", 0.0, synthetic=True)
        else:
            out = env.step({"a": self.guess})["a"]
            env_step = EnvironmentStep(
                1, "t0", obs, self.guess, out.obs, out.reward, terminated=True, info=out.info
            )
        return [Rollout(steps=[agent, env_step], meta=dict(meta or {}), terminated=not bad)]


def engine() -> RolloutEngine:
    return RolloutEngine({"answer": AnswerEnv}, {"guess": GuessProtocol})


def request(guess: str | None, n: int = 1) -> RolloutRequest:
    return RolloutRequest(
        EnvSpec("answer", {"answer": "4"}), ProtocolSpec("guess", {"guess": guess}), num_episodes=n
    )


REQUESTS = [request("4", n=2), request("5"), request(None)]


def test_run_eval_default_metrics_reward_success_parse_errors_length():
    metrics, rollouts = asyncio.run(run_eval(engine(), REQUESTS))
    assert len(rollouts) == 4
    assert metrics == {
        "reward_mean": 0.5,
        "success_rate": 0.5,
        "parse_error_rate": 0.25,
        "length_mean": 1.0,
        "num_rollouts": 4.0,
    }


def test_custom_reducers_read_env_info_and_meta():
    reducers = [
        Reducer("correct", "info.correct", reduce="count"),
        Reducer(
            "first_episode", "meta.episode_index", reduce="fraction", transform=lambda e: e == 0
        ),
    ]
    metrics, _ = asyncio.run(run_eval(engine(), REQUESTS[:2], reducers))
    assert metrics["correct"] == 2.0
    assert metrics["first_episode"] == pytest.approx(2 / 3)


def test_eval_item_has_the_documented_keys():
    _, rollouts = asyncio.run(run_eval(engine(), [request("4")]))
    item = eval_item(rollouts[0])
    assert item["success"] is True
    assert item["info"] == {"correct": True}
    assert item["meta"]["env_kind"] == "answer"
    assert item["parse_error"] is False and item["parse_error_rate"] == 0.0


def test_engine_evaluator_calls_requests_fn_each_time_and_keeps_rollouts():
    calls = []

    def requests_fn():
        calls.append(1)
        return [request("4"), request("3")]

    evaluator = EngineEvaluator(engine(), requests_fn)
    assert isinstance(evaluator, Evaluator)
    first = asyncio.run(evaluator.evaluate())
    second = asyncio.run(evaluator.evaluate())
    assert first == second
    assert first["success_rate"] == 0.5
    assert len(calls) == 2
    assert len(evaluator.last_rollouts) == 2


def test_run_eval_without_requests_is_an_error():
    with pytest.raises(ValueError, match="no requests"):
        asyncio.run(run_eval(engine(), []))
