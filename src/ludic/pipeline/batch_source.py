"""Both ends of the pipeline's queue: :func:`run_pipeline_actor`, :class:`PipelineBatchSource`.

An actor (unique ``actor_id``) claims a global batch index, waits for admission
(``ludic.training.staleness.may_start``, counted in finished batch indices), makes the batch
with any ``BatchSource`` and pushes it, blocking while the queue is full. The learner's
``PipelineBatchSource`` is the Trainer's ``BatchSource``: it requeues what a crashed learner
held, decodes batches (bad ones to ``P:dead``), drops stale items (``is_too_stale``; all stale:
``P:dropped``) and acknowledges each batch in ``mark_trained`` (version += 1), committed at the
next checkpoint. Versions, resumes, lost versions and the Trainer's own bound: docs/async.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from ludic.pipeline.redis_queue import PushStopped, RedisBatchQueue, RunFinishedError
from ludic.pipeline.redis_tokens import (
    commit_accounted,
    mark_accounted,
    queued_tokens,
    resume_accounting,
    token_totals,
)
from ludic.training.batching.wire import (
    Producer,
    WireBatch,
    WireFormatError,
    decode_batch,
    encode_batch,
)
from ludic.training.ledger import ABORTED, DROPPED_STALE, GENERATED, SOURCE_KEYS, batch_tokens
from ludic.training.sample_audit import DROPPED_BY_SOURCE, SampleAudit
from ludic.training.staleness import is_too_stale, may_start
from ludic.training.types import BatchSource, DataExhausted, SAWBatch, SAWItem

__all__ = [
    "META_ACTOR_ID",
    "META_BATCH_ID",
    "AdmissionTimeoutError",
    "PipelineBatchSource",
    "run_pipeline_actor",
]

log = logging.getLogger(__name__)

META_BATCH_ID = "pipeline_batch_id"
META_ACTOR_ID = "pipeline_actor_id"


class AdmissionTimeoutError(TimeoutError):
    """An actor waited longer than ``admission_timeout_s`` for the learner to catch up."""


class StopFlag(Protocol):
    """``asyncio.Event``, ``threading.Event`` or anything with ``is_set()``."""

    def is_set(self) -> bool: ...


@dataclass(frozen=True)
class _InFlight:
    producer: Producer
    num_items: int
    dropped_items: int

    def record(self, version: int) -> dict[str, int | str]:
        """The batch's record for the queue (``P:trained``, ``P:dropped``)."""
        return {
            "actor_id": self.producer.actor_id,
            "batch_index": self.producer.batch_index,
            "version": version,
            "num_items": self.num_items,
            "dropped_items": self.dropped_items,
        }


