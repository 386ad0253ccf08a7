"""Checkpoints: model, optimizer, scheduler, step, RNG states and trainer extra state.

Layout: ``<dir>/step_00000012/`` with ``model.pt`` (the full ``state_dict``, plain or peft),
``optimizer.pt``, ``scheduler.pt``, ``rng.pt``, ``trainer_state.json`` (``step``, ``extra``) and
what ``CheckpointConfig.write_extra`` writes. Written to a temporary folder, fsynced and renamed
into place (a crash never leaves half a ``step_*``); only the last ``keep_last`` are kept.
Non-finite or exploded weights are refused. A sharded (FSDP2) model: every rank calls ``save`` /
``load``, model and optimizer go through ``torch.distributed.checkpoint`` into ``dcp/``, which
reshards on load (another world size, one process; a ``model.pt`` loads sharded too).
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ludic.distributed.weight_transfer.extractor import is_dtensor
from ludic.jsonl import fsync_dir, fsync_tree
from ludic.training.optim import parameter_problem

STEP_PREFIX = "step_"
STATE_FILE = "trainer_state.json"
FILES = ("model.pt", "optimizer.pt", "scheduler.pt", "rng.pt", STATE_FILE)
DCP_DIR = "dcp"
"""Model and optimizer of a sharded checkpoint (``torch.distributed.checkpoint``)."""
SHARDED_FILES = ("scheduler.pt", "rng.pt", STATE_FILE)


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often to checkpoint."""

    dir: str | Path
    """Folder holding the ``step_*`` checkpoints (created if missing)."""
    every_n_steps: int = 100
    """Save after every this many optimizer steps; 0 saves only when asked."""
    keep_last: int | None = 3
    """Keep the newest this many checkpoints; ``None`` keeps all."""
    write_extra: Callable[[Path, torch.nn.Module], None] | None = None
    """Called as ``write_extra(folder, model)`` to write more into each checkpoint before
    it is fsynced and renamed into place (e.g. the policy as a Hugging Face folder). With
    a sharded model every rank calls it, after the shards are saved: it may gather (rank
    0 writes)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dir", Path(self.dir))
        if self.every_n_steps < 0:
            raise ValueError(
                f"CheckpointConfig.every_n_steps={self.every_n_steps} is invalid; expected "
                ">= 0 (0 = only explicit saves)"
            )
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(
                f"CheckpointConfig.keep_last={self.keep_last} is invalid; expected >= 1, or "
                "None to keep every checkpoint"
            )


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :meth:`CheckpointManager.load` restored besides the objects it loaded into."""

    step: int
    extra: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or unreadable."""


class CheckpointManager:
    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self.dir = Path(config.dir)

    def is_due(self, step: int) -> bool:
        every = self.config.every_n_steps
        return every > 0 and step > 0 and step % every == 0

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [
            p for p in self.dir.glob(f"{STEP_PREFIX}*") if p.is_dir() and (p / STATE_FILE).exists()
        ]
        return sorted(found, key=step_of)

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Write checkpoint ``step`` atomically, prune old ones, return its folder. Raises
        :class:`CheckpointError` (saving nothing) when the weights are non-finite or exploded."""
        problem = parameter_problem(model)  # a collective on sharded weights: every rank
        if problem is not None:
            raise CheckpointError(
                f"not saving checkpoint step {step} in {str(self.dir)!r}: {problem}; lower the "
                "learning rate or set max_grad_norm and resume from an earlier checkpoint"
            )
        final = self.dir / f"{STEP_PREFIX}{step:08d}"
        tmp = self.dir / f".tmp-{final.name}"
        sharded = is_sharded(model)
        if sharded:
            main = _rank() == 0
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            _barrier()
            _save_sharded(tmp / DCP_DIR, model, optimizer)  # every rank writes its shards
            if self.config.write_extra is not None:  # a collective: every rank calls it
                self.config.write_extra(tmp, model)
            if not main:
                _barrier()  # rank 0 renames the folder into place
                return final
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            torch.save(model.state_dict(), tmp / "model.pt")
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict() if scheduler is not None else {}, tmp / "scheduler.pt")
        torch.save(_rng_state(), tmp / "rng.pt")
        state = {"step": step, "extra": extra or {}}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, default=str))
        if self.config.write_extra is not None and not sharded:
            self.config.write_extra(tmp, model)
        fsync_tree(tmp)
        old = self.dir / f".old-{final.name}"
        if final.exists():  # moved aside (atomic), so a crash leaves a whole old or new one
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        fsync_dir(self.dir)
        shutil.rmtree(old, ignore_errors=True)
        self._prune()
        if sharded:
            _barrier()
        return final

    def load(
        self,
        path: str | Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
    ) -> LoadedCheckpoint:
        """See :func:`load_checkpoint`."""
        return load_checkpoint(path, model, optimizer, scheduler)

    def _prune(self) -> None:
        keep = self.config.keep_last
        if keep is None:
            return
        for old in self.checkpoints()[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
) -> LoadedCheckpoint:
    """Restore checkpoint ``path`` into the given objects and the global RNGs (with a
    sharded model or a sharded checkpoint, on every rank)."""
    path = Path(path)
    dcp = (path / DCP_DIR).is_dir()
    expected = SHARDED_FILES if dcp else FILES
    missing = [name for name in expected if not (path / name).is_file()]
    if missing:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is missing {missing}; it is not a complete "
            f"checkpoint (pick one from CheckpointManager.checkpoints())"
        )
    try:
        state = json.loads((path / STATE_FILE).read_text())
        if dcp:
            _load_sharded(path / DCP_DIR, model, optimizer)
        elif is_sharded(model):  # full tensors from a single-process run, onto the shards
            _load_full_into_sharded(path, model, optimizer)
        else:
            model.load_state_dict(_load(path / "model.pt"))
            if optimizer is not None:
                optimizer.load_state_dict(_load(path / "optimizer.pt"))
        if scheduler is not None:
            scheduler.load_state_dict(_load(path / "scheduler.pt"))
        _set_rng_state(_load(path / "rng.pt"))
        return LoadedCheckpoint(
            step=int(state["step"]), extra=dict(state.get("extra", {})), path=path
        )
    except (
        OSError,
        EOFError,
        pickle.UnpicklingError,
        RuntimeError,
        KeyError,
        ValueError,
        TypeError,
    ) as err:
        raise CheckpointError(
            f"cannot load checkpoint {str(path)!r}: {err}. It is corrupt or was saved "
            "for a different model/optimizer setup"
        ) from err


