"""Reward-model sections of the run config: ``reward_model`` (``task: reward_model``,
training a reward model on preference pairs) and ``reward`` (a learned reward for RL)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ludic.run.config_common import Device, LoraConfig, Section, TinyModelConfig, VLLMConfig

__all__ = [
    "PreferenceDataConfig",
    "RewardModelSection",
    "RewardSection",
    "SyntheticPreferencesConfig",
]


class SyntheticPreferencesConfig(Section):
    """Preference pairs over arithmetic problems (``ludic.training.reward_model.preferences.
    synthetic_arithmetic_preferences``): prompt ``"3+4="``, chosen the answer, rejected
    the answer off by 1..max_offset."""

    num_pairs: int = Field(512, ge=2)
    """Pairs generated in all (the eval split is taken from them)."""
    seed: int = 0
    operators: list[Literal["+", "-", "*"]] = Field(["+"], min_length=1)
    min_digits: int = Field(1, ge=1)
    max_digits: int = Field(1, ge=1)
    max_offset: int = Field(9, ge=1)
    """Wrong answers differ from the right one by 1..max_offset."""

    @model_validator(mode="after")
    def _digits(self) -> SyntheticPreferencesConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(
                f"min_digits={self.min_digits} > max_digits={self.max_digits}; need "
                "min_digits <= max_digits"
            )
        return self


class PreferenceDataConfig(Section):
    """Where the preference pairs come from, and the held-out evaluation split."""

    path: str | None = None
    """A JSONL file of {"prompt", "chosen", "rejected"[, "margin", "meta"]} lines; null
    generates ``synthetic`` arithmetic pairs."""
    synthetic: SyntheticPreferencesConfig = SyntheticPreferencesConfig()
    """Used when ``path`` is null."""
    eval_size: int = Field(64, ge=1)
    """Pairs held out to measure pairwise accuracy before, during and after training."""
    holdout: Literal["pairs", "prompts"] = "pairs"
    """pairs: random pairs (exact duplicates are dropped from training); prompts: whole
    prompts, so every eval prompt is unseen in training."""

    @model_validator(mode="after")
    def _one_source(self) -> PreferenceDataConfig:
        if self.path is not None and self.synthetic != SyntheticPreferencesConfig():
            raise ValueError(
                "path is set, so synthetic is not used; remove the synthetic settings or "
                "set path: null"
            )
        return self


class RewardModelSection(Section):
    """Reward-model training (``task: reward_model``): a sequence classifier with one
    label (backbone + linear ``score`` head) trained on preference pairs with the
    Bradley-Terry loss."""

    training_mode: Literal["head_only", "lora", "full"] = "full"
    """head_only: the head alone; lora: LoRA adapters + head; full: every weight."""
    path: str | None = None
    """An HF folder or hub id (a sequence classifier, or a causal LM that gets a fresh
    one-label head); null builds the tiny reward model in RUN_DIR/model."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Used when ``path`` is null."""
    lora: LoraConfig | None = None
    """LoRA adapters for training_mode lora (null there: the defaults)."""
    device: Device = "cpu"
    steps: int = Field(300, ge=1)
    """Optimizer steps."""
    lr: float = Field(1e-3, gt=0)
    batch_size: int = Field(16, ge=1)
    """Preference pairs per step."""
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    eval_every: int = Field(0, ge=0)
    """Also evaluate every N steps (0: only before and after training)."""
    publish_every: int = Field(0, ge=0)
    """Publish weights to ``server`` every N steps (version = step) and after the last
    step; 0 never."""
    server: VLLMConfig | None = None
    """A vLLM reward server (``ludic serve reward``) kept in sync with the training model:
    started on the initial model unless ``server.start_server`` is false. Null: none."""
    checkpoint_every: int = Field(100, ge=1)
    keep_last: int = Field(2, ge=1)
    data: PreferenceDataConfig = PreferenceDataConfig()

    @model_validator(mode="after")
    def _consistent(self) -> RewardModelSection:
        if self.lora is not None and self.training_mode != "lora":
            raise ValueError(
                f"lora is set but training_mode={self.training_mode!r}; set training_mode: "
                "lora or remove lora"
            )
        if self.path is not None and self.tiny != TinyModelConfig():
            raise ValueError(
                "path is set, so tiny is not used; remove the tiny settings or set path: null"
            )
        if self.server is not None and self.publish_every == 0:
            raise ValueError(
                "server is set but publish_every=0: set publish_every >= 1 to keep the "
                "server in sync, or remove server"
            )
        if self.lr_schedule != "constant" and self.warmup_steps >= self.steps:
            raise ValueError(
                f"lr_schedule={self.lr_schedule!r} decays to 0 at steps={self.steps}, so "
                f"warmup_steps={self.warmup_steps} must be smaller"
            )
        return self


class RewardSection(Section):
    """A learned reward for RL (``algorithm.name: reward_rl``): a reward model with one
    label scores each completion (``format_reward_input(question, completion)``), and the
    score replaces or combines with the env's reward."""

    path: str
    """The reward model: an HF sequence-classifier folder, e.g. RUN_DIR/reward_model of a
    ``task: reward_model`` run."""
    backend: Literal["transformers", "vllm"] = "transformers"
    """transformers: scored in process; vllm: a vLLM reward server (``server``)."""
    server: VLLMConfig = VLLMConfig()
    """The reward server when backend is vllm (started on ``path`` unless
    ``server.start_server`` is false)."""
    mode: Literal["replace", "add", "multiply", "weighted"] = "replace"
    """How score s and env reward r combine: s, r + s, r * s, or weight*r + (1-weight)*s."""
    weight: float = Field(0.5, ge=0.0, le=1.0)
    """The env reward's share in mode weighted."""
    normalize: bool = True
    """Score with the sigmoid of the reward model's logit (false: the raw logit)."""
