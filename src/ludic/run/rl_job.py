"""The RL job in one process (``trainer.mode: sync`` / ``async``), or as the ranks of one
sharded trainer (``trainer.world_size``); :mod:`ludic.jobs` picks it for a policy run.

Two phases, each with its own Trainer and checkpoints: ``warm_start`` (SFT on
demonstrations; skipped at ``warm_start.steps == 0``), then ``rl`` (the configured
algorithm, publishing every ``trainer.publish_every`` steps), with greedy evaluations
before RL, every ``eval.every`` steps and after. Ctrl-C or SIGTERM stops at a step boundary
with a checkpoint; ``train_rl(config, resume=RUN_DIR)`` continues from the newest. A step's
records are fsynced before its checkpoint and a resume drops later ones, so they agree.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from ludic.distributed import ClientPolicyPublisher, policy_state_dict
from ludic.inference import HFChatTemplate
from ludic.run.builders import batch_requests, make_algorithm, make_engine
from ludic.run.config import RunConfig
from ludic.run.errors import RunError
from ludic.run.export import POLICY_DIR
from ludic.run.models import load_policy
from ludic.run.phases import (
    evaluate_policy,
    make_trainer,
    phase_checkpoint_config,
    phase_loggers,
    report_run,
    run_rl,
    warm_start,
)
from ludic.run.reward_loop import reward_loop_from_config, with_reward_loop
from ludic.run.run_dir import RunDirectory, open_run, removed_if_start_fails
from ludic.run.run_loggers import run_loggers
from ludic.run.servers import inference_backend, reward_backend
from ludic.run.threads import use_torch_threads
from ludic.run.trainer_ranks import run_as_ranks, save_policy, share_run_dir
from ludic.training import (
    AsyncBatchSource,
    CheckpointManager,
    RLAlgorithm,
    RolloutBatchSource,
    RolloutEngine,
    SleepingBatchSource,
    Trainer,
)
from ludic.training.checkpoint import load_checkpoint
from ludic.training.data_parallel import TrainerRanks

__all__ = ["RESUMABLE_CHANGES", "evaluate_rl", "train_rl"]

RESUMABLE_CHANGES = {
    "trainer.steps",
    "logging",
    "eval.every",
    "trainer.checkpoint_policy",
    "trainer.shared_prefix",
    "trainer.packing",
    "trainer.logprobs",
    "trainer.logprob_chunk_tokens",
    "model.gradient_checkpointing",
    "model.attn_implementation",
    "trainer.world_size",
}
"""Config fields a resumed run may change; anything else must match the saved config."""


def train_rl(config: RunConfig, *, resume: str | Path | None = None) -> Path:
    """Run (or resume) an RL job in this process (rank 0 leads, other ranks follow);
    returns the run directory. The config has passed :func:`~ludic.run.preflight.check_config`."""
    use_torch_threads(config, processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return run_as_ranks(
        config, lambda ranks: _lead(config, resume=resume, ranks=ranks), resume=resume is not None
    )


def _lead(config: RunConfig, *, resume: str | Path | None, ranks: TrainerRanks | None) -> Path:
    """The run, in one process or as rank 0 of several (see :mod:`ludic.run.trainer_ranks`)."""
    console = Console()
    started = time.perf_counter()
    run, config = open_run(config, resume=resume, resumable=RESUMABLE_CHANGES)
    with removed_if_start_fails(run, created=resume is None):
        policy, tokenizer = load_policy(config, run.model_dir)
    console.print(f"run directory: [bold]{run.path}[/bold]")
    if ranks is not None:  # the other ranks load the policy from here
        share_run_dir(run.path, ranks)
    with run_loggers(config, run):  # one wandb run / TensorBoard folder for every phase
        resuming = resume is not None
        warm_start(config, run, policy, tokenizer, resuming=resuming, console=console, ranks=ranks)
        _reinforce(config, run, policy, tokenizer, resuming=resuming, console=console, ranks=ranks)
    save_policy(policy, tokenizer, run.path / POLICY_DIR, ranks)
    console.print(f"trained policy (Hugging Face folder): {run.path / POLICY_DIR}")
    report_run(config, run, console, started=started, title="ludic run summary")
    return run.path


def evaluate_rl(config: RunConfig, *, run_dir: str | Path | None = None) -> dict[str, float]:
    """Greedy evaluation of the newest checkpoint in ``run_dir`` (or of the config's
    initial model when ``run_dir`` is None); returns the metrics."""
    use_torch_threads(config)
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
        return asyncio.run(evaluate_policy(config, engine))


# ---------------------------------------------------------------------------- phases
def _reinforce(
    config: RunConfig,
    run: RunDirectory,
    policy,
    tokenizer,
    *,
    resuming: bool,
    console: Console,
    ranks: TrainerRanks | None = None,
) -> None:
    """The RL phase, its policy, reward-model and reward-loop servers running meanwhile."""
    backend = inference_backend(
        config, policy, tokenizer, model_dir=run.model_dir, log_dir=run.path
    )
    with (
        backend as client,
        reward_backend(config, log_dir=run.path) as reward_client,
        reward_loop_from_config(config, log_dir=run.path) as reward_loop,
    ):
        template = HFChatTemplate(tokenizer)
        # standalone reward loop: each rollout is scored as its episode ends
        on_episode = [reward_loop.on_episode] if reward_loop is not None else []
        engine = make_engine(config, client, template, on_episode=on_episode)
        eval_engine = make_engine(config, client, template, env_overrides=config.env.eval_kwargs)
        algorithm = make_algorithm(config, reward_client=reward_client)
        if reward_loop is not None:  # evaluation keeps the env's reward
            algorithm = with_reward_loop(algorithm, reward_loop, config)
        trainer: Trainer
        source = _rollout_source(config, client, engine, algorithm, lambda: trainer.step)
        loggers = phase_loggers(
            config, run, "rl", f"RL ({algorithm.name})", config.trainer.steps, console
        )
        trainer = make_trainer(
            config, run, "rl", policy, tokenizer, source, algorithm,
            publisher=ClientPolicyPublisher(client), loggers=loggers, ranks=ranks,
        )  # fmt: skip
        run_rl(
            config, run, trainer, source, eval_engine, loggers[0],
            resuming=resuming, console=console,
        )  # fmt: skip


def _rollout_source(
    config: RunConfig,
    client: Any,
    engine: RolloutEngine,
    algorithm: RLAlgorithm,
    trainer_step: Callable[[], int],
) -> Any:
    """The RL phase's batches: rollouts of ``engine``, made ahead with ``trainer.mode:
    async``, the colocated vLLM server asleep while the trainer trains."""
    batch_index: list[int] = []  # async: batches are numbered in the order they start

    def next_requests():
        # Problems and sampling seeds are a function of the batch's index (the step that
        # will train on it), so a resumed run sees exactly the problems an uninterrupted
        # one would.
        if config.trainer.mode == "sync":
            index = trainer_step()
        else:
            index = batch_index[0] if batch_index else trainer_step()
            batch_index[:] = [index + 1]
        return batch_requests(config, index)

    source: Any = RolloutBatchSource.from_algorithm(engine, next_requests, algorithm)
    if config.trainer.mode == "async":
        source = AsyncBatchSource(source, max_staleness=config.trainer.staleness)
    if config.inference.backend == "vllm" and config.inference.vllm.sleep_level:
        # colocated: the server frees the GPU while the trainer trains
        source = SleepingBatchSource(source, client, level=config.inference.vllm.sleep_level)
    return source


def _newest_checkpoint(run: RunDirectory) -> Path | None:
    for phase in ("rl", "warm_start"):
        if run.has_checkpoint(phase):
            return CheckpointManager(
                phase_checkpoint_config(run.load_config(), run, phase)
            ).latest()
    return None
