"""The run directory: everything a training run leaves behind (docs/cli.md, "Run directory").

``config.yaml`` (the resolved config), ``model/`` (the initial model when the run built the
tiny one), ``metrics.jsonl`` (a line per optimizer step and per evaluation),
``samples.jsonl`` (a few full rollouts per logged RL step), ``checkpoints/PHASE/step_*/``,
``reward_curve.png``, ``summary.json``, ``policy/`` (the trained policy as a Hugging Face
folder) and, with the loggers, ``wandb/``, ``wandb_run_id`` and ``tensorboard/``.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from ludic.jsonl import append_jsonl, read_jsonl, rewrite_jsonl, write_atomic
from ludic.run.config import RunConfig
from ludic.run.errors import RunError
from ludic.run.loading import ConfigError, dump_config, read_config_file, validate_config
from ludic.types import Rollout, rollout_to_dict

PHASES = ("warm_start", "rl")


class MetricsSink(Protocol):
    """Receives every record appended to ``metrics.jsonl`` (e.g. a wandb run)."""

    def record(self, record: Mapping[str, Any]) -> None: ...


class RunDirectory:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.config_path = self.path / "config.yaml"
        self.model_dir = self.path / "model"
        self.metrics_path = self.path / "metrics.jsonl"
        self.samples_path = self.path / "samples.jsonl"
        self.plot_path = self.path / "reward_curve.png"
        self.summary_path = self.path / "summary.json"
        self.sinks: list[MetricsSink] = []
        """Told every record :meth:`append_metrics` writes, after it is on disk."""

    @classmethod
    def create(cls, output_dir: str | Path, name: str) -> RunDirectory:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = Path(output_dir) / f"{name}-{stamp}"
        path, n = base, 1
        while path.exists():
            n += 1
            path = base.with_name(f"{base.name}-{n}")
        path.mkdir(parents=True)
        return cls(path)

    @classmethod
    def open(cls, path: str | Path) -> RunDirectory:
        run = cls(path)
        if not run.config_path.is_file():
            raise FileNotFoundError(
                f"--resume {str(path)!r}: not a run directory (no config.yaml); pass the "
                "folder a previous `ludic train` printed"
            )
        return run

    # ---- paths -------------------------------------------------------------------------
    def checkpoint_dir(self, phase: str) -> Path:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        return self.path / "checkpoints" / phase

    def has_checkpoint(self, phase: str) -> bool:
        folder = self.checkpoint_dir(phase)
        return folder.is_dir() and any(p.name.startswith("step_") for p in folder.iterdir())

    def holds_results(self) -> bool:
        """Whether the run has produced anything worth keeping: a metrics record or a
        checkpoint (of any phase)."""
        checkpoints = self.path / "checkpoints"
        return self.metrics_path.is_file() or (
            checkpoints.is_dir() and any(checkpoints.rglob("step_*"))
        )

    # ---- config ------------------------------------------------------------------------
    def save_config(self, config: RunConfig) -> None:
        """Write ``config.yaml`` atomically (a pipeline actor may be reading it)."""
        write_atomic(self.config_path, dump_config(config))

    def load_config(self) -> RunConfig:
        try:
            return validate_config(read_config_file(self.config_path))
        except ConfigError as e:
            raise ConfigError(f"{self.config_path}: {e}") from None

    # ---- records -----------------------------------------------------------------------
    def append_metrics(self, record: Mapping[str, Any]) -> None:
        """Append one line and fsync it, so a checkpoint saved afterwards never gets ahead
        of ``metrics.jsonl``."""
        line = _jsonable(record)
        append_jsonl(self.metrics_path, line)
        for sink in self.sinks:
            sink.record(line)

    def read_metrics(self) -> list[dict[str, Any]]:
        """Every record; a torn last line (a crash mid-append) is dropped with a warning
        naming the file, a damaged line elsewhere is an error naming file and line."""
        if not self.metrics_path.is_file():
            return []
        return read_jsonl(self.metrics_path, tolerate_torn_tail=True)

    def truncate_metrics(self, phase: str, after_step: int) -> None:
        """Drop ``phase`` records past ``after_step`` (steps a resume will redo), the
        evaluations past it, and every later phase's records (so after ``warm_start`` all
        ``rl`` and ``eval`` records). The file is rewritten atomically."""
        if not self.metrics_path.is_file():
            return
        later = PHASES[PHASES.index(phase) + 1 :] if phase in PHASES else ()
        evals_from = after_step if phase == "rl" else -1  # warm start: no eval survives

        def redone(r: Mapping[str, Any]) -> bool:
            kind, step = r.get("phase"), r.get("step", 0)
            return (
                (kind == phase and step > after_step)
                or kind in later
                or (kind == "eval" and phase in PHASES and step > evals_from)
            )

        rewrite_jsonl(self.metrics_path, [r for r in self.read_metrics() if not redone(r)])

    def append_samples(self, step: int, rollouts: Iterable[Rollout]) -> None:
        append_jsonl(self.samples_path, *({"step": step, **rollout_to_dict(r)} for r in rollouts))

    def truncate_samples(self, after_step: int) -> None:
        """Drop the samples of steps past ``after_step`` (a resume redoes them)."""
        if self.samples_path.is_file():
            kept = read_jsonl(self.samples_path, tolerate_torn_tail=True)
            rewrite_jsonl(self.samples_path, [r for r in kept if r.get("step", 0) <= after_step])

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        self.summary_path.write_text(json.dumps(_jsonable(summary), indent=2) + "\n")


def open_run(
    config: RunConfig, *, resume: str | Path | None, resumable: Iterable[str]
) -> tuple[RunDirectory, RunConfig]:
    """A new run directory for ``config`` (``resume`` None), or the run at ``resume``
    with ``config`` checked against its saved one: they may differ only at the dotted keys
    (or below) in ``resumable``, else ``RunError`` names the differing keys. Saves the
    config either way."""
    if resume is None:
        run = RunDirectory.create(config.output_dir, config.name)
    else:
        run = RunDirectory.open(resume)
        resumable = sorted(resumable)
        changed = changed_keys(run.load_config(), config, resumable)
        if changed:
            raise RunError(
                f"--resume: the config differs from the run's saved config at {changed}; "
                f"resume with the run's own config.yaml (only {', '.join(resumable)} may "
                "change) or start a new run"
            )
    run.save_config(config)
    return run, config


@contextlib.contextmanager
def removed_if_start_fails(run: RunDirectory, *, created: bool) -> Iterator[None]:
    """Around the start of a run (loading its model): when it fails, a run directory this
    start ``created`` is removed again unless it already holds results
    (:meth:`RunDirectory.holds_results`), so a model that does not load leaves no
    half-made run behind. A resumed run's directory is always kept."""
    try:
        yield
    except BaseException:
        if created and not run.holds_results():
            shutil.rmtree(run.path, ignore_errors=True)
        raise