# ------------------------------------------------------------------------------- learner
class PipelineBatchSource:
    """Learner side: a ``BatchSource`` that takes batches from a :class:`RedisBatchQueue`.

    * ``max_staleness``: drop items older than ``version - max_staleness`` (``None``: keep
      all). Written to ``P:max_staleness`` so actors can check they use the same value.
    * ``batch_timeout_s``: ``next_batch`` raises ``TimeoutError`` after this long without
      a batch (it never blocks forever), or ``DataExhausted`` once producers closed the
      queue and it is empty.
    * ``version``: the learner's policy version to start from; default ``P:version``
      (0 on a fresh prefix).

    Call :meth:`mark_trained` with each batch after its optimizer step; until then the
    batch stays in the learner's processing list and a crash puts it back in the queue.
    ``last_batch`` is the latest batch handed out.
    """

    def __init__(
        self,
        queue: RedisBatchQueue,
        *,
        max_staleness: int | None,
        batch_timeout_s: float = 600.0,
        version: int | None = None,
    ) -> None:
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(
                f"PipelineBatchSource: max_staleness must be >= 0 or None, got {max_staleness}"
            )
        self.queue = queue
        self.max_staleness = max_staleness
        self.batch_timeout_s = batch_timeout_s
        self._version = version
        self._started = False
        self._in_flight: dict[str, _InFlight] = {}
        self.last_batch: SAWBatch | None = None
        # the token ledger of batches dropped whole (all stale or undecodable) and of
        # batches a crash left unaccounted for, carried into the next one handed out
        self._carried = dict.fromkeys(SOURCE_KEYS, 0)
        self._carried_ids: list[str] = []
        self._carried_audit: dict[str, float] = {}  # the stale items' totals, likewise

    @property
    def version(self) -> int:
        """The learner's policy version (starts the source on first use)."""
        self._start()
        assert self._version is not None
        return self._version

    def set_version(self, version: int) -> None:
        """Set the policy version (e.g. ``trainer.step`` after a resume) here and in Redis.
        Called first, it also says what the learner's state holds: batches trained to a
        newer version (after its checkpoint) are trained again."""
        self._start(version)
        self.queue.set_version(version)
        self._version = version

    def _start(self, version: int | None = None) -> None:
        if self._started:
            return
        if version is not None:
            self._version = version
        elif self._version is None:
            self._version = self.queue.version() or 0
        requeued = self.queue.requeue_unacked(committed_version=self._version)
        if requeued:
            log.warning(
                "learner %r: %d batch(es) taken or trained after version %d by an earlier "
                "run went back to the queue, to be trained once from here",
                self.queue.learner_id,
                requeued,
                self._version,
            )
        orphans = resume_accounting(self.queue, self._version)
        if orphans:
            log.warning(
                "learner %r: %d batch(es) dropped or set aside after version %d by an earlier "
                "run: their %d tokens count as aborted",
                self.queue.learner_id,
                len(orphans),
                self._version,
                sum(orphans.values()),
            )
            self._carry_aborted(orphans)
        generated, pending = token_totals(self.queue)  # nothing accounted for in this run yet
        self.ledger_committed_before = generated - pending
        self.queue.set_version(self._version)
        self.queue.set_max_staleness(self.max_staleness)
        self._started = True

    def _carry_aborted(self, tokens: dict[str, int]) -> None:
        """Batches whose tokens were generated and will never be trained on: counted as
        aborted by the step of the next batch handed out."""
        self._carried[GENERATED] += sum(tokens.values())
        self._carried[ABORTED] += sum(tokens.values())
        self._carried_ids.extend(tokens)

    ledger_run_wide = True  # the actors' counts in Redis, across learner restarts
    ledger_committed_before = 0
    """Tokens of the batches that checkpoints before this learner started accounted for
    (set when the source starts)."""

    def ledger_totals(self) -> tuple[int, int]:
        """(completion tokens every actor of the run pushed, of them those in batches no
        learner step has accounted for): see :mod:`ludic.pipeline.redis_tokens`."""
        self._start()
        return token_totals(self.queue)

    async def next_batch(self) -> SAWBatch:
        with interrupt_on_cancel(self.queue):
            return await self._next_batch()

    async def _next_batch(self) -> SAWBatch:
        await asyncio.to_thread(self._start)
        deadline = time.monotonic() + self.batch_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            taken = await asyncio.to_thread(self.queue.take, max(remaining, 0.0))
            if taken is None:
                if await asyncio.to_thread(self.queue.is_closed):
                    raise DataExhausted(
                        f"pipeline {self.queue.keys.prefix}: producers are done and the "
                        "queue is empty"
                    )
                raise TimeoutError(
                    f"no batch in {self.queue.keys.queue} for {self.batch_timeout_s:g}s: "
                    "are actors running on this prefix (and admitted: see max_staleness)?"
                )
            try:
                wire = decode_batch(taken.payload or b"")
                if wire.producer.batch_id != taken.batch_id:
                    raise WireFormatError(
                        f"payload says batch {wire.producer.batch_id!r} but was queued as "
                        f"{taken.batch_id!r}"
                    )
            except WireFormatError as err:
                log.error("rejected batch %s (moved to dead): %s", taken.batch_id, err)
                tokens = await asyncio.to_thread(queued_tokens, self.queue, taken.batch_id)
                await asyncio.to_thread(self.queue.reject, taken.batch_id, str(err))
                self._carry_aborted({taken.batch_id: tokens})
                continue
            batch, record = self._select(wire)
            if batch is not None:
                # this step's token ledger counts the batch and what was carried into it
                handed, self._carried_ids = [taken.batch_id, *self._carried_ids], []
                await asyncio.to_thread(mark_accounted, self.queue, handed, self.version + 1)
                self.last_batch = batch
                return batch
            self._carried_ids.append(taken.batch_id)
            log.warning(
                "dropped batch %s: all %d items older than version %d - max_staleness %s",
                taken.batch_id,
                record["dropped_items"],
                record["version"],
                self.max_staleness,
            )
            await asyncio.to_thread(self.queue.drop, taken.batch_id, record)

    def _select(self, wire: WireBatch) -> tuple[SAWBatch | None, dict[str, int | str]]:
        """Drop stale items: the batch of fresh ones (``None`` if none is left) and the
        record for the queue."""
        version, producer = self.version, wire.producer
        fresh: list[SAWItem] = []
        stale: list[SAWItem] = []
        staleness: list[int] = []
        lost = 0  # items sampled by a version newer than ours: weights a crash lost
        for item in wire.batch.items:
            item_version = item.policy_version
            if item_version is None:
                item_version = producer.policy_version
            if is_too_stale(item_version, version, self.max_staleness):
                stale.append(item)
                continue
            fresh.append(item)
            if item_version is not None:
                lag = version - item_version
                staleness.append(max(lag, 0))
                lost += lag < 0
        dropped = len(wire.batch.items) - len(fresh)
        info = _InFlight(producer, len(fresh), dropped)
        record = info.record(version)
        tokens = batch_tokens(wire.batch.meta)
        if tokens is not None:
            tokens[DROPPED_STALE] += sum(item.num_action_tokens for item in stale)
            for key, value in tokens.items():
                self._carried[key] += value
        for key, value in SampleAudit.totals_of(stale).items():  # for the bias audit
            self._carried_audit[key] = self._carried_audit.get(key, 0) + value
        if not fresh:
            return None, record
        self._in_flight[producer.batch_id] = info
        carried, self._carried = self._carried, dict.fromkeys(SOURCE_KEYS, 0)
        audit, self._carried_audit = self._carried_audit, {}
        meta = {
            **wire.batch.meta,
            **(carried if tokens is not None else {}),
            **({DROPPED_BY_SOURCE: audit} if audit.get("samples") else {}),
            META_BATCH_ID: producer.batch_id,
            META_ACTOR_ID: producer.actor_id,
            "pipeline_batch_index": producer.batch_index,
            "pipeline_dropped_stale": dropped,
            "pipeline_staleness_mean": statistics.fmean(staleness) if staleness else 0.0,
            "pipeline_staleness_max": max(staleness, default=0),
            # after a resume: sampled by the crashed learner's newer weights (their
            # behaviour logprobs are exact, so the loss's ratio still holds); counted
            "pipeline_from_lost_versions": lost,
        }
        return SAWBatch(items=fresh, meta=meta), record

    def on_checkpoint(self, step: int) -> None:
        """The learner's checkpoint of ``step`` is written: the batches trained up to it
        are done for good (:meth:`RedisBatchQueue.commit`), and so are the token counts
        their steps accounted for (:func:`~ludic.pipeline.redis_tokens.commit_accounted`)."""
        self.queue.commit(step)
        commit_accounted(self.queue, step)

    def _handed_out(self, batch: SAWBatch, what: str) -> _InFlight:
        batch_id = batch.meta.get(META_BATCH_ID)
        info = self._in_flight.get(batch_id) if isinstance(batch_id, str) else None
        if info is None:
            raise ValueError(
                f"{what}: batch {batch_id!r} was not handed out by this "
                "PipelineBatchSource or was already marked; pass the batch next_batch "
                f"returned (its meta keeps {META_BATCH_ID!r})"
            )
        return info

    def reject(self, batch: SAWBatch, error: str) -> None:
        """``batch`` (one this source returned) cannot be trained on: move it to
        ``P:dead`` with ``error`` (its payload kept for inspection), so that neither this
        learner nor a restarted one takes it again; the version does not move."""
        info = self._handed_out(batch, "reject")
        self.queue.reject(info.producer.batch_id, error)
        del self._in_flight[info.producer.batch_id]

    def mark_trained(self, batch: SAWBatch) -> None:
        """Acknowledge ``batch`` (one this source returned) after its optimizer step:
        record it in ``P:trained`` and advance the policy version by one, atomically."""
        info = self._handed_out(batch, "mark_trained")
        version = self.version + 1
        self.queue.ack(info.producer.batch_id, info.record(version), version=version)
        del self._in_flight[info.producer.batch_id]
        self._version = version


