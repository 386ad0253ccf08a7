"""Trainer.train_async on the tiny model: generation overlaps training, no item older than
max_staleness is trained on (asserted at every step), the step survives cancellation,
PPO epochs / mini-batches and the proximal logprobs (pi at the start of the step)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import pytest
import torch
from tests.test_end_to_end import _grpo_trainer
from tests.training.test_trainer import ListSource, WeightedNLL, _algorithm, _config, _items

from ludic.models.tiny import build_tiny_causal_lm
from ludic.stats import Reducer
from ludic.training import make_grpo
from ludic.training.batching.async_source import AsyncBatchSource
from ludic.training.losses.base import LossInputs, LossOutput
from ludic.training.trainer import Trainer
from ludic.training.types import SAWBatch, SAWItem


def test_train_async_needs_an_asynchronous_source(tiny_model) -> None:
    trainer = Trainer(tiny_model, _algorithm(), ListSource(SAWBatch(_items())), _config())
    with pytest.raises(TypeError, match="AsyncBatchSource"):
        trainer.train_async_sync(1)


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_no_trained_token_is_older_than_max_staleness_at_any_step(tiny_tokenizer, max_staleness):
    trainer, policy, serving, client = _async_grpo_trainer(tiny_tokenizer, max_staleness)

    history = trainer.train_async_sync(6)

    assert [m["policy_version"] for m in history] == [1, 2, 3, 4, 5, 6]
    for m in history:
        trained_at = m["policy_version"] - 1  # the weights' version during the step
        assert trained_at - m["oldest_version"] <= max_staleness
        assert m["staleness/max"] == trained_at - m["oldest_version"]
    ahead = [m["batch/async/generating_batches"] + m["batch/async/queued_batches"] for m in history]
    if max_staleness == 0:
        assert max(ahead) == 0  # on-policy: nothing is generated while a step trains
    else:
        assert max(ahead) >= 1  # generation ran ahead while the trainer stepped
        assert max(m["staleness/max"] for m in history) >= 1
    assert client.policy_version == 6
    for p, s in zip(policy.parameters(), serving.parameters()):
        assert torch.equal(p, s)


def _async_grpo_trainer(tokenizer, max_staleness: int):
    sync, policy, serving, client = _grpo_trainer(tokenizer, make_grpo(group_size=4))
    trainer = Trainer(
        policy,
        sync.algorithm,
        AsyncBatchSource(sync.batch_source, max_staleness=max_staleness),
        sync.config,
        publisher=sync.publisher,
        metric_reducers=[Reducer("oldest_version", "policy_version", reduce="min")],
    )
    return trainer, policy, serving, client


def test_train_async_closes_its_source(tiny_tokenizer) -> None:
    trainer, *_ = _async_grpo_trainer(tiny_tokenizer, 1)
    trainer.train_async_sync(2)
    with pytest.raises(RuntimeError, match="after aclose"):
        asyncio.run(trainer.batch_source.next_batch())


class StaleThenFresh:
    """An async-style source whose first batch is entirely stale."""

    max_staleness = 1

    def __init__(self) -> None:
        self.calls = 0
        self.trained: list[SAWBatch] = []
        self.closed = False

    def on_policy_version(self, version: int) -> None:
        pass

    async def next_batch(self) -> SAWBatch:
        self.calls += 1
        version = -5 if self.calls == 1 else 0
        return SAWBatch(_items(3, seed=self.calls, policy_version=version), {"call": self.calls})

    def mark_trained(self, batch: SAWBatch) -> None:
        self.trained.append(batch)

    def reject(self, batch: SAWBatch, error: str) -> None:
        raise AssertionError(f"rejected {batch.meta}: {error}")

    def on_checkpoint(self, step: int) -> None:
        pass

    async def aclose(self) -> None:
        self.closed = True


def test_an_all_stale_async_batch_is_replaced_and_counted(tiny_model) -> None:
    source = StaleThenFresh()
    trainer = Trainer(tiny_model, _algorithm(), source, _config())
    (metrics,) = trainer.train_async_sync(1)
    assert metrics["dropped/stale"] == 3 and metrics["num_items"] == 3
    assert [b.meta["call"] for b in source.trained] == [1, 2]  # both acknowledged
    assert source.closed


@dataclass
class ProximalSpy(WeightedNLL):
    requires_proximal_logprobs: bool = True
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        self.seen.append(
            (inputs.proximal_logprobs.clone(), inputs.logprobs.detach().clone(), inputs.action_mask)
        )
        return super().__call__(inputs)


def test_proximal_logprobs_are_the_weights_at_the_start_of_the_step(tiny_model) -> None:
    spy = ProximalSpy()
    items = _items(4)
    trainer = Trainer(
        tiny_model, _algorithm(spy), ListSource(SAWBatch(items)), _config(ppo_epochs=3)
    )
    (metrics,) = trainer.train_sync(1)
    assert metrics["num_updates"] == 3 and len(spy.seen) == 3
    first_prox, first_logp, mask = spy.seen[0]
    torch.testing.assert_close(first_prox, first_logp * mask, rtol=0, atol=1e-6)
    for prox, logp, m in spy.seen[1:]:
        assert torch.equal(prox, first_prox)  # pi_prox is fixed for the whole step
        assert not torch.allclose(logp * m, prox, atol=1e-6)  # pi_theta moved


def test_minibatches_equal_consecutive_single_item_steps(tiny_tokenizer) -> None:
    items = _items(2)
    both = Trainer(
        build_tiny_causal_lm(tiny_tokenizer, seed=0),
        _algorithm(),
        ListSource(SAWBatch(items)),
        _config(num_minibatches=2),
    )
    (metrics,) = both.train_sync(1)
    assert metrics["num_updates"] == 2 and both.step == 1
    candidates = []
    for order in ([0, 1], [1, 0]):
        one_by_one = Trainer(
            build_tiny_causal_lm(tiny_tokenizer, seed=0),
            _algorithm(),
            ListSource(*(SAWBatch([items[i]]) for i in order)),
            _config(),
        )
        one_by_one.train_sync(2)
        candidates.append(
            all(
                torch.allclose(a, b, atol=1e-6)
                for a, b in zip(both.model.parameters(), one_by_one.model.parameters())
            )
        )
    assert any(candidates)


def test_the_lr_schedule_advances_once_per_trainer_step(tiny_model) -> None:
    config = _config(lr_schedule="linear", total_steps=4, ppo_epochs=2, num_minibatches=2)
    trainer = Trainer(tiny_model, _algorithm(), ListSource(SAWBatch(_items(4))), config)
    history = trainer.train_sync(2)
    assert [m["lr"] for m in history] == pytest.approx([1e-3, 0.75e-3])


class StepRecorder:
    def __init__(self, steps: list[int]) -> None:
        self.steps = steps

    def log(self, step: int, metrics) -> None:
        self.steps.append(step)

    def close(self) -> None:
        pass


class SlowLoss(WeightedNLL):
    """Signals when the first loss runs (in the trainer's worker thread), then waits."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, inputs: LossInputs) -> LossOutput:
        self.started.set()
        self.release.wait(10)
        return super().__call__(inputs)


def test_cancelling_during_the_update_finishes_and_logs_the_step_first(tiny_model) -> None:
    loss = SlowLoss()
    source = AsyncBatchSource(ListSource(SAWBatch(_items(3, policy_version=0))), max_staleness=4)
    logged: list[int] = []
    trainer = Trainer(tiny_model, _algorithm(loss), source, _config())
    trainer.logger.loggers.append(StepRecorder(logged))

    async def run() -> None:
        task = asyncio.ensure_future(trainer.train_async(5))
        while not loss.started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.05)
        loss.release.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert trainer.step == 1 and logged == [1]  # the step in progress ended and was logged


def test_items_carry_first_and_last_versions() -> None:
    item = SAWItem((1, 2, 3, 4), (0, 1, 1, 1), weight=1.0, action_versions=(3, 3, 4))
    assert (item.policy_version, item.first_version, item.last_version) == (3, 3, 4)
    assert item.version_span == 1
    with pytest.raises(ValueError, match="action_versions has 2 entries for 3"):
        SAWItem((1, 2, 3, 4), (0, 1, 1, 1), weight=1.0, action_versions=(3, 4))


def test_one_update_takes_proximal_logprobs_from_its_own_forward(tiny_model) -> None:
    spy = ProximalSpy()
    trainer = Trainer(tiny_model, _algorithm(spy), ListSource(SAWBatch(_items(4))), _config())
    trainer.train_sync(1)
    ((prox, logp, mask),) = spy.seen
    assert torch.equal(prox, logp * mask)
