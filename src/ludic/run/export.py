"""The trained policy as a Hugging Face folder (``RUN_DIR/policy/``, ``ludic export``).

A run writes ``RUN_DIR/policy/`` at the end of each phase, and ``ludic export RUN_DIR
[--step N] [--phase P] OUT`` writes any kept checkpoint. The folder loads with
``AutoModelForCausalLM.from_pretrained`` and ``ludic serve policy --model``:
``config.json``, ``model.safetensors`` (LoRA merged), ``generation_config.json``, the
tokenizer and ``ludic_checksums.json`` (for ``VLLMChatClient.load_weights_from_disk``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ludic.distributed import policy_state_dict
from ludic.distributed.weight_transfer.extractor import gather_full_tensors
from ludic.distributed.weight_transfer.manifest import write_manifest
from ludic.jsonl import fsync_dir, fsync_tree
from ludic.run.errors import RunError
from ludic.run.models import load_policy
from ludic.run.run_dir import RunDirectory
from ludic.training.checkpoint import (
    CheckpointConfig,
    CheckpointManager,
    load_checkpoint,
    step_of,
)
from ludic.training.data_parallel import TrainerRanks, gathered

__all__ = [
    "POLICY_DIR",
    "export_run",
    "recover_policy_folder",
    "save_policy",
    "save_policy_folder",
]

POLICY_DIR = "policy"
"""``RUN_DIR/policy``: the newest phase's final policy."""

PHASES = ("rl", "warm_start")


def save_policy_folder(
    policy: torch.nn.Module,
    tokenizer: Any,
    out: str | Path,
    *,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``policy`` and ``tokenizer`` as a Hugging Face folder at ``out`` (with
    ``state_dict``: those weights, e.g. a sharded policy's gathered ones, under
    ``policy``'s config), with ``ludic_checksums.json``, the checksums a server that
    loads the folder from disk is verified against
    (:mod:`ludic.distributed.weight_transfer.manifest`).

    A peft LoRA model is written merged (``policy_state_dict``: W + BA, the names of
    the base model) without touching the training model. The folder is written next to
    ``out``, fsynced, and swapped into place in one step (``renameat2(RENAME_EXCHANGE)``
    on Linux), so a crash at any moment leaves ``out`` either the old folder or the
    complete new one. Where the exchange is not available the old folder is first
    renamed to ``.NAME-old``; a crash between the two renames is repaired by the next
    call (and by :func:`recover_policy_folder`). Folders a killed call left behind are
    removed by the next call.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_policy_folder(out)
    for stale in out.parent.glob(f".{out.name}-tmp-*"):  # a killed call's temporary folder
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-tmp-", dir=out.parent))
    try:
        model = _base_model(policy)
        weights = policy_state_dict(policy) if state_dict is None else dict(state_dict)
        model.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_manifest(tmp)  # what a server loading the folder must report
        fsync_tree(tmp)
        if not out.exists():
            tmp.rename(out)
        elif not _exchange(tmp, out):  # tmp now holds the old folder, removed below
            old = _old(out)
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)  # a crash before this line: recover_policy_folder restores
            shutil.rmtree(old, ignore_errors=True)
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def save_policy(policy: Any, tokenizer: Any, out: Path, ranks: TrainerRanks | None) -> Path | None:
    """:func:`save_policy_folder` of a possibly sharded policy: with ``ranks``, every rank
    calls it (a collective): all gather the full weights with rank 0, which writes the
    folder and returns it (the others return ``None``)."""
    if ranks is None:
        return save_policy_folder(policy, tokenizer, out)
    state = policy_state_dict(policy)
    if not ranks.is_main:
        gather_full_tensors(state)
        return None
    return save_policy_folder(policy, tokenizer, out, state_dict=gathered(state))


def recover_policy_folder(out: str | Path) -> None:
    """Put back the folder a crash between the two renames of the fallback swap left as
    ``.NAME-old`` (``out`` itself missing); otherwise drop a leftover ``.NAME-old``."""
    out = Path(out)
    old = _old(out)
    if old.is_dir():
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.rename(out)


def _old(out: Path) -> Path:
    return out.with_name(f".{out.name}-old")


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where
    the system or the filesystem cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    renameat2.argtypes += [ctypes.c_uint]
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


def export_run(
    run_dir: str | Path, out: str | Path, *, step: int | None = None, phase: str | None = None
) -> Path:
    """Write a checkpoint of ``run_dir`` as a Hugging Face folder at ``out``.

    ``phase`` (``rl`` or ``warm_start``) and ``step`` pick the checkpoint: by default the
    newest RL checkpoint, else the newest warm-start one; with ``step`` alone, that step
    of RL (else of the warm start). Returns ``out``.
    """
    run = RunDirectory.open(run_dir)
    if phase is not None and phase not in PHASES:
        raise RunError(f"--phase {phase!r}: expected one of {list(PHASES)}")
    checkpoint = _pick_checkpoint(run, step, phase)
    config = run.load_config()
    policy, tokenizer = load_policy(config, run.model_dir)
    load_checkpoint(checkpoint, policy)
    return save_policy_folder(policy, tokenizer, out)


def _pick_checkpoint(run: RunDirectory, step: int | None, phase: str | None) -> Path:
    phases = PHASES if phase is None else (phase,)
    available: dict[str, list[int]] = {}
    for name in phases:
        if not run.has_checkpoint(name):
            continue
        paths = CheckpointManager(_config(run, name)).checkpoints()
        available[name] = [step_of(p) for p in paths]
        for path in reversed(paths):  # newest first
            if step is None or step_of(path) == step:
                return path
    kept = "; ".join(f"{name}: {steps}" for name, steps in available.items()) or "none"
    wanted = "a checkpoint" if step is None else f"step {step}"
    raise RunError(
        f"{run.path}: no {wanted} to export (kept checkpoints: {kept}); checkpoints "
        "are kept every trainer.checkpoint_every steps, the last trainer.keep_last of them"
    )


def _config(run: RunDirectory, phase: str) -> CheckpointConfig:
    return CheckpointConfig(run.checkpoint_dir(phase), every_n_steps=0, keep_last=None)


def _base_model(policy: torch.nn.Module) -> Any:
    """The transformers model to save: a peft model's base (saved with merged weights)."""
    get_base = getattr(policy, "get_base_model", None)
    return get_base() if callable(get_base) else policy
