"""Weights to publish: the policy's parameters under the *base* HF model's names.

Inference runtimes load plain HF checkpoints, so a LoRA policy is published merged
(``W + delta``) under the base model's names. The merge is computed out of place: the
training model (and its adapter) is never modified. A vLLM server with LoRA support can
take the adapter alone instead (:func:`adapter_state_dict`, :func:`adapter_config`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

PEFT_PREFIX = "base_model.model."
BASE_LAYER_INFIX = ".base_layer"
LORA_MARKERS = ("lora_", ".original_module.")


def policy_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF-named, detached policy weights ready for ``PolicyPublisher.publish``.

    * A plain model: its ``state_dict()`` (detached, sharing storage).
    * A peft LoRA model: every LoRA-wrapped base weight replaced by
      ``W + sum_adapters get_delta_weight(adapter)`` (computed without touching the
      model), LoRA tensors left out, and peft's ``base_model.model.`` prefix and
      ``.base_layer`` infix removed, so the names equal the base model's ``state_dict``.
    """
    if not _is_peft_model(model):
        return {name: t.detach() for name, t in model.state_dict().items()}
    merged = _merged_lora_tensors(model)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if any(marker in name for marker in LORA_MARKERS):
            continue
        out[_base_name(name)] = merged.get(name, tensor).detach()
    return out


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA tensors of a peft model's active adapter under peft's saved names
    (``base_model.model.<module>.lora_A.weight``), detached: what an adapter-only sync
    publishes (``ludic.inference.vllm.adapter``). ``ValueError`` for a model without one,
    or an adapter vLLM's LoRA support would not load as trained (see
    :func:`adapter_config`)."""
    from peft import get_peft_model_state_dict

    adapter_config(model)  # refuses what vLLM cannot serve
    state = get_peft_model_state_dict(model)
    return {name: t.detach() for name, t in state.items()}


def adapter_config(model: torch.nn.Module) -> dict[str, object]:
    """The active adapter's ``r``, ``lora_alpha`` and ``target_modules`` (what a server
    needs besides the tensors). ``ValueError`` unless the model is a peft LoRA model with
    one plain LoRA adapter (no DoRA, rsLoRA, LoRA bias or ``modules_to_save``)."""
    if not _is_peft_model(model):
        raise ValueError("an adapter-only sync needs a peft LoRA model (model.lora)")
    active = getattr(model, "active_adapter", "default")
    peft = model.peft_config[active]  # type: ignore[index]
    unsupported = {
        "use_dora": getattr(peft, "use_dora", False),
        "use_rslora": getattr(peft, "use_rslora", False),
        "lora_bias": getattr(peft, "lora_bias", False),
        "modules_to_save": bool(getattr(peft, "modules_to_save", None)),
    }
    used = [k for k, v in unsupported.items() if v]
    if used or len(model.peft_config) != 1:  # type: ignore[arg-type]
        raise ValueError(
            f"adapter-only syncs take one plain LoRA adapter, not {used or 'several'}; "
            "publish the merged weights (model.lora.sync: merged)"
        )
    if isinstance(peft.target_modules, str):
        raise ValueError(
            f"adapter-only syncs take target_modules as a list of names, not the pattern "
            f"{peft.target_modules!r}"
        )
    return {
        "r": int(peft.r),
        "lora_alpha": peft.lora_alpha,
        "target_modules": sorted(peft.target_modules),
    }


def check_finite(state_dict: Mapping[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` naming the first floating-point tensor holding NaN/inf.

    One pass first: the tensors' L2 norms (``torch._foreach_norm``, one call), finite
    unless a tensor holds NaN/inf or its norm overflows; only then each tensor is
    checked, to name it (or to clear a finite tensor whose norm overflowed)."""
    floats = [t.detach() for t in state_dict.values() if t.is_floating_point()]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in floats:
        by_device.setdefault(t.device, []).append(t)
    if all(
        bool(torch.isfinite(torch.stack(torch._foreach_norm(ts)).float()).all())
        for ts in by_device.values()
    ):
        return
    for name, tensor in state_dict.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(
                f"refusing to publish: tensor {name!r} contains NaN/inf; the training step "
                "diverged (lower TrainerConfig.lr, or set max_grad_norm)"
            )


def _is_peft_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and any(
        _is_lora_layer(module) for module in model.modules()
    )


def _is_lora_layer(module: torch.nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "get_delta_weight")


def _merged_lora_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{state_dict name of a base weight/bias: merged tensor}`` for every LoRA layer."""
    merged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if not _is_lora_layer(module) or _delta_already_applied_or_off(module):
                continue
            adapters = [a for a in _active_adapters(module) if a in module.lora_A]
            if not adapters:
                continue
            base = module.get_base_layer()
            prefix = f"{module_name}{BASE_LAYER_INFIX}."
            weight = base.weight.detach().clone()
            bias = base.bias.detach().clone() if getattr(base, "bias", None) is not None else None
            for adapter in adapters:
                if adapter in getattr(module, "lora_variant", {}):
                    raise NotImplementedError(
                        f"LoRA layer {module_name!r} uses a LoRA variant (e.g. DoRA) for "
                        f"adapter {adapter!r}; policy_state_dict merges vanilla LoRA only"
                    )
                weight += module.get_delta_weight(adapter).to(weight.dtype)
                if getattr(module, "lora_bias", {}).get(adapter, False) and bias is not None:
                    lora_b = module.lora_B[adapter].bias
                    bias += (lora_b * module.scaling[adapter]).to(bias.dtype)
            merged[prefix + "weight"] = weight
            if bias is not None:
                merged[prefix + "bias"] = bias
    return merged


def _delta_already_applied_or_off(module: torch.nn.Module) -> bool:
    """A merged layer's base weight already holds the delta; a disabled one adds none."""
    return bool(getattr(module, "merged", False) or getattr(module, "disable_adapters", False))


def _active_adapters(module: torch.nn.Module) -> list[str]:
    active = getattr(module, "active_adapters", None) or getattr(module, "active_adapter", [])
    return [active] if isinstance(active, str) else list(active)


def _base_name(name: str) -> str:
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX) :]
    name = name.replace(BASE_LAYER_INFIX + ".", ".")
    # modules_to_save copies replace the original module under its own name.
    if ".modules_to_save." in name:
        head, tail = name.split(".modules_to_save.", 1)
        name = f"{head}.{tail.split('.', 1)[1]}"
    return name
