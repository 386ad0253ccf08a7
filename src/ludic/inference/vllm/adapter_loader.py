"""The worker's side of an adapter-only LoRA sync (``ludic.inference.vllm.adapter``):
write the received adapter as a peft folder, load it in place through vLLM's LoRA
manager, and report what vLLM's adapter cache holds for verification."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ludic.distributed.weight_transfer.verify import Checksum, checksums, make_report
from ludic.inference.vllm.adapter import ADAPTER_FILE, ADAPTER_ID, CONFIG_FILE


def write_adapter(folder: Path, tensors: Mapping[str, torch.Tensor], config: Mapping) -> None:
    """Write ``tensors`` and ``config`` as a peft adapter folder, replacing what was there."""
    from safetensors.torch import save_file

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    save_file(
        {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
        str(folder / ADAPTER_FILE),
    )
    (folder / CONFIG_FILE).write_text(json.dumps(dict(config)))


def load_adapter(model_runner: Any, folder: Path, name: str) -> None:
    """Load the adapter folder into the worker's LoRA manager as :data:`ADAPTER_ID`,
    replacing the one there (vLLM's ``load_inplace``)."""
    from vllm.lora.request import LoRARequest

    if getattr(model_runner, "lora_manager", None) is None:
        raise RuntimeError(
            "this vLLM server was started without LoRA support; start it with --lora-rank R "
            "(ludic serve policy --lora-rank R) to take adapter-only syncs"
        )
    request = LoRARequest(
        lora_name=name, lora_int_id=ADAPTER_ID, lora_path=str(folder), load_inplace=True
    )
    model_runner.add_lora(request)


def adapter_report(
    model_runner: Any,
    tensors: Mapping[str, torch.Tensor],
    received: Mapping[str, Checksum],
    config: Mapping[str, Any],
    *,
    version: int | None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> dict[str, Any]:
    """The worker's report of an adapter sync (``verify.make_report``'s shape): each
    tensor as received, and as vLLM's adapter cache holds it against what the received
    tensor becomes there (the LoRA dtype; ``lora_b`` scaled by ``alpha / r``)."""
    held = model_runner.lora_manager._adapter_manager.get_adapter(ADAPTER_ID)
    if held is None:
        raise RuntimeError("the adapter is not in vLLM's adapter cache after its load")
    scaling = float(config["lora_alpha"]) / int(config["r"])
    names, got, want = [], [], []
    unverified: dict[str, str] = {}
    for name, is_a, stored in _stored_loras(model_runner.model, held, tensors):
        if isinstance(stored, str):
            unverified[name] = stored
            continue
        expected = tensors[name].to(stored.device, stored.dtype, copy=True)
        if not is_a:
            expected *= scaling  # vLLM's LoRALayerWeights.optimize, in the LoRA dtype
        names.append(name)
        got.append(stored)
        want.append(expected)
    loaded = {
        name: {
            "parts": [name],
            "checksum": list(g),
            "expected": list(w),
            "element_size": t.element_size(),
            "sharded": False,
        }
        for name, g, w, t in zip(names, checksums(got), checksums(want), got)
    }
    return make_report(
        version=version,
        tp_rank=tp_rank,
        tp_size=tp_size,
        received=received,
        loaded=loaded,
        unverified=unverified,
        partial=[],
        adapter=True,
    )


def _stored_loras(
    model: Any, held: Any, tensors: Mapping[str, torch.Tensor]
) -> Iterator[tuple[str, bool, torch.Tensor | str]]:
    """Each of ``tensors``' names, whether it is a ``lora_a``, and vLLM's adapter's copy
    of it (``held``'s; a fused module's slice for a packed part), or why there is none."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    packed = {
        part: (fused, i)
        for fused, parts in getattr(model, "packed_modules_mapping", {}).items()
        for i, part in enumerate(parts)
    }
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:  # renames only, as vLLM's adapter loader (no stacking)
        mapper = mapper.get_rename_mapper()
    for name in tensors:
        module, is_a = parse_fine_tuned_lora_name(name, mapper)
        layer, index = held.loras.get(module), None
        if layer is None:  # packed into its fused module (q_proj -> qkv_proj)
            head, _, part = module.rpartition(".")
            fused, index = packed.get(part, (None, None))
            layer = held.loras.get(f"{head}.{fused}") if fused else None
        if layer is None:
            yield name, is_a, f"vLLM's adapter holds no LoRA for module {module!r}"
            continue
        stored = layer.lora_a if is_a else layer.lora_b
        if index is not None:
            stored = stored[index]
        dropped = f"vLLM's adapter dropped the LoRA of module {module!r}"
        yield name, is_a, dropped if stored is None else stored
