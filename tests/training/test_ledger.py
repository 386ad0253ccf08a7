"""The token ledger: generated = trained + dropped (stale, filter, reward) + aborted +
in flight, checked by the Trainer after every step, on real rollout sources (in sync and
async), across a checkpoint, and loudly when a source's figures do not add up."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from tests.pipeline.helpers import rollout_source
from tests.training.test_trainer import _algorithm

from ludic.training.batching.async_source import AsyncBatchSource
from ludic.training.checkpoint import CheckpointConfig
from ludic.training.config import TrainerConfig
from ludic.training.ledger import GENERATED, LedgerError, TokenLedger
from ludic.training.trainer import Trainer

KEYS = ("trained", "dropped_stale", "dropped_filter", "dropped_reward", "aborted", "in_flight")


def _closes(metrics: dict[str, float]) -> bool:
    return metrics["tokens/generated"] == sum(metrics[f"tokens/{k}"] for k in KEYS)


def test_the_identity_and_a_resume_count_what_was_in_flight_as_aborted() -> None:
    ledger = TokenLedger(generated=10, trained=6, dropped_stale=1, in_flight=3)
    ledger.check(step=1)
    ledger.trained -= 2
    with pytest.raises(LedgerError, match=r"step 4: .* generated 10 != 8 .* 2 tokens unaccounted"):
        ledger.check(step=4)
    state = TokenLedger(10, 6, 1, 0, 0, 0, 3).state()
    resumed = TokenLedger.resumed(state, in_flight_kept=False)
    assert (resumed.in_flight, resumed.aborted, resumed.generated) == (0, 3, 10)
    # a durable queue's batches in flight are still there: its source counts them again
    kept = TokenLedger.resumed(state, in_flight_kept=True)
    assert (kept.in_flight, kept.aborted, kept.generated) == (3, 0, 10)


def test_sync_training_accounts_for_every_token_the_filter_drops_too(tiny_model) -> None:
    every_other = itertools.cycle([True, False])
    trainer = Trainer(
        tiny_model,
        _algorithm(),
        rollout_source(num_rollouts=4),
        TrainerConfig(lr=1e-3),
        sample_filter=lambda item: next(every_other),
    )
    history = trainer.train_sync(3)
    for metrics in history:
        assert _closes(metrics)
    last = history[-1]
    # 4 rollouts x 2 completion tokens a step, half of them filtered out
    assert (last["tokens/generated"], last["tokens/trained"]) == (24, 12)
    assert last["tokens/dropped_filter"] == 12 and last["tokens/in_flight"] == 0
    # and where the step's time went
    times = ("time/wait_s", "time/train_s", "time/sync_s", "time/generate_s")
    assert all(last[key] >= 0 for key in times) and 0 <= last["time/idle_fraction"] <= 1
    # the whole step, log to log: its parts and what ran between the steps
    for metrics in history:
        parts = sum(metrics[key] for key in ("time/wait_s", "time/train_s", "time/sync_s"))
        assert parts <= metrics["time/step_s"] < parts + 5.0


def test_async_training_counts_the_batches_made_ahead_as_in_flight(tiny_model, tmp_path) -> None:
    source = AsyncBatchSource(rollout_source(num_rollouts=4), max_staleness=2)
    config = TrainerConfig(lr=1e-3)
    checkpoint = CheckpointConfig(tmp_path, every_n_steps=0)
    trainer = Trainer(tiny_model, _algorithm(), source, config, checkpoint=checkpoint)
    history = trainer.train_async_sync(4)
    assert all(_closes(m) for m in history)
    assert any(m["tokens/in_flight"] > 0 for m in history)  # generation ran ahead
    assert history[-1]["tokens/trained"] == 4 * 8
    # the end: the batches made ahead and discarded are aborted, and the ledger closes
    settled = trainer.ledger
    assert settled is not None and settled.in_flight == 0
    assert settled.aborted == source.ledger_totals()[1] >= history[-1]["tokens/in_flight"]
    assert settled.aborted > 0  # two batches made ahead (max_staleness 2) and discarded
    assert settled.generated == source.ledger_totals()[0] == settled.accounted()
    trainer.save_checkpoint()
    # a resumed run continues from the settled ledger
    again = Trainer(
        tiny_model,
        _algorithm(),
        AsyncBatchSource(rollout_source(num_rollouts=4), max_staleness=2),
        config,
        checkpoint=checkpoint,
    )
    again.resume()
    (metrics,) = again.train_async_sync(1)
    assert _closes(metrics) and metrics["tokens/trained"] == 5 * 8
    assert metrics["tokens/aborted"] == settled.aborted


def test_a_source_whose_figures_do_not_add_up_stops_the_step_naming_the_gap(tiny_model) -> None:
    source = rollout_source(num_rollouts=2)
    make = source.next_batch

    async def lying_batch():
        batch = await make()
        batch.meta[GENERATED] += 5  # claims tokens that are in no item and dropped nowhere
        return batch

    source.next_batch = lying_batch  # type: ignore[method-assign]
    trainer = Trainer(tiny_model, _algorithm(), source, TrainerConfig(lr=1e-3))
    with pytest.raises(LedgerError, match="step 1: the token ledger does not close.*5 tokens"):
        asyncio.run(trainer.train_step())


def test_items_whose_reward_failed_are_dropped_reward_in_the_ledger_and_the_audit(
    tiny_model,
) -> None:
    """The reward loop drops a group whose reward failed: its items go through the update
    with weight 0; the ledger counts their tokens as dropped_reward, the audit as dropped."""
    from tests.training.test_trainer import ListSource

    from ludic.training.types import SAWBatch, SAWItem

    ok = SAWItem((1, 2, 3, 4), (0, 0, 1, 1), 1.0, meta={"reward": 1.0})
    failed = SAWItem((5, 6, 7), (0, 1, 1), 0.0, meta={"reward": 0.0, "reward_dropped": True})
    batch = SAWBatch([ok, failed], meta={GENERATED: 4})
    trainer = Trainer(tiny_model, _algorithm(), ListSource(batch), TrainerConfig(lr=1e-3))
    metrics = asyncio.run(trainer.train_step())
    assert _closes(metrics)
    assert (metrics["tokens/trained"], metrics["tokens/dropped_reward"]) == (2, 2)
    assert (metrics["audit/trained_samples"], metrics["audit/dropped_samples"]) == (1, 1)
