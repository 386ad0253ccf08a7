"""Pins ``ludic.training.reward_credit`` (RewardModelScorer, RewardModelCreditAssigner), the
rollout-hook contract of the batch sources, and the ``make_reward_rl`` preset."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

from ludic.agents import Agent
from ludic.context import FullDialog
from ludic.envs import DatasetQAEnv
from ludic.inference import (
    HFChatTemplate,
    InferenceSpec,
    SamplingSpec,
    ScriptedChatClient,
    TransformersChatClient,
)
from ludic.inference.reward_client import (
    RewardModelClient,
    RewardModelTrainingMode,
    ScoringRequest,
    ScoringResponse,
    format_reward_input,
)
from ludic.inference.transformers_reward_client import TransformersRewardClient
from ludic.interaction import SingleAgentProtocol
from ludic.models.tiny import build_tiny_causal_lm, build_tiny_reward_model
from ludic.parsers import ParseResult
from ludic.rollouts.engine import RolloutEngine
from ludic.rollouts.strategies import GRPORequestStrategy
from ludic.training.algorithm import RLAlgorithm, make_reinforce, make_reward_rl
from ludic.training.batching.synced_batching import RolloutBatchSource
from ludic.training.config import TrainerConfig
from ludic.training.credit_assignment import GroupNormalizedReturn
from ludic.training.losses import ReinforceLoss, TokenAggregation, TokenClippedSurrogateLoss
from ludic.training.reward_credit import (
    RM_SCORES_KEY,
    RM_VERSION_KEY,
    RewardModelCreditAssigner,
    RewardModelScorer,
    reward_text,
)
from ludic.training.trainer import Trainer
from ludic.training.types import (
    CreditAssigner,
    EnvSpec,
    ProtocolSpec,
    RolloutHook,
    RolloutRequest,
)
from ludic.types import AgentStep, EnvironmentStep, Rollout, TokenTrace, Turn

# ---------------------------------------------------------------------------- helpers


def make_rollout(
    env_rewards: Sequence[float],
    scores: Sequence[float | None] | None = None,
    *,
    group_id: str | None = None,
    obs: str = "q",
    prefix: str = "",
) -> Rollout:
    """One turn per env reward: an agent step answering ``{prefix}q{j}`` with
    ``{prefix}a{j}`` (completion tokens [4, 5]) and an env step with that reward.
    ``scores`` (if given) is written to ``meta["rm_scores"]`` as the scorer would."""
    steps: list[AgentStep | EnvironmentStep] = []
    for j, r in enumerate(env_rewards):
        tid = f"t{j}"
        steps.append(
            AgentStep(
                index=len(steps),
                turn_id=tid,
                prompt_messages=[
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "earlier question"},
                    {"role": "assistant", "content": "earlier answer"},
                    {"role": "user", "content": f"{prefix}q{j}"},
                ],
                completion=f"{prefix}a{j}",
            )
        )
        steps.append(
            EnvironmentStep(
                index=len(steps),
                turn_id=tid,
                prev_obs=obs if j == 0 else f"{obs}/{j}",
                action="a",
                next_obs="next",
                reward=r,
                agent_step_indices=(len(steps) - 1,),
            )
        )
    meta: dict[str, Any] = {} if group_id is None else {"group_id": group_id}
    if scores is not None:
        meta[RM_SCORES_KEY] = list(scores)
    return Rollout(steps=steps, meta=meta)


class RecordingRewardClient:
    """A ``RewardModelClient`` that scores ``table[text]`` (else ``default``) and records
    every ``score_batch`` call."""

    def __init__(
        self,
        table: Mapping[str, float] | None = None,
        *,
        default: float = 0.0,
        version: int = 3,
        extra: int = 0,
    ) -> None:
        self.table = dict(table or {})
        self.default = default
        self.version = version
        self.extra = extra  # return this many scores too many (to test the count check)
        self.calls: list[tuple[list[str], bool]] = []

    async def score(self, request: ScoringRequest) -> tuple[ScoringResponse, dict[str, Any]]:
        scores = await self.score_batch(list(request.inputs), normalize=request.normalize)
        return ScoringResponse(scores=scores, model_version=self.version), {}

    async def score_batch(
        self, inputs: Sequence[str | Sequence[int]], *, normalize: bool = True
    ) -> list[float]:
        texts = [str(x) for x in inputs]
        self.calls.append((texts, normalize))
        return [self.table.get(t, self.default) for t in texts] + [0.0] * self.extra

    def sync_weights(
        self,
        params: Mapping[str, torch.Tensor],
        *,
        version: int | None = None,
        training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
        timeout_s: float | None = None,
    ) -> str:
        raise NotImplementedError

    async def get_model_version(self) -> int:
        return self.version


def weights(assigner: RewardModelCreditAssigner, rollouts: list[Rollout]) -> list[list[float]]:
    return assigner.compute(rollouts)


# ------------------------------------------------------------ credit assigner: arithmetic

R, S = [1.0, 0.0, 2.0], [0.5, -1.0, 0.25]  # env rewards and per-turn RM scores


@pytest.mark.parametrize(
    ("mode", "extra", "expected"),
    [
        # c = [0.5, -1, 0.25]; return-to-go
        ("replace", {}, [-0.25, -0.75, 0.25]),
        # c = [1.5, -1, 2.25]
        ("add", {}, [2.75, 1.25, 2.25]),
        # c = [0.5, 0, 0.5]
        ("multiply", {}, [1.0, 0.5, 0.5]),
        # c = 0.5 r + 0.5 s = [0.75, -0.5, 1.125]
        ("weighted", {}, [1.375, 0.625, 1.125]),
        # c = 0.25 r + 0.75 s = [0.625, -0.75, 0.6875]
        ("weighted", {"weight": 0.25}, [0.5625, -0.0625, 0.6875]),
    ],
)
def test_per_turn_scores_combine_per_mode_into_return_to_go(mode, extra, expected):
    assigner = RewardModelCreditAssigner(mode=mode, **extra)
    assert weights(assigner, [make_rollout(R, S)]) == [pytest.approx(expected)]


@pytest.mark.parametrize(
    ("mode", "expected"),
    # (r, s) = (2, 0.5) and (0, 0.5): replace s; add r + s; multiply r * s; weighted
    # 0.5 r + 0.5 s
    [
        ("replace", [0.5, 0.5]),
        ("add", [2.5, 0.5]),
        ("multiply", [1.0, 0.0]),
        ("weighted", [1.25, 0.25]),
    ],
)
def test_single_turn_weight_is_the_combined_reward(mode, expected):
    rollouts = [make_rollout([2.0], [0.5]), make_rollout([0.0], [0.5])]
    out = weights(RewardModelCreditAssigner(mode=mode), rollouts)
    assert out == [[pytest.approx(expected[0])], [pytest.approx(expected[1])]]


@pytest.mark.parametrize(
    ("mode", "rewards", "expected"),
    [
        # Only the last turn is scored (s = 0.5); unscored turns combine with s = 0.
        ("replace", [0.5, 0.0, 1.0], [0.5, 0.5, 0.5]),  # c = [0, 0, 0.5]
        ("add", [0.5, 0.0, 1.0], [2.0, 1.5, 1.5]),  # c = [0.5, 0, 1.5]
        ("weighted", [0.5, 0.0, 1.0], [1.0, 0.75, 0.75]),  # c = [0.25, 0, 0.75]
        ("multiply", [0.0, 0.0, 1.0], [0.5, 0.5, 0.5]),  # c = [0, 0, 0.5]
    ],
)
def test_an_outcome_score_on_the_last_turn_reaches_every_turn(mode, rewards, expected):
    rollout = make_rollout(rewards, [None, None, 0.5])
    assert weights(RewardModelCreditAssigner(mode=mode), [rollout]) == [pytest.approx(expected)]


def test_multiply_refuses_to_gate_an_unscored_env_reward_to_zero():
    rollout = make_rollout([0.5, 0.0, 1.0], [None, None, 0.5])
    with pytest.raises(ValueError, match=r"mode='multiply'.*turn 't0'.*per_turn=True"):
        RewardModelCreditAssigner(mode="multiply").compute([rollout])


@pytest.mark.parametrize(
    ("mode", "rewards", "scores", "expected"),
    [
        # R = s = [0.9, 0.1, 0.1, 0.9]: mean 0.5, std 0.4
        ("replace", [5.0, -3.0, 0.0, 1.0], [0.9, 0.1, 0.1, 0.9], [1.0, -1.0, -1.0, 1.0]),
        # R = r + s = [1.5, 0.5, 0.5, -0.5]: mean 0.5, std sqrt(0.5)
        ("add", [1.0, 0.0, 1.0, 0.0], [0.5, 0.5, -0.5, -0.5], [2**0.5, 0.0, 0.0, -(2**0.5)]),
        # R = r * s = [1, 0.5, 0.5, 0]: mean 0.5, std sqrt(0.125)
        ("multiply", [2.0, 2.0, 1.0, 0.0], [0.5, 0.25, 0.5, 0.8], [2**0.5, 0.0, 0.0, -(2**0.5)]),
        # R = 0.5 r + 0.5 s = [1, 0, 0.5, 0.5]: mean 0.5, std sqrt(0.125)
        ("weighted", [1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 1.0], [2**0.5, -(2**0.5), 0.0, 0.0]),
    ],
)
def test_group_normalized_advantage_per_mode(mode, rewards, scores, expected):
    rollouts = [make_rollout([r], [s], group_id="g") for r, s in zip(rewards, scores)]
    assigner = RewardModelCreditAssigner(mode=mode, group_normalize=True, group_size=4, eps=0.0)
    assert [w[0] for w in weights(assigner, rollouts)] == pytest.approx(expected)


def test_group_normalization_uses_the_combined_return_and_fills_every_turn():
    # add: R_a = (1 + 0.5) + (0 + 0.5) = 2, R_b = (0 + 0) + (0 + 1) = 1 -> A = +-1
    rollouts = [
        make_rollout([1.0, 0.0], [0.5, 0.5], group_id="g"),
        make_rollout([0.0, 0.0], [0.0, 1.0], group_id="g"),
    ]
    assigner = RewardModelCreditAssigner(mode="add", group_normalize=True, group_size=2, eps=0.0)
    assert weights(assigner, rollouts) == [[1.0, 1.0], [-1.0, -1.0]]


def test_group_normalization_uses_the_default_eps():
    rollouts = [make_rollout([0.0], [s], group_id="g") for s in (1.0, 0.0)]
    assigner = RewardModelCreditAssigner(group_normalize=True, group_size=2)
    expected = 0.5 / (0.5 + 1e-6)
    assert weights(assigner, rollouts) == [[pytest.approx(expected)], [pytest.approx(-expected)]]


def test_a_group_with_equal_combined_returns_gets_zeros():
    # replace: different env rewards, equal RM scores -> equal returns -> exactly 0
    flat = [make_rollout([r], [0.3], group_id="flat") for r in (1.0, 0.0, 5.0)]
    assigner = RewardModelCreditAssigner(group_normalize=True, group_size=3)
    assert weights(assigner, flat) == [[0.0], [0.0], [0.0]]


def test_negative_group_coef_pushes_down_a_group_below_the_batch_mean():
    # replace: combined returns = RM scores; "low" all 0.2, "high" all 0.8, batch mean 0.5
    rollouts = [make_rollout([0.0], [s], group_id=g) for g, s in (("low", 0.2),) * 2]
    rollouts += [make_rollout([0.0], [s], group_id=g) for g, s in (("high", 0.8),) * 2]
    assigner = RewardModelCreditAssigner(
        group_normalize=True, group_size=2, negative_group_coef=2.0
    )
    assert [w[0] for w in weights(assigner, rollouts)] == pytest.approx([-0.6, -0.6, 0.0, 0.0])
    with pytest.raises(ValueError, match="negative_group_coef=1.0 needs group_normalize=True"):
        RewardModelCreditAssigner(negative_group_coef=1.0)


def test_groups_follow_group_normalized_return_initial_obs_grouping():
    rollouts = [
        make_rollout([0.0], [1.0], obs="p1"),
        make_rollout([0.0], [3.0], obs="p2"),
        make_rollout([0.0], [0.0], obs="p1"),
        make_rollout([0.0], [1.0], obs="p2"),
    ]
    assigner = RewardModelCreditAssigner(group_normalize=True, group_size=2, eps=0.0)
    assert [w[0] for w in weights(assigner, rollouts)] == [1.0, 1.0, -1.0, -1.0]
    # The very same grouping (and errors) as GroupNormalizedReturn on the same returns:
    env_rollouts = [make_rollout([s], obs=o) for s, o in ((1.0, "p1"), (3.0, "p2"), (0, "p1"))]
    env_rollouts.append(make_rollout([1.0], obs="p2"))
    baseline = GroupNormalizedReturn(group_size=2, eps=0.0).compute(env_rollouts)
    assert weights(assigner, rollouts) == baseline


def test_group_size_mismatch_is_reported_like_group_normalized_return():
    rollouts = [make_rollout([0.0], [s], group_id="q17") for s in (0.0, 1.0, 2.0)]
    assigner = RewardModelCreditAssigner(group_normalize=True, group_size=2)
    with pytest.raises(ValueError, match=r"group_size=2 but group 'q17' has 3 rollouts"):
        assigner.compute(rollouts)


def test_assigner_satisfies_the_credit_assigner_protocol():
    assert isinstance(RewardModelCreditAssigner(), CreditAssigner)


# ------------------------------------------------------------ credit assigner: errors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "sum"}, r"mode='sum'; expected one of \('replace', 'add', 'multiply'"),
        ({"mode": "weighted", "weight": 1.5}, r"weight=1\.5; expected 0 <= weight <= 1"),
        ({"weight": -0.1}, r"weight=-0\.1"),
        ({"weight": math.nan}, r"weight=nan"),
        ({"group_normalize": True}, r"group_normalize=True needs group_size >= 2.*None"),
        ({"group_normalize": True, "group_size": 1}, r"group_size=1"),
        ({"group_size": 4}, r"group_size=4 is only used with group_normalize=True"),
        ({"eps": -1.0}, r"eps=-1\.0"),
    ],
)
def test_bad_settings_are_rejected_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardModelCreditAssigner(**kwargs)


def test_missing_scores_name_the_hook_to_run():
    with pytest.raises(
        ValueError, match=r"no meta\['rm_scores'\].*RewardModelScorer.*rollout_hooks"
    ):
        RewardModelCreditAssigner().compute([make_rollout([1.0])])


@pytest.mark.parametrize(
    ("scores", "match"),
    [
        ([0.5, 0.5], r"expected one score \(or None\) per turn, 3 in all"),
        ([0.5, math.nan, 0.5], r"\[1\]=nan; expected a finite float or None"),
        ([0.5, "0.5", 0.5], r"\[1\]='0\.5'"),
    ],
)
def test_malformed_scores_are_rejected(scores, match):
    with pytest.raises(ValueError, match=match):
        RewardModelCreditAssigner().compute([make_rollout(R, scores)])


# ---------------------------------------------------------------------------- scorer


def test_scorer_makes_one_call_with_the_last_turn_of_every_rollout():
    client = RecordingRewardClient({"A:q2\nA:a2": 0.9, "B:q0\nB:a0": 0.2}, version=5)
    rollouts = [make_rollout(R, prefix="A:"), make_rollout([1.0], prefix="B:")]
    scorer = RewardModelScorer(client)
    assert isinstance(scorer, RolloutHook)

    asyncio.run(scorer(rollouts))

    assert client.calls == [(["A:q2\nA:a2", "B:q0\nB:a0"], True)]
    assert rollouts[0].meta[RM_SCORES_KEY] == [None, None, 0.9]
    assert rollouts[1].meta[RM_SCORES_KEY] == [0.2]
    assert [r.meta[RM_VERSION_KEY] for r in rollouts] == [5, 5]


def test_per_turn_scorer_scores_every_turn_in_one_call():
    table = {f"A:q{j}\nA:a{j}": 0.1 * (j + 1) for j in range(3)}
    client = RecordingRewardClient(table, default=-1.0)
    rollouts = [make_rollout(R, prefix="A:"), make_rollout([0.0, 0.0], prefix="B:")]
    asyncio.run(RewardModelScorer(client, per_turn=True, normalize=False)(rollouts))

    texts = [f"A:q{j}\nA:a{j}" for j in range(3)] + ["B:q0\nB:a0", "B:q1\nB:a1"]
    assert client.calls == [(texts, False)]
    assert rollouts[0].meta[RM_SCORES_KEY] == pytest.approx([0.1, 0.2, 0.3])
    assert rollouts[1].meta[RM_SCORES_KEY] == [-1.0, -1.0]


def test_default_text_is_the_last_user_message_and_the_completion():
    rollout = make_rollout([0.0], prefix="X")
    (turn,) = rollout.turns()
    assert reward_text(rollout, turn) == format_reward_input("Xq0", "Xa0") == "Xq0\nXa0"


def test_custom_format_fn_gets_the_rollout_and_the_turn():
    seen: list[tuple[str, str]] = []

    def fmt(rollout: Rollout, turn: Turn) -> str:
        seen.append((rollout.id, turn.turn_id))
        return f"{rollout.meta['group_id']}|{turn.agent_steps[-1].completion}"

    client = RecordingRewardClient()
    rollout = make_rollout([0.0, 0.0], group_id="g7")
    asyncio.run(RewardModelScorer(client, format_fn=fmt, per_turn=True)([rollout]))
    assert client.calls == [(["g7|a0", "g7|a1"], True)]
    assert seen == [(rollout.id, "t0"), (rollout.id, "t1")]


def test_turns_without_agent_steps_are_not_scored_and_no_call_is_made_for_nothing():
    client = RecordingRewardClient()
    bare = Rollout(
        steps=[
            EnvironmentStep(
                index=0, turn_id="t0", prev_obs="o", action="a", next_obs="n", reward=1.0
            )
        ]
    )
    asyncio.run(RewardModelScorer(client)([bare]))
    asyncio.run(RewardModelScorer(client)([]))
    assert client.calls == []
    assert bare.meta[RM_SCORES_KEY] == [None]
    assert RM_VERSION_KEY not in bare.meta


def test_wrong_number_of_scores_is_an_error():
    client = RecordingRewardClient(extra=1)
    with pytest.raises(RuntimeError, match=r"returned 3 scores for 2 inputs"):
        asyncio.run(RewardModelScorer(client)([make_rollout([0.0]), make_rollout([0.0])]))


def test_non_finite_scores_are_an_error():
    client = RecordingRewardClient(default=math.inf)
    with pytest.raises(ValueError, match=r"turn 't0' as inf; expected a finite score"):
        asyncio.run(RewardModelScorer(client)([make_rollout([0.0])]))


def test_a_prompt_without_user_message_needs_a_format_fn():
    rollout = make_rollout([0.0])
    rollout.agent_steps[0].prompt_messages[:] = [{"role": "system", "content": "s"}]
    with pytest.raises(ValueError, match=r"no 'user' message.*format_fn"):
        asyncio.run(RewardModelScorer(RecordingRewardClient())([rollout]))


def test_scorer_rejects_a_client_without_score_batch():
    with pytest.raises(TypeError, match=r"no score_batch"):
        RewardModelScorer(object())  # type: ignore[arg-type]


def test_scorer_on_the_real_transformers_reward_client(tiny_tokenizer):
    model = build_tiny_reward_model(tiny_tokenizer, seed=0)
    client = TransformersRewardClient(model, tiny_tokenizer)
    assert isinstance(client, RewardModelClient)
    rollouts = [make_rollout([0.0], prefix=p) for p in ("A", "BB", "CCC")]
    asyncio.run(RewardModelScorer(client)(rollouts))

    with torch.no_grad():
        expected = [
            torch.sigmoid(
                model(input_ids=torch.tensor([tiny_tokenizer(t)["input_ids"]])).logits
            ).item()
            for t in ("Aq0\nAa0", "BBq0\nBBa0", "CCCq0\nCCCa0")
        ]
    assert [r.meta[RM_SCORES_KEY][0] for r in rollouts] == pytest.approx(expected, abs=1e-6)
    assert [r.meta[RM_VERSION_KEY] for r in rollouts] == [0, 0, 0]


# ---------------------------------------------------------------- rollout hook contract


class OneTurnProtocol:
    """Builds a one-turn rollout (prompt tokens [1, 2, 3], completion [4, 5], env reward
    1) without an env or a model: enough to drive a batch source."""

    async def run(self, *, env, max_steps, env_seed=None, inference=None, meta=None):
        rollout = make_rollout([1.0])
        rollout.steps[0].trace = TokenTrace((1, 2, 3), (4, 5), finish_reason="stop")
        rollout.meta.update(meta or {})
        return [rollout]


def fake_engine() -> RolloutEngine:
    return RolloutEngine({"none": lambda: None}, {"one_turn": OneTurnProtocol})


def _requests(n: int = 2):
    return lambda: [RolloutRequest(EnvSpec("none"), ProtocolSpec("one_turn")) for _ in range(n)]


class MetaCredit:
    """Credit = the rollout's meta['mark'] (fails if a hook did not set it)."""

    def compute(self, rollouts: Sequence[Rollout]) -> list[list[float]]:
        return [[float(r.meta["mark"])] * len(r.turns()) for r in rollouts]


