"""The two phases of a training run, shared by ``ludic train`` and the pipeline learner.

:func:`warm_start` runs SFT on demonstrations with its own Trainer and checkpoints;
:func:`run_rl` runs an RL Trainer that is already built (resume, publish the starting
weights, evaluate when due, step, checkpoint). The helpers below build what both phases
need: the loggers, the checkpoint settings, the pad id, the greedy evaluation and the
run summary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from ludic.distributed.interfaces import PolicyPublisher
from ludic.eval import default_reducers, run_eval
from ludic.run.builders import (
    RunError,
    make_requests,
    rl_sample_filter,
    rl_trainer_config,
    sampling_spec,
    warm_start_trainer_config,
)
from ludic.run.config import RunConfig
from ludic.run.demos import demonstrations_path
from ludic.run.export import POLICY_DIR, save_policy
from ludic.run.plot import plot_reward_curve
from ludic.run.progress import ProgressLogger, print_summary
from ludic.run.reference import reference_policy
from ludic.run.run_dir import PhaseMetricsWriter, RunDirectory
from ludic.run.servers import published_weights
from ludic.run.signals import run_interruptible
from ludic.run.steps import checkpoint_on_failure, run_steps
from ludic.training import (
    CheckpointConfig,
    OfflineBatchSource,
    RichConsoleLogger,
    RLAlgorithm,
    RolloutEngine,
    Trainer,
    make_sft,
)
from ludic.training.data_parallel import TrainerRanks
from ludic.training.types import BatchSource

__all__ = [
    "CONSOLE_KEYS",
    "evaluate_policy",
    "make_trainer",
    "pad_id",
    "phase_checkpoint_config",
    "phase_loggers",
    "report_run",
    "run_rl",
    "run_summary",
    "warm_start",
]

CONSOLE_KEYS = ["batch/reward_mean", "loss", "grad_norm", "tokens_per_s"]
LEDGER_PHASE = "ledger"
"""The metrics record written after the RL steps: the token ledger settled at the end
(batches made ahead and discarded count as aborted); ``summary.json`` takes it from there."""


def warm_start(
    config: RunConfig,
    run: RunDirectory,
    policy,
    tokenizer,
    *,
    resuming: bool,
    console: Console,
    ranks: TrainerRanks | None = None,
) -> None:
    """SFT on demonstrations before RL (none at ``warm_start.steps: 0``, nor once RL has a
    checkpoint), then the policy saved as ``RUN_DIR/policy``."""
    steps = config.warm_start.steps
    if steps <= 0 or run.has_checkpoint("rl"):
        return
    demos = demonstrations_path(config, tokenizer, run.path / "demos.jsonl")
    algorithm = make_sft()
    source = OfflineBatchSource(  # one batch per step, so step N starts at batch N
        demos,
        credit_assigner=algorithm.credit_assigner,
        batch_size=config.warm_start.batch_size,
        seed=config.seed,
    )
    loggers = phase_loggers(config, run, "warm_start", "warm start (SFT)", steps, console)
    trainer = make_trainer(
        config,
        run,
        "warm_start",
        policy,
        tokenizer,
        source,
        algorithm,
        loggers=loggers,
        ranks=ranks,
    )
    with checkpoint_on_failure(trainer, loggers[0], console):
        if resuming:
            if run.has_checkpoint("warm_start"):
                trainer.resume()
            run.truncate_metrics("warm_start", trainer.step)
            source.skip(trainer.step)
            loggers[0].last_step = trainer.step
        run_steps(trainer, steps - trainer.step, every=config.trainer.checkpoint_every)
    save_policy(policy, tokenizer, run.path / POLICY_DIR, ranks)


def make_trainer(
    config: RunConfig,
    run: RunDirectory,
    phase: str,
    policy: Any,
    tokenizer: Any,
    source: BatchSource | None,
    algorithm: RLAlgorithm,
    *,
    publisher: PolicyPublisher | None = None,
    loggers: Sequence[Any] = (),
    ranks: TrainerRanks | None = None,
) -> Trainer:
    """The one place a run's Trainer is wired, for every mode and rank: the phase's
    settings and checkpoints; for ``rl`` also the reference model, what is published and
    the sample filter. ``source`` is ``None`` on a following rank (rank 0's batches)."""
    pad = pad_id(tokenizer)
    checkpoint = phase_checkpoint_config(config, run, phase, tokenizer, ranks)
    if phase == "warm_start":
        settings = warm_start_trainer_config(config, pad)
        return Trainer(
            policy, algorithm, source, settings, checkpoint=checkpoint, loggers=loggers, ranks=ranks
        )
    return Trainer(
        policy,
        algorithm,
        source,
        rl_trainer_config(config, pad),
        reference_model=reference_policy(config, run, policy, tokenizer),
        publisher=publisher,
        published_weights=published_weights(config),
        checkpoint=checkpoint,
        loggers=loggers,
        sample_filter=rl_sample_filter(config),
        ranks=ranks,
    )


def run_rl(
    config,
    run,
    trainer,
    source,
    eval_engine,
    metrics_writer,
    *,
    resuming: bool,
    console: Console,
    on_published: Callable[[], None] | None = None,
    on_steps_done: Callable[[], None] | None = None,
) -> None:
    """The RL phase's loop: resume, publish the starting weights (then ``on_published()``,
    e.g. the pipeline learner announcing itself), evaluate when due, run the steps (then
    ``on_steps_done()``, e.g. the pipeline learner ending the run for its actors, before
    the token ledger is settled); a failure checkpoints (:func:`checkpoint_on_failure`)."""
    with checkpoint_on_failure(trainer, metrics_writer, console):
        if resuming:
            if run.has_checkpoint("rl"):
                trainer.resume()
            run.truncate_samples(trainer.step)
        run.truncate_metrics("rl", trainer.step)
        metrics_writer.last_step = trainer.step
        trainer.publish_policy()  # the backend samples from the current weights, version = step
        if on_published is not None:
            on_published()
        _evaluate_and_step(config, run, trainer, source, eval_engine, console, on_steps_done)


def _evaluate_and_step(config, run, trainer, source, eval_engine, console, on_steps_done) -> None:
    """The RL steps with their evaluations (before RL, every ``eval.every`` steps, after
    RL), then ``on_steps_done()`` and the token ledger settled."""
    evaluated = {r["step"] for r in run.read_metrics() if r.get("phase") == "eval"}

    async def record_eval() -> None:
        metrics = await evaluate_policy(config, eval_engine)
        run.append_metrics({"phase": "eval", "step": trainer.step, **metrics})
        evaluated.add(trainer.step)
        console.print(
            f"eval at RL step {trainer.step}: success_rate {metrics['success_rate']:.3f}, "
            f"reward_mean {metrics['reward_mean']:.3f}"
        )

    async def after_step(step: int) -> None:
        rollouts = getattr(source, "last_rollouts", None)  # none: a pipeline learner
        if (
            rollouts
            and config.logging.num_sample_rollouts
            and step % config.logging.console_every == 0
        ):
            run.append_samples(step, rollouts[: config.logging.num_sample_rollouts])
        if _eval_due(config, step) and step < config.trainer.steps:
            await record_eval()

    # A resume redoes an evaluation only if its record is missing (interrupted mid-eval).
    if (
        _eval_due(config, trainer.step)
        and trainer.step not in evaluated
        and trainer.step < config.trainer.steps
    ):
        run_interruptible(record_eval())
    first = trainer.step
    run_steps(
        trainer,
        config.trainer.steps - trainer.step,
        after_step,
        every=config.trainer.checkpoint_every,
    )
    if on_steps_done is not None:
        on_steps_done()
    if trainer.step > first:  # settled at the end (batches made ahead and discarded: aborted)
        trainer.settle_ledger()
        if trainer.ledger is not None:
            run.append_metrics(
                {"phase": LEDGER_PHASE, "step": trainer.step, **trainer.ledger.metrics()}
            )
    if trainer.step not in evaluated:
        run_interruptible(record_eval())


def _eval_due(config: RunConfig, step: int) -> bool:  # before RL, every eval.every steps, after RL
    every, last = config.eval.every, config.trainer.steps
    return step in (0, last) or bool(every and step % every == 0)


def eval_seeds(config: RunConfig) -> range:
    first = config.eval.first_problem
    return range(first, first + config.eval.num_problems)


async def evaluate_policy(config: RunConfig, engine: RolloutEngine) -> dict[str, float]:
    requests = make_requests(config, eval_seeds(config), sampling_spec(config, greedy=True))
    metrics, _ = await run_eval(engine, requests, default_reducers())
    return metrics


def phase_loggers(
    config: RunConfig, run: RunDirectory, phase: str, title: str, steps: int, console: Console
) -> list[Any]:
    shown = "loss" if phase == "warm_start" else "batch/reward_mean"
    loggers: list[Any] = [
        PhaseMetricsWriter(run, phase),
        ProgressLogger(steps, title, reward_key=shown, console=console),
        RichConsoleLogger(keys=CONSOLE_KEYS, every=config.logging.console_every, console=console),
    ]
    return loggers  # wandb and TensorBoard follow metrics.jsonl: see ludic.run.run_loggers


def phase_checkpoint_config(
    config: RunConfig,
    run: RunDirectory,
    phase: str,
    tokenizer: Any = None,
    ranks: TrainerRanks | None = None,
) -> CheckpointConfig:
    """Where a phase checkpoints. With ``tokenizer`` (and ``trainer.checkpoint_policy``),
    each checkpoint also holds its policy as a Hugging Face folder (``step_N/policy``;
    with ``ranks``, written by rank 0 from the weights every rank gathers)."""
    write_extra = None
    if tokenizer is not None and config.trainer.checkpoint_policy:

        def write_extra(folder: Path, model: Any) -> None:
            save_policy(model, tokenizer, folder / POLICY_DIR, ranks)

    # every_n_steps=0: the job saves (after the step's records), not the Trainer.
    return CheckpointConfig(
        run.checkpoint_dir(phase),
        every_n_steps=0,
        keep_last=config.trainer.keep_last,
        write_extra=write_extra,
    )


def pad_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise RunError("model.path: the tokenizer has neither a pad nor an EOS token")
    return int(pad)


def report_run(
    config: RunConfig, run: RunDirectory, console: Console, *, started: float, title: str
) -> None:
    """The run's end: its reward curve plotted, its summary written (``summary.json``)
    and printed under ``title``."""
    plot_reward_curve(run.read_metrics(), run.plot_path, title=config.name)
    summary = run_summary(run, time.perf_counter() - started)
    run.write_summary(summary)
    print_summary(console, summary, title=title)


def run_summary(run: RunDirectory, seconds: float) -> dict[str, Any]:
    records = run.read_metrics()
    rl = [
        r["reward_mean"]
        for r in records
        if r.get("phase") == "rl" and r.get("reward_mean") is not None
    ]
    evals = [r for r in records if r.get("phase") == "eval"]
    last_rl = next((r for r in reversed(records) if r.get("phase") == "rl"), {})
    audit = {key[len("audit/") :]: v for key, v in last_rl.items() if key.startswith("audit/")}
    settled = next((r for r in reversed(records) if r.get("phase") in ("rl", LEDGER_PHASE)), {})
    ledger = {key[len("tokens/") :]: v for key, v in settled.items() if key.startswith("tokens/")}
    k = max(1, len(rl) // 10)
    return {
        "run_dir": str(run.path),
        "warm_start_steps": sum(1 for r in records if r.get("phase") == "warm_start"),
        "rl_steps": len(rl),
        "reward_first_10pct": sum(rl[:k]) / k if rl else None,
        "reward_last_10pct": sum(rl[-k:]) / k if rl else None,
        "eval_success_before": evals[0]["success_rate"] if evals else None,
        "eval_success_after": evals[-1]["success_rate"] if evals else None,
        "seconds": round(seconds, 1),
        "sample_audit": audit or None,  # trained against dropped items (cumulative)
        "token_ledger": ledger or None,  # where every generated token went (cumulative)
    }
