"""Loading received tensors into an inference model.

* :class:`ModuleWeightLoader`: any ``nn.Module`` (tests, in-process inference); copies in
  place into its ``state_dict`` entries, checking names, shapes and dtypes.
* :class:`VLLMWeightLoader`: inside a vLLM worker (e.g. a worker-extension method), given
  the worker's ``model_runner``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ludic.distributed.weight_transfer.base import WeightLoader


class ModuleWeightLoader(WeightLoader):
    """Copies named tensors into ``module``'s parameters and buffers, in place.

    Every name must be a ``state_dict`` key of ``module`` with the same shape; dtypes
    are converted to the module's. All names are checked before anything is copied, so a
    bad update leaves the module untouched.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def load(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        targets = self.module.state_dict(keep_vars=True)
        unknown = [name for name in named_tensors if name not in targets]
        if unknown:
            raise KeyError(
                f"ModuleWeightLoader: {len(unknown)} name(s) are not in the module's "
                f"state_dict, e.g. {unknown[:3]}; the trainer and the inference model must "
                "be the same architecture (and the trainer publishes HF names)"
            )
        for name, tensor in named_tensors.items():
            if tuple(tensor.shape) != tuple(targets[name].shape):
                raise ValueError(
                    f"ModuleWeightLoader: {name!r} has shape {tuple(tensor.shape)} but the "
                    f"module's is {tuple(targets[name].shape)}; nothing was loaded"
                )
        with torch.no_grad():
            for name, tensor in named_tensors.items():
                targets[name].copy_(tensor)


class VLLMWeightLoader(WeightLoader):
    """Loads into a vLLM worker's model, given ``model_runner`` (``self.model_runner``
    inside a worker extension).

    * CPU workers: after start-up vLLM pre-packs every linear weight and leaves the
      parameter an empty ``[0]`` tensor, so ``model.load_weights`` fails there. The loader
      calls ``model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)``,
      which re-runs vLLM's checkpoint loading (and the pre-packing) on the new tensors.
    * CUDA workers: ``model_runner.model.load_weights(weights=[(name, tensor), ...])``.

    Names are HF checkpoint names; vLLM maps them to its fused parameters.
    """

    def __init__(self, model_runner: Any, *, device: str | torch.device | None = None) -> None:
        self.model_runner = model_runner
        self.device = torch.device(device) if device is not None else _runner_device(model_runner)

    def load(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        if self.device.type == "cpu":
            self.model_runner.reload_weights(
                weights_iterator=iter(named_tensors.items()), is_checkpoint_format=True
            )
        else:
            self.model_runner.model.load_weights(weights=list(named_tensors.items()))


def _runner_device(model_runner: Any) -> torch.device:
    device = getattr(model_runner, "device", None)
    if device is not None:
        return torch.device(device)
    try:
        return next(model_runner.model.parameters()).device
    except (AttributeError, StopIteration):
        raise ValueError(
            "VLLMWeightLoader cannot tell the worker's device (model_runner has no .device "
            "and its model no parameters); pass device='cpu' or device='cuda'"
        ) from None