def test_batch_source_runs_hooks_in_order_before_credit_assignment():
    order: list[str] = []

    async def first(rollouts: list[Rollout]) -> None:
        order.append("first")
        for r in rollouts:
            r.meta["mark"] = 2.0

    async def second(rollouts: list[Rollout]) -> None:
        order.append("second")
        for r in rollouts:
            r.meta["mark"] *= 3.0

    source = RolloutBatchSource(
        fake_engine(), _requests(), MetaCredit(), rollout_hooks=[first, second]
    )
    batch = asyncio.run(source.next_batch())
    assert order == ["first", "second"]
    assert [item.weight for item in batch.items] == [6.0, 6.0]
    assert source.rollout_hooks == (first, second)


def test_hooks_run_again_on_every_regenerated_batch():
    calls: list[int] = []

    async def hook(rollouts: list[Rollout]) -> None:
        calls.append(len(rollouts))
        for r in rollouts:
            r.meta["mark"] = 1.0

    source = RolloutBatchSource(
        fake_engine(),
        _requests(),
        MetaCredit(),
        rollout_hooks=(hook,),
        sample_filter=lambda item: len(calls) >= 2,
    )
    batch = asyncio.run(source.next_batch())
    assert calls == [2, 2] and batch.meta["attempts"] == 2


