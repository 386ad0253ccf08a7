"""Rollout execution and batch sources: requests -> rollouts -> ``SAWItem``s -> ``SAWBatch``."""

from ludic.training.batching.intra_batch_control import GRPORequestStrategy, RequestStrategy
from ludic.training.batching.offline import (
    DataExhausted,
    OfflineBatchSource,
    RolloutFilter,
    read_rollouts_jsonl,
    write_rollouts_jsonl,
)
from ludic.training.batching.requests_from_dataset import make_requests_fn_from_queue
from ludic.training.batching.rollout_engine import RolloutEngine, UnknownKindError
from ludic.training.batching.saw import (
    SampleFilter,
    TokenAlignmentError,
    build_saw_batch,
    parse_error_rate,
    rollouts_to_saw_items,
    summarize_rollouts,
)
from ludic.training.batching.synced_batching import EmptyBatchError, RolloutBatchSource

__all__ = [
    "DataExhausted",
    "EmptyBatchError",
    "GRPORequestStrategy",
    "OfflineBatchSource",
    "RequestStrategy",
    "RolloutBatchSource",
    "RolloutEngine",
    "RolloutFilter",
    "SampleFilter",
    "TokenAlignmentError",
    "UnknownKindError",
    "build_saw_batch",
    "make_requests_fn_from_queue",
    "parse_error_rate",
    "read_rollouts_jsonl",
    "rollouts_to_saw_items",
    "summarize_rollouts",
    "write_rollouts_jsonl",
]
