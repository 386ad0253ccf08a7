"""Reward-loop scores drive training: a ``RolloutBatchSource`` with the ``RewardLoop``
hook and ``RewardLoopCreditAssigner`` gives GRPO advantages of the combined returns, and a
group with a dropped sample (its reward function failed, no fallback) trains on nothing."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from ludic.agents import Agent
from ludic.context import FullDialog
from ludic.envs import DatasetQAEnv
from ludic.inference import HFChatTemplate, ScriptedChatClient
from ludic.interaction import SingleAgentProtocol
from ludic.parsers import ParseResult
from ludic.rewards import REWARD_KEY, RewardLoop, make_reward_manager
from ludic.rollouts.engine import RolloutEngine
from ludic.rollouts.strategies import GRPORequestStrategy
from ludic.training import RewardLoopCreditAssigner
from ludic.training.batching.synced_batching import RolloutBatchSource
from ludic.training.types import EnvSpec, ProtocolSpec, RolloutRequest

SAMPLES = [{"question": f"q{i}", "answer": "a"} for i in range(3)]
ANSWERS = itertools.cycle(["good", "bad"])  # in each group of 2: one good, one bad


async def judge(data_source, solution_str, ground_truth, extra_info):
    if extra_info["question"] == "q2":
        raise RuntimeError("judge unavailable")
    return 0.9 if solution_str.strip() == "good" else 0.1


def _batch(tiny_tokenizer, assigner) -> tuple[list, list, dict]:
    client = ScriptedChatClient(tiny_tokenizer, lambda req, prompt: next(ANSWERS))
    loop = RewardLoop(make_reward_manager("naive", compute_score=judge), mode="standalone")

    def protocol() -> SingleAgentProtocol:
        return SingleAgentProtocol(
            Agent(
                client=client,
                context=FullDialog(),
                parser=lambda text: ParseResult(action=text.strip()),
                chat_template=HFChatTemplate(tiny_tokenizer),
            )
        )

    engine = RolloutEngine(
        {"qa": lambda: DatasetQAEnv(SAMPLES)},
        {"single": protocol},
        on_episode=[loop.on_episode],
        max_concurrency=1,
    )
    requests = [RolloutRequest(EnvSpec("qa"), ProtocolSpec("single"), env_seed=i) for i in range(3)]
    source = RolloutBatchSource(
        engine,
        lambda: requests,
        assigner,
        request_strategy=GRPORequestStrategy(group_size=2),
        rollout_hooks=[loop],
    )
    batch = asyncio.run(source.next_batch())
    return source.last_rollouts, batch.items, batch.meta


def test_grpo_advantages_from_reward_loop_scores_and_dropped_groups(tiny_tokenizer) -> None:
    assigner = RewardLoopCreditAssigner(group_size=2)
    rollouts, items, meta = _batch(tiny_tokenizer, assigner)
    weight = {r.id: None for r in rollouts}
    for item in items:
        weight[item.meta["rollout_id"]] = item.weight
    for r in rollouts:
        question, score = r.initial_obs, r.meta[REWARD_KEY]["score"]
        if question == "q2":  # dropped: the whole group is out
            assert score is None and weight[r.id] == 0.0
        else:  # one 0.9 and one 0.1 per group: advantages +-1 (population std)
            expected = 1.0 if score == 0.9 else -1.0
            assert weight[r.id] == pytest.approx(expected, abs=1e-4)
    assert assigner.dropped_groups == 1
    # the batch's statistics (logged as batch/...) count the failures
    assert meta["reward_loop/errors"] == 2 and meta["reward_loop/dropped"] == 2
    assert meta["reward_loop/score_mean"] == pytest.approx(0.5)


def test_other_combinations_and_bad_settings(tiny_tokenizer) -> None:
    assigner = RewardLoopCreditAssigner(mode="add", group_normalize=False)
    rollouts, items, _ = _batch(tiny_tokenizer, assigner)
    by_id = {item.meta["rollout_id"]: item.weight for item in items}
    for r in rollouts:
        score = r.meta[REWARD_KEY]["score"]
        expected = 0.0 if score is None else r.total_reward + score
        assert by_id[r.id] == pytest.approx(expected)
    with pytest.raises(ValueError, match="group_normalize=True needs group_size"):
        RewardLoopCreditAssigner()
    with pytest.raises(ValueError, match="mode='multiply'"):
        RewardLoopCreditAssigner(mode="multiply", group_size=2)  # type: ignore[arg-type]


def _scored(env_rewards: list[float], score: float | None, obs: str):
    from tests.training.test_credit_assignment import make_rollout

    rollout = make_rollout(env_rewards, obs=obs)
    rollout.meta[REWARD_KEY] = {"score": score, "metrics": {}, "error": None}
    return rollout


def test_any_preset_credit_assigner_sees_the_combined_return() -> None:
    from ludic.training.credit_assignment import GroupNormalizedReturn, MonteCarloReturn

    # two turns, env rewards [0.5, 1.0] (R_env = 1.5), score 0.2; weighted with 0.25:
    # R = 0.25 * 1.5 + 0.75 * 0.2 = 0.525; the last turn carries R - 0.5 = 0.025
    rollout = _scored([0.5, 1.0], 0.2, "q")
    reinforce = RewardLoopCreditAssigner(mode="weighted", weight=0.25, inner=MonteCarloReturn())
    assert reinforce.compute([rollout]) == [pytest.approx([0.525, 0.025])]
    assert rollout.total_reward == 1.5  # the rollout itself is not changed
    # a group-relative inner drops a group with a dropped member, keeps the others
    group = [
        _scored([1.0], 0.9, "a"),
        _scored([0.0], 0.1, "a"),
        _scored([1.0], None, "b"),
        _scored([0.0], 0.3, "b"),
    ]
    grpo = RewardLoopCreditAssigner(inner=GroupNormalizedReturn(group_size=2, eps=0.0))
    assert grpo.compute(group) == [pytest.approx([1.0]), pytest.approx([-1.0]), [0.0], [0.0]]
    assert grpo.dropped_groups == 1
    # a per-rollout inner drops only the rollout
    plain = RewardLoopCreditAssigner(mode="add", inner=MonteCarloReturn())
    assert plain.compute(group) == [
        pytest.approx([1.9]),
        pytest.approx([0.1]),
        [0.0],
        pytest.approx([0.3]),
    ]
    assert plain.dropped_groups == 0
