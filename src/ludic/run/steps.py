"""The step loop of a training phase, built so that a crash at any moment loses nothing.

* :func:`run_steps` runs the steps in one event loop with a cancellation point at every
  step boundary (so Ctrl-C / SIGTERM stop there even when no batch awaits anything), and
  saves each due checkpoint *after* its step's metrics line, samples and evaluation: a
  checkpoint never gets ahead of ``metrics.jsonl``, and a resume drops what is past it.
* :func:`checkpoint_on_failure` saves the last completed step on Ctrl-C, SIGTERM or any
  exception, unless the weights are non-finite or exploded, or the step counter ran ahead
  of its metrics line.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator

from rich.console import Console

from ludic.run.run_dir import PhaseMetricsWriter
from ludic.run.signals import run_interruptible
from ludic.training import Trainer
from ludic.training.checkpoint import step_of
from ludic.training.optim import parameter_problem

__all__ = ["checkpoint_on_failure", "run_steps", "save_checkpoint"]


@contextlib.contextmanager
def checkpoint_on_failure(
    trainer: Trainer, metrics: PhaseMetricsWriter, console: Console
) -> Iterator[None]:
    """Ctrl-C, SIGTERM or any failure in a phase (a step, an evaluation, a weight sync)
    saves a checkpoint of the last completed step, then re-raises. Nothing is saved when
    the weights are non-finite or exploded, or when the step counter is ahead of
    ``metrics.jsonl`` (a failure between the optimizer step and its log line): the newest
    checkpoint then stays the resume point. Inside the step loop Ctrl-C cancels at the
    next await, which :func:`run_steps` places at every step boundary."""
    try:
        yield
    except BaseException:
        if trainer.ranks is not None:  # a save is a collective the other ranks may not join
            console.print(
                f"[yellow]not checkpointing step {trainer.step}: a run over several trainer "
                "ranks saves only at its checkpoint steps; --resume continues from the newest"
                "[/yellow]"
            )
            raise
        problem = parameter_problem(trainer.model)
        if problem is not None:
            console.print(f"[yellow]not checkpointing step {trainer.step}: {problem}[/yellow]")
        elif trainer.step != metrics.last_step:
            console.print(
                f"[yellow]not checkpointing step {trainer.step}: it failed before its "
                "metrics line was written; --resume continues from the newest checkpoint"
                "[/yellow]"
            )
        elif trainer.step > 0:
            save_checkpoint(trainer)
        raise
    finally:
        trainer.close()


def run_steps(
    trainer: Trainer,
    num_steps: int,
    after_step: Callable[[int], Awaitable[None]] | None = None,
    *,
    every: int,
) -> None:
    """``num_steps`` optimizer steps (and ``after_step`` hooks) in one event loop, a
    checkpoint every ``every`` steps and one after the last step; an asynchronous batch
    source is closed (its generation cancelled) when the loop ends, however it ends. A checkpoint is saved
    after its step's metrics line, samples and evaluation, so it never gets ahead of them.
    """

    async def loop() -> None:
        try:
            for _ in range(num_steps):
                await asyncio.sleep(0)  # a step boundary: a pending Ctrl-C/SIGTERM cancels here
                await trainer.train_step()
                if after_step is not None:
                    await after_step(trainer.step)
                if every and trainer.step % every == 0:
                    save_checkpoint(trainer)
            save_checkpoint(trainer)  # the phase's last step is always resumable
        finally:  # an asynchronous source stops generating
            await trainer.close_source()

    run_interruptible(loop())  # asyncio.run, cancelled by SIGTERM also in a background job


def save_checkpoint(trainer: Trainer) -> None:
    """Save step ``trainer.step`` unless its checkpoint exists already."""
    assert trainer.checkpoints is not None
    latest = trainer.checkpoints.latest()
    if trainer.step > 0 and (latest is None or step_of(latest) != trainer.step):
        trainer.save_checkpoint()
