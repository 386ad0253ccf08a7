"""Publishing reward-model weights (spec 2, sec. 6.4 and 7), per training mode.

:func:`reward_sync_params` turns what the caller passes into exactly the tensors a sync
moves: names normalized to the served checkpoint's (peft / HF wrapper prefixes removed),
then checked against the mode:

* ``HEAD_ONLY``: only head tensors (``score.*`` / ``classifier.*``), at least one;
* ``LORA``: merged weights of backbone and head; raw peft tensors (``lora_A``/``lora_B``,
  ``.base_layer``, ``modules_to_save`` copies) are refused, since sending them would load
  the unmerged base weights;
* ``FULL``: backbone and head, no peft tensors.

A failed check raises ``ValueError`` naming the mode and the offending names, before
anything is announced. :func:`reward_model_state_dict` builds the right dict from a
training model (head only, or merged out of place for LoRA).

:class:`RewardModelPublisher` wraps a policy publisher (``BroadcastPolicyPublisher``: the
same extractor, sender and control plane as the policy): what it announces is built from
the very tensors it broadcasts, so announcement and payload cannot differ (the sample
client in the spec filtered names out of the announcement but still broadcast them,
which desynchronizes the group).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ludic.distributed.interfaces import PolicyPublisher
from ludic.distributed.weights import policy_state_dict
from ludic.inference.reward_client import RewardModelTrainingMode

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


class RewardModelPublisher:
    """Publishes reward-model weights through ``inner`` (normally the
    ``BroadcastPolicyPublisher`` of a :class:`VLLMRewardClient`), after
    :func:`reward_sync_params` has normalized and checked them."""

    def __init__(
        self,
        inner: PolicyPublisher,
        *,
        head_modules: Sequence[str] = HEAD_MODULES,
        training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
    ) -> None:
        self.inner = inner
        self.head_modules = tuple(head_modules)
        self.training_mode = RewardModelTrainingMode.parse(training_mode)

    def publish(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        *,
        training_mode: RewardModelTrainingMode | str | None = None,
    ) -> None:
        """Publish ``state_dict`` as reward-model ``version`` (``training_mode`` defaults
        to the one given at construction). Raises before anything is announced if the
        tensors do not fit the mode."""
        mode = self.training_mode if training_mode is None else training_mode
        params = reward_sync_params(state_dict, mode, head_modules=self.head_modules)
        self.inner.publish(params, version)


def create_reward_publisher(
    client: Any,
    *,
    head_modules: Sequence[str] = HEAD_MODULES,
    training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
    rank0_only: bool = False,
    rank: int = 0,
) -> PolicyPublisher:
    """A :class:`RewardModelPublisher` over ``client``'s weight-sync group (a
    :class:`~ludic.inference.vllm_reward_client.VLLMRewardClient` after
    ``init_weight_sync()``). ``rank0_only``: for multi-rank trainers, publish from
    ``rank`` 0 only (the others take part in gathering sharded weights)."""
    inner = getattr(client, "publisher", None)
    if inner is None:
        raise RuntimeError(
            "create_reward_publisher needs a client with a weight-sync group: call "
            "client.init_weight_sync() first"
        )
    publisher = RewardModelPublisher(inner, head_modules=head_modules, training_mode=training_mode)
    if rank0_only:
        from ludic.distributed.broadcast_publisher import Rank0OnlyPublisher

        return Rank0OnlyPublisher(publisher, rank)
    return publisher


def _sample(params: Mapping[str, Any], k: int = 3) -> str:
    names = list(params)
    more = f" and {len(names) - k} more" if len(names) > k else ""
    return ", ".join(repr(n) for n in names[:k]) + more
