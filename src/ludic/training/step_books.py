"""The books of a run's steps: the token ledger, the bias audit and each step's metrics.

:class:`StepBooks` is the observer the Trainer calls at two points of a step: when a
batch arrives (what the source generated, what the filters and staleness dropped) and
once the step is trained (what it trained, its metrics). It keeps what a checkpoint saves
of them. It decides nothing about what is trained (``training/step_selection.py``).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ludic.stats import Reducer, aggregate_stats
from ludic.timing import take_stage_seconds
from ludic.training.ledger import GENERATE_S, GENERATED, SOURCE_KEYS, TokenLedger, batch_tokens
from ludic.training.policy_update import ENTROPY_STAT, StepResult
from ludic.training.sample_audit import DROPPED_BY_SOURCE, SampleAudit
from ludic.training.types import BatchSource, LedgerSource, SAWBatch, SAWItem

__all__ = ["STEP_TIMES", "StepBooks", "is_number"]

log = logging.getLogger(__name__)

STEP_TIMES = ("time/wait_s", "time/train_s", "time/sync_s")
"""A step's wall time, in three parts: waiting for the batch, training, publishing;
``time/idle_fraction`` is the first's share."""


class StepBooks:
    """Where every generated token went (``ledger``; ``None`` until a batch says what was
    generated for it: a rollout source's do, an SFT one's not), trained against dropped
    items (``audit``), and the metrics of each step."""

    def __init__(self, source: BatchSource, metric_reducers: Sequence[Reducer] = ()) -> None:
        self.metric_reducers = tuple(metric_reducers)
        self.audit = SampleAudit()
        self.ledger: TokenLedger | None = None
        self._source = source if isinstance(source, LedgerSource) else None
        self._ledger_base = 0  # generated before a resume (a LedgerSource counts from 0)
        # the ledger as of the last step that closed it: what a checkpoint keeps (a step
        # that fails half-way may have counted part of its batch)
        self._closed_ledger: dict[str, int] | None = None
        self._audit_warned = False
        self._last_logged: float | None = None  # perf_counter when the last step was logged

    # ---------------------------------------------------------------- a batch arrives
    def saw(self, batch: SAWBatch, kept: Sequence[SAWItem], fresh: Sequence[SAWItem]) -> None:
        """``batch`` from the source, of whose items the filter ``kept`` some and staleness
        left ``fresh`` ones: the dropped ones to the audit, the tokens to the ledger."""
        if len(fresh) < len(batch.items):
            chosen = {id(i) for i in fresh}
            self.audit.add((i for i in batch.items if id(i) not in chosen), dropped=True)
        if isinstance(by_source := batch.meta.get(DROPPED_BY_SOURCE), Mapping):
            self.audit.add_dropped_totals(by_source)
        if self._account_source(batch):
            assert self.ledger is not None
            self.ledger.dropped_filter += _tokens(batch.items) - _tokens(kept)
            self.ledger.dropped_stale += _tokens(kept) - _tokens(fresh)

    def rejected(self, items: Sequence[SAWItem]) -> None:
        """``items`` of a batch the loss cannot use, set aside by the source."""
        if self.ledger is not None:
            self.ledger.dropped_filter += _tokens(items)

    def _account_source(self, batch: SAWBatch) -> bool:
        """Add what the source generated and threw away of ``batch`` to the ledger; False
        when there is no ledger (no batch so far said what was generated for it)."""
        tokens = batch_tokens(batch.meta)
        if tokens is None:
            if self.ledger is None:
                return False
            tokens = {key: 0 for key in SOURCE_KEYS} | {GENERATED: _tokens(batch.items)}
        if self.ledger is None:
            self.ledger = TokenLedger()
            if self._source is not None and self._source.ledger_run_wide:
                # a ledger from here on: what checkpoints of earlier learners accounted
                # for (none of which this Trainer resumed) is not in it
                self._ledger_base = -self._source.ledger_committed_before
        self.ledger.add_source_part(tokens)
        if self._source is None:
            self.ledger.generated += tokens[GENERATED]
        return True

    # ---------------------------------------------------------------- a step is trained
    def trained(self, items: Sequence[SAWItem], step: int, *, close_ledger: bool) -> None:
        """The step's items are trained (those whose reward failed with weight 0); with
        ``close_ledger`` (the rank that saw the batches) the ledger must close."""
        no_reward = [i for i in items if i.meta.get("reward_dropped")]
        self.audit.add(no_reward, dropped=True)
        self.audit.add((i for i in items if not i.meta.get("reward_dropped")), dropped=False)
        ledger = self.ledger
        if not close_ledger or ledger is None:
            return
        ledger.dropped_reward += _tokens(no_reward)
        ledger.trained += _tokens(items) - _tokens(no_reward)
        self._take_source_totals(ledger)
        ledger.check(step)
        self._closed_ledger = ledger.state()

    def warn_once(self, step: int) -> None:
        """Say, once per run, when the dropped items are unlike the trained ones (the
        metrics keep the figures)."""
        if not self._audit_warned and (warning := self.audit.warning()) is not None:
            self._audit_warned = True
            log.warning("step %d: %s", step, warning)

    def settle(self, step: int) -> None:
        """The end of training, once nothing more is made: what was made and never handed
        out counts as aborted (``TokenLedger.settle``), and the ledger must still close."""
        if self.ledger is None:
            return
        self._take_source_totals(self.ledger)
        self.ledger.settle()
        self.ledger.check(step)
        self._closed_ledger = self.ledger.state()

    def _take_source_totals(self, ledger: TokenLedger) -> None:
        if self._source is not None:
            generated, in_flight = self._source.ledger_totals()
            ledger.generated, ledger.in_flight = self._ledger_base + generated, in_flight

    # ---------------------------------------------------------------- metrics
    def timing(
        self,
        started: float,
        waited: float,
        trained_s: float,
        sync_s: float,
        raw: Iterable[SAWBatch],
    ) -> dict[str, float]:
        """A step's ``time/*`` metrics: its parts, the batches' generation, the stages
        timed inside it, and ``time/step_s``: the wall time since the previous step's
        metrics (the first: since ``started``), which includes what ran between steps."""
        timing = {"time/wait_s": waited, "time/train_s": trained_s, "time/sync_s": sync_s}
        made = [b.meta[GENERATE_S] for b in raw if is_number(b.meta.get(GENERATE_S))]
        if made:  # how long the step's batches took to generate (async: while it trained)
            timing["time/generate_s"] = float(sum(made))
        timing["time/idle_fraction"] = waited / max(sum(timing[k] for k in STEP_TIMES), 1e-9)
        for stage, seconds in take_stage_seconds().items():
            timing[f"time/stage/{stage}_s"] = seconds
        now = time.perf_counter()
        timing["time/step_s"] = now - (started if self._last_logged is None else self._last_logged)
        self._last_logged = now
        return timing

    def metrics(
        self,
        step: int,
        batch: SAWBatch,
        result: StepResult,
        selection: Mapping[str, float],
        timing: Mapping[str, float],
    ) -> dict[str, float]:
        items = batch.items
        num_tokens = sum(item.num_tokens for item in items)
        loss_stats = dict(result.loss_stats)
        entropy = loss_stats.pop(ENTROPY_STAT, None)
        metrics: dict[str, float] = {
            "loss": result.loss,
            **{f"loss/{key}": value for key, value in loss_stats.items()},
            **({} if entropy is None else {"entropy": entropy}),
            "grad_norm": result.grad_norm,
            "lr": result.lr,
            "num_items": len(items),
            "num_tokens": num_tokens,
            "num_action_tokens": sum(item.num_action_tokens for item in items),
            "num_microbatches": result.num_microbatches,
            "num_tokens_run": result.tokens_run,
            "tokens_per_s": num_tokens / max(timing["time/train_s"], 1e-9),
            **timing,
            **selection,
            **_reward_stats(items),
            **{f"batch/{k}": float(v) for k, v in batch.meta.items() if is_number(v)},
            **self.audit.metrics(),
            **({} if self.ledger is None else self.ledger.metrics()),
            "policy_version": step,
        }
        if result.num_updates > 1:
            metrics["num_updates"] = result.num_updates
        metrics.update(aggregate_stats(self.metric_reducers, items))
        return metrics

    # ---------------------------------------------------------------- checkpoints
    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the audit, and the ledger as of its last close."""
        return {"sample_audit": self.audit.state(), "token_ledger": self._closed_ledger}

    def restore(self, extra: Mapping[str, Any]) -> None:
        """The books of a checkpoint's ``extra`` (:meth:`state`)."""
        self.audit = SampleAudit.from_state(extra.get("sample_audit"))
        state = extra.get("token_ledger")
        run_wide = self._source is not None and self._source.ledger_run_wide
        self.ledger = None if state is None else TokenLedger.resumed(state, in_flight_kept=run_wide)
        self._ledger_base = 0 if self.ledger is None or run_wide else self.ledger.generated
        self._closed_ledger = None if self.ledger is None else self.ledger.state()


def _reward_stats(items: Sequence[SAWItem]) -> dict[str, float]:
    rewards = [float(i.meta["reward"]) for i in items if is_number(i.meta.get("reward"))]
    if not rewards:
        return {}
    return {
        "reward/mean": statistics.fmean(rewards),
        "reward/std": statistics.pstdev(rewards),
        "reward/min": min(rewards),
        "reward/max": max(rewards),
    }


def _tokens(items: Iterable[SAWItem]) -> int:
    """Generated (action) tokens of ``items``: what the token ledger counts."""
    return sum(item.num_action_tokens for item in items)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