# ------------------------------------------------------------------------------- actor
RUN_ENDED = "the run ended before the batch was made"


async def run_pipeline_actor(
    source: BatchSource,
    queue: RedisBatchQueue,
    *,
    actor_id: str,
    max_staleness: int | None,
    num_batches: int | None = None,
    stop: StopFlag | None = None,
    policy_version: Callable[[], int | None] | None = None,
    admission_timeout_s: float = 600.0,
    poll_s: float = 0.05,
) -> list[str]:
    """Pull batches from ``source`` and push them to ``queue`` until ``num_batches`` are
    pushed, ``stop`` is set, the source raises ``DataExhausted``, the queue is closed or
    the learner ended the run (``queue.finish_run``: checked before each batch, while
    waiting for admission and while waiting on a full queue; a batch whose generation
    fails after the run ended, e.g. on the learner's stopped vLLM server, ends the actor
    as the run's end does). Returns the pushed batch ids (each push confirmed by Redis).

    * ``actor_id``: unique among running actors; an actor restarted with the same id
      regenerates the batch index it had claimed (``stop`` keeps the claim for it).
      Claims are given up for good (``P:abandoned``, with the reason) when the source
      raises ``DataExhausted`` or the learner ended the run.
    * ``max_staleness``: must equal the learner's (checked against ``P:max_staleness``);
      batch ``k`` starts once the learner has finished ``k - max_staleness`` batches.
    * ``policy_version``: the version the actor's inference runs (e.g. the client's
      synced version), read before each batch: stamped on items that carry none and sent
      as the producer's version.
    """
    stop_set = stop.is_set if stop is not None else lambda: False
    pushed: list[str] = []
    with interrupt_on_cancel(queue):
        announced = await asyncio.to_thread(queue.max_staleness)
        if announced is not None and announced != max_staleness:
            raise ValueError(
                f"actor {actor_id!r}: max_staleness={max_staleness} but the learner on "
                f"{queue.keys.prefix!r} uses {announced}; start actors with the learner's value"
            )
        while num_batches is None or len(pushed) < num_batches:
            if stop_set() or await asyncio.to_thread(_queue_ended, queue):
                break
            # A claim is given up only for good (the run ended, the data ran out). An actor
            # stopped or killed keeps it: restarted under its id, it makes that batch, so no
            # batch index (a function of which its prompts are) is skipped.
            index = await asyncio.to_thread(queue.claim_index, actor_id)
            if not await _admitted(
                queue, index, max_staleness, stop_set, admission_timeout_s, poll_s
            ):
                if await asyncio.to_thread(queue.is_done):
                    await asyncio.to_thread(queue.abandon_claim, actor_id, RUN_ENDED)
                break
            version = policy_version() if policy_version is not None else None
            batch = await _generate(source, queue, actor_id, index)
            if batch is None:
                break
            batch_id = await _push(queue, actor_id, index, batch, version, stop_set)
            if batch_id is None:
                break
            pushed.append(batch_id)
    return pushed


