"""What every ludic trainer shares: the end of an optimizer step, the step counter,
publishing, checkpoints with resume, and logging.

:class:`TrainingCore` is composed into ``Trainer`` (policy RL, SFT) and ``PreferenceTrainer``
(reward models); each trainer keeps how a batch becomes a loss and what to publish. After the
trainer's ``loss.backward()``: ``core.optimizer_step()`` (finite check, clip, step, schedule),
``core.step += 1`` (the step is the published version), a publish when
``core.is_due(publish_every)``, ``core.maybe_checkpoint(extra)``, ``core.logger.log(...)``.
A non-finite loss or gradient raises :class:`NonFiniteError` (step skipped, gradients zeroed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch

from ludic.training.checkpoint import (
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    LoadedCheckpoint,
    load_checkpoint,
)
from ludic.training.config import TrainerConfig
from ludic.training.loggers import MultiLogger, TrainingLogger
from ludic.training.optim import build_lr_scheduler, build_optimizer, clipped_optimizer_step


class NonFiniteError(FloatingPointError):
    """The loss or gradient of a step was NaN/inf; the optimizer step was skipped."""


class TrainingCore:
    """A model with its AdamW optimizer and LR schedule (built from ``optim_config``),
    the step counter, checkpoints (``checkpoint``) and loggers.

    * ``owner``: the trainer's name, used in messages (``"step 3"`` / ``"reward-model step 3"``).
    * ``fix_hint``: what a non-finite step tells the user to change (config field names).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optim_config: TrainerConfig,
        *,
        owner: str,
        fix_hint: str,
        checkpoint: CheckpointConfig | None = None,
        loggers: Iterable[TrainingLogger] = (),
    ) -> None:
        self.model = model
        self.owner = owner
        self.fix_hint = fix_hint
        self.max_grad_norm = optim_config.max_grad_norm
        self.optimizer = build_optimizer(model, optim_config)
        self.scheduler = build_lr_scheduler(self.optimizer, optim_config)
        self.checkpoints = CheckpointManager(checkpoint) if checkpoint is not None else None
        self.logger = MultiLogger(loggers)
        self.step = 0

    # ---------------------------------------------------------------- the step
    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        return self.scheduler.get_last_lr()[0]

    def optimizer_step(self, *, schedule: bool = True) -> float:
        """Check gradients finite, clip to ``max_grad_norm``, step the optimizer and (unless
        ``schedule=False``) the schedule, zero the gradients; returns the pre-clip gradient
        norm. Does not advance :attr:`step` (the trainer does, once the step's own work is
        done)."""
        return clipped_optimizer_step(
            self.model,
            self.optimizer,
            self.scheduler,
            self.max_grad_norm,
            abort=self.abort_step,
            schedule=schedule,
        )

    def abort_step(self, reason: str) -> NoReturn:
        """Zero the gradients and raise :class:`NonFiniteError` for the step in progress."""
        self.optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(
            f"{self.owner} {self.step + 1}: {reason}; the optimizer step was skipped and "
            f"gradients zeroed. {self.fix_hint}"
        )

    def is_due(self, every: int) -> bool:
        """Whether the current step is a multiple of ``every`` (``every <= 0``: never)."""
        return every > 0 and self.step % every == 0

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, extra: Mapping[str, Any]) -> Path:
        """Save model, optimizer, schedule, RNG states and ``extra`` as step :attr:`step`."""
        if self.checkpoints is None:
            raise ValueError(f"{self.owner}: no checkpoint config; pass checkpoint=...")
        return self.checkpoints.save(
            self.step, self.model, self.optimizer, self.scheduler, dict(extra)
        )

    def maybe_checkpoint(self, extra: Callable[[], Mapping[str, Any]]) -> Path | None:
        """:meth:`save_checkpoint` when the checkpoint config says this step is due."""
        if self.checkpoints is not None and self.checkpoints.is_due(self.step):
            return self.save_checkpoint(extra())
        return None

    def resume(self, path: str | Path | None = None) -> LoadedCheckpoint:
        """Restore model, optimizer, schedule, RNGs and :attr:`step` from ``path`` (default:
        the latest checkpoint); returns what was loaded (its ``extra`` for the trainer to
        check)."""
        if path is None:
            if self.checkpoints is None:
                raise ValueError(
                    f"{self.owner}: resume() without a path needs checkpoint=CheckpointConfig"
                    "(dir=...) to find the latest checkpoint"
                )
            path = self.checkpoints.latest()
            if path is None:
                raise CheckpointError(
                    f"no checkpoint to resume from in {str(self.checkpoints.dir)!r}"
                )
        loaded = load_checkpoint(path, self.model, self.optimizer, self.scheduler)
        self.step = loaded.step
        return loaded

    def close(self) -> None:
        self.logger.close()


class HasTrainingCore:
    """Exposes a trainer's :class:`TrainingCore` (``self.core``) under the familiar names:
    ``step``, ``optimizer``, ``scheduler``, ``checkpoints``, ``logger``."""

    core: TrainingCore

    @property
    def step(self) -> int:
        return self.core.step

    @step.setter
    def step(self, value: int) -> None:
        self.core.step = value

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.core.optimizer

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def checkpoints(self) -> CheckpointManager | None:
        return self.core.checkpoints

    @property
    def logger(self) -> MultiLogger:
        return self.core.logger

    def close(self) -> None:
        self.core.close()
