"""Evaluation: run requests with a ``RolloutEngine`` and reduce rollouts to metrics."""

from ludic.eval.core import default_reducers, eval_item, run_eval
from ludic.eval.evaluator import EngineEvaluator, Evaluator

__all__ = ["EngineEvaluator", "Evaluator", "default_reducers", "eval_item", "run_eval"]
