"""Keep a model's parameters back to back in one flat buffer per (device, dtype).

A weight sync moves tensors that lie back to back where they are; others are first copied into
a pack buffer (``ludic.distributed.weight_transfer.packing``), which on CPU competes with the
transfer for the same cores (``benchmarks/README.md``). Megatron-LM and DeepSpeed keep
contiguous parameter buffers for the same reason. :func:`flatten_parameters` changes only the
storage: every ``Parameter`` stays the same object with the same values, so optimizers built
before or after see the same parameters. Sharded (FSDP2) parameters are refused.
"""

from __future__ import annotations

import torch

from ludic.distributed.weight_transfer.extractor import is_dtensor


def flatten_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """Re-home every parameter of ``model`` into one flat buffer per (device, dtype), in
    ``named_parameters`` order (which is ``state_dict`` order; tied parameters once), and
    return the buffers.

    ``param.data`` becomes a view into its buffer, so ``model.state_dict()`` yields
    adjacent views a weight sync can send without packing. Moving the model afterwards
    (``model.to(...)``) gives each parameter its own memory again; flatten after moving.
    Persistent buffers (e.g. norms' running stats) stay where they are.

    Raises ``ValueError`` for sharded (``DTensor``, FSDP2) parameters: their memory is
    the shard's, owned by the sharding.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if is_dtensor(param):
            raise ValueError(
                f"flatten_parameters: {name!r} is a DTensor (FSDP2/TP shard); sharded "
                "parameters cannot be re-homed into a flat buffer"
            )
        groups.setdefault((param.device, param.dtype), []).append(param)
    buffers = []
    for (device, dtype), params in groups.items():
        flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
        at = 0
        with torch.no_grad():
            for param in params:
                view = flat[at : at + param.numel()].view(param.shape)
                view.copy_(param)
                param.data = view
                at += param.numel()
        buffers.append(flat)
    return buffers
