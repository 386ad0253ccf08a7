"""The Trainer: one optimisation loop for every algorithm.

An algorithm is ``RLAlgorithm`` = credit assigner (already applied by the batch source)
+ ``loss`` (+ optional ``preprocess``). Each :meth:`Trainer.train_step` runs, in order::

    batch   = await batch_source.next_batch()
    items   = preprocess, sample_filter, staleness            (dropped counts are logged)
    prox    = logprobs of the weights at the start of the step (losses that need pi_prox)
    ref     = logprobs of the reference model, once per step, no grad (KL losses)
    for each of ppo_epochs x num_minibatches updates (1 x 1 by default):
        for each micro-batch (<= max_tokens_per_microbatch tokens, padded or packed):
            logprobs = the action tokens' logprobs, [B, T-1] float32 (token_scores:
                       packed or shared-prefix forward, output head a chunk at a time)
            loss     = algorithm.loss(LossInputs(normalizers over the mini-batch))
            loss.backward()                 (micro-batch losses sum to the mini-batch loss)
        check grads finite -> clip -> optimizer.step
    scheduler.step -> step += 1
    publish weights every publish_every steps (version = step) -> log -> checkpoint

``trainer.step`` counts trainer steps and is the policy version.

**Asynchronous RL** (:meth:`Trainer.train_async`, spec 4): with an
:class:`~ludic.training.batching.async_source.AsyncBatchSource` generation keeps running
while the trainer computes (the optimizer step runs in a worker thread, off the event loop),
at most ``max_staleness`` versions ahead; items with a token older than ``step -
max_staleness`` are dropped (``dropped/stale``) and staleness is logged per step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ludic._async import on_compute_thread
from ludic.distributed.interfaces import PolicyPublisher
from ludic.distributed.weight_transfer.extractor import gather_full_tensors
from ludic.distributed.weights import policy_state_dict
from ludic.stats import Reducer, aggregate_stats
from ludic.timing import take_stage_seconds, timed
from ludic.training.checkpoint import CheckpointConfig
from ludic.training.collate import CollatedBatch, collate, require_fits, split_microbatches
from ludic.training.config import TrainerConfig
from ludic.training.core import (  # noqa: F401 (NonFiniteError re-exported)
    HasTrainingCore,
    NonFiniteError,
    TrainingCore,
)
from ludic.training.data_parallel import (
    BatchChannel,
    ShardedScorer,
    TrainerRanks,
    all_reduce_sum,
    broadcast_flag,
    gathered,
    shard_policy,
    split_items,
)
from ludic.training.filters import SampleFilter
from ludic.training.flat_parameters import flatten_parameters
from ludic.training.ledger import (
    GENERATE_S,
    GENERATED,
    SOURCE_KEYS,
    TokenLedger,
    batch_tokens,
)
from ludic.training.loggers import TrainingLogger
from ludic.training.logprobs import token_logprobs  # noqa: F401 (re-exported)
from ludic.training.losses.base import LossInputs, check_loss
from ludic.training.packing import split_packed_microbatches
from ludic.training.sample_audit import DROPPED_BY_SOURCE, SampleAudit
from ludic.training.token_scores import (
    CausalLMParts,
    ScoringOptions,
    score_tokens,
    split_causal_lm,
)
from ludic.training.types import (
    AcknowledgingBatchSource,
    BatchSource,
    ConcurrentBatchSource,
    DataExhausted,
    EmptyBatchError,
    LedgerSource,
    SAWBatch,
    SAWItem,
    StalenessBoundedSource,
    TrainingAlgorithm,
    check_batch_source,
)
from ludic.training.varlen_attention import use_varlen_sdpa

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepTotals:
    """Normalizers over the whole optimizer step (every micro-batch)."""

    num_sequences: int
    num_action_tokens: int


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What the updates of one trainer step produced (means over its updates)."""

    loss: float
    loss_stats: dict[str, float]
    grad_norm: float
    lr: float
    num_updates: int
    num_microbatches: int
    tokens_run: int = 0
    """Positions the model ran (padding included), over every update."""


STEP_TIMES = ("time/wait_s", "time/train_s", "time/sync_s")
"""A step's wall time, in three parts: waiting for the batch, training, publishing;
``time/idle_fraction`` is the first's share."""
MAX_REJECTED_BATCHES = 16
"""Batches in a row an acknowledging source may have rejected (items the loss cannot use)
before the step fails: one is a poison pill, this many is a misconfigured producer."""
MAX_EMPTY_ASYNC_BATCHES = 8
"""How many batches in a row an asynchronous step may find empty (all stale or filtered)
before it raises ``EmptyBatchError``."""


