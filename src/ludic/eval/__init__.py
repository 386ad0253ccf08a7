"""Evaluation: run requests with a ``RolloutEngine`` and reduce rollouts to metrics."""

from __future__ import annotations

from ludic._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "default_reducers": "ludic.eval.core",
    "eval_item": "ludic.eval.core",
    "run_eval": "ludic.eval.core",
    "EngineEvaluator": "ludic.eval.evaluator",
    "Evaluator": "ludic.eval.evaluator",
}

__getattr__, __all__ = lazy_exports(__name__, globals(), _EXPORTS)
