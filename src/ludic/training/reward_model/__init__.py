"""Reward-model training: preference pairs, model set-up per training mode (head only,
LoRA, full), the Bradley-Terry ``PreferenceTrainer`` and saving a servable model."""

from __future__ import annotations

from ludic._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "PreferencePair": "ludic.training.reward_model.preferences",
    "read_preferences_jsonl": "ludic.training.reward_model.preferences",
    "write_preferences_jsonl": "ludic.training.reward_model.preferences",
    "split_preferences": "ludic.training.reward_model.preferences",
    "prepare_reward_model": "ludic.training.reward_model.setup",
    "LoraSettings": "ludic.training.reward_model.setup",
    "save_reward_model": "ludic.training.reward_model.trainer",
    "PreferenceTrainer": "ludic.training.reward_model.trainer",
    "PreferenceTrainerConfig": "ludic.training.reward_model.config",
    "evaluate_preferences": "ludic.training.reward_model.setup",
}

__getattr__, __all__ = lazy_exports(__name__, globals(), _EXPORTS)
