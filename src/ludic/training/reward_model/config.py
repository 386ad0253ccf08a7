"""``PreferenceTrainerConfig``: the hyperparameters of reward-model training, in a module
that imports no torch (the run config's ``reward_model`` section is built from it)."""

from __future__ import annotations

from dataclasses import dataclass

from ludic.training.config import LR_SCHEDULES, LRSchedule, TrainerConfig


@dataclass(frozen=True)
class PreferenceTrainerConfig:
    """Hyperparameters of reward-model training; invalid values raise naming the field."""

    lr: float = 1e-4
    """AdamW peak learning rate."""
    batch_size: int = 16
    """Preference pairs per optimizer step (2 * batch_size sequences in one forward)."""
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    """Clip the global gradient L2 norm; ``None`` turns clipping off."""
    lr_schedule: LRSchedule = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    """Required by the ``linear`` and ``cosine`` schedules (they decay to 0 there)."""
    publish_every: int = 0
    """Publish every this many steps (version = step); 0 never (``publish()`` still works)."""
    seed: int = 0
    """Seeds torch and the order in which pairs are visited."""
    device: str = "cpu"

    def __post_init__(self) -> None:
        _check(self.batch_size >= 1, "batch_size", self.batch_size, ">= 1")
        _check(self.publish_every >= 0, "publish_every", self.publish_every, ">= 0 (0 = never)")
        _check(self.lr_schedule in LR_SCHEDULES, "lr_schedule", self.lr_schedule, LR_SCHEDULES)
        try:
            self.optimizer_config()
        except ValueError as e:  # name this class, not the TrainerConfig it builds
            raise ValueError(str(e).replace("TrainerConfig.", "PreferenceTrainerConfig.")) from None

    def optimizer_config(self) -> TrainerConfig:
        """The ``TrainerConfig`` that ludic's optimizer/scheduler builders read."""
        return TrainerConfig(
            lr=self.lr,
            weight_decay=self.weight_decay,
            max_grad_norm=self.max_grad_norm,
            lr_schedule=self.lr_schedule,
            warmup_steps=self.warmup_steps,
            total_steps=self.total_steps,
            seed=self.seed,
            device=self.device,
        )


def _check(ok: bool, name: str, value: object, expected: object) -> None:
    if not ok:
        raise ValueError(
            f"PreferenceTrainerConfig.{name}={value!r} is invalid; expected {expected}"
        )