async def _generate(
    source: BatchSource, queue: RedisBatchQueue, actor_id: str, index: int
) -> SAWBatch | None:
    """The next batch of ``source``; ``None`` when the actor ends: its data ran out, or the
    run ended while the batch generated (its claim abandoned either way)."""
    try:
        return await source.next_batch()
    except DataExhausted:
        await asyncio.to_thread(queue.abandon_claim, actor_id, "the actor's data ran out")
    except Exception as err:
        # The learner ended the run while this batch generated (and, with the vllm
        # backend, stopped the server it was generating on): the batch could not be
        # pushed anyway, so the actor ends as at any other end of the run.
        if not await asyncio.to_thread(queue.is_done):
            raise
        log.info("actor %s: the run ended while batch %d generated (%s)", actor_id, index, err)
        await asyncio.to_thread(queue.abandon_claim, actor_id, RUN_ENDED)
    return None


async def _push(
    queue: RedisBatchQueue,
    actor_id: str,
    index: int,
    batch: SAWBatch,
    version: int | None,
    stop_set: Callable[[], bool],
) -> str | None:
    """Push ``batch`` as batch ``index``: its id, or ``None`` when the actor ends (the run
    ended: its claim abandoned; or ``stop_set()`` while the queue was full)."""
    producer = Producer(f"batch-{index}", actor_id, index, _producer_version(batch, version))
    payload = encode_batch(_stamp_versions(batch, version), producer)
    try:
        await asyncio.to_thread(
            queue.push,
            producer.batch_id,
            payload,
            actor_id=actor_id,
            info={"batch_index": index, "num_items": len(batch.items)},
            tokens=int(batch.meta.get(GENERATED, 0)),
            stop=stop_set,
        )
    except RunFinishedError:
        await asyncio.to_thread(queue.abandon_claim, actor_id, RUN_ENDED)
        return None
    except PushStopped:  # the actor stops: its restart makes this batch again
        return None
    return producer.batch_id


