"""Adapter-only LoRA syncs: a policy trained with LoRA publishes its adapter, not its
merged weights, and vLLM serves it through its own LoRA support.

The protocol, one sync at a time:

1. The trainer announces the sync: ``POST /lora_adapter`` with the adapter's peft config
   (``r``, ``lora_alpha``, ``target_modules``). The announcement holds for the next sync
   only (a sync without one is a full-weight sync).
2. The adapter's tensors travel like any other sync's (broadcast or CUDA IPC chunks), under
   peft's names (``base_model.model.<module>.lora_A.weight``).
3. Each worker keeps the chunks; with the last one it writes them as a peft adapter
   folder (``adapter_model.safetensors`` + ``adapter_config.json``, one folder per worker,
   replaced by each sync) and loads it with ``model_runner.add_lora(LoRARequest(...,
   load_inplace=True))``: vLLM's own loader parses, packs (``q_proj`` into ``qkv_proj``)
   and scales it, replacing the adapter of the previous sync under the same id.
4. The server then routes every request that names no adapter to it (the admission gate
   adds the ``LoRARequest``, read with the version), so clients keep asking for the base
   model and get the current policy.

**Verification** (``ludic.distributed.weight_transfer.verify``): a worker reports the
checksum of each tensor as received, and, as loaded, the checksum of the tensor vLLM's
adapter cache holds for it (``lora_a`` as sent, ``lora_b`` times ``alpha / r``, both in the
LoRA dtype) against the one computed from the received tensor. The stacked buffers the
adapter is copied into when it serves are not read back: the canary covers them.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ludic.distributed.weight_transfer.verify import Checksum, checksums, make_report

ADAPTER_NAME = "ludic-policy"
"""The name the policy adapter is loaded under."""
ADAPTER_ID = 1
"""vLLM's ``lora_int_id`` of the policy adapter (one adapter, replaced in place)."""
ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
CONFIG_KEYS = ("r", "lora_alpha", "target_modules")
"""The peft config fields an announcement must carry."""


def is_lora_name(name: str) -> bool:
    """A peft LoRA tensor's name (``...q_proj.lora_A.weight``)."""
    return ".lora_A." in name or ".lora_B." in name


def check_adapter_config(config: Mapping[str, Any], max_rank: int | None) -> dict[str, Any]:
    """The announced peft config as written to ``adapter_config.json``; ``ValueError``
    naming the field unless it has ``r`` (at most ``max_rank``, the server's
    ``--max-lora-rank``), ``lora_alpha`` and a list of ``target_modules``."""
    missing = [k for k in CONFIG_KEYS if k not in config]
    if missing:
        raise ValueError(f"the adapter config has no {missing}; it needs {list(CONFIG_KEYS)}")
    r, alpha, targets = config["r"], config["lora_alpha"], config["target_modules"]
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"adapter r={r!r}: need a positive integer")
    if max_rank is not None and r > max_rank:
        raise ValueError(
            f"adapter r={r} exceeds this server's --max-lora-rank {max_rank}; start it with "
            f"--lora-rank {r} or more"
        )
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"adapter lora_alpha={alpha!r}: need a positive number")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"adapter target_modules={targets!r}: need a list of module names")
    return {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": alpha,
        "target_modules": sorted(targets),
        "bias": "none",
        "lora_dropout": 0.0,
        "use_rslora": False,
    }


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
    from vllm.lora.utils import parse_fine_tuned_lora_name

    held = model_runner.lora_manager._adapter_manager.get_adapter(ADAPTER_ID)
    if held is None:
        raise RuntimeError("the adapter is not in vLLM's adapter cache after its load")
    model = model_runner.model
    packed = {
        part: (fused, i)
        for fused, parts in getattr(model, "packed_modules_mapping", {}).items()
        for i, part in enumerate(parts)
    }
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:  # renames only, as vLLM's adapter loader (no stacking)
        mapper = mapper.get_rename_mapper()
    scaling = float(config["lora_alpha"]) / int(config["r"])
    names, got, want = [], [], []
    unverified: dict[str, str] = {}
    for name, tensor in tensors.items():
        module, is_a = parse_fine_tuned_lora_name(name, mapper)
        layer, index = held.loras.get(module), None
        if layer is None:  # packed into its fused module (q_proj -> qkv_proj)
            head, _, part = module.rpartition(".")
            fused, index = packed.get(part, (None, None))
            layer = held.loras.get(f"{head}.{fused}") if fused else None
        if layer is None:
            unverified[name] = f"vLLM's adapter holds no LoRA for module {module!r}"
            continue
        stored = layer.lora_a if is_a else layer.lora_b
        if index is not None:
            stored = stored[index]
        if stored is None:
            unverified[name] = f"vLLM's adapter dropped the LoRA of module {module!r}"
            continue
        expected = tensor.to(stored.device, stored.dtype, copy=True)
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
    report = make_report(
        version=version,
        tp_rank=tp_rank,
        tp_size=tp_size,
        received=received,
        loaded=loaded,
        unverified=unverified,
    )
    report["partial"] = []
    report["adapter"] = True
    return report
