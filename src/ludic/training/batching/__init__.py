"""Batch sources: rollouts -> credit -> ``SAWItem``s -> ``SAWBatch``.

The rollout engine, requests and request strategies live in :mod:`ludic.rollouts`; they are
re-exported here for existing imports."""

from __future__ import annotations

from ludic._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "GRPORequestStrategy": "ludic.rollouts.strategies",
    "RequestStrategy": "ludic.rollouts.strategies",
    "DataExhausted": "ludic.rollouts.requests",
    "OfflineBatchSource": "ludic.training.batching.offline",
    "RolloutFilter": "ludic.training.batching.offline",
    "read_rollouts_jsonl": "ludic.training.batching.offline",
    "write_rollouts_jsonl": "ludic.training.batching.offline",
    "make_requests_fn_from_queue": "ludic.rollouts.requests_from_dataset",
    "RolloutEngine": "ludic.rollouts.engine",
    "UnknownKindError": "ludic.rollouts.engine",
    "SampleFilter": "ludic.training.batching.saw",
    "TokenAlignmentError": "ludic.training.batching.saw",
    "build_saw_batch": "ludic.training.batching.saw",
    "parse_error_rate": "ludic.rollouts.summary",
    "rollouts_to_saw_items": "ludic.training.batching.saw",
    "summarize_rollouts": "ludic.rollouts.summary",
    "EmptyBatchError": "ludic.training.batching.synced_batching",
    "RolloutBatchSource": "ludic.training.batching.synced_batching",
    "AsyncBatchSource": "ludic.training.batching.async_source",
    "SleepingBatchSource": "ludic.training.batching.colocated",
    "Producer": "ludic.training.batching.wire",
    "WireFormatError": "ludic.training.batching.wire",
    "decode_batch": "ludic.training.batching.wire",
    "encode_batch": "ludic.training.batching.wire",
}

__getattr__, __all__ = lazy_exports(__name__, globals(), _EXPORTS)
