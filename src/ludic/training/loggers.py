"""Training loggers: ``log(step, metrics)`` once per optimizer step, ``close()`` at the end.

``RichConsoleLogger`` prints one line per step, ``JsonlLogger`` appends one JSON object per
step, ``WandbLogger`` / ``TensorBoardLogger`` import their package lazily (install the
extra named in the error), and ``MultiLogger`` fans out to several.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rich.console import Console


@runtime_checkable
class TrainingLogger(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class RichConsoleLogger:
    """One line per step: ``step 12 | loss 0.4312 | grad_norm 1.02 | ...``.

    ``keys`` picks and orders the metrics shown (default: all, in insertion order);
    ``every`` prints only every this many steps.
    """

    def __init__(
        self, keys: Sequence[str] | None = None, every: int = 1, console: Console | None = None
    ) -> None:
        if every < 1:
            raise ValueError(f"RichConsoleLogger(every={every}) is invalid; expected >= 1")
        self.keys = list(keys) if keys is not None else None
        self.every = every
        self.console = console or Console()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if step % self.every:
            return
        keys = self.keys if self.keys is not None else list(metrics)
        parts = [f"[bold]step {step}[/bold]"]
        parts += [f"[cyan]{k}[/cyan] {_fmt(metrics[k])}" for k in keys if k in metrics]
        self.console.print(" | ".join(parts), highlight=False, soft_wrap=True)

    def close(self) -> None:
        return None


class JsonlLogger:
    """Appends ``{"step": step, **metrics}`` as one JSON line per call to ``path``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class WandbLogger:
    """Logs to Weights & Biases; ``init_kwargs`` go to ``wandb.init`` (project, config, ...)."""

    def __init__(self, **init_kwargs: Any) -> None:
        wandb = _require("wandb", "wandb")
        self._run = wandb.init(**init_kwargs)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class TensorBoardLogger:
    """Writes scalars to a TensorBoard event folder ``log_dir``."""

    def __init__(self, log_dir: str | Path) -> None:
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float):
                self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MultiLogger:
    """Forwards every call to each of ``loggers``."""

    def __init__(self, loggers: Iterable[TrainingLogger]) -> None:
        self.loggers = list(loggers)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for logger in self.loggers:
            logger.log(step, metrics)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def _require(module: str, extra: str) -> Any:
    try:
        return __import__(module)
    except ImportError as err:
        raise ImportError(
            f"{module} is not installed; install it with `pip install ludic-rl[{extra}]`"
        ) from err


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    return str(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bool | int | str) or value is None:
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return number if math.isfinite(number) else str(number)
