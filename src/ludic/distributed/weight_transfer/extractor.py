"""From a training model to :class:`WeightChunk` s ready to move: :class:`ModelWeightExtractor`.

A plain ``nn.Module`` gives its ``state_dict()``; a peft LoRA model is merged out of place
(``ludic.distributed.weights.policy_state_dict``: base names, LoRA tensors left out); an FSDP2
model's shards are gathered chunk by chunk with ``DTensor.full_tensor()``, a collective over
the trainer's group, so ranks that do not send call :func:`gather_full_tensors` in step.
Names stay exactly as ``state_dict`` gives them: tied weights appear under every alias
(``lm_head.weight`` too), since vLLM's loaders skip it themselves where the model ties it and
need it where it does not.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping

import torch

from ludic.distributed.weight_transfer.base import WeightChunk, WeightExtractor, dtype_name
from ludic.distributed.weights import policy_state_dict

DEFAULT_CHUNK_BYTES = 64 * 2**20


class ModelWeightExtractor(WeightExtractor):
    """Yields chunks of HF-named, contiguous tensors.

    Args:
        dtype: the inference dtype; floating-point tensors are converted to it (integer
            and bool buffers are left alone). ``None`` keeps the training dtype.
        group_by_module: keep the tensors of one module (consecutive names with the same
            parent, e.g. ``model.layers.0.self_attn.q_proj``) in the same chunk when they
            fit. With ``False`` chunks are filled tensor by tensor.
        chunk_bytes: target chunk size; consecutive modules are batched into one chunk
            while the total stays <= ``chunk_bytes``. A module larger than that is split
            into its tensors, and a tensor larger than that is a chunk of its own.
    """

    def __init__(
        self,
        *,
        dtype: torch.dtype | None = None,
        group_by_module: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes={chunk_bytes}; must be > 0 (default 64 MiB)")
        if dtype is not None:
            dtype_name(dtype)  # raises for dtypes the wire cannot carry
        self.dtype = dtype
        self.group_by_module = group_by_module
        self.chunk_bytes = chunk_bytes
        # The plan of the last state dict, by its names and sizes: a trainer extracts the
        # same layout on every sync, and planning costs ~1 us of Python a tensor.
        self._last_plan: tuple[tuple, list[tuple[list[str], str | None]]] | None = None

    def extract(self, model: torch.nn.Module) -> Iterator[WeightChunk]:
        """Chunks of ``model``'s policy weights (peft models merged, FSDP2 gathered)."""
        return self.extract_state_dict(policy_state_dict(model))

    def extract_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> Iterator[WeightChunk]:
        """Chunks of an HF-named state dict (e.g. the one ``Trainer`` publishes), names in
        state-dict order.

        Tensors are materialised (gathered, converted, made contiguous) one chunk at a
        time, so at most one chunk of copies is alive at once.
        """
        for names, module in self._reused_plan(state_dict):
            tensors = [self._prepare(state_dict[name]) for name in names]
            yield WeightChunk(names=list(names), tensors=tensors, module_name=module)

    def forget_plan(self) -> None:
        """Plan the next extraction afresh (the plan is otherwise reused while the state
        dict's names and sizes stay the same)."""
        self._last_plan = None

    # ------------------------------------------------------------------ internals
    def _reused_plan(
        self, state_dict: Mapping[str, torch.Tensor]
    ) -> list[tuple[list[str], str | None]]:
        """:meth:`_plan`, computed once per layout (names and sizes) of ``state_dict``."""
        key = (tuple(state_dict), tuple([self._out_bytes(t) for t in state_dict.values()]))
        if self._last_plan is None or self._last_plan[0] != key:
            self._last_plan = key, list(self._plan(state_dict))
        return self._last_plan[1]

    def _plan(
        self, state_dict: Mapping[str, torch.Tensor]
    ) -> Iterator[tuple[list[str], str | None]]:
        """``(names, module)`` per chunk, from sizes alone (no gathering happens here);
        ``module`` is the chunk's one parent module, or ``None`` when it spans several."""
        budget = self.chunk_bytes
        current: list[str] = []
        parents: set[str] = set()
        current_bytes = 0
        for parent, group in self._groups(state_dict):
            sizes = [self._out_bytes(state_dict[name]) for name in group]
            group_bytes = sum(sizes)
            if current and current_bytes + group_bytes > budget:
                yield current, _only(parents)
                current, parents, current_bytes = [], set(), 0
            if group_bytes <= budget:
                current.extend(group)
                parents.add(parent)
                current_bytes += group_bytes
                continue
            # A module larger than the budget: fill chunks tensor by tensor.
            for name, size in zip(group, sizes):
                if current and current_bytes + size > budget:
                    yield current, _only(parents)
                    current, parents, current_bytes = [], set(), 0
                current.append(name)
                parents.add(parent)
                current_bytes += size
        if current:
            yield current, _only(parents)

    def _groups(self, state_dict: Mapping[str, torch.Tensor]) -> list[tuple[str, list[str]]]:
        """``(parent, names)`` for runs of consecutive names with the same parent module
        (one name per group without ``group_by_module``). State-dict order is kept: the
        gathers of sharded tensors must run in the same order on every rank."""
        groups: list[tuple[str, list[str]]] = []
        previous = None
        for name in state_dict:
            parent = name.rpartition(".")[0]
            if self.group_by_module and parent == previous:
                groups[-1][1].append(name)
            else:
                groups.append((parent, [name]))
            previous = parent
        return groups

    def _out_bytes(self, tensor: torch.Tensor) -> int:
        if self.dtype is None or not tensor.is_floating_point():
            return tensor.nbytes
        return tensor.numel() * self.dtype.itemsize

    def _prepare(self, tensor: torch.Tensor) -> torch.Tensor:
        # Only copy when needed: a contiguous tensor already in the inference dtype is
        # passed on as is (the sender reads it before the trainer's next step).
        if type(tensor) is not torch.Tensor or tensor.requires_grad:  # Parameter, DTensor
            tensor = tensor.detach()
            if is_dtensor(tensor):
                # Gather in the training dtype, then convert: every rank runs the same
                # collective (see gather_full_tensors).
                tensor = tensor.full_tensor()
        if self.dtype is not None and tensor.dtype != self.dtype and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        return tensor if tensor.is_contiguous() else tensor.contiguous()


def _only(parents: set[str]) -> str | None:
    return next(iter(parents)) if len(parents) == 1 else None


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (FSDP2 / TP shards)."""
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(tensor, dtensor)


@functools.cache
def _dtensor_class() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def gather_full_tensors(state_dict: Mapping[str, torch.Tensor]) -> None:
    """Take part in the gathers of an extraction run on another rank, discarding results.

    Calls ``full_tensor()`` on every ``DTensor`` of ``state_dict`` in state-dict order, the
    order :class:`ModelWeightExtractor` gathers them in. A no-op without DTensors.
    """
    for tensor in state_dict.values():
        if is_dtensor(tensor):
            tensor.detach().full_tensor()
