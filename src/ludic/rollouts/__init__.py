"""Rollouts: requests -> the rollout engine -> ``Rollout``s.

* ``requests``: :class:`RolloutRequest` (env, protocol, seed, sampling) and its specs;
* ``strategies``: request strategies that expand requests (``GRPORequestStrategy``);
* ``engine``: :class:`RolloutEngine`, which runs episodes concurrently;
* ``hooks``: :class:`RolloutHook`, async annotators of fresh rollouts (reward models);
* ``summary``: batch statistics of rollouts.

Nothing here knows about training; ``ludic.training`` turns rollouts into batches.
"""

from __future__ import annotations

from ludic._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "RolloutRequest": "ludic.rollouts.requests",
    "EnvSpec": "ludic.rollouts.requests",
    "ProtocolSpec": "ludic.rollouts.requests",
    "DataExhausted": "ludic.rollouts.requests",
    "RequestStrategy": "ludic.rollouts.strategies",
    "GRPORequestStrategy": "ludic.rollouts.strategies",
    "RolloutEngine": "ludic.rollouts.engine",
    "UnknownKindError": "ludic.rollouts.engine",
    "RolloutHook": "ludic.rollouts.hooks",
    "RM_SCORES_KEY": "ludic.rollouts.hooks",
    "check_rollout_hooks": "ludic.rollouts.hooks",
    "run_rollout_hooks": "ludic.rollouts.hooks",
    "parse_error_rate": "ludic.rollouts.summary",
    "summarize_rollouts": "ludic.rollouts.summary",
    "make_requests_fn_from_queue": "ludic.rollouts.requests_from_dataset",
}

__getattr__, __all__ = lazy_exports(__name__, globals(), _EXPORTS)