def test_batch_source_runs_hooks_before_credit():
    async def hook(rollouts: list[Rollout]) -> None:
        for r in rollouts:
            r.meta["mark"] = -0.5

    source = RolloutBatchSource(fake_engine(), _requests(3), MetaCredit(), rollout_hooks=[hook])
    batch = asyncio.run(source.next_batch())
    assert [item.weight for item in batch.items] == [-0.5] * 3


def test_a_sync_hook_or_one_returning_a_value_is_an_error():
    def sync_hook(rollouts):
        return None

    async def returns_rollouts(rollouts):
        return rollouts

    for hook, match in (
        (sync_hook, r"not an awaitable.*async def"),
        (returns_rollouts, r"in place"),
    ):
        source = RolloutBatchSource(fake_engine(), _requests(), MetaCredit(), rollout_hooks=[hook])
        with pytest.raises(TypeError, match=match):
            asyncio.run(source.next_batch())


def test_non_callable_hooks_are_rejected_at_construction():
    engine = fake_engine()
    with pytest.raises(TypeError, match=r"RolloutBatchSource: rollout_hooks\[1\]=3"):
        RolloutBatchSource(
            engine,
            _requests(),
            MetaCredit(),
            rollout_hooks=[RewardModelScorer(RecordingRewardClient()), 3],
        )  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"RLAlgorithm\('x'\): rollout_hooks\[0\]='hook'"):
        RLAlgorithm("x", MetaCredit(), ReinforceLoss(), rollout_hooks=("hook",))  # type: ignore[arg-type]


