"""ProgressLogger: a rich progress bar that is a TrainingLogger and stays quiet off a TTY."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from ludic.run.progress import ProgressLogger
from ludic.training.loggers import TrainingLogger


def test_progress_logger_off_a_terminal_prints_the_bar_once_at_close() -> None:
    buf = io.StringIO()
    logger = ProgressLogger(5, "rl", console=Console(file=buf, force_terminal=False, width=120))
    assert isinstance(logger, TrainingLogger)
    logger.log(1, {"batch/reward_mean": 0.25, "tokens_per_s": 1234.5})
    logger.log(2, {"loss": 0.1})  # no reward, no tokens/s: shown as "-"
    logger.log(3, {"batch/reward_mean": 0.5, "tokens_per_s": 2000.0})
    logger.close()
    logger.close()  # idempotent
    logger.log(4, {})  # after close: ignored

    out = buf.getvalue()
    assert out.count("\n") == 1, out
    assert "rl" in out and "3/5" in out and "reward 0.500" in out and "2,000 tok/s" in out


def test_progress_logger_shows_dash_for_missing_or_non_finite_values() -> None:
    buf = io.StringIO()
    logger = ProgressLogger(
        2, "sft", reward_key="loss", console=Console(file=buf, force_terminal=False, width=120)
    )
    logger.log(1, {"loss": float("nan")})
    logger.close()
    out = buf.getvalue()
    assert "1/2" in out and "loss -" in out and "- tok/s" in out


def test_progress_logger_rejects_a_non_positive_total() -> None:
    with pytest.raises(ValueError, match="total_steps=0"):
        ProgressLogger(0, "rl")
