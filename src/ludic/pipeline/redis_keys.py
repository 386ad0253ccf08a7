"""The names and errors of the Redis batch queue (:mod:`ludic.pipeline.redis_queue`).

Every key of a run lies under its prefix ``P``, so several runs share one Redis: the queue
(``P:queue``, ``P:payload:<id>``, ``P:processing:<learner>``, ``P:uncommitted:<learner>``),
each batch's fate (``P:produced``, ``P:trained``, ``P:dropped``, ``P:dead``, ``P:unused``,
``P:abandoned``), counters and the token ledger (``ludic.pipeline.redis_tokens``), the
learner's state (``P:version``, ``P:learner``, ``P:done``) and weights (``P:weights``).
Every key and what it holds: docs/async.md, "What is in Redis".
"""

from __future__ import annotations

from dataclasses import dataclass

try:  # the client, imported once here with a clear error when it is missing
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the Redis pipeline needs the `redis` client: pip install 'ludic-rl[redis]'"
    ) from err

__all__ = [
    "COUNTERS",
    "NoBackoff",
    "PipelineConnectionError",
    "PipelineStateError",
    "PushStopped",
    "QueueFullError",
    "QueueInterrupted",
    "RedisKeys",
    "Retry",
    "RunFinishedError",
    "TakenBatch",
    "readable_id",
    "redis",
]

COUNTERS = (
    "pushed_batches",
    "trained_batches",
    "trained_items",
    "dropped_batches",
    "dropped_items",
    "dead_batches",
    "requeued_batches",
    "retrained_batches",
    "abandoned_claims",
    "unused_batches",
    "generated_tokens",
)
"""Names in ``P:stats``. ``dropped_items`` counts stale items, whether their whole batch was
dropped or only part of it (the rest trained). ``abandoned_claims``: batch indices an actor
claimed and gave up for good without pushing (the run ended, or its source ran out;
recorded in ``P:abandoned``); an actor that is stopped or killed keeps its claim. ``unused_batches``:
batches still queued when the learner ended the run (:meth:`RedisBatchQueue.finish_run`).
``generated_tokens``: completion tokens of the batches pushed (the token ledger's
``generated``, see :mod:`ludic.pipeline.redis_tokens`).
``retrained_batches``: batches trained after a learner's last checkpoint that a resume from
it put back in the queue (their records and counts undone)."""


class PipelineConnectionError(ConnectionError):
    """Redis stayed unreachable for longer than ``reconnect_timeout_s``."""


class QueueFullError(TimeoutError):
    """The queue stayed full (``max_queued`` batches) for ``push_timeout_s``."""


class QueueInterrupted(RuntimeError):
    """A call waiting on Redis (a lost connection, a full queue, an empty one) gave up
    because :meth:`RedisBatchQueue.interrupt` was called (the caller was cancelled)."""


class RunFinishedError(RuntimeError):
    """The learner ended the run (``P:done``): no more batches are taken."""


class PushStopped(RuntimeError):
    """``push`` gave up waiting on a full queue because its ``stop`` flag was set."""


class PipelineStateError(RuntimeError):
    """An operation does not fit the queue's state (e.g. acking a batch this learner does
    not hold)."""


@dataclass(frozen=True)
class RedisKeys:
    """The key names of one pipeline (see the module docstring)."""

    prefix: str

    def __post_init__(self) -> None:
        if not self.prefix or any(c.isspace() for c in self.prefix):
            raise ValueError(f"pipeline prefix must be non-empty without spaces: {self.prefix!r}")

    def _key(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    queue = property(lambda self: self._key("queue"))
    produced = property(lambda self: self._key("produced"))
    trained = property(lambda self: self._key("trained"))
    dropped = property(lambda self: self._key("dropped"))
    dead = property(lambda self: self._key("dead"))
    stats = property(lambda self: self._key("stats"))
    version = property(lambda self: self._key("version"))
    next_index = property(lambda self: self._key("next_index"))
    claims = property(lambda self: self._key("claims"))
    max_staleness = property(lambda self: self._key("max_staleness"))
    closed = property(lambda self: self._key("closed"))
    done = property(lambda self: self._key("done"))
    unused = property(lambda self: self._key("unused"))
    abandoned = property(lambda self: self._key("abandoned"))
    learner = property(lambda self: self._key("learner"))
    weights = property(lambda self: self._key("weights"))
    weights_version = property(lambda self: self._key("weights_version"))
    batch_tokens = property(lambda self: self._key("batch_tokens"))
    accounted = property(lambda self: self._key("accounted"))

    def payload(self, batch_id: str) -> str:
        return f"{self.prefix}:payload:{batch_id}"

    def dead_payload(self, batch_id: str) -> str:
        return f"{self.prefix}:dead_payload:{batch_id}"

    def processing(self, learner_id: str) -> str:
        return f"{self.prefix}:processing:{learner_id}"

    def uncommitted(self, learner_id: str) -> str:
        return f"{self.prefix}:uncommitted:{learner_id}"


def readable_id(raw: bytes) -> str:
    """A batch id as text: itself, or ``0x<hex>`` when it is not valid UTF-8."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "0x" + raw.hex()


@dataclass(frozen=True)
class TakenBatch:
    """A batch taken by a learner: its id and payload (``None`` if none was stored)."""

    batch_id: str
    payload: bytes | None