def test_rl_algorithm_defaults_to_no_hooks_and_stores_a_tuple():
    assert make_reinforce().rollout_hooks == ()
    scorer = RewardModelScorer(RecordingRewardClient())
    algo = RLAlgorithm("x", MetaCredit(), ReinforceLoss(), rollout_hooks=[scorer])  # type: ignore[arg-type]
    assert algo.rollout_hooks == (scorer,)


# ---------------------------------------------------------------------------- preset


def test_make_reward_rl_without_groups_is_reinforce_on_combined_rewards():
    client = RecordingRewardClient()
    algo = make_reward_rl(client, mode="weighted", weight=0.25, normalize=False)
    assert algo.name == "reward_rl"
    assert isinstance(algo.loss, ReinforceLoss)
    assert algo.credit_assigner == RewardModelCreditAssigner(mode="weighted", weight=0.25)
    (scorer,) = algo.rollout_hooks
    assert isinstance(scorer, RewardModelScorer)
    assert scorer.client is client and scorer.normalize is False and scorer.per_turn is False


def test_make_reward_rl_with_groups_is_grpo_on_combined_returns():
    algo = make_reward_rl(RecordingRewardClient(), group_size=4, per_turn=True)
    assert algo.credit_assigner == RewardModelCreditAssigner(group_normalize=True, group_size=4)
    assert isinstance(algo.loss, TokenClippedSurrogateLoss)
    assert algo.loss.aggregation is TokenAggregation.SEQ_MEAN_TOKEN_MEAN
    assert algo.rollout_hooks[0].per_turn is True  # type: ignore[attr-defined]


