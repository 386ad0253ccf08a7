"""Training: batches of ``SAWItem``s -> loss -> optimizer step -> published weights.

Names are imported lazily on first access, so importing a light module such as
``ludic.training.types`` does not pull in the Trainer (and the layering stays clean).
"""

from __future__ import annotations

from ludic._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    # pure data and contracts
    "SAWItem": "ludic.training.types",
    "SAWBatch": "ludic.training.types",
    "BatchSource": "ludic.training.types",
    "CreditAssigner": "ludic.training.types",
    "RolloutRequest": "ludic.rollouts.requests",
    "EnvSpec": "ludic.rollouts.requests",
    "ProtocolSpec": "ludic.rollouts.requests",
    "DataExhausted": "ludic.rollouts.requests",
    "EmptyBatchError": "ludic.training.types",
    "RolloutHook": "ludic.rollouts.hooks",
    # algorithms = credit assignment + loss
    "RLAlgorithm": "ludic.training.algorithm",
    "BatchMeanBaseline": "ludic.training.algorithm",
    "make_reinforce": "ludic.training.algorithm",
    "make_reinforce_baseline": "ludic.training.algorithm",
    "make_grpo": "ludic.training.algorithm",
    "make_dr_grpo": "ludic.training.algorithm",
    "make_gspo": "ludic.training.algorithm",
    "make_cispo": "ludic.training.algorithm",
    "make_gmpo": "ludic.training.algorithm",
    "make_decoupled_ppo": "ludic.training.algorithm",
    "make_decoupled_grpo": "ludic.training.algorithm",
    "make_sft": "ludic.training.algorithm",
    "MonteCarloReturn": "ludic.training.credit_assignment",
    "GroupNormalizedReturn": "ludic.training.credit_assignment",
    "EpisodicReturn": "ludic.training.credit_assignment",
    "PerStepReward": "ludic.training.credit_assignment",
    "ConstantCredit": "ludic.training.credit_assignment",
    "make_reward_rl": "ludic.training.algorithm",
    "RewardModelScorer": "ludic.training.reward_credit",
    "RewardModelCreditAssigner": "ludic.training.reward_credit",
    "RewardLoopCreditAssigner": "ludic.training.reward_loop_credit",
    # batch sources
    "RolloutEngine": "ludic.training.batching",
    "GRPORequestStrategy": "ludic.training.batching",
    "RolloutBatchSource": "ludic.training.batching",
    "AsyncBatchSource": "ludic.training.batching",
    "SleepingBatchSource": "ludic.training.batching",
    "OfflineBatchSource": "ludic.training.batching",
    "rollouts_to_saw_items": "ludic.training.batching",
    "write_rollouts_jsonl": "ludic.training.batching",
    "read_rollouts_jsonl": "ludic.training.batching",
    "make_requests_fn_from_queue": "ludic.training.batching",
    "Reducer": "ludic.stats",
    "aggregate_stats": "ludic.stats",
    # trainer and utilities
    "Trainer": "ludic.training.trainer",
    "NonFiniteError": "ludic.training.core",
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
    # reward-model training on preference pairs
    "PreferencePair": "ludic.training.reward_model.preferences",
    "wrong_answer_preferences": "ludic.training.reward_model.preferences",
    "read_preferences_jsonl": "ludic.training.reward_model.preferences",
    "write_preferences_jsonl": "ludic.training.reward_model.preferences",
    "split_preferences": "ludic.training.reward_model.preferences",
    "PreferenceTrainer": "ludic.training.reward_model.trainer",
    "PreferenceTrainerConfig": "ludic.training.reward_model.config",
    "LoraSettings": "ludic.training.reward_model.setup",
    "prepare_reward_model": "ludic.training.reward_model.setup",
    "evaluate_preferences": "ludic.training.reward_model.setup",
    "save_reward_model": "ludic.training.reward_model.trainer",
}

__getattr__, __all__ = lazy_exports(__name__, globals(), _EXPORTS)
