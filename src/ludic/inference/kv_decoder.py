"""A lean decoding forward pass for Llama-shaped Hugging Face models, used to sample.

Sampling a small model on CPU is bound by per-call overhead, not arithmetic. :class:`KVDecoder`
runs the model's layers through :class:`~ludic.models.lean_layers.LeanLayers` (the model's
own modules without its forward's wrapping; which models it serves and why is said there)
with a preallocated key/value cache and one ``scaled_dot_product_attention`` per layer.
Logits agree with the model's forward to float32 rounding
(``tests/inference/test_kv_decoder.py``); the in-process backend samples from them and
returns their log-softmax as it does with the model's forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ludic.models.lean_layers import Fused, LeanLayers, base_model, decoder_problem

__all__ = ["KVDecoder", "decoder_problem"]


class KVDecoder:
    """Prefill a batch of left-padded prompts, then decode one token per row per call.

    ``prefill(input_ids, attention)`` takes ``[P, W]`` token ids with their 0/1 attention
    mask (padding on the left) and returns the last position's logits ``[P, V]``;
    ``select(rows)`` reorders the batch (from one row per distinct prompt to one per
    request); ``step(token_ids)`` appends one token ``[B]`` per row and returns the next
    logits ``[B, V]``. At most ``capacity`` positions fit (prompt width plus new tokens).
    Build one per batch, under ``torch.no_grad``.
    """

    def __init__(self, model: torch.nn.Module, capacity: int) -> None:
        problem = decoder_problem(model)
        if problem is not None:
            raise ValueError(f"KVDecoder: {problem}")
        base = base_model(model)
        self.lm_head = base.lm_head
        with torch.no_grad():
            self.lean = LeanLayers(base.model, base.config)
        self.capacity = capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.valid = torch.zeros(0, 0, dtype=torch.bool)  # [B, capacity]: key may be seen
        self.position = torch.zeros(0, dtype=torch.long)  # [B]: next token's position
        self.length = 0  # positions written so far
        self._spread = False  # the cache holds one row per prompt, not yet per request

    @property
    def fused(self) -> list[Fused] | None:
        """The fused projection weights, or None when each projection is called."""
        return self.lean.fused

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        rows, width = input_ids.shape
        if width > self.capacity:
            raise ValueError(f"KVDecoder: prompt width {width} > capacity {self.capacity}")
        device = input_ids.device
        lean = self.lean
        # the prompts' keys and values, one row per prompt: select() spreads them to the
        # requests' rows of the full cache
        shape = (rows, lean.kv_heads, width, lean.head_dim)
        dtype = lean.inner.embed_tokens.weight.dtype
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in lean.layers]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in lean.layers]
        lean.build_angles(self.capacity)
        self.valid = torch.zeros((rows, self.capacity), dtype=torch.bool, device=device)
        self.valid[:, :width] = attention.bool()
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        # A query sees the earlier valid keys and itself (a padding query then sees
        # only itself: no row of the softmax is empty, and its output is never read).
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        mask = causal & (
            self.valid[:, None, :width] | torch.eye(width, dtype=torch.bool, device=device)
        )
        hidden = self._forward(input_ids, positions, mask[:, None], start=0)
        self.position = positions[:, -1] + 1
        self.length = width
        self._spread = True
        return self.lm_head(lean.final_norm(hidden[:, -1]))

    def select(self, rows: torch.Tensor) -> None:
        if self._spread:  # the prompts' entries into a cache of capacity positions per row
            self._spread = False
            self.keys = [self._full(k, rows) for k in self.keys]
            self.values = [self._full(v, rows) for v in self.values]
        else:
            self.keys = [k.index_select(0, rows) for k in self.keys]
            self.values = [v.index_select(0, rows) for v in self.values]
        self.valid = self.valid.index_select(0, rows)
        self.position = self.position.index_select(0, rows)

    def _full(self, prompts: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``[B, KV, capacity, D]`` holding ``prompts[rows]`` in its first positions; the
        rest is written by the steps before any attention reads it (``[:length]``)."""
        full = prompts.new_empty(
            (rows.shape[0], *prompts.shape[1:2], self.capacity, prompts.shape[-1])
        )
        torch.index_select(prompts, 0, rows, out=full[:, :, : prompts.shape[2]])
        return full

    @torch.no_grad()
    def step(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.length >= self.capacity:
            raise ValueError(f"KVDecoder: the cache is full ({self.capacity} positions)")
        if self._spread:  # decoding the prompts' own rows
            self.select(torch.arange(self.position.shape[0], device=self.position.device))
        self.valid[:, self.length] = True
        mask = self.valid[:, None, None, : self.length + 1]
        hidden = self._forward(token_ids[:, None], self.position[:, None], mask, self.length)
        self.position = self.position + 1
        self.length += 1
        return self.lm_head(self.lean.final_norm(hidden[:, -1]))

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, start: int
    ) -> torch.Tensor:
        """Hidden states ``[B, T, H]`` (before the final norm) of ``input_ids`` ``[B, T]``
        written at cache slots ``start..start+T``; ``mask`` ``[B, 1, T, start+T]`` says which
        keys each query sees."""
        lean = self.lean
        rows, width = input_ids.shape
        end = start + width
        hidden = lean.embed(input_ids)
        cos, sin = lean.angles(positions)
        for i in range(lean.num_layers):
            q, k, v = lean.project(i, hidden, cos, sin)  # [B, T, heads, D]
            self.keys[i][:, :, start:end] = k.transpose(1, 2)
            self.values[i][:, :, start:end] = v.transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                self.keys[i][:, :, :end],
                self.values[i][:, :, :end],
                attn_mask=mask,
                scale=lean.scaling(i),
                enable_gqa=lean.heads != lean.kv_heads,
            )
            hidden = lean.finish(i, hidden, out.transpose(1, 2).reshape(rows, width, -1))
        return hidden