def test_make_reward_rl_validates_its_arguments_and_takes_a_loss():
    with pytest.raises(ValueError, match=r"make_reward_rl: group_size=1"):
        make_reward_rl(RecordingRewardClient(), group_size=1)
    with pytest.raises(ValueError, match=r"mode='max'"):
        make_reward_rl(RecordingRewardClient(), mode="max")  # type: ignore[arg-type]
    loss = ReinforceLoss()
    assert make_reward_rl(RecordingRewardClient(), group_size=2, loss=loss).loss is loss


# ---------------------------------------------------------------------------- end to end

SAMPLES = [{"question": "1+2=", "answer": "3"}, {"question": "3+4=", "answer": "7"}]


def _policy_engine(tokenizer, client) -> RolloutEngine:
    template = HFChatTemplate(tokenizer)

    def protocol() -> SingleAgentProtocol:
        agent = Agent(
            client=client,
            context=FullDialog(),
            parser=lambda text: ParseResult(action=text),
            chat_template=template,
        )
        return SingleAgentProtocol(agent)

    return RolloutEngine({"qa": lambda: DatasetQAEnv(SAMPLES)}, {"single": protocol})


def _qa_requests(inference: InferenceSpec):
    return lambda: [
        RolloutRequest(EnvSpec("qa"), ProtocolSpec("single"), env_seed=s, inference=inference)
        for s in range(2)
    ]


