"""Adapter-only LoRA syncs: a policy trained with LoRA publishes its adapter, not its merged
weights, and vLLM serves it through its own LoRA support.

This module holds the protocol's names and checks (no vLLM import: the trainer uses it); the
worker's side is ``ludic.inference.vllm.adapter_loader``. One sync: ``POST /lora_adapter``
announces the peft config (for the next sync only); the tensors travel like any sync's, under
peft's names; each worker writes a peft folder and loads it in place (vLLM's ``add_lora``);
requests naming no adapter are then served with it. Verification and refusals:
docs/design.md, "Adapter-only LoRA syncs".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
