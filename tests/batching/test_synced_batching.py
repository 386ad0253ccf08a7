"""RolloutBatchSource: on-policy batches, GRPO expansion, empty-batch retries."""

from __future__ import annotations

import asyncio

import pytest

from ludic.rollouts.engine import RolloutEngine
from ludic.rollouts.strategies import GRPORequestStrategy
from ludic.training.batching.synced_batching import EmptyBatchError, RolloutBatchSource
from ludic.training.types import BatchSource, EnvSpec, ProtocolSpec, RolloutRequest


def engine(fakes):
    return RolloutEngine({"fake": fakes.FakeEnv}, {"fake": fakes.FakeProtocol})


class CountingRequests:
    def __init__(self, n: int = 2) -> None:
        self.calls = 0
        self.n = n

    def __call__(self) -> list[RolloutRequest]:
        self.calls += 1
        return [RolloutRequest(EnvSpec("fake"), ProtocolSpec("fake")) for _ in range(self.n)]


def test_next_batch_expands_groups_and_keeps_the_rollouts(fakes):
    source = RolloutBatchSource(
        engine(fakes),
        CountingRequests(2),
        fakes.TurnRewardCredit(),
        request_strategy=GRPORequestStrategy(3),
    )
    assert isinstance(source, BatchSource)
    batch = asyncio.run(source.next_batch())
    assert len(batch) == 6
    assert len(source.last_rollouts) == 6
    assert len({r.meta["group_id"] for r in source.last_rollouts}) == 2
    assert len({r.meta["env_seed"] for r in source.last_rollouts}) == 2
    assert batch.meta["attempts"] == 1
    assert batch.meta["num_rollouts"] == 6


def test_empty_batches_are_retried_then_raise_after_max_empty_batches(fakes):
    requests = CountingRequests()
    source = RolloutBatchSource(
        engine(fakes),
        requests,
        fakes.TurnRewardCredit(),
        sample_filter=lambda item: False,
        max_empty_batches=3,
    )
    with pytest.raises(EmptyBatchError, match=r"3 consecutive batches.*2 items dropped"):
        asyncio.run(source.next_batch())
    assert requests.calls == 3


def test_source_and_trainer_raise_the_same_empty_batch_error_class(fakes):
    """``except ludic.training.EmptyBatchError`` must catch the batch source's error too."""
    from ludic.training import EmptyBatchError as TrainingEmptyBatchError

    source = RolloutBatchSource(
        engine(fakes), CountingRequests(), fakes.TurnRewardCredit(), sample_filter=lambda i: False
    )
    with pytest.raises(TrainingEmptyBatchError):
        asyncio.run(source.next_batch())


def test_a_batch_that_is_empty_once_is_regenerated(fakes):
    state = {"calls": 0}

    def keep_from_second_round(item):
        return state["calls"] >= 2

    requests = CountingRequests()

    def requests_fn():
        state["calls"] += 1
        return requests()

    source = RolloutBatchSource(
        engine(fakes), requests_fn, fakes.TurnRewardCredit(), sample_filter=keep_from_second_round
    )
    batch = asyncio.run(source.next_batch())
    assert len(batch) == 2
    assert batch.meta["attempts"] == 2


def test_requests_fn_returning_nothing_is_an_error(fakes):
    source = RolloutBatchSource(engine(fakes), lambda: [], fakes.TurnRewardCredit())
    with pytest.raises(ValueError, match=r"requests_fn\(\) returned no requests"):
        asyncio.run(source.next_batch())


def test_invalid_settings_are_rejected_at_construction(fakes):
    with pytest.raises(ValueError, match="max_empty_batches must be >= 1"):
        RolloutBatchSource(
            engine(fakes), CountingRequests(), fakes.TurnRewardCredit(), max_empty_batches=0
        )
    with pytest.raises(ValueError, match="retokenize=True needs a chat_template"):
        RolloutBatchSource(
            engine(fakes), CountingRequests(), fakes.TurnRewardCredit(), retokenize=True
        )


def test_batch_carries_items_and_reward_statistics(fakes):
    engine = RolloutEngine(
        {"fake": fakes.FakeEnv},
        {"fake": fakes.FakeProtocol},
    )
    reqs = [
        RolloutRequest(EnvSpec("fake", {"reward": 1.0}), ProtocolSpec("fake"), num_episodes=2),
        RolloutRequest(
            EnvSpec("fake", {"reward": 0.0}), ProtocolSpec("fake", {"parse_error": True})
        ),
    ]
    source = RolloutBatchSource(engine, lambda: reqs, fakes.TurnRewardCredit())
    batch = asyncio.run(source.next_batch())
    assert [it.weight for it in batch.items] == [1.0, 1.0, 0.0]
    assert batch.meta["num_rollouts"] == 3
    assert batch.meta["total_rewards"] == [1.0, 1.0, 0.0]
    assert batch.meta["reward_mean"] == pytest.approx(2 / 3)
    assert (batch.meta["reward_min"], batch.meta["reward_max"]) == (0.0, 1.0)
    assert batch.meta["length_mean"] == 1.0
    assert batch.meta["terminated_frac"] == 1.0
    assert batch.meta["truncated_frac"] == 0.0
    assert batch.meta["parse_error_rate"] == pytest.approx(1 / 3)
