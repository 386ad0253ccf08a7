"""The actor/learner pipeline over Redis: rollout actors push batches into a Redis queue,
one learner trains on them and publishes weights back.

Two floors, each importing only the one below it:

* the Redis parts -- :mod:`~ludic.pipeline.redis_keys` (key names, the guarded client
  import), :mod:`~ludic.pipeline.redis_queue` (the batch queue: claims, pushes, the
  learner's processing list, acknowledgements), :mod:`~ludic.pipeline.redis_weights`
  (weights through Redis), :mod:`~ludic.pipeline.redis_server` (a local ``redis-server``)
  and :mod:`~ludic.pipeline.batch_source` (``PipelineBatchSource`` for the Trainer,
  ``run_pipeline_actor`` for an actor);
* the processes -- :mod:`~ludic.pipeline.run_info` (a pipeline run's Redis URL, key
  prefix and ``pipeline.json``), :mod:`~ludic.pipeline.learner` (``ludic learner``),
  :mod:`~ludic.pipeline.actor` (``ludic actor``), :mod:`~ludic.pipeline.launch`
  (``trainer.mode: pipeline``: a local Redis, the learner and the actors as processes) and
  :mod:`~ludic.pipeline.ray_launch` (``ludic launch``: the same, placed on a Ray cluster;
  without an address, on a local Ray on loopback, :mod:`~ludic.pipeline.ray_local`).

Needs the ``redis`` extra (``pip install 'ludic-rl[redis]'``); ``ludic launch`` the ``ray``
extra.
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