def test_batch_source_with_make_reward_rl_weights_items_by_group_normalized_rm_scores(
    tiny_tokenizer,
):
    # The scripted policy answers "good" on even sampling seeds, "bad" on odd ones: each
    # group of 2 holds one of each (GRPORequestStrategy gives seeds base + 0, base + 1).
    policy = ScriptedChatClient(
        tiny_tokenizer, lambda req, prompt: "good" if req.sampling.seed % 2 == 0 else "bad"
    )
    table = {f"{s['question']}\n{a}": v for s in SAMPLES for a, v in (("good", 0.9), ("bad", 0.3))}
    rm = RecordingRewardClient(table, version=11)
    algo = make_reward_rl(rm, group_size=2, mode="add")
    source = RolloutBatchSource(
        _policy_engine(tiny_tokenizer, policy),
        _qa_requests(InferenceSpec(SamplingSpec(max_tokens=8, seed=0))),
        algo.credit_assigner,
        request_strategy=GRPORequestStrategy(group_size=2),
        rollout_hooks=algo.rollout_hooks,
    )
    batch = asyncio.run(source.next_batch())

    assert len(rm.calls) == 1 and sorted(rm.calls[0][0]) == sorted(table)
    assert len(batch.items) == 4
    for item, rollout in zip(batch.items, source.last_rollouts):
        completion = rollout.agent_steps[0].completion
        assert rollout.total_reward == 0.0  # wrong answers: the env gives 0, add keeps it
        assert rollout.meta[RM_VERSION_KEY] == 11
        # R = 0 + s in {0.9, 0.3}; each group: mean 0.6, std 0.3 -> A = +-0.3/(0.3 + 1e-6)
        sign = 1.0 if completion == "good" else -1.0
        assert item.weight == pytest.approx(sign * 0.3 / (0.3 + 1e-6))
        assert item.meta["rollout_id"] == rollout.id


