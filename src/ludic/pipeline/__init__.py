"""The actor/learner pipeline over Redis: rollout actors push batches into a Redis queue,
one learner trains on them and publishes weights back (the guide: docs/async.md).

The Redis parts (``redis_keys``, ``redis_queue``, ``redis_tokens``, ``redis_weights``,
``redis_server``, and ``batch_source``: ``PipelineBatchSource``, ``run_pipeline_actor``) sit
below the processes (``run_info``, ``learner``, ``actor``, ``launch`` for ``trainer.mode:
pipeline``; ``ray_launch``, ``ray_local``, ``ray_processes`` for ``ludic launch`` on Ray);
the layers contract in ``pyproject.toml`` keeps imports pointing down. Needs the ``redis``
extra (``pip install 'ludic-rl[redis]'``); ``ludic launch`` the ``ray`` extra.
"""

from __future__ import annotations

from ludic._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "PipelineBatchSource": "ludic.pipeline.batch_source",
    "run_pipeline_actor": "ludic.pipeline.batch_source",
    "AdmissionTimeoutError": "ludic.pipeline.batch_source",
    "RedisBatchQueue": "ludic.pipeline.redis_queue",
    "PipelineConnectionError": "ludic.pipeline.redis_queue",
    "PipelineStateError": "ludic.pipeline.redis_queue",
    "QueueFullError": "ludic.pipeline.redis_queue",
    "RunFinishedError": "ludic.pipeline.redis_queue",
    "RedisWeightPublisher": "ludic.pipeline.redis_weights",
    "RedisWeightSubscriber": "ludic.pipeline.redis_weights",
    "WeightsFormatError": "ludic.pipeline.redis_weights",
    "RedisServer": "ludic.pipeline.redis_server",
    "start_redis_server": "ludic.pipeline.redis_server",
}

__getattr__, __all__ = lazy_exports(__name__, globals(), _EXPORTS)
