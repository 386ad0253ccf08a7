"""Attention over packed sequences without a mask: one causal sdpa call per sequence of a row.

A packed row under plain sdpa needs a block-diagonal causal mask: ``L^2`` scores per head, and
no fast causal kernel. As flash-attention's varlen kernel does on GPU, but for sdpa on any
device, this registers the transformers attention implementation :data:`VARLEN_SDPA`: given
``cu_seq_lens_q`` (the packed forward passes it) it runs one causal sdpa call per sequence
(``sum L_i^2`` scores); otherwise it is exactly transformers' sdpa, masks included. So a model
switched to it (:func:`use_varlen_sdpa`) computes what it computed before, in every forward;
the trainer switches a policy whose implementation is ``sdpa`` when packing is on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["VARLEN_SDPA", "use_varlen_sdpa", "varlen_sdpa_attention"]

VARLEN_SDPA = "ludic_varlen_sdpa"


def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query ``[B, H, T, D]``, key/value
    ``[B, H_kv, T, D]``; returns ``[B, T, H, D]``."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if cu_seq_lens is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{VARLEN_SDPA}: cu_seq_lens_q needs one packed row without a cache; got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}"
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{VARLEN_SDPA}: sliding-window attention is not supported")
    groups = getattr(module, "num_key_value_groups", query.shape[1] // key.shape[1])
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    bounds = cu_seq_lens.tolist()
    parts = [
        F.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            dropout_p=dropout,
            scale=scaling,
            is_causal=True,
        )
        for start, end in zip(bounds[:-1], bounds[1:])
        if end > start
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    AttentionMaskInterface.register(VARLEN_SDPA, sdpa_mask)


def use_varlen_sdpa(model: torch.nn.Module) -> bool:
    """Switch ``model`` (a Hugging Face model using ``sdpa``) to :data:`VARLEN_SDPA`;
    False, and nothing changed, for another implementation (flash-attention has its own
    varlen kernel; eager is what the user asked for)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    _register()
    model.set_attn_implementation(VARLEN_SDPA)
    return True
