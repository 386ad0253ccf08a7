"""A reliable, bounded batch queue on Redis for the pipeline: :class:`RedisBatchQueue`.

Payloads are opaque bytes (``ludic.training.batching.wire``); the keys are ``redis_keys``'s.
``take`` moves an id into the learner's processing list (``BLMOVE``); ``ack`` / ``drop`` /
``reject`` settle it in one ``MULTI``/``EXEC`` under ``WATCH``, so each id ends in exactly one
of ``P:trained``, ``P:dropped``, ``P:dead``; an ack is final once a checkpoint covers it
(``commit``), and ``requeue_unacked`` hands a starting learner back what its predecessor held.
``push`` blocks while ``max_queued`` batches wait (:class:`QueueFullError` after
``push_timeout_s``); retries are idempotent. The guarantees in full: docs/design.md, "Pipeline".
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ludic.pipeline.redis_keys import (
    COUNTERS,
    NoBackoff,
    PipelineConnectionError,
    PipelineStateError,
    PushStopped,
    QueueFullError,
    QueueInterrupted,
    RedisKeys,
    Retry,
    RunFinishedError,
    TakenBatch,
    readable_id,
    redis,
)
from ludic.pipeline.redis_urls import redacted

log = logging.getLogger(__name__)

__all__ = [
    "PipelineConnectionError",
    "PipelineStateError",
    "PushStopped",
    "QueueFullError",
    "QueueInterrupted",
    "RedisBatchQueue",
    "RedisKeys",
    "RunFinishedError",
    "TakenBatch",
]

T = TypeVar("T")


class RedisBatchQueue:
    """The Redis side of the pipeline, shared by actors (``claim_index``, ``push``) and the
    learner (``take``, ``ack``, ``drop``, ``reject``, ``requeue_unacked``, versions).

    * ``url``: e.g. ``redis://localhost:6379/0``.
    * ``prefix``: namespaces every key, so several runs can share one Redis.
    * ``max_queued``: the queue bound (batches waiting, not counting in-flight ones).
    * ``learner_id``: names this learner's processing list; a restarted learner must use
      the same id to recover its unacknowledged batches. One live learner per id.
    * ``push_timeout_s``: how long ``push`` waits on a full queue.
    * ``block_s``: the longest single blocking ``BLMOVE``.
    * ``reconnect_timeout_s``: how long a command is retried while Redis is unreachable.

    Methods are synchronous (the async pipeline runs them in a thread); the underlying
    ``redis.Redis`` client is thread-safe.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str,
        max_queued: int = 4,
        learner_id: str = "learner",
        push_timeout_s: float = 600.0,
        block_s: float = 1.0,
        reconnect_timeout_s: float = 30.0,
    ) -> None:
        if max_queued < 1:
            raise ValueError(f"RedisBatchQueue: max_queued must be >= 1, got {max_queued}")
        if block_s <= 0 or reconnect_timeout_s < 0 or push_timeout_s < 0:
            raise ValueError(
                "RedisBatchQueue: block_s must be > 0 and push_timeout_s, reconnect_timeout_s >= 0"
            )
        self.url = redacted(url)  # for messages; the client keeps the password
        self.keys = RedisKeys(prefix)
        self.max_queued = max_queued
        self.learner_id = learner_id
        self.push_timeout_s = push_timeout_s
        self.block_s = block_s
        self.reconnect_timeout_s = reconnect_timeout_s
        # The socket timeout must outlast a blocking BLMOVE. The client's own retries are
        # off: _retry owns the policy, and every write re-checks its state before redoing.
        self.client = redis.Redis.from_url(
            url,
            socket_connect_timeout=2.0,
            socket_timeout=block_s + 5.0,
            retry=Retry(NoBackoff(), 0),
        )
        self._held: set[bytes] = set()  # ids this handle took and has not finished
        self._wake = threading.Event()  # set (and replaced) by interrupt()

    @property
    def processing_key(self) -> str:
        return self.keys.processing(self.learner_id)

    def close(self) -> None:
        """Close the connections."""
        self.client.close()

    def interrupt(self) -> None:
        """Make every call now waiting in another thread (retrying a lost connection,
        ``push`` on a full queue, ``take`` on an empty one) raise :class:`QueueInterrupted`
        within one blocking read (``block_s``); later calls are unaffected.

        For cancellation: a coroutine cancelled while its ``asyncio.to_thread`` call waits
        here calls it, so the thread does not outlive it (``asyncio.run`` waits for such
        threads before returning, which would hold up a Ctrl-C or SIGTERM for as long as
        ``reconnect_timeout_s`` while Redis is down).
        """
        wake, self._wake = self._wake, threading.Event()
        wake.set()

    def _interrupted(self, what: str) -> QueueInterrupted:
        return QueueInterrupted(f"{what}: interrupted (queue {self.keys.queue} at {self.url})")

    # -------------------------------------------------------------------- actor side
    def claim_index(self, actor_id: str) -> int:
        """The global batch index this actor generates next: its outstanding claim if it
        has one (an actor restarted under the same id regenerates the batch it lost),
        else a fresh one from ``P:next_index``. ``push`` clears the claim."""
        k = self.keys

        def attempt(pipe: Any) -> int | None:
            pipe.watch(k.claims, k.next_index)
            held = pipe.hget(k.claims, actor_id)
            if held is not None:
                return int(held)
            index = int(pipe.get(k.next_index) or 0)
            pipe.multi()
            pipe.set(k.next_index, index + 1)
            pipe.hset(k.claims, actor_id, index)
            pipe.execute()
            return index

        return self._transaction(f"claim a batch index for actor {actor_id!r}", attempt)

    def push(
        self,
        batch_id: str,
        payload: bytes,
        *,
        actor_id: str | None = None,
        info: Mapping[str, Any] | None = None,
        tokens: int = 0,
        timeout_s: float | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> bool:
        """Enqueue ``payload`` as ``batch_id``, waiting while the queue is full.

        Returns True when pushed, False when ``batch_id`` was pushed before (a retry after
        a lost reply). ``actor_id``'s claim is cleared in the same transaction; ``info``
        (JSON) is stored in ``P:produced``; ``tokens`` (the completion tokens generated for
        the batch) in ``P:batch_tokens`` and the ``generated_tokens`` counter (the token
        ledger, :mod:`ludic.pipeline.redis_tokens`). Raises :class:`QueueFullError` after
        ``timeout_s`` (default ``push_timeout_s``) of a full queue, and
        :class:`RunFinishedError` as soon as the learner has ended the run (also while
        waiting on a full queue), :class:`PushStopped` when ``stop()`` turns true while
        waiting on a full queue (the actor is shutting down).
        """
        k = self.keys
        timeout_s = self.push_timeout_s if timeout_s is None else timeout_s
        record = json.dumps({**(info or {}), "actor_id": actor_id, "pushed_at": time.time()})
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        wake = self._wake
        while True:
            outcome = self._push_once(batch_id, payload, record, actor_id, tokens)
            if outcome == "done":
                raise RunFinishedError(
                    f"the learner on {k.prefix!r} ended the run; batch {batch_id} is not wanted"
                )
            if outcome != "full":
                return outcome == "pushed"
            if stop is not None and stop():
                raise PushStopped(f"push of {batch_id} stopped while {k.queue} was full")
            now = time.monotonic()
            if now >= deadline:
                raise QueueFullError(
                    f"queue {k.queue} stayed full ({self.max_queued} batches) for "
                    f"{timeout_s:g}s while pushing {batch_id}: the learner is not taking "
                    "batches. Is it running on this prefix? (raise max_queued or push_timeout_s "
                    "to wait longer)"
                )
            if wake.wait(min(delay, deadline - now)):
                raise self._interrupted(f"push of {batch_id} to a full queue")
            delay = min(delay * 2, 0.25)

    def _push_once(
        self, batch_id: str, payload: bytes, record: str, actor_id: str | None, tokens: int
    ) -> str:
        """One push transaction: ``"pushed"``, else ``"duplicate"``, ``"done"`` or ``"full"``."""
        k = self.keys

        def attempt(pipe: Any) -> str:
            pipe.watch(k.queue, k.produced, k.done)
            if pipe.hexists(k.produced, batch_id):
                return "duplicate"
            if pipe.exists(k.done):
                return "done"
            if pipe.llen(k.queue) >= self.max_queued:
                return "full"
            pipe.multi()
            pipe.set(k.payload(batch_id), payload)
            pipe.lpush(k.queue, batch_id)
            pipe.hset(k.produced, batch_id, record)
            pipe.hincrby(k.stats, "pushed_batches", 1)
            pipe.hset(k.batch_tokens, batch_id, tokens)
            if tokens:
                pipe.hincrby(k.stats, "generated_tokens", tokens)
            if actor_id is not None:
                pipe.hdel(k.claims, actor_id)
            pipe.execute()
            return "pushed"

        return self._transaction(f"push batch {batch_id}", attempt)

    def abandon_claim(self, actor_id: str, reason: str) -> bool:
        """Give up ``actor_id``'s claimed batch index for good, without pushing it (the
        run ended, the actor's data ran out): recorded in ``P:abandoned`` as
        ``batch-<index>`` with ``reason``, and admission control counts it as finished, so
        later indices are not held back by a batch that will never come. Returns False if
        the actor held no claim. (An actor stopped or killed keeps its claim: restarted
        under the same id, it makes that batch; call this to retire the id instead.)
        """
        k = self.keys

        def attempt(pipe: Any) -> bool:
            pipe.watch(k.claims)
            index = pipe.hget(k.claims, actor_id)
            if index is None:
                return False
            record = {"actor_id": actor_id, "batch_index": int(index), "reason": reason}
            pipe.multi()
            pipe.hdel(k.claims, actor_id)
            pipe.hset(k.abandoned, f"batch-{int(index)}", json.dumps({**record, "at": time.time()}))
            pipe.hincrby(k.stats, "abandoned_claims", 1)
            pipe.execute()
            return True

        return self._transaction(f"abandon the claim of actor {actor_id!r}", attempt)

    def close_producing(self) -> None:
        """Mark the pipeline's producers as done: once the queue is empty, ``take`` stops
        waiting and the learner's batch source raises ``DataExhausted``."""
        self._retry("close the queue", lambda: self.client.set(self.keys.closed, 1))

    def is_closed(self) -> bool:
        return bool(
            self._retry("read the closed flag", lambda: self.client.exists(self.keys.closed))
        )

    # -------------------------------------------------------------------- run lifecycle
    def finish_run(self, reason: str = "the run ended before it was trained on") -> int:
        """The learner is done: set ``P:done`` (actors stop; a push is refused from now
        on, atomically, since ``push`` watches it), then move every batch still queued to
        ``P:unused`` with ``reason``. Returns how many were moved."""
        k = self.keys
        self._retry("set the done flag", lambda: self.client.set(k.done, 1))
        value = json.dumps({"reason": reason, "learner_id": self.learner_id, "at": time.time()})

        def attempt(pipe: Any) -> int:
            pipe.watch(k.queue)
            ids = pipe.lrange(k.queue, 0, -1)
            pipe.multi()
            pipe.delete(k.queue)
            for raw in ids:
                pipe.delete(k.payload("").encode() + raw)
                pipe.hset(k.unused, readable_id(raw), value)
            if ids:
                pipe.hincrby(k.stats, "unused_batches", len(ids))
            pipe.execute()
            return len(ids)

        return self._transaction("move queued batches to unused", attempt)

    def is_done(self) -> bool:
        """Whether the learner ended the run (:meth:`finish_run`)."""
        return bool(self._retry("read the done flag", lambda: self.client.exists(self.keys.done)))

    def start_run(self) -> None:
        """Clear ``P:done`` and the learner's announcement (a learner starting or resuming
        the run; also done by ``ludic train`` before it starts actors)."""
        k = self.keys
        self._retry("clear the done flag", lambda: self.client.delete(k.done, k.learner))

    def announce_learner(self, info: Mapping[str, Any]) -> None:
        """Publish the running learner's ``info`` (JSON) in ``P:learner``."""
        value = json.dumps(dict(info))
        self._retry("announce the learner", lambda: self.client.set(self.keys.learner, value))

    def learner_info(self) -> dict[str, Any] | None:
        """The running learner's announcement, ``None`` before one announced itself (or
        after it finished the run)."""
        raw = self._retry("read the learner", lambda: self.client.get(self.keys.learner))
        return None if raw is None else json.loads(raw)

    def withdraw_learner(self) -> None:
        self._retry("withdraw the learner", lambda: self.client.delete(self.keys.learner))

    def call(self, what: str, fn: Callable[[Any], T]) -> T:
        """``fn(client)`` under this queue's reconnect policy (for companions that keep
        their own keys under the prefix, e.g. the weight store)."""
        return self._retry(what, lambda: fn(self.client))

    # -------------------------------------------------------------------- learner side
    @property
    def uncommitted_key(self) -> str:
        return self.keys.uncommitted(self.learner_id)

    def requeue_unacked(self, committed_version: int) -> int:
        """Run when a learner starts, before its first ``take``, with the version of the
        state it starts from (its checkpoint's step): what a crash left behind goes back to
        the head of the queue, to be taken in the order it was first taken:

        * every id in the processing list (taken, never trained);
        * every id in the uncommitted list whose update is newer than
          ``committed_version`` (trained after the checkpoint, so lost with the crash):
          its ``P:trained`` record and counts are undone. Those at or below it are in
          the checkpoint: committed now (:meth:`commit`).

        Returns how many ids went back."""
        k, moved = self.keys, 0
        self.commit(committed_version)
        while True:  # newest first to the head: the oldest ends up taken first
            batch_id = self._retry(
                "requeue unacknowledged batches",
                lambda: self.client.lmove(self.processing_key, k.queue, "LEFT", "RIGHT"),
            )
            if batch_id is None:
                break
            moved += 1
        if moved:
            self._retry(
                "count requeued", lambda: self.client.hincrby(k.stats, "requeued_batches", moved)
            )
        while (raw := self._retry("read uncommitted", self._newest_uncommitted)) is not None:
            self._undo_training(raw.decode())  # trained before those taken, so after them
            moved += 1
        self._held.clear()
        return moved

    def _newest_uncommitted(self) -> bytes | None:
        newest = self.client.lrange(self.uncommitted_key, 0, 0)
        return newest[0] if newest else None

    def _undo_training(self, batch_id: str) -> None:
        """``batch_id``'s update was lost (newer than the checkpoint a learner resumes
        from): undo its ``P:trained`` record and counts, put it back at the queue's head."""
        k, uncommitted = self.keys, self.uncommitted_key

        def attempt(pipe: Any) -> None:
            pipe.watch(uncommitted, k.trained)
            if pipe.lpos(uncommitted, batch_id) is None:
                return  # already moved: a retry after a lost reply
            raw = pipe.hget(k.trained, batch_id)
            record = json.loads(raw) if raw is not None else {}
            pipe.multi()
            pipe.lrem(uncommitted, 1, batch_id)
            pipe.rpush(k.queue, batch_id)
            pipe.hdel(k.trained, batch_id)
            for name, amount in (
                ("trained_batches", 1),
                ("trained_items", int(record.get("num_items", 0))),
                ("dropped_items", int(record.get("dropped_items", 0))),
            ):
                if amount:
                    pipe.hincrby(k.stats, name, -amount)
            pipe.hincrby(k.stats, "retrained_batches", 1)
            pipe.execute()

        self._transaction(f"requeue batch {batch_id} trained after the checkpoint", attempt)

    def commit(self, version: int) -> int:
        """The learner's state through ``version`` is durable (a checkpoint of that step
        was written): the uncommitted batches whose update is at or below it are done for
        good, their payloads deleted. Returns how many."""
        k, uncommitted = self.keys, self.uncommitted_key

        def attempt(pipe: Any) -> int:
            pipe.watch(uncommitted, k.trained)
            ids = [raw.decode() for raw in pipe.lrange(uncommitted, 0, -1)]
            records = pipe.hmget(k.trained, ids) if ids else []
            done = [
                batch_id
                for batch_id, raw in zip(ids, records)
                if raw is None or int(json.loads(raw).get("version", 0)) <= version
            ]
            pipe.multi()
            for batch_id in done:
                pipe.lrem(uncommitted, 1, batch_id)
                pipe.delete(k.payload(batch_id))
            pipe.execute()
            return len(done)

        return self._transaction(f"commit batches through version {version}", attempt)

    def take(self, timeout_s: float) -> TakenBatch | None:
        """The next batch, moved into this learner's processing list; ``None`` after
        ``timeout_s`` without one, or as soon as the queue is empty and closed.

        A batch whose payload is missing is rejected (``P:dead``) and skipped.
        """
        deadline = time.monotonic() + max(timeout_s, 0.0)
        wake = self._wake
        while True:
            if wake.is_set():
                raise self._interrupted("take a batch")
            block = max(min(self.block_s, deadline - time.monotonic()), 0.01)
            raw = self._retry("take a batch", lambda b=block: self._adopt_or_move(b))
            if raw is not None:
                try:
                    batch_id = raw.decode()
                except UnicodeDecodeError:  # a hostile or torn push: never crash on it
                    self._reject_undecodable(raw)
                    continue
                key = self.keys.payload(batch_id)
                payload = self._retry(f"read {key}", lambda key=key: self.client.get(key))
                if payload is not None:
                    return TakenBatch(batch_id, payload)
                self.reject(batch_id, f"no payload stored under {key}")
                continue
            if time.monotonic() >= deadline or self.is_closed():
                return None

    def _adopt_or_move(self, block_s: float) -> bytes | None:
        # An id in our processing list that we never saw: a BLMOVE whose reply was lost.
        for raw in reversed(self.client.lrange(self.processing_key, 0, -1)):
            if raw not in self._held:
                self._held.add(raw)
                return raw
        raw = self.client.blmove(self.keys.queue, self.processing_key, block_s, "RIGHT", "LEFT")
        if raw is None:
            return None
        self._held.add(raw)
        return raw

    def _reject_undecodable(self, raw: bytes) -> None:
        """An id that is not valid UTF-8 (no actor of ludic's makes one): move it from the
        processing list to ``P:dead`` as ``0x<hex>``, with its payload if there is one."""
        k, processing = self.keys, self.processing_key
        name = readable_id(raw)
        error = f"batch id {raw[:64]!r} is not valid UTF-8 (recorded as {name[:80]})"
        log.error("rejected batch %s (moved to dead): %s", name[:80], error)
        payload_key = k.payload("").encode() + raw
        value = json.dumps({"error": error, "learner_id": self.learner_id, "at": time.time()})

        def attempt(pipe: Any) -> None:
            pipe.watch(processing)
            if pipe.lpos(processing, raw) is None:
                return  # already moved: a retry after a lost reply
            payload = pipe.get(payload_key)
            pipe.multi()
            pipe.lrem(processing, 1, raw)
            if payload is not None:
                pipe.set(k.dead_payload(name), payload)
            pipe.delete(payload_key)
            pipe.hset(k.dead, name, value)
            pipe.hincrby(k.stats, "dead_batches", 1)
            pipe.execute()

        self._transaction("reject an undecodable batch id", attempt)
        self._held.discard(raw)

    def ack(self, batch_id: str, record: Mapping[str, Any], *, version: int) -> None:
        """The step that trained ``batch_id`` is done: record it in ``P:trained`` (with
        ``version``), count ``record["num_items"]`` trained and ``record["dropped_items"]``
        stale items, set ``P:version`` to ``version`` and move it from the processing list
        to the uncommitted one, its payload kept, atomically. It is done for good once a
        checkpoint covers ``version`` (:meth:`commit`); a resume from an older checkpoint
        trains it again (:meth:`requeue_unacked`)."""
        counters = {
            "trained_batches": 1,
            "trained_items": int(record.get("num_items", 0)),
            "dropped_items": int(record.get("dropped_items", 0)),
        }
        record = {**record, "version": version}
        self._finish(
            batch_id, self.keys.trained, record, counters, version=version, uncommitted=True
        )

    def drop(self, batch_id: str, record: Mapping[str, Any]) -> None:
        """Every item of ``batch_id`` was too stale: record it in ``P:dropped``."""
        counters = {"dropped_batches": 1, "dropped_items": int(record.get("dropped_items", 0))}
        self._finish(batch_id, self.keys.dropped, record, counters)

    def reject(self, batch_id: str, error: str) -> None:
        """``batch_id`` cannot be trained on (bad payload): record it in ``P:dead`` with
        ``error``, keep its bytes under ``P:dead_payload:<id>``."""
        self._finish(
            batch_id, self.keys.dead, {"error": error}, {"dead_batches": 1}, keep_payload=True
        )

    def _finish(
        self,
        batch_id: str,
        record_key: str,
        record: Mapping[str, Any],
        counters: Mapping[str, int],
        *,
        version: int | None = None,
        keep_payload: bool = False,
        uncommitted: bool = False,
    ) -> None:
        k, processing = self.keys, self.processing_key
        value = json.dumps({**record, "learner_id": self.learner_id, "at": time.time()})

        def attempt(pipe: Any) -> None:
            pipe.watch(processing, record_key)
            if pipe.hexists(record_key, batch_id):
                return  # already finished: a retry after a lost reply
            if pipe.lpos(processing, batch_id) is None:
                raise PipelineStateError(
                    f"batch {batch_id} is not in {processing}, so learner "
                    f"{self.learner_id!r} cannot finish it (was it requeued by another "
                    "learner with the same learner_id, or never taken?)"
                )
            payload = pipe.get(k.payload(batch_id)) if keep_payload else None
            pipe.multi()
            pipe.lrem(processing, 1, batch_id)
            if payload is not None:
                pipe.set(k.dead_payload(batch_id), payload)
            if uncommitted:  # the payload stays until a checkpoint covers this update
                pipe.lpush(self.uncommitted_key, batch_id)
            else:
                pipe.delete(k.payload(batch_id))
            pipe.hset(record_key, batch_id, value)
            for name, amount in counters.items():
                if amount:
                    pipe.hincrby(k.stats, name, amount)
            if version is not None:
                pipe.set(k.version, version)
            pipe.execute()

        self._transaction(f"finish batch {batch_id}", attempt)
        self._held.discard(batch_id.encode())

    # -------------------------------------------------------------------- shared state
    def version(self) -> int | None:
        """The learner's policy version (``None`` before any learner set it)."""
        raw = self._retry("read the version", lambda: self.client.get(self.keys.version))
        return None if raw is None else int(raw)

    def set_version(self, version: int) -> None:
        self._retry("write the version", lambda: self.client.set(self.keys.version, version))

    def finished_batches(self) -> int:
        """Batch indices that are done: trained + dropped + dead + abandoned claims +
        unused (queued when the run ended). Admission control counts these (not
        versions), so a batch that will never be trained does not hold actors back
        forever: not even after a finished run is resumed with more steps."""
        c = self.counters()
        return (
            c["trained_batches"]
            + c["dropped_batches"]
            + c["dead_batches"]
            + c["abandoned_claims"]
            + c["unused_batches"]
        )

    def counters(self) -> dict[str, int]:
        raw = self._retry("read counters", lambda: self.client.hmget(self.keys.stats, COUNTERS))
        return {name: int(v or 0) for name, v in zip(COUNTERS, raw)}

    def queued(self) -> int:
        return int(self._retry("read the queue length", lambda: self.client.llen(self.keys.queue)))

    def records(self, which: str) -> dict[str, dict[str, Any]]:
        """``which`` in ``produced``, ``trained``, ``dropped``, ``dead``, ``unused``,
        ``abandoned``: id -> record."""
        if which not in {"produced", "trained", "dropped", "dead", "unused", "abandoned"}:
            raise ValueError(f"records(): unknown record {which!r}")
        raw = self._retry(f"read {which}", lambda: self.client.hgetall(getattr(self.keys, which)))
        return {key.decode(): json.loads(value) for key, value in raw.items()}

    def max_staleness(self) -> int | None:
        """The ``max_staleness`` the learner announced (``None``: unknown or unbounded)."""
        raw = self._retry("read max_staleness", lambda: self.client.get(self.keys.max_staleness))
        return None if raw in (None, b"none") else int(raw)

    def set_max_staleness(self, value: int | None) -> None:
        self._retry(
            "write max_staleness",
            lambda: self.client.set(self.keys.max_staleness, "none" if value is None else value),
        )

    def purge(self) -> int:
        """Delete every key under this prefix (start a run afresh); returns how many."""

        def delete_all() -> int:
            keys = list(self.client.scan_iter(match=f"{self.keys.prefix}:*", count=500))
            return int(self.client.delete(*keys)) if keys else 0

        self._held.clear()
        return self._retry(f"purge prefix {self.keys.prefix!r}", delete_all)

    # -------------------------------------------------------------------- plumbing
    def _transaction(self, what: str, attempt: Callable[[Any], T]) -> T:
        """Run ``attempt(pipe)`` (WATCH ... MULTI ... EXEC) until no watched key changed
        under it, retrying connection errors (see :meth:`_retry`)."""

        def once() -> T:
            while True:
                with self.client.pipeline() as pipe:
                    try:
                        return attempt(pipe)
                    except redis.WatchError:
                        continue

        return self._retry(what, once)

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried with backoff (50 ms .. 1 s) while Redis is unreachable, for at
        most ``reconnect_timeout_s``; then :class:`PipelineConnectionError`."""
        deadline: float | None = None
        delay = 0.05
        wake = self._wake
        while True:
            try:
                return fn()
            except (redis.ConnectionError, redis.TimeoutError) as err:
                now = time.monotonic()
                deadline = now + self.reconnect_timeout_s if deadline is None else deadline
                if now >= deadline:
                    raise PipelineConnectionError(
                        f"{what}: Redis at {self.url} unreachable for "
                        f"{self.reconnect_timeout_s:.0f}s ({type(err).__name__}: {err}). Is "
                        "redis-server running? (raise reconnect_timeout_s to wait longer)"
                    ) from err
                if wake.wait(min(delay, deadline - now)):
                    raise self._interrupted(what) from err
                delay = min(delay * 2, 1.0)