def step_of(path: Path) -> int:
    """The step of a ``step_*`` checkpoint folder (-1 for another name)."""
    try:
        return int(path.name[len(STEP_PREFIX) :])
    except ValueError:
        return -1


def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


# ---------------------------------------------------------------------- sharded models
def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are ``DTensor`` shards (FSDP2 / tensor parallel)."""
    return any(is_dtensor(p) for p in model.parameters())


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _save_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder))


def _load_sharded(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """A ``dcp/`` checkpoint into ``model`` (sharded or not, any world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=str(folder))
        set_model_state_dict(model, state["model"])
        return
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


def _load_full_into_sharded(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """A single-process checkpoint (``model.pt`` / ``optimizer.pt``, read by every rank)
    into a sharded model and its optimizer."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, _load(path / "model.pt"), options=full)
    if optimizer is not None:
        saved = _load(path / "optimizer.pt")  # keyed by parameter index, as torch saves it
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        by_name = {
            "state": {names[int(i)]: value for i, value in saved["state"].items()},
            "param_groups": [
                {**group, "params": [names[int(i)] for i in group["params"]]}
                for group in saved["param_groups"]
            ],
        }
        set_optimizer_state_dict(model, optimizer, by_name, options=full)


def _rng_state() -> dict[str, Any]:
    """RNG states as tensors/ints/tuples only, so they load with ``weights_only=True``."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuples(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value: Any) -> Any:
    """``random.setstate`` needs tuples; be robust to serializers that turn them to lists."""
    if isinstance(value, list | tuple):
        return tuple(_as_tuples(v) for v in value)
    return value