@contextlib.contextmanager
def interrupt_on_cancel(queue: RedisBatchQueue) -> Iterator[None]:
    """Cancelled (Ctrl-C, SIGTERM, a timeout): make the queue call still running in a
    worker thread give up at once (:meth:`RedisBatchQueue.interrupt`) instead of waiting
    out a dead Redis or an empty queue, which would hold up the process's exit."""
    try:
        yield
    except asyncio.CancelledError:
        queue.interrupt()
        raise


def _queue_ended(queue: RedisBatchQueue) -> bool:
    return queue.is_closed() or queue.is_done()


async def _admitted(
    queue: RedisBatchQueue,
    index: int,
    max_staleness: int | None,
    stop_set: Callable[[], bool],
    timeout_s: float,
    poll_s: float,
) -> bool:
    """Wait until batch ``index`` may start (True), or ``stop`` is set or the learner
    ended the run (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        finished = await asyncio.to_thread(queue.finished_batches)
        if may_start(index, finished, max_staleness):
            return True
        if stop_set() or await asyncio.to_thread(queue.is_done):
            return False
        if time.monotonic() >= deadline:
            raise AdmissionTimeoutError(
                f"batch {index} waits for the learner to finish {index - max_staleness} batches "
                f"(index - max_staleness={max_staleness}); it has finished {finished} after "
                f"{timeout_s:.0f}s. Is the learner running on {queue.keys.prefix!r}?"
            )
        await asyncio.sleep(poll_s)


def _stamp_versions(batch: SAWBatch, version: int | None) -> SAWBatch:
    """Items without a policy version get ``version`` (the actor's, at generation start)."""
    if version is None or all(item.policy_version is not None for item in batch.items):
        return batch
    items = [
        item
        if item.policy_version is not None
        else dataclasses.replace(item, policy_version=version)
        for item in batch.items
    ]
    return SAWBatch(items=items, meta=batch.meta)


def _producer_version(batch: SAWBatch, version: int | None) -> int | None:
    if version is not None:
        return version
    known = [item.policy_version for item in batch.items if item.policy_version is not None]
    return min(known, default=None)
