"""Reward-model weights by training mode (docs/design.md, "Reward models"): the naming rules.

:func:`reward_sync_params` turns what the caller passes into exactly what a sync moves: names
normalized to the served checkpoint's (peft / HF wrapper prefixes removed), then checked
against the :class:`RewardModelTrainingMode` (``HEAD_ONLY``: head tensors only; ``LORA``:
merged weights, raw peft tensors refused; ``FULL``: no peft tensors), a ``ValueError`` before
anything is announced (the rules in full: docs/reward-models.md). :func:`reward_model_state_dict`
builds that dict from a training model. Pure naming and tensor selection: no client, server or
process group here, so both the inference clients and the publishers build on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

import torch

from ludic.distributed.weights import policy_state_dict


class RewardModelTrainingMode(Enum):
    """What of a reward model is trained, and therefore what a weight sync carries.

    * ``HEAD_ONLY``: the backbone is frozen, only the linear head trains; a sync carries
      the head's tensors only (``score.weight``, ``score.bias`` if present).
    * ``LORA``: peft LoRA adapters on the backbone plus the head train; a sync carries the
      merged weights (``W + B A * scaling``) of the whole model, under base-model names.
    * ``FULL``: everything trains; a sync carries the whole model.
    """

    HEAD_ONLY = "head_only"
    LORA = "lora"
    FULL = "full"

    @classmethod
    def parse(cls, value: RewardModelTrainingMode | str) -> RewardModelTrainingMode:
        """``value`` as a mode; raises ``ValueError`` listing the valid names."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            raise ValueError(
                f"unknown reward-model training mode {value!r}; expected {valid}"
            ) from None


HEAD_MODULES = ("score", "classifier")
"""Module names of a sequence-classification head (HF: ``score`` for decoder LMs such as
Qwen2 / Llama, ``classifier`` for encoders)."""

PEFT_MARKERS = ("lora_", ".base_layer.", ".original_module.", ".modules_to_save.")
"""Name fragments of raw (unmerged) peft tensors."""

_PREFIXES = ("base_model.model.",)


def normalize_name(name: str) -> str:
    """A parameter name as the served checkpoint has it: peft's ``base_model.model.``
    removed (repeatedly), ``model.model.`` collapsed to ``model.``, and a bare
    ``layers.`` prefixed with ``model.``."""
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
    if name.startswith("model.model."):
        name = name[len("model.") :]
    if name.startswith("layers."):
        name = f"model.{name}"
    return name


def is_head(name: str, head_modules: Sequence[str] = HEAD_MODULES) -> bool:
    """Whether ``name`` belongs to the classification head (a module path component
    equal to one of ``head_modules``)."""
    return any(part in head_modules for part in name.split(".")[:-1])


def reward_sync_params(
    params: Mapping[str, torch.Tensor],
    training_mode: RewardModelTrainingMode | str,
    *,
    head_modules: Sequence[str] = HEAD_MODULES,
) -> dict[str, torch.Tensor]:
    """The tensors a sync in ``training_mode`` moves, under served names; raises
    ``ValueError`` if ``params`` do not fit the mode (see the module docstring)."""
    mode = RewardModelTrainingMode.parse(training_mode)
    where = f"reward-model sync ({mode.name})"
    if not params:
        raise ValueError(f"{where}: no tensors to publish")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in params.items():
        clean = normalize_name(name)
        if clean in out:
            raise ValueError(f"{where}: {name!r} and another tensor both map to {clean!r}")
        out[clean] = tensor
    peft = [n for n in out if any(m in f".{n}." or m in n for m in PEFT_MARKERS)]
    if peft:
        raise ValueError(
            f"{where}: {len(peft)} raw peft tensor(s) such as {peft[0]!r}; publish merged "
            "weights (reward_model_state_dict(model, mode) merges LoRA out of place)"
        )
    head = [n for n in out if is_head(n, head_modules)]
    backbone = [n for n in out if not is_head(n, head_modules)]
    if not head:
        raise ValueError(
            f"{where}: no head tensor (a module named one of {tuple(head_modules)}, e.g. "
            f"'score.weight'); got {_sample(out)}"
        )
    if mode is RewardModelTrainingMode.HEAD_ONLY and backbone:
        raise ValueError(
            f"{where}: HEAD_ONLY carries only head weights, got {len(backbone)} backbone "
            f"tensor(s) such as {backbone[0]!r} (reward_model_state_dict(model, 'head_only') "
            "selects the head)"
        )
    if mode is not RewardModelTrainingMode.HEAD_ONLY and not backbone:
        raise ValueError(
            f"{where}: {mode.name} carries the backbone too, got head tensors only "
            f"({_sample(out)}); use HEAD_ONLY to sync just the head"
        )
    return out


def reward_model_state_dict(
    model: torch.nn.Module,
    training_mode: RewardModelTrainingMode | str,
    *,
    head_modules: Sequence[str] = HEAD_MODULES,
) -> dict[str, torch.Tensor]:
    """What to publish for ``model`` trained in ``training_mode``: the head only
    (HEAD_ONLY) or every weight, LoRA merged out of place (the training model is left
    as it is). Names are the base model's (``policy_state_dict``)."""
    mode = RewardModelTrainingMode.parse(training_mode)
    state = policy_state_dict(model)
    if mode is RewardModelTrainingMode.HEAD_ONLY:
        state = {n: t for n, t in state.items() if is_head(normalize_name(n), head_modules)}
    return state


def _sample(params: Mapping[str, Any], k: int = 3) -> str:
    names = list(params)
    more = f" and {len(names) - k} more" if len(names) > k else ""
    return ", ".join(repr(n) for n in names[:k]) + more