def test_one_reward_rl_step_with_a_tiny_policy_and_a_tiny_reward_model(tiny_tokenizer):
    """The whole loop on real tiny models: sample -> RM scores -> REINFORCE weights -> step."""
    rm_model = build_tiny_reward_model(tiny_tokenizer, seed=0)
    rm = TransformersRewardClient(rm_model, tiny_tokenizer)
    policy = build_tiny_causal_lm(tiny_tokenizer, seed=0)
    serving = TransformersChatClient(build_tiny_causal_lm(tiny_tokenizer, seed=0), tiny_tokenizer)
    algo = make_reward_rl(rm, mode="replace", normalize=False)
    source = RolloutBatchSource(
        _policy_engine(tiny_tokenizer, serving),
        _qa_requests(InferenceSpec(SamplingSpec(temperature=1.0, max_tokens=4, seed=0))),
        algo.credit_assigner,
        rollout_hooks=algo.rollout_hooks,
    )
    trainer = Trainer(
        policy, algo, source, TrainerConfig(lr=1e-2, pad_token_id=tiny_tokenizer.pad_token_id)
    )
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}

    metrics = asyncio.run(trainer.train_step())

    rollouts = source.last_rollouts
    texts = [reward_text(r, r.turns()[-1]) for r in rollouts]
    with torch.no_grad():
        expected = [
            float(rm_model(input_ids=torch.tensor([tiny_tokenizer(t)["input_ids"]])).logits)
            for t in texts
        ]
    assert [r.meta[RM_SCORES_KEY][-1] for r in rollouts] == pytest.approx(expected, abs=1e-5)
    assert metrics["num_items"] == len(rollouts) == 2
    assert any(not torch.equal(before[n], p) for n, p in policy.named_parameters())