def changed_keys(saved: RunConfig, config: RunConfig, allowed: Iterable[str]) -> list[str]:
    """The dotted keys at which ``config`` differs from ``saved``, but for those at or below
    a key in ``allowed`` (a collection: it is read once per key)."""
    return sorted(
        key
        for key in _flat_diff(saved.model_dump(), config.model_dump())
        if not any(key == r or key.startswith(r + ".") for r in allowed)
    )


def _flat_diff(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys where ``a`` and ``b`` differ; ``kwargs`` dicts count as one value."""
    keys: list[str] = []
    for k in sorted(set(a) | set(b)):
        path = f"{prefix}{k}"
        va, vb = a.get(k), b.get(k)
        nested = isinstance(va, Mapping) and isinstance(vb, Mapping)
        if nested and k not in ("kwargs", "eval_kwargs"):
            keys += _flat_diff(va, vb, path + ".")
        elif va != vb:
            keys.append(path)
    return keys


class PhaseMetricsWriter:
    """A ``TrainingLogger`` that appends a phase's step metrics to ``metrics.jsonl``.

    Each line leads with ``phase``, ``step``, ``reward_mean`` (mean total reward of the
    step's rollouts), ``loss``, ``tokens_per_s`` and ``policy_version``, then every other
    trainer metric.
    """

    def __init__(self, run: RunDirectory, phase: str) -> None:
        self.run, self.phase = run, phase
        self.last_step = 0
        """The step of the newest line written (or of the checkpoint a resume loaded)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        record: dict[str, Any] = {
            "phase": self.phase,
            "step": step,
            "reward_mean": metrics.get("batch/reward_mean"),
            "loss": metrics.get("loss"),
            "tokens_per_s": metrics.get("tokens_per_s"),
            "policy_version": metrics.get("policy_version"),
        }
        record.update({k: v for k, v in metrics.items() if k not in record})
        self.run.append_metrics(record)
        self.last_step = step

    def close(self) -> None:
        return None


def _jsonable(value: Any) -> Any:
    """NaN/inf become null so every line is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value
