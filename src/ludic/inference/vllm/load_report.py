"""A vLLM worker's side of sync verification: the checksums of what it received and of what
it loaded (``ludic.distributed.weight_transfer.verify`` has the checksum and the check).

One :class:`LoadRecorder` per sync: ``receive`` records each chunk's tensors; on a CPU worker
the load runs inside ``capturing()``, which reads each layer's parameters after vLLM's loaders
wrote them and before vLLM pre-packs them (a pre-packed weight cannot be read back); ``report``
reads the rest and builds the report. Served names come from the HF ones through the model's
``hf_to_vllm_mapper`` and ``packed_modules_mapping`` (``q_proj`` -> ``qkv_proj``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ludic.distributed.weight_transfer.verify import (
    TIED,
    Checksum,
    add_checksums,
    checksum_tensors,
    checksums,
    fetch_checksums,
    make_report,
)

logger = logging.getLogger(__name__)


class LoadRecorder:
    """Checksums of one sync's received tensors and of the served parameters it wrote.

    Args:
        model: the worker's model (``model_runner.model``).
        keep_tensors: keep the received tensors until :meth:`report` (a CPU worker keeps
            them anyway until its one load); without, the checksums in the parameters'
            dtypes are taken as each tensor arrives.
        tied_embeddings: the served model ties ``lm_head`` to the embeddings.
        tp_rank, tp_size: this worker's tensor-parallel place.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        keep_tensors: bool,
        tied_embeddings: bool,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.model = model
        self.keep_tensors = keep_tensors
        self.tied_embeddings = tied_embeddings
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.part_to_fused = {
            part: fused
            for fused, parts in getattr(model, "packed_modules_mapping", {}).items()
            if len(parts) > 1
            for part in parts
        }
        self.mapper = getattr(model, "hf_to_vllm_mapper", None)
        self.lora_wrapped = {  # a server with LoRA support wraps layers: x.base_layer.weight
            name.replace(".base_layer.", "."): name
            for name, _ in model.named_parameters()
            if ".base_layer." in name
        }
        self.received: dict[str, Checksum] = {}
        self.numel: dict[str, int] = {}
        self.cast: dict[tuple[str, torch.dtype], Checksum] = {}  # (HF name, dtype) -> ...
        self.tensors: dict[str, torch.Tensor] = {}
        self.captured: dict[str, tuple[list[torch.Tensor], torch.dtype, int]] = {}
        """Served name -> (checksum tensors, dtype, numel) read before pre-packing."""
        self.seconds = 0.0  # spent on checksums (the cost of verification on this worker)

    # ---------------------------------------------------------------- while receiving
    def receive(self, named: Mapping[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        try:
            self._receive(named)
        finally:
            self.seconds += time.perf_counter() - started

    def _receive(self, named: Mapping[str, torch.Tensor]) -> None:
        names, tensors = list(named), list(named.values())
        for name, t, s in zip(names, tensors, checksums(tensors)):
            self.received[name] = s
            self.numel[name] = int(t.numel())
            self.cast[(name, t.dtype)] = s
        if self.keep_tensors:
            self.tensors.update(named)
            return
        params = dict(self.model.named_parameters())
        for name, t in named.items():
            param = params.get(self.served_name(name) or "")
            if param is not None and param.dtype != t.dtype:
                (self.cast[(name, param.dtype)],) = checksums([t.to(param.dtype)])

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """While a CPU reload runs: record each processed layer's parameters just before
        ``quant_method.process_weights_after_loading`` (vLLM's pre-packing) runs."""
        prefixes = {id(m): name for name, m in self.model.named_modules()}
        patched: list[tuple[Any, Any]] = []
        for module in self.model.modules():
            qm = getattr(module, "quant_method", None)
            original = getattr(qm, "process_weights_after_loading", None)
            if original is None or any(qm is q for q, _ in patched):
                continue
            patched.append((qm, qm.__dict__.get("process_weights_after_loading")))
            qm.process_weights_after_loading = self._capture_then(original, prefixes)
        try:
            yield
        finally:
            for qm, own in patched:
                if own is None:
                    del qm.process_weights_after_loading
                else:
                    qm.process_weights_after_loading = own

    def _capture_then(self, original: Any, prefixes: Mapping[int, str]) -> Any:
        def process(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            prefix = prefixes.get(id(layer))
            started = time.perf_counter()
            if prefix is not None:
                for n, p in layer.named_parameters(recurse=False):
                    if p.numel():  # fetched with the others in report()
                        full = f"{prefix}.{n}" if prefix else n
                        self.captured[full] = (checksum_tensors(p), p.dtype, int(p.numel()))
            self.seconds += time.perf_counter() - started
            return original(layer, *args, **kwargs)

        return process

    # ---------------------------------------------------------------- after the load
    def served_name(self, hf_name: str) -> str | None:
        name = hf_name
        if self.mapper is not None:
            mapped = self.mapper._map_name(name)  # vLLM's WeightsMapper
            if mapped is None:
                return None
            name = mapped
        pieces = name.split(".")
        for i in range(len(pieces) - 1, -1, -1):
            if pieces[i] in self.part_to_fused:
                pieces[i] = self.part_to_fused[pieces[i]]
                break
        name = ".".join(pieces)
        return self.lora_wrapped.get(name, name)

    def report(self, version: int | None) -> dict[str, Any]:
        params = dict(self.model.named_parameters())
        groups: dict[str, list[str]] = {}
        unverified: dict[str, str] = {}
        for name in self.received:
            served = self.served_name(name)
            if served is not None and (served in params or served in self.captured):
                groups.setdefault(served, []).append(name)
            elif self.tied_embeddings and name.endswith("lm_head.weight"):
                unverified[name] = TIED
            else:
                unverified[name] = (
                    f"the served model has no parameter {served!r} for it (vLLM names: e.g. "
                    f"{sorted(params)[:3]}); set inference.vllm.verify_sync: off only if "
                    "the canary passes"
                )
        partial: list[str] = []
        read: dict[str, tuple[list[torch.Tensor], torch.dtype, int]] = {}
        for served, parts in groups.items():
            fused = served not in parts  # q_proj -> qkv_proj
            if fused and not self._complete(served, parts):
                partial.extend(parts)  # a fused layer written in part (CUDA only)
            elif served in self.captured:
                read[served] = self.captured[served]
            else:
                param = params[served]
                read[served] = (checksum_tensors(param), param.dtype, int(param.numel()))
        fetched = dict(zip(read, fetch_checksums([r[0] for r in read.values()])))
        loaded: dict[str, dict[str, Any]] = {}
        for served, (_, dtype, numel) in read.items():
            parts, checksum = groups[served], fetched[served]
            full = sum(self.numel[p] for p in parts)
            size = torch.empty((), dtype=dtype).element_size()
            expected = add_checksums((self._cast_checksum(p, dtype) for p in parts), size)
            loaded[served] = {
                "parts": sorted(parts),
                "checksum": list(checksum),
                "expected": list(expected),
                "element_size": size,
                "sharded": self.tp_size > 1 and numel < full,
            }
        return make_report(
            version=version,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            received=self.received,
            loaded=loaded,
            unverified=unverified,
            partial=sorted(partial),
        )

    def _complete(self, served: str, parts: list[str]) -> bool:
        """Whether every HF part of the fused parameter ``served`` was received."""
        fused = set(self.part_to_fused.values())
        leaf = next((p for p in reversed(served.split(".")) if p in fused), None)
        wanted = [k for k, v in self.part_to_fused.items() if v == leaf]
        return len(parts) == len(wanted)

    def _cast_checksum(self, name: str, dtype: torch.dtype) -> Checksum:
        key = (name, dtype)
        if key not in self.cast:
            tensor = self.tensors.get(name)
            if tensor is None:
                raise RuntimeError(
                    f"no checksum of {name!r} in {dtype} (the tensor was not kept); a bug in "
                    "ludic's load report"
                )
            (self.cast[key],) = checksums([tensor.to(dtype)])
        return self.cast[key]