class Trainer(HasTrainingCore):
    """Optimises ``model`` with ``algorithm.loss`` on batches from ``batch_source``.

    * ``model``: an HF-style causal LM (``model(input_ids=, attention_mask=).logits``),
      plain or peft; only parameters with ``requires_grad`` are optimised.
    * ``publisher``: receives ``published_weights(model)`` every ``publish_every`` steps:
      ``policy_state_dict`` (the default: a LoRA policy merged) or ``adapter_state_dict``
      (the adapter alone, for a vLLM server's LoRA support; ``ludic.distributed.weights``).
    * ``checkpoint``: where/how often to save; enables :meth:`resume`.
    * ``sample_filter``: ``SAWItem -> bool`` (True keeps), e.g. ``filters.drop_truncated()``.
    * ``reference_model``: frozen model for ``ref_logprobs``; required by losses with
      ``requires_ref_logprobs``.
    * ``metric_reducers``: ``stats.Reducer``s over the step's (kept) ``SAWItem``s, e.g.
      ``Reducer("success", "meta.reward", reduce="fraction", transform=lambda r: r > 0)``.
    * ``ranks``: data-parallel training over torch.distributed ranks, the policy sharded
      with FSDP2 (:mod:`ludic.training.data_parallel`): every rank builds the same
      Trainer with ``ranks=TrainerRanks.current()``; rank 0's batch source, publisher and
      loggers are the ones used (the other ranks' are ignored).

    The optimizer, schedule, step counter, checkpoints and loggers live in a
    :class:`~ludic.training.core.TrainingCore` (``trainer.core``) shared with the
    reward-model trainer; ``trainer.step``, ``.optimizer``, ``.checkpoints`` read through.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        algorithm: TrainingAlgorithm,
        batch_source: BatchSource,
        config: TrainerConfig,
        *,
        publisher: PolicyPublisher | None = None,
        checkpoint: CheckpointConfig | None = None,
        loggers: Iterable[TrainingLogger] = (),
        sample_filter: SampleFilter | None = None,
        reference_model: torch.nn.Module | None = None,
        metric_reducers: Sequence[Reducer] = (),
        ranks: TrainerRanks | None = None,
        published_weights: Callable[[torch.nn.Module], dict[str, torch.Tensor]] = (
            policy_state_dict
        ),
    ) -> None:
        _check_algorithm(algorithm)
        check_batch_source(batch_source)
        self.config = config
        self.device = torch.device(config.device)
        _seed_everything(config.seed)
        self.model = model.to(self.device)
        if config.gradient_checkpointing:
            _enable_gradient_checkpointing(self.model)
        if config.flat_parameters:
            flatten_parameters(self.model)
        self.algorithm = algorithm
        self.loss = algorithm.loss
        self.batch_source = batch_source
        self._source_kinds: dict[tuple[type, type], bool] = {}
        self.publisher = publisher
        self.published_weights = published_weights
        self.sample_filter = sample_filter
        self.audit = SampleAudit()
        """Trained against dropped items, cumulative (``ludic.training.sample_audit``)."""
        self._audit_warned = False
        self._last_logged: float | None = None  # perf_counter when the last step was logged
        self.ledger: TokenLedger | None = None
        """Where every generated token went (``ludic.training.ledger``); ``None`` until a
        batch says what was generated for it (a rollout source's do; an SFT one's not)."""
        self._ledger_base = 0  # generated before a resume (a LedgerSource counts from 0)
        # the ledger as of the last step that closed it: what a checkpoint keeps (a step
        # that fails half-way may have counted part of its batch)
        self._closed_ledger: dict[str, int] | None = None
        self.reference_model = self._prepare_reference(reference_model)
        # a group of one shards too (FSDP2 over one process: the NCCL path on one GPU)
        self.ranks = ranks
        self._varlen = self._varlen_attention()
        self._parts = self._split(self.model)
        self._reference_parts = (
            None if self.reference_model is None else self._split(self.reference_model)
        )
        self.scoring = ScoringOptions(
            logprobs=config.logprobs,
            chunk_tokens=config.logprob_chunk_tokens,
            packing=config.packing,
            row_tokens=self._packed_row_tokens(),
            # Sharded: a shared-prefix forward runs the decoder twice, a plain one once, and
            # every rank must run as many (gathering) forwards as the others.
            shared_prefix=config.shared_prefix and (ranks is None or ranks.world_size == 1),
            varlen=self._varlen,
            dtype=config.dtype,
            pad_token_id=config.pad_token_id,
        )
        self.metric_reducers = tuple(metric_reducers)
        self._scorer: ShardedScorer | None = None
        self._channel: BatchChannel | None = None
        if self.ranks is not None:
            self._scorer = shard_policy(self.model, self.scoring, self.device.type)
            self._channel = BatchChannel(self.ranks)
            # Rank 0 decides: whether weights are published, and the batch source's kind.
            self.publisher = publisher if self.ranks.is_main else None
            self._publishes = broadcast_flag(publisher is not None, self.ranks)
            concurrent = isinstance(batch_source, ConcurrentBatchSource)
            self._concurrent = broadcast_flag(concurrent, self.ranks)
            if not self.ranks.is_main:
                loggers = ()  # rank 0 logs the step (its metrics are summed over ranks)
        else:
            self._publishes = publisher is not None
            self._concurrent = isinstance(batch_source, ConcurrentBatchSource)
        self.core = TrainingCore(
            self.model,
            config,
            owner="step",
            fix_hint="Check the model weights and batch for NaN/inf, lower TrainerConfig.lr, "
            "or set TrainerConfig.max_grad_norm",
            checkpoint=checkpoint,
            loggers=loggers,
        )
        self._published_version = self.step  # the backend is assumed to serve these weights

    # ---------------------------------------------------------------- the loop
    async def train_step(self) -> dict[str, float]:
        """One trainer step; returns (and logs) its metrics.

        Once its batch is in hand, the step runs to its end (log and checkpoint included)
        even if the caller is cancelled meanwhile (Ctrl-C): the cancellation is raised
        after it, so the weights never get ahead of the metrics and checkpoints."""
        self._announce_version()  # idempotent; the first call sets the source's base
        t_start = time.perf_counter()
        batch, raw_batches, selection = await self._next_batch()
        waited = time.perf_counter() - t_start
        if self._last_logged is None:
            self._last_logged = t_start
        finish = asyncio.ensure_future(self._finish_step(batch, raw_batches, selection, waited))
        try:
            return await asyncio.shield(finish)
        except asyncio.CancelledError:
            await asyncio.wait([finish])
            raise

    async def _finish_step(
        self,
        batch: SAWBatch,
        raw_batches: list[SAWBatch],
        selection: Mapping[str, float],
        waited: float,
    ) -> dict[str, float]:
        t_batch = time.perf_counter()
        if self._concurrent:  # generation lives on the event loop: train off it
            result = await asyncio.to_thread(self._optimize, batch)
        else:  # one compute thread for sampling and training: see on_compute_thread
            result = await on_compute_thread(self._optimize_with_threads, batch)
        t_compute = time.perf_counter()
        self.step += 1
        if self._publishes and self.core.is_due(self.config.publish_every):
            if self._concurrent:
                await asyncio.to_thread(self.publish_policy)
            else:
                await on_compute_thread(self.publish_policy)
        self._announce_version()
        timing = {
            "time/wait_s": waited,  # for the batch: what generation cost the trainer
            "time/train_s": t_compute - t_batch,
            "time/sync_s": time.perf_counter() - t_compute,  # the publish (weight sync)
        }
        # how long the step's batches took to generate (in async mode, while it trained)
        made = [b.meta[GENERATE_S] for b in raw_batches if _is_number(b.meta.get(GENERATE_S))]
        if made:
            timing["time/generate_s"] = float(sum(made))
        timing["time/idle_fraction"] = waited / max(sum(timing[k] for k in STEP_TIMES), 1e-9)
        for stage, seconds in take_stage_seconds().items():
            timing[f"time/stage/{stage}_s"] = seconds
        no_reward = [i for i in batch.items if i.meta.get("reward_dropped")]
        self.audit.add(no_reward, dropped=True)  # trained with weight 0
        self.audit.add((i for i in batch.items if not i.meta.get("reward_dropped")), dropped=False)
        if self.ranks is None or self.ranks.is_main:  # the rank that saw the batches made
            self._close_ledger(batch.items, no_reward)
        metrics = self._metrics(batch, result, selection, timing)
        now = time.perf_counter()
        # the wall time since the previous step's metrics (the first: since its wait began):
        # its parts above, plus what ran between steps (hooks, evaluations, checkpoints)
        metrics["time/step_s"] = now - (self._last_logged if self._last_logged is not None else now)
        self._last_logged = now
        with timed("logging"):
            self.logger.log(self.step, metrics)
        if not self._audit_warned and (warning := self.audit.warning()) is not None:
            self._audit_warned = True  # once per run: the metrics keep the figures
            log.warning("step %d: %s", self.step, warning)
        if self._source_is(AcknowledgingBatchSource):  # a Redis learner's acks
            for raw in raw_batches:
                self.batch_source.mark_trained(raw)
        # After the log: a checkpoint never gets ahead of its step's metrics line.
        with timed("checkpoint"):
            checkpointed = self.core.maybe_checkpoint(self._checkpoint_extra) is not None
        if checkpointed:
            self._checkpointed()
        return metrics

    async def train(self, num_steps: int) -> list[dict[str, float]]:
        """Run ``num_steps`` optimizer steps, or fewer if the batch source raises
        :class:`DataExhausted`; returns each completed step's metrics."""
        history: list[dict[str, float]] = []
        for _ in range(num_steps):
            try:
                history.append(await self.train_step())
            except DataExhausted:
                break
        return history

    async def train_async(self, num_steps: int) -> list[dict[str, float]]:
        """:meth:`train` with generation running concurrently (asynchronous RL).

        The batch source must be asynchronous, e.g.
        ``AsyncBatchSource(RolloutBatchSource(...), max_staleness=2)``; it is closed (its
        generation cancelled) when training ends, however it ends."""
        if not self._source_is(ConcurrentBatchSource):
            raise TypeError(
                f"Trainer.train_async needs an asynchronous batch source, got "
                f"{type(self.batch_source).__name__}; wrap it: AsyncBatchSource(source, "
                "max_staleness=N) (ludic.training.batching.async_source)"
            )
        try:
            history = await self.train(num_steps)
        finally:
            await self.close_source()
        self.settle_ledger()
        return history

    async def close_source(self) -> None:
        """Close an asynchronous batch source: its generation cancelled (what it made and
        did not hand out stays counted, for :meth:`settle_ledger`)."""
        if self._source_is(ConcurrentBatchSource):
            await self.batch_source.aclose()

    def settle_ledger(self) -> None:
        """The end of training, once nothing more is made: what was made and never handed
        out counts as aborted (``TokenLedger.settle``), and the ledger must still close."""
        if self.ledger is None or (self.ranks is not None and not self.ranks.is_main):
            return
        if self._source_is(LedgerSource):
            generated, in_flight = self.batch_source.ledger_totals()
            self.ledger.generated = self._ledger_base + generated
            self.ledger.in_flight = in_flight
        self.ledger.settle()
        self.ledger.check(self.step)
        self._closed_ledger = self.ledger.state()

    def train_async_sync(self, num_steps: int) -> list[dict[str, float]]:
        """:meth:`train_async` for scripts without an event loop."""
        return _run_outside_loop(self.train_async(num_steps), "train_async_sync", "train_async")

    def train_sync(self, num_steps: int) -> list[dict[str, float]]:
        """:meth:`train` for scripts without an event loop."""
        return _run_outside_loop(self.train(num_steps), "train_sync", "train")

    # ---------------------------------------------------------------- stages
    async def _next_batch(self) -> tuple[SAWBatch, list[SAWBatch], dict[str, float]]:
        """The step's batch after filtering and staleness, with the raw batches it came from
        and the selection metrics. With ``ranks``, rank 0 makes it and broadcasts it; the
        other ranks receive it (and raise what rank 0's source raised)."""
        if self.ranks is None:
            return await self._select_batch()
        assert self._channel is not None
        if not self.ranks.is_main:
            batch = await asyncio.to_thread(self._channel.receive)
            return batch, [], {}
        try:
            batch, raw_batches, selection = await self._select_batch()
            payload = self._channel.encode(batch)  # a batch the wire refuses ends the step too
        except BaseException as error:
            await asyncio.to_thread(self._channel.send_end, error)
            raise
        await asyncio.to_thread(self._channel.send_payload, payload)
        return batch, raw_batches, selection

    async def _select_batch(self) -> tuple[SAWBatch, list[SAWBatch], dict[str, float]]:
        """:meth:`_next_batch` from the batch source. An asynchronous source is asked again
        (up to :data:`MAX_EMPTY_ASYNC_BATCHES` times) when every item of a batch was
        dropped."""
        raw_batches: list[SAWBatch] = []
        dropped = {"dropped/filter": 0, "dropped/stale": 0}
        attempts = MAX_EMPTY_ASYNC_BATCHES if self._concurrent else 1
        rejecting = self._source_is(AcknowledgingBatchSource)
        rejected = 0
        while len(raw_batches) < attempts and rejected < MAX_REJECTED_BATCHES:
            raw = await self.batch_source.next_batch()
            fresh = self._select_items(raw, dropped)
            if not fresh:
                raw_batches.append(raw)
                continue
            batch = SAWBatch(items=fresh, meta=raw.meta)
            if self.algorithm.preprocess is not None:  # a baseline over the kept items
                batch = self.algorithm.preprocess(batch)
            problem = self._loss_input_problem(batch.items)
            if problem is None:
                raw_batches.append(raw)
                return batch, raw_batches, {**dropped, **self._staleness(batch.items)}
            if not rejecting:
                raise ValueError(problem)
            # a batch from another process (a Redis learner's): set it aside, never crash
            # on it again after a restart, and train on the next one
            log.error("step %d: batch rejected: %s", self.step + 1, problem)
            if self.ledger is not None:
                self.ledger.dropped_filter += _tokens(fresh)
            await asyncio.to_thread(self.batch_source.reject, raw, problem)
            rejected += 1
        if rejected >= MAX_REJECTED_BATCHES:
            raise EmptyBatchError(
                f"step {self.step + 1}: {rejected} batches in a row rejected (the last: "
                f"{problem}); they are set aside, but the producers keep making such batches: "
                "check their sampling settings against the loss"
            )
        received = sum(len(b.items) for b in raw_batches)
        what = (
            f"batch of {received} items is"
            if len(raw_batches) == 1
            else f"{len(raw_batches)} batches in a row ({received} items) are"
        )
        raise EmptyBatchError(
            f"step {self.step + 1}: {what} empty after {dropped['dropped/filter']} dropped by "
            "sample_filter and "
            f"{dropped['dropped/stale']} stale (a token older than version {self.step} - "
            f"max_staleness={self.max_staleness}); loosen the filter, raise "
            "TrainerConfig.max_staleness (or the batch source's), or check the batch source"
        )

    def _select_items(self, batch: SAWBatch, dropped: dict[str, int]) -> list[SAWItem]:
        kept = [i for i in batch.items if self.sample_filter is None or self.sample_filter(i)]
        fresh = [i for i in kept if not self._is_stale(i)]
        dropped["dropped/filter"] += len(batch.items) - len(kept)
        dropped["dropped/stale"] += len(kept) - len(fresh)
        if len(fresh) < len(batch.items):
            chosen = {id(i) for i in fresh}
            self.audit.add((i for i in batch.items if id(i) not in chosen), dropped=True)
        if isinstance(by_source := batch.meta.get(DROPPED_BY_SOURCE), Mapping):
            self.audit.add_dropped_totals(by_source)
        if self._account_source(batch):
            assert self.ledger is not None
            self.ledger.dropped_filter += _tokens(batch.items) - _tokens(kept)
            self.ledger.dropped_stale += _tokens(kept) - _tokens(fresh)
        return fresh

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
            source = self.batch_source
            if isinstance(source, LedgerSource) and source.ledger_run_wide:
                # a ledger from here on: what checkpoints of earlier learners accounted
                # for (none of which this Trainer resumed) is not in it
                self._ledger_base = -source.ledger_committed_before
        self.ledger.add_source_part(tokens)
        if not self._source_is(LedgerSource):
            self.ledger.generated += tokens[GENERATED]
        return True

    def _close_ledger(self, items: Sequence[SAWItem], no_reward: Sequence[SAWItem]) -> None:
        """The step's trained tokens and those of ``no_reward`` (reward failed), the
        source's totals, and the check that the ledger closes."""
        ledger = self.ledger
        if ledger is None:
            return
        ledger.dropped_reward += _tokens(no_reward)
        ledger.trained += _tokens(items) - _tokens(no_reward)
        if self._source_is(LedgerSource):
            generated, in_flight = self.batch_source.ledger_totals()
            ledger.generated, ledger.in_flight = self._ledger_base + generated, in_flight
        ledger.check(self.step)
        self._closed_ledger = ledger.state()

    @property
    def max_staleness(self) -> int | None:
        """The oldest token version trained on is ``step - max_staleness``: the smaller of
        ``TrainerConfig.max_staleness`` and the batch source's (``None``: no
        bound)."""
        source = self.batch_source
        bounds = [
            self.config.max_staleness,
            source.max_staleness if self._source_is(StalenessBoundedSource) else None,
        ]
        known = [b for b in bounds if b is not None]
        return min(known) if known else None

    def _is_stale(self, item: SAWItem) -> bool:
        bound, version = self.max_staleness, item.policy_version
        return bound is not None and version is not None and version < self.step - bound

    def _staleness(self, items: Sequence[SAWItem]) -> dict[str, float]:
        """Staleness = current version - the item's oldest token version, over the items
        with known versions; and the largest number of updates one item straddles."""
        ages = [self.step - i.policy_version for i in items if i.policy_version is not None]
        if not ages:
            return {}
        return {
            "staleness/mean": statistics.fmean(ages),
            "staleness/max": float(max(ages)),
            "staleness/version_span_max": float(max(i.version_span for i in items)),
        }

    def _loss_input_problem(self, items: Sequence[SAWItem]) -> str | None:
        """Why the loss cannot train on ``items`` (``None``: it can)."""
        if not self.loss.requires_old_logprobs:
            return None
        missing = [item for item in items if item.old_logprobs is None]
        if not missing:
            return None
        rollout_ids = [item.meta.get("rollout_id") for item in missing[:3]]
        return (
            f"{type(self.loss).__name__} requires old_logprobs, but {len(missing)} of "
            f"{len(items)} items have none (rollouts {rollout_ids}); request behaviour "
            "logprobs with InferenceSpec(returns=ReturnSpec.for_rl())"
        )

    def _optimize_with_threads(self, batch: SAWBatch) -> StepResult:
        """:meth:`_optimize` with torch's threads at ``config.update_threads`` (sync: the
        event loop waits for the update, and bigger ops than sampling's gain from them)."""
        threads = self.config.update_threads
        before = torch.get_num_threads()
        if threads is None or threads == before:
            return self._optimize(batch)
        torch.set_num_threads(threads)
        try:
            return self._optimize(batch)
        finally:
            torch.set_num_threads(before)

    def _optimize(self, batch: SAWBatch) -> StepResult:
        """Every update of one trainer step: ``ppo_epochs`` passes of ``num_minibatches``
        mini-batches, each its own optimizer update with its own normalizers."""
        lr = self.core.lr
        passes = [self._minibatches(batch.items, epoch) for epoch in range(self.config.ppo_epochs)]
        updates = [mb for minibatches in passes for mb in minibatches]
        shares = self._shares(batch.items)
        mine = [item for item in batch.items if id(item) in shares[self._rank]]
        filler = [batch.items[0]]  # a padding micro-batch (every rank holds the batch)
        proximal = self._proximal_logprobs(batch.items, shares) if len(updates) > 1 else None
        reference = self._reference_logprobs(mine)
        losses, norms, stats = [], [], dict[str, float]()
        num_microbatches = tokens_run = 0
        for u, items in enumerate(updates):
            totals = StepTotals(  # over the whole mini-batch, on every rank
                num_sequences=len(items),
                num_action_tokens=sum(item.num_action_tokens for item in items),
            )
            microbatches, padding = self._my_microbatches(items, shares)
            loss, loss_stats, run = self._accumulate_gradients(
                microbatches, totals, proximal, reference, padding=[filler] * padding
            )
            ran = len(microbatches)
            if self.ranks is not None:  # each rank ran its share: sum the shares
                loss, loss_stats, run, ran = self._summed_over_ranks(loss, loss_stats, run, ran)
            norms.append(self.core.optimizer_step(schedule=u == len(updates) - 1))
            losses.append(loss)
            num_microbatches += ran
            tokens_run += run
            for key, value in loss_stats.items():
                stats[key] = stats.get(key, 0.0) + value / len(updates)
        return StepResult(
            loss=statistics.fmean(losses),
            loss_stats=stats,
            grad_norm=statistics.fmean(norms),
            lr=lr,
            num_updates=len(updates),
            num_microbatches=num_microbatches,
            tokens_run=tokens_run,
        )

    @property
    def _rank(self) -> int:
        return 0 if self.ranks is None else self.ranks.rank

    def _shares(self, items: Sequence[SAWItem]) -> list[set[int]]:
        """``id`` s of the step's items each rank trains on (every item on one rank without
        ``ranks``); the same split on every rank, fixed for the whole step."""
        if self.ranks is None:
            return [{id(item) for item in items}]
        split = split_items(items, self.ranks.world_size)
        return [{id(items[i]) for i in share} for share in split]

    def _my_microbatches(
        self, items: Sequence[SAWItem], shares: Sequence[set[int]]
    ) -> tuple[list[list[SAWItem]], int]:
        """This rank's micro-batches of the mini-batch ``items``, and how many *padding*
        micro-batches it must run after them so that every rank runs as many as the
        busiest (FSDP2 gathers weights in every forward: a collective)."""
        per_rank = [self._microbatches([i for i in items if id(i) in share]) for share in shares]
        local = per_rank[self._rank]
        return local, max(len(m) for m in per_rank) - len(local)

    @staticmethod
    def _summed_over_ranks(
        loss: float, stats: Mapping[str, float], tokens_run: int, microbatches: int
    ) -> tuple[float, dict[str, float], int, int]:
        """The update's loss, stats, positions run and (real) micro-batches, summed over
        ranks (a collective)."""
        keys = sorted(stats)  # the same on every rank: padding micro-batches add their keys
        counts = [loss, float(tokens_run), float(microbatches)]
        total = all_reduce_sum([*counts, *(stats[k] for k in keys)])
        stats_sum = dict(zip(keys, total[3:], strict=True))
        return total[0], stats_sum, int(total[1]), int(total[2])

    def _microbatches(self, items: Sequence[SAWItem]) -> list[list[SAWItem]]:
        """Padded micro-batches (``B * T_max`` within the budget), or with ``packing``
        packed ones (``R * L`` within it)."""
        budget = self.config.max_tokens_per_microbatch
        if not self.config.packing:
            return split_microbatches(items, budget)
        require_fits(items, budget)
        lengths = [item.num_tokens for item in items]
        groups = split_packed_microbatches(lengths, budget, self.scoring.row_tokens)
        return [[items[i] for i in group] for group in groups]

    def _minibatches(self, items: Sequence[SAWItem], epoch: int) -> list[list[SAWItem]]:
        n = min(self.config.num_minibatches, len(items))
        if n <= 1:
            return [list(items)]
        gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.step * 1009 + epoch)
        order = torch.randperm(len(items), generator=gen).tolist()
        return [[items[i] for i in order[k::n]] for k in range(n)]

    def _proximal_logprobs(
        self, items: Sequence[SAWItem], shares: Sequence[set[int]] | None = None
    ) -> dict[int, torch.Tensor] | None:
        """pi_prox: each item's next-token logprobs [T-1] under the weights at the start of
        the step (no grad), for losses with ``requires_proximal_logprobs`` (decoupled PPO,
        truncated importance sampling) when the step makes several updates (with one, the
        update's own forward gives them); keyed by ``id(item)``. With ``ranks``, for this
        rank's share of ``items`` only (``shares``), padded to the busiest rank's forwards."""
        if not self.loss.requires_proximal_logprobs:
            return None
        self.model.train()  # the mode of the gradient forward (dropout alike)
        shares = shares or self._shares(items)
        local, missing = self._my_microbatches(items, shares)
        mine = [item for mb in local for item in mb]
        padding = [[items[0]]] * missing
        return self._logprobs_without_grad(
            self.model, self._parts, mine, self.device, padding=padding
        )

    def _reference_logprobs(self, items: Sequence[SAWItem]) -> dict[int, torch.Tensor] | None:
        """The reference model's next-token logprobs [T-1] per item (no grad, on
        ``reference_device``), once per step for every update; keyed by ``id(item)``."""
        if self.reference_model is None or not self.loss.requires_ref_logprobs:
            return None
        device = torch.device(self.config.reference_device or self.config.device)
        return self._logprobs_without_grad(
            self.reference_model, self._reference_parts, items, device
        )

    def _logprobs_without_grad(
        self,
        model: torch.nn.Module,
        parts: CausalLMParts | None,
        items: Sequence[SAWItem],
        device: torch.device,
        *,
        padding: Sequence[list[SAWItem]] = (),
    ) -> dict[int, torch.Tensor]:
        """Next-token logprobs per item (keyed by ``id``); then forwards of the ``padding``
        micro-batches, whose results are dropped (while another rank's items keep the
        sharded policy busy)."""
        out: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for mb_items in self._microbatches(items):
                mb = collate(mb_items, self.config.pad_token_id, device)
                logprobs = self._score(model, mb, parts)[0].to(self.device)
                for row, item in enumerate(mb_items):
                    out[id(item)] = logprobs[row, : item.num_tokens - 1]
            for mb_items in padding:
                self._score(model, collate(mb_items, self.config.pad_token_id, device), parts)
        return out

    def _score(
        self,
        model: torch.nn.Module,
        mb: CollatedBatch,
        parts: CausalLMParts | None,
        *,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """``(logprobs, entropy, tokens_run)`` of ``mb`` under ``model`` (the policy through
        its FSDP2 root unit when sharded)."""
        if model is self.model and self._scorer is not None:
            return self._scorer(mb, with_entropy)
        scores = score_tokens(model, mb, self.scoring, with_entropy=with_entropy, parts=parts)
        return scores.logprobs, scores.entropy, scores.tokens_run

    def _accumulate_gradients(
        self,
        microbatches: list[list[SAWItem]],
        totals: StepTotals,
        proximal: Mapping[int, torch.Tensor] | None = None,
        reference: Mapping[int, torch.Tensor] | None = None,
        *,
        padding: Sequence[list[SAWItem]] = (),
    ) -> tuple[float, dict[str, float], int]:
        """Forward + loss + backward per micro-batch.

        Returns the update's loss (the sum over micro-batches, which equals the full-batch
        loss because the normalizers are global), the loss stats, averaged over
        micro-batches with weights = their share of action tokens (a stat named
        ``"loss"`` is left out: the summed loss is the authoritative value), and the
        positions the model ran. The ``padding`` micro-batches run last with their loss
        times 0: they add nothing but keep this rank's collectives in step with the
        busiest rank's (data-parallel training).
        """
        self.model.train()
        total_loss, stats, tokens_run = 0.0, dict[str, float](), 0
        runs = [(items, False) for items in microbatches] + [(i, True) for i in padding]
        for items, is_padding in runs:
            mb = collate(items, self.config.pad_token_id, self.device)
            logprobs, entropy, run = self._score(self.model, mb, self._parts, with_entropy=True)
            if is_padding:  # stand-ins for what only the item's own rank holds
                proximal_rows = reference_rows = logprobs.detach()
            else:
                proximal_rows = None if proximal is None else _rows(proximal, items, mb)
                reference_rows = None if reference is None else _rows(reference, items, mb)
            inputs = self._loss_inputs(mb, logprobs, entropy, totals, proximal_rows, reference_rows)
            out = self.loss(inputs)
            value = float(out.loss.detach())
            if not math.isfinite(value):
                self.core.abort_step(f"loss is {value}")
            share = 0.0 if is_padding else mb.num_action_tokens / max(totals.num_action_tokens, 1)
            (out.loss * 0.0 if is_padding else out.loss).backward()
            total_loss += 0.0 if is_padding else value
            tokens_run += 0 if is_padding else run
            for key, stat in out.stats.items():
                if key != "loss":
                    stats[key] = stats.get(key, 0.0) + share * float(stat)
            assert entropy is not None
            mean_entropy = float(entropy.detach().sum()) / max(mb.num_action_tokens, 1)
            stats[ENTROPY_STAT] = stats.get(ENTROPY_STAT, 0.0) + share * mean_entropy
        return total_loss, stats, tokens_run

    def _loss_inputs(
        self,
        mb: CollatedBatch,
        logprobs: torch.Tensor,
        entropy: torch.Tensor | None,
        totals: StepTotals,
        proximal: torch.Tensor | None = None,
        reference: torch.Tensor | None = None,
    ) -> LossInputs:
        """``logprobs`` [B, T-1] (0.0 off the action mask) and, as the loss needs them,
        pi_prox (``proximal``, laid out as ``logprobs``), the reference's logprobs and the
        entropy."""
        extra: dict[str, Any] = {}
        if self.loss.requires_proximal_logprobs:
            # One update per step: the weights at its start are the ones of this forward.
            extra["proximal_logprobs"] = logprobs.detach() if proximal is None else proximal
        if reference is not None and self.loss.requires_ref_logprobs:
            extra["ref_logprobs"] = reference
        if self.loss.requires_entropy:
            extra["entropy"] = entropy
        return LossInputs(
            logprobs=logprobs,
            action_mask=mb.action_mask,
            weights=mb.weights,
            num_sequences=totals.num_sequences,
            num_action_tokens=totals.num_action_tokens,
            old_logprobs=mb.old_logprobs,
            action_versions=mb.action_versions,
            **extra,
        )

    def _split(self, model: torch.nn.Module) -> CausalLMParts | None:
        """The decoder and output head of ``model`` for chunked logprobs (checked here, at
        construction, so an unsupported model fails before the first step)."""
        return split_causal_lm(model) if self.config.logprobs == "chunked" else None

    def _varlen_attention(self) -> bool:
        """With packing: whether the policy's attention runs per sequence over one packed
        row (flash-attention's varlen kernel; sdpa, switched to
        :data:`~ludic.training.varlen_attention.VARLEN_SDPA`, which computes the same)."""
        if not self.config.packing:
            return False
        config = getattr(self.model, "config", None)
        implementation = str(getattr(config, "_attn_implementation", "") or "")
        if self.reference_model is not None:  # it runs the same packed rows
            use_varlen_sdpa(self.reference_model)
        return implementation.startswith("flash") or use_varlen_sdpa(self.model)

    def _packed_row_tokens(self) -> int | None:
        """One row of the whole budget when attention runs per sequence (varlen), else
        rows as long as the micro-batch's longest sequence (eager's dense mask costs
        ``row_len^2`` per row)."""
        return self.config.max_tokens_per_microbatch if self._varlen else None

    # ---------------------------------------------------------------- sync, save, log
    def publish_policy(self) -> None:
        """Publish the current weights as version ``step`` (also useful after resume).
        With ``ranks``, every rank must call it: the sharded weights are gathered on rank 0
        (one collective per tensor, every rank in the same order), which then publishes
        them like a single process (so a publisher may push to several servers at once)."""
        if not self._publishes:
            raise ValueError("Trainer has no publisher; pass Trainer(publisher=...)")
        state = self.published_weights(self.model)
        if self.ranks is None:
            assert self.publisher is not None
            self.publisher.publish(state, version=self.step)
        elif self.publisher is not None:  # rank 0: the full weights, then any publisher
            self.publisher.publish(gathered(state), version=self.step)
        else:  # another rank: join rank 0's gathers, in the same order
            gather_full_tensors(state)
        self._published_version = self.step

    def _source_is(self, kind: type) -> bool:
        """``isinstance(self.batch_source, kind)``, kept per source type and kind: the
        check of a runtime-checkable ``Protocol`` looks up each of its members on every
        call, and the trainer asks several times a step (once per item for staleness)."""
        key = (type(self.batch_source), kind)
        known = self._source_kinds.get(key)
        if known is None:
            known = self._source_kinds[key] = isinstance(self.batch_source, kind)
        return known

    def _announce_version(self) -> None:
        """Tell the batch source (``on_policy_version``) the newest version the inference
        side serves: the last published one (the step itself without a publisher)."""
        if self._source_is(ConcurrentBatchSource):
            version = self.step if not self._publishes else self._published_version
            self.batch_source.on_policy_version(version)

    def save_checkpoint(self) -> Path:
        with timed("checkpoint"):
            path = self.core.save_checkpoint(self._checkpoint_extra())
        self._checkpointed()
        return path

    def _checkpointed(self) -> None:
        """A checkpoint of this step is on disk: tell an acknowledging source."""
        main = self.ranks is None or self.ranks.is_main  # the rank whose source hands out
        if main and self._source_is(AcknowledgingBatchSource):
            self.batch_source.on_checkpoint(self.step)

    def _checkpoint_extra(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm.name,
            "config": dataclasses.asdict(self.config),
            "sample_audit": self.audit.state(),
            "token_ledger": self._closed_ledger,
        }

    def resume(self, path: str | Path | None = None) -> int:
        """Restore model, optimizer, schedule, RNGs, ``step`` and the sample audit from
        ``path`` (default: the latest checkpoint). Returns the restored step."""
        loaded = self.core.resume(path)
        self.audit = SampleAudit.from_state(loaded.extra.get("sample_audit"))
        state = loaded.extra.get("token_ledger")
        run_wide = self._source_is(LedgerSource) and self.batch_source.ledger_run_wide
        self.ledger = None if state is None else TokenLedger.resumed(state, in_flight_kept=run_wide)
        self._ledger_base = 0 if self.ledger is None or run_wide else self.ledger.generated
        self._closed_ledger = None if self.ledger is None else self.ledger.state()
        return loaded.step

    def _metrics(
        self,
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
            **{f"batch/{k}": float(v) for k, v in batch.meta.items() if _is_number(v)},
            **self.audit.metrics(),
            **({} if self.ledger is None else self.ledger.metrics()),
            "policy_version": self.step,
        }
        if result.num_updates > 1:
            metrics["num_updates"] = result.num_updates
        metrics.update(aggregate_stats(self.metric_reducers, items))
        return metrics

    def _prepare_reference(self, model: torch.nn.Module | None) -> torch.nn.Module | None:
        if model is None:
            if self.loss.requires_ref_logprobs:
                raise ValueError(
                    f"{type(self.loss).__name__} requires ref_logprobs; pass "
                    "Trainer(reference_model=...) (a frozen copy of the initial policy)"
                )
            return None
        model = model.to(self.config.reference_device or self.device).eval()
        model.requires_grad_(False)
        return model


def _reward_stats(items: Sequence[SAWItem]) -> dict[str, float]:
    rewards = [float(i.meta["reward"]) for i in items if _is_number(i.meta.get("reward"))]
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


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _run_outside_loop(coro: Any, name: str, async_name: str) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError(
        f"Trainer.{name}() was called inside a running event loop; use "
        f"`await trainer.{async_name}(num_steps)` there"
    )


ENTROPY_STAT = "_token_entropy"
"""The trainer's own stat in a step's loss stats, logged as ``entropy``."""


def _rows(
    values: Mapping[int, torch.Tensor], items: Sequence[SAWItem], mb: CollatedBatch
) -> torch.Tensor:
    """Per-item logprobs [T_i - 1] (keyed by ``id(item)``) laid out as ``[B, T-1]``, 0.0
    off the action mask (as ``old_logprobs``)."""
    dtype = next(iter(values.values())).dtype if values else mb.action_mask.dtype
    rows = mb.action_mask.new_zeros(mb.action_mask.shape, dtype=dtype)
    for row, item in enumerate(items):
        value = values[id(item)]
        rows[row, : value.shape[0]] = value
    return rows * mb.action_mask


def _enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError(
            f"TrainerConfig.gradient_checkpointing=True but {type(model).__name__} has no "
            "gradient_checkpointing_enable() (a Hugging Face model has); set it to False"
        )
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _check_algorithm(algorithm: object) -> None:
    """``algorithm`` is a :class:`TrainingAlgorithm` with a whole :class:`Loss`."""
    if not isinstance(algorithm, TrainingAlgorithm):
        raise TypeError(
            f"Trainer(algorithm=) needs name, loss and preprocess (a TrainingAlgorithm), got "
            f"{type(algorithm).__name__}; pass an RLAlgorithm (e.g. make_grpo())"
        )
    check_loss(algorithm.loss, "Trainer")
    if algorithm.preprocess is not None and not callable(algorithm.preprocess):
        raise TypeError(
            f"Trainer: algorithm {algorithm.name!r} has preprocess={algorithm.preprocess!r}, "
            "which is not callable; pass a function SAWBatch -> SAWBatch or None"
        )
