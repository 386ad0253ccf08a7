"""External loggers for a whole run: one wandb run and one TensorBoard folder span every
phase (warm start, RL, evaluations) and a resumed run (docs/cli.md, "Loggers").

They follow ``metrics.jsonl``: each record appended (:meth:`RunDirectory.append_metrics`)
is sent on with its keys under its phase (``rl/batch/reward_mean``) against that phase's
step. wandb (``logging.wandb``) keeps its run id in ``RUN_DIR/wandb_run_id`` so
``--resume`` continues the same run; ``logging.wandb_mode: offline`` writes under
``RUN_DIR/wandb``. TensorBoard (``logging.tensorboard``): ``RUN_DIR/tensorboard``.
"""

from __future__ import annotations

import contextlib
import math
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import yaml

from ludic.jsonl import write_atomic
from ludic.run.config import RunConfig
from ludic.run.loading import dump_config
from ludic.run.run_dir import MetricsSink, RunDirectory

WANDB_ID_FILE = "wandb_run_id"
TENSORBOARD_DIR = "tensorboard"


def scalars(record: Mapping[str, Any]) -> tuple[str, int, dict[str, float]]:
    """``(phase, step, {phase/key: value})`` for a metrics record's finite numbers."""
    phase, step = str(record["phase"]), int(record["step"])
    values = {
        f"{phase}/{key}": float(value)
        for key, value in record.items()
        if key not in ("phase", "step")
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    }
    return phase, step, values


class WandbSink:
    """One wandb run for the run directory (see the module docstring)."""

    def __init__(self, config: RunConfig, run: RunDirectory) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "logging.wandb: wandb is not installed; pip install 'ludic-rl[wandb]'"
            ) from e
        id_file = run.path / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if not run_id:  # first start (the file is written atomically, never torn)
            run_id = uuid.uuid4().hex[:16]
            write_atomic(id_file, run_id + "\n")
        self._run = wandb.init(
            project=config.logging.wandb_project,
            name=run.path.name,
            id=run_id,
            resume="allow",
            dir=str(run.path),
            config=yaml.safe_load(dump_config(config)),
            mode=config.logging.wandb_mode,
        )
        self._phases: set[str] = set()

    def record(self, record: Mapping[str, Any]) -> None:
        phase, step, values = scalars(record)
        step_key = f"{phase}/step"
        if phase not in self._phases:  # each phase's metrics plot against its own step
            self._run.define_metric(step_key)
            self._run.define_metric(f"{phase}/*", step_metric=step_key)
            self._phases.add(phase)
        self._run.log({**values, step_key: step})

    def close(self) -> None:
        self._run.finish()


class TensorBoardSink:
    """Scalars under ``RUN_DIR/tensorboard``, tagged ``phase/key`` at the phase's step."""

    def __init__(self, run: RunDirectory) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(
                "logging.tensorboard: tensorboard is not installed; "
                "pip install 'ludic-rl[tensorboard]'"
            ) from e
        self._writer = SummaryWriter(log_dir=str(run.path / TENSORBOARD_DIR))

    def record(self, record: Mapping[str, Any]) -> None:
        _, step, values = scalars(record)
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


@contextlib.contextmanager
def run_loggers(config: RunConfig, run: RunDirectory) -> Iterator[list[MetricsSink]]:
    """Attach the configured external loggers to ``run`` for the ``with`` block; they are
    closed (the wandb run finished) on the way out, also when the run fails."""
    sinks: list[Any] = []
    try:
        if config.logging.wandb:
            sinks.append(WandbSink(config, run))
        if config.logging.tensorboard:
            sinks.append(TensorBoardSink(run))
        run.sinks.extend(sinks)
        yield sinks
    finally:
        for sink in sinks:
            if sink in run.sinks:
                run.sinks.remove(sink)
            sink.close()
