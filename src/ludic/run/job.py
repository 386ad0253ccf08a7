"""The main job: ``ludic train`` / ``ludic eval`` as plain functions.

A training run has two phases, each with its own Trainer and checkpoints:
``warm_start`` (SFT on demonstrations; skipped when ``warm_start.steps == 0``) then ``rl``
(the configured algorithm, sampling from the inference backend, which the trainer
re-syncs every ``trainer.publish_every`` steps). ``metrics.jsonl`` gets one line per step
of either phase and one per evaluation (greedy, before RL, every ``eval.every`` steps and
after RL).

Ctrl-C (or SIGTERM) stops at a step boundary, saves a checkpoint and re-raises
``KeyboardInterrupt`` (:class:`~ludic.run.signals.Terminated` for SIGTERM); any other
failure also saves one while the weights are finite. ``train(config, resume=RUN_DIR)``
continues from the newest checkpoint with the same step count, optimizer state and data
position.

Crash consistency: a step's ``metrics.jsonl`` line (and its samples and evaluation) is
written and fsynced before that step's checkpoint, and a resume drops every record past
the checkpoint it loads, so after a crash at any moment the file and the checkpoint agree.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from ludic.distributed import ClientPolicyPublisher, policy_state_dict
from ludic.eval import default_reducers, run_eval
from ludic.inference import HFChatTemplate
from ludic.run.builders import (
    RunError,
    batch_requests,
    inference_backend,
    load_policy,
    make_algorithm,
    make_engine,
    make_requests,
    reward_backend,
    rl_sample_filter,
    rl_trainer_config,
    sampling_spec,
    warm_start_trainer_config,
)
from ludic.run.config import RunConfig
from ludic.run.demos import demonstrations_path
from ludic.run.plot import plot_reward_curve
from ludic.run.preflight import check_config
from ludic.run.progress import ProgressLogger, print_summary
from ludic.run.run_dir import PhaseMetricsWriter, RunDirectory, open_run
from ludic.run.signals import terminate_as_interrupt
from ludic.run.steps import checkpoint_on_failure, run_steps
from ludic.training import (
    AsyncBatchSource,
    CheckpointConfig,
    CheckpointManager,
    GRPORequestStrategy,
    OfflineBatchSource,
    RichConsoleLogger,
    RolloutBatchSource,
    RolloutEngine,
    Trainer,
    make_sft,
)
from ludic.training.checkpoint import load_checkpoint

__all__ = ["RunError", "evaluate", "train"]

CONSOLE_KEYS = ["batch/reward_mean", "loss", "grad_norm", "tokens_per_s"]
RESUMABLE_CHANGES = {"trainer.steps", "logging", "eval.every"}
"""Config fields a resumed run may change; anything else must match the saved config."""


def train(config: RunConfig, *, resume: str | Path | None = None) -> Path:
    """Run (or resume) a training job; returns the run directory. ``task: reward_model``
    runs :func:`ludic.run.reward_job.train_reward_model` instead."""
    with terminate_as_interrupt():
        if config.task == "reward_model":
            from ludic.run.reward_job import train_reward_model

            return train_reward_model(config, resume=resume)  # runs check_config itself
        check_config(config)  # every part buildable before the run directory or a step
        if config.trainer.mode == "pipeline":  # learner + actor processes over Redis
            from ludic.run.pipeline_launch import launch_pipeline

            return launch_pipeline(config, resume=resume)
        return _train(config, resume=resume)


def _train(config: RunConfig, *, resume: str | Path | None) -> Path:
    console = Console()
    run, config = open_run(config, resume=resume, resumable=RESUMABLE_CHANGES)
    console.print(f"run directory: [bold]{run.path}[/bold]")
    started = time.perf_counter()
    policy, tokenizer = load_policy(config, run.model_dir)
    if config.warm_start.steps > 0 and not run.has_checkpoint("rl"):
        _warm_start(config, run, policy, tokenizer, resuming=resume is not None, console=console)
    _reinforce(config, run, policy, tokenizer, resuming=resume is not None, console=console)
    plot_reward_curve(run.read_metrics(), run.plot_path, title=config.name)
    summary = _summary(run, time.perf_counter() - started)
    run.write_summary(summary)
    print_summary(console, summary, title="ludic run summary")
    return run.path


def evaluate(config: RunConfig, *, run_dir: str | Path | None = None) -> dict[str, float]:
    """Greedy evaluation of the newest checkpoint in ``run_dir`` (or of the config's
    initial model when ``run_dir`` is None); returns the metrics. ``task: reward_model``
    runs :func:`ludic.run.reward_job.evaluate_reward_model` instead."""
    if config.task == "reward_model":
        from ludic.run.reward_job import evaluate_reward_model

        return evaluate_reward_model(config, run_dir=run_dir)
    run = RunDirectory.open(run_dir) if run_dir is not None else None
    model_dir = run.model_dir if run is not None else Path(tempfile.mkdtemp(prefix="ludic-eval-"))
    policy, tokenizer = load_policy(config, model_dir)
    if run is not None:
        checkpoint = _newest_checkpoint(run)
        if checkpoint is None:
            raise RunError(f"{run.path}: no checkpoint to evaluate yet")
        load_checkpoint(checkpoint, policy)
    log_dir = run.path if run is not None else model_dir
    with inference_backend(
        config, policy, tokenizer, model_dir=model_dir, log_dir=log_dir
    ) as client:
        client.sync_weights(policy_state_dict(policy), version=0)
        engine = make_engine(
            config, client, HFChatTemplate(tokenizer), env_overrides=config.env.eval_kwargs
        )
        return asyncio.run(_evaluate(config, engine))


# ---------------------------------------------------------------------------- phases
def _warm_start(
    config: RunConfig, run: RunDirectory, policy, tokenizer, *, resuming: bool, console: Console
) -> None:
    steps = config.warm_start.steps
    demos = demonstrations_path(config, tokenizer, run.path / "demos.jsonl")
    algorithm = make_sft()
    source = OfflineBatchSource(  # one batch per step, so step N starts at batch N
        demos,
        credit_assigner=algorithm.credit_assigner,
        batch_size=config.warm_start.batch_size,
        seed=config.seed,
    )
    loggers = _loggers(config, run, "warm_start", "warm start (SFT)", steps, console)
    trainer = Trainer(
        policy,
        algorithm,
        source,
        warm_start_trainer_config(config, _pad_id(tokenizer)),
        checkpoint=_checkpoint_config(config, run, "warm_start"),
        loggers=loggers,
    )
    with checkpoint_on_failure(trainer, loggers[0], console):
        if resuming:
            if run.has_checkpoint("warm_start"):
                trainer.resume()
            run.truncate_metrics("warm_start", trainer.step)
            source.skip(trainer.step)
            loggers[0].last_step = trainer.step
        run_steps(trainer, steps - trainer.step, every=config.trainer.checkpoint_every)


def _reinforce(
    config: RunConfig, run: RunDirectory, policy, tokenizer, *, resuming: bool, console: Console
) -> None:
    backend = inference_backend(
        config, policy, tokenizer, model_dir=run.model_dir, log_dir=run.path
    )
    with backend as client, reward_backend(config, log_dir=run.path) as reward_client:
        _reinforce_with(
            config,
            run,
            policy,
            tokenizer,
            client,
            reward_client=reward_client,
            resuming=resuming,
            console=console,
        )


def _reinforce_with(
    config: RunConfig,
    run: RunDirectory,
    policy,
    tokenizer,
    client,
    *,
    reward_client=None,
    resuming: bool,
    console: Console,
) -> None:
    template = HFChatTemplate(tokenizer)
    engine = make_engine(config, client, template)
    eval_engine = make_engine(config, client, template, env_overrides=config.env.eval_kwargs)
    algorithm = make_algorithm(config, reward_client=reward_client)
    trainer: Trainer

    batch_index: list[int] = []  # async: batches are numbered in the order they start

    def next_requests():
        # Problems and sampling seeds are a function of the batch's index (the step that
        # will train on it), so a resumed run sees exactly the problems an uninterrupted
        # one would.
        if config.trainer.mode == "sync":
            index = trainer.step
        else:
            index = batch_index[0] if batch_index else trainer.step
            batch_index[:] = [index + 1]
        return batch_requests(config, index)

    source: Any = RolloutBatchSource(
        engine,
        next_requests,
        algorithm.credit_assigner,
        request_strategy=GRPORequestStrategy(group_size=config.algorithm.group_size),
        rollout_hooks=algorithm.rollout_hooks,
    )
    if config.trainer.mode == "async":
        source = AsyncBatchSource(source, max_staleness=config.trainer.staleness)
    loggers = _loggers(config, run, "rl", f"RL ({algorithm.name})", config.trainer.steps, console)
    trainer = Trainer(
        policy,
        algorithm,
        source,
        rl_trainer_config(config, _pad_id(tokenizer)),
        publisher=ClientPolicyPublisher(client),
        checkpoint=_checkpoint_config(config, run, "rl"),
        loggers=loggers,
        sample_filter=rl_sample_filter(config, algorithm),
    )
    with checkpoint_on_failure(trainer, loggers[0], console):
        _run_rl(
            config,
            run,
            trainer,
            source,
            eval_engine,
            loggers[0],
            resuming=resuming,
            console=console,
        )


def _run_rl(
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
) -> None:
    """The RL phase's loop: resume, publish the starting weights (then ``on_published()``,
    e.g. the pipeline learner announcing itself), evaluate when due, run the steps."""
    if resuming:
        if run.has_checkpoint("rl"):
            trainer.resume()
        run.truncate_samples(trainer.step)
    run.truncate_metrics("rl", trainer.step)
    metrics_writer.last_step = trainer.step
    trainer.publish_policy()  # the backend samples from the current weights, version = step
    if on_published is not None:
        on_published()
    evaluated = {r["step"] for r in run.read_metrics() if r.get("phase") == "eval"}

    async def record_eval() -> None:
        metrics = await _evaluate(config, eval_engine)
        run.append_metrics({"phase": "eval", "step": trainer.step, **metrics})
        evaluated.add(trainer.step)
        console.print(
            f"eval at RL step {trainer.step}: success_rate {metrics['success_rate']:.3f}, "
            f"reward_mean {metrics['reward_mean']:.3f}"
        )

    def eval_due(step: int) -> bool:  # before RL, every eval.every steps, after RL
        every, last = config.eval.every, config.trainer.steps
        return step in (0, last) or bool(every and step % every == 0)

    async def after_step(step: int) -> None:
        rollouts = getattr(source, "last_rollouts", None)  # none: a pipeline learner
        if (
            rollouts
            and config.logging.num_sample_rollouts
            and step % config.logging.console_every == 0
        ):
            run.append_samples(step, rollouts[: config.logging.num_sample_rollouts])
        if eval_due(step) and step < config.trainer.steps:
            await record_eval()

    # A resume redoes an evaluation only if its record is missing (interrupted mid-eval).
    if (
        eval_due(trainer.step)
        and trainer.step not in evaluated
        and trainer.step < config.trainer.steps
    ):
        asyncio.run(record_eval())
    run_steps(
        trainer,
        config.trainer.steps - trainer.step,
        after_step,
        every=config.trainer.checkpoint_every,
    )
    if trainer.step not in evaluated:
        asyncio.run(record_eval())


async def _evaluate(config: RunConfig, engine: RolloutEngine) -> dict[str, float]:
    requests = make_requests(
        config, range(config.eval.num_problems), sampling_spec(config, greedy=True)
    )
    metrics, _ = await run_eval(engine, requests, default_reducers())
    return metrics


# ---------------------------------------------------------------------------- helpers
def _loggers(
    config: RunConfig, run: RunDirectory, phase: str, title: str, steps: int, console: Console
) -> list[Any]:
    shown = "loss" if phase == "warm_start" else "batch/reward_mean"
    loggers: list[Any] = [
        PhaseMetricsWriter(run, phase),
        ProgressLogger(steps, title, reward_key=shown, console=console),
        RichConsoleLogger(keys=CONSOLE_KEYS, every=config.logging.console_every, console=console),
    ]
    if config.logging.wandb:
        from ludic.training import WandbLogger

        loggers.append(WandbLogger(project="ludic", name=f"{run.path.name}/{phase}"))
    if config.logging.tensorboard:
        from ludic.training import TensorBoardLogger

        loggers.append(TensorBoardLogger(run.path / "tensorboard" / phase))
    return loggers


def _checkpoint_config(config: RunConfig, run: RunDirectory, phase: str) -> CheckpointConfig:
    # every_n_steps=0: the job saves (after the step's records), not the Trainer.
    return CheckpointConfig(
        run.checkpoint_dir(phase), every_n_steps=0, keep_last=config.trainer.keep_last
    )


def _newest_checkpoint(run: RunDirectory) -> Path | None:
    for phase in ("rl", "warm_start"):
        if run.has_checkpoint(phase):
            return CheckpointManager(_checkpoint_config(run.load_config(), run, phase)).latest()
    return None


def _pad_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise RunError("model.path: the tokenizer has neither a pad nor an EOS token")
    return int(pad)


def _summary(run: RunDirectory, seconds: float) -> dict[str, Any]:
    records = run.read_metrics()
    rl = [
        r["reward_mean"]
        for r in records
        if r.get("phase") == "rl" and r.get("reward_mean") is not None
    ]
    evals = [r for r in records if r.get("phase") == "eval"]
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
    }
