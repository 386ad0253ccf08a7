"""Training loggers: JSONL lines, console lines, fan-out, lazy optional backends."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest
from rich.console import Console

from ludic.training.loggers import (
    JsonlLogger,
    MultiLogger,
    RichConsoleLogger,
    TensorBoardLogger,
    TrainingLogger,
    WandbLogger,
)


def test_jsonl_logger_writes_one_object_per_step_with_the_step(tmp_path) -> None:
    path = tmp_path / "logs" / "metrics.jsonl"
    logger = JsonlLogger(path)
    logger.log(1, {"loss": 0.5, "num_items": 4})
    logger.log(2, {"loss": math.nan})
    logger.close()

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 0.5, "num_items": 4}, {"step": 2, "loss": "nan"}]


def test_rich_console_logger_prints_one_line_per_step_with_chosen_keys() -> None:
    buf = io.StringIO()
    logger = RichConsoleLogger(keys=["loss"], console=Console(file=buf, width=200))
    logger.log(3, {"loss": 0.123456, "lr": 1e-5})
    out = buf.getvalue()
    assert out.count("\n") == 1
    assert "step 3" in out and "loss 0.1235" in out and "lr" not in out


def test_multi_logger_forwards_log_and_close_to_every_logger() -> None:
    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple[int, dict]] = []
            self.closed = False

        def log(self, step, metrics) -> None:
            self.calls.append((step, dict(metrics)))

        def close(self) -> None:
            self.closed = True

    a, b = Recorder(), Recorder()
    multi = MultiLogger([a, b])
    assert isinstance(multi, TrainingLogger)
    multi.log(7, {"loss": 1.0})
    multi.close()
    assert a.calls == b.calls == [(7, {"loss": 1.0})]
    assert a.closed and b.closed


def test_wandb_logger_without_wandb_names_the_extra_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ImportError, match=r"ludic-rl\[wandb\]"):
        WandbLogger(project="x")


def test_tensorboard_logger_without_tensorboard_names_the_extra_to_install(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match=r"ludic-rl\[tensorboard\]"):
        TensorBoardLogger(tmp_path)
