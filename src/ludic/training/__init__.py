"""Training: batches of ``SAWItem``s -> loss -> optimizer step -> published weights.

Names are imported lazily on first access, so importing a light module such as
``ludic.training.types`` does not pull in the Trainer (and the layering stays clean).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    # pure data and contracts
    "SAWItem": "ludic.training.types",
    "SAWBatch": "ludic.training.types",
    "BatchSource": "ludic.training.types",
    "CreditAssigner": "ludic.training.types",
    "RolloutRequest": "ludic.training.types",
    "EnvSpec": "ludic.training.types",
    "ProtocolSpec": "ludic.training.types",
    # trainer and utilities
    "Trainer": "ludic.training.trainer",
    "EmptyBatchError": "ludic.training.trainer",
    "NonFiniteError": "ludic.training.trainer",
    "token_logprobs": "ludic.training.trainer",
    "TrainerConfig": "ludic.training.config",
    "CollatedBatch": "ludic.training.collate",
    "collate": "ludic.training.collate",
    "split_microbatches": "ludic.training.collate",
    "build_optimizer": "ludic.training.optim",
    "build_lr_scheduler": "ludic.training.optim",
    "lr_multiplier": "ludic.training.optim",
    "SampleFilter": "ludic.training.filters",
    "drop_truncated": "ludic.training.filters",
    "drop_incomplete_completions": "ludic.training.filters",
    "drop_parse_errors": "ludic.training.filters",
    "combine": "ludic.training.filters",
    "CheckpointConfig": "ludic.training.checkpoint",
    "CheckpointManager": "ludic.training.checkpoint",
    "CheckpointError": "ludic.training.checkpoint",
    "LoadedCheckpoint": "ludic.training.checkpoint",
    "load_checkpoint": "ludic.training.checkpoint",
    "TrainingLogger": "ludic.training.loggers",
    "RichConsoleLogger": "ludic.training.loggers",
    "JsonlLogger": "ludic.training.loggers",
    "WandbLogger": "ludic.training.loggers",
    "TensorBoardLogger": "ludic.training.loggers",
    "MultiLogger": "ludic.training.loggers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ludic.training' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
