"""A lean decoding forward pass for Llama-shaped Hugging Face models, used to sample.

Sampling a small model on CPU is bound by per-call overhead, not arithmetic, and a
transformers 5 forward wraps the model's math in mask building, cache classes, output
capturing and decorators at every decoded token. :class:`KVDecoder` runs the same model's
own modules (its embedding, norms, projections, MLPs, rotary embedding and
``apply_rotary_pos_emb``) in the order the model's ``forward`` does, with a preallocated
key/value cache and one attention per layer (``scaled_dot_product_attention`` over a
prompt, two matmuls for a decode step), and nothing else.
Because it calls the modules, a LoRA adapter attached by peft (which wraps the projections)
is applied as in the model's own forward.

It serves the architectures whose decoder layer is ``x + attn(norm(x))`` then
``x + mlp(norm(x))`` with rotary positions and full attention: Llama, Mistral and Qwen2
(without an active sliding window) and Qwen3 (its per-head query/key norms included).
:func:`decoder_problem` says why another model is not served; the caller then uses the
model's own forward. Logits agree with the model's forward to float32 rounding
(``tests/inference/test_kv_decoder.py``); the in-process backend samples from them and
returns their log-softmax as it does with the model's forward.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["KVDecoder", "decoder_problem"]

SERVED = {
    "llama": "transformers.models.llama.modeling_llama",
    "mistral": "transformers.models.mistral.modeling_mistral",
    "qwen2": "transformers.models.qwen2.modeling_qwen2",
    "qwen3": "transformers.models.qwen3.modeling_qwen3",
}
"""``config.model_type`` -> the modeling module whose ``apply_rotary_pos_emb`` it uses."""


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The ``*ForCausalLM`` under a peft wrapper (peft's ``get_base_model``), if any."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_problem(model: torch.nn.Module) -> str | None:
    """Why :class:`KVDecoder` cannot decode ``model`` (None: it can)."""
    base = _base(model)
    config = getattr(base, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SERVED:
        return f"model_type {kind!r} is not one of {sorted(SERVED)}"
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        return f"attention layer types {sorted(layer_types)} (only full attention is served)"
    if kind == "mistral" and getattr(config, "sliding_window", None) is not None:
        return f"mistral with sliding_window={config.sliding_window}"
    inner = getattr(base, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, n) for n in needed):
        return f"{type(base).__name__} has no .model with {', '.join(needed)}"
    if not hasattr(base, "lm_head"):
        return f"{type(base).__name__} has no lm_head"
    return None


class KVDecoder:
    """Prefill a batch of left-padded prompts, then decode one token per row per call.

    ``prefill(input_ids, attention)`` takes ``[P, W]`` token ids with their 0/1 attention
    mask (padding on the left) and returns the last position's logits ``[P, V]``;
    ``select(rows)`` reorders the batch (from one row per distinct prompt to one per
    request); ``step(token_ids)`` appends one token ``[B]`` per row and returns the next
    logits ``[B, V]``. At most ``capacity`` positions fit (prompt width plus new tokens).
    """

    def __init__(self, model: torch.nn.Module, capacity: int) -> None:
        problem = decoder_problem(model)
        if problem is not None:
            raise ValueError(f"KVDecoder: {problem}")
        base = _base(model)
        self.config = base.config
        self.inner = base.model
        self.lm_head = base.lm_head
        module = importlib.import_module(SERVED[self.config.model_type])
        self._rotate: Callable[..., tuple[torch.Tensor, torch.Tensor]] = module.apply_rotary_pos_emb
        self.capacity = capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.valid = torch.zeros(0, 0, dtype=torch.bool)  # [B, capacity]: key may be seen
        self.position = torch.zeros(0, dtype=torch.long)  # [B]: next token's position
        self.length = 0  # positions written so far

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        rows, width = input_ids.shape
        if width > self.capacity:
            raise ValueError(f"KVDecoder: prompt width {width} > capacity {self.capacity}")
        device = input_ids.device
        attn = self.inner.layers[0].self_attn
        kv_heads = attn.config.num_key_value_heads
        shape = (rows, kv_heads, self.capacity, attn.head_dim)
        dtype = self.inner.embed_tokens.weight.dtype
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.inner.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.inner.layers]
        self.valid = torch.zeros((rows, self.capacity), dtype=torch.bool, device=device)
        self.valid[:, :width] = attention.bool()
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        # A query sees the earlier valid keys and itself (a padding query then sees
        # only itself: no row of the softmax is empty, and its output is never read).
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        mask = causal & (
            self.valid[:, None, :width] | torch.eye(width, dtype=torch.bool, device=device)
        )
        logits = self._forward(input_ids, positions, mask[:, None], start=0)
        self.position = positions[:, -1] + 1
        self.length = width
        return logits[:, -1]

    def select(self, rows: torch.Tensor) -> None:
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.valid = self.valid.index_select(0, rows)
        self.position = self.position.index_select(0, rows)

    @torch.no_grad()
    def step(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.length >= self.capacity:
            raise ValueError(f"KVDecoder: the cache is full ({self.capacity} positions)")
        self.valid[:, self.length] = True
        mask = self.valid[:, None, None, : self.length + 1]
        logits = self._forward(token_ids[:, None], self.position[:, None], mask, self.length)
        self.position = self.position + 1
        self.length += 1
        return logits[:, -1]

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, start: int
    ) -> torch.Tensor:
        """Logits ``[B, T, V]`` of ``input_ids`` ``[B, T]`` written at cache slots
        ``start..start+T``; ``mask`` ``[B, 1, T, start+T]`` says which keys each query sees."""
        hidden = self.inner.embed_tokens(input_ids)
        cos, sin = self.inner.rotary_emb(hidden, positions)
        end = start + input_ids.shape[1]
        for i, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            shape = (*x.shape[:-1], -1, attn.head_dim)
            q, k, v = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), attn.v_proj(x)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q, k = self._rotate(q, k, cos, sin)
            self.keys[i][:, :, start:end] = k
            self.values[i][:, :, start:end] = v.view(shape).transpose(1, 2)
            out = _attention(q, self.keys[i][:, :, :end], self.values[i][:, :, :end], mask, attn)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.lm_head(self.inner.norm(hidden))


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, attn: torch.nn.Module
) -> torch.Tensor:
    """Softmax attention of ``q`` ``[B, H, T, D]`` over ``k``, ``v`` ``[B, KV, L, D]``
    (grouped: ``H = KV * groups``) where ``mask`` ``[B, 1, T, L]`` is True. One query per row
    (a decode step) takes two batched matmuls: in a ``torch.profiler`` trace of a decode
    step of the demo's model on CPU they cost less than ``scaled_dot_product_attention``'s
    kernel, which takes the prompt (several queries) here."""
    groups = attn.num_key_value_groups
    if q.shape[2] != 1:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=attn.scaling, enable_gqa=groups > 1
        )
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * attn.scaling
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return weights @ v
