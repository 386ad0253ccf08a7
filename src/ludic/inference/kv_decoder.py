"""A lean decoding forward pass for Llama-shaped Hugging Face models, used to sample.

Sampling a small model on CPU is bound by per-call overhead, not arithmetic, and a
transformers 5 forward wraps the model's math in mask building, cache classes, output
capturing and decorators at every decoded token. :class:`KVDecoder` runs the same model's
own modules (its embedding, norms, projections, MLPs) in the order the model's ``forward``
does, with a preallocated key/value cache, rotary angles looked up in a table built once per
batch (the model's own ``rotary_emb`` at every position) and one
``scaled_dot_product_attention`` per layer, and nothing else. For a small model (projection
weights of at most :data:`FUSE_BYTES`), the query/key/value and the gate/up projections run
as one matmul each, on weights concatenated per batch, and the query and key heads are
rotated together.
Because it calls the modules, a LoRA adapter attached by peft (which wraps the projections)
is applied as in the model's own forward (wrapped projections are never fused).

It serves the architectures whose decoder layer is ``x + attn(norm(x))`` then
``x + mlp(norm(x))`` with rotary positions (``rotate_half``) and full attention: Llama,
Mistral and Qwen2 (without an active sliding window) and Qwen3 (its per-head query/key
norms included), with rotary scaling that does not depend on the sequence (not the
``dynamic`` or ``longrope`` types). :func:`decoder_problem` says why another model is not
served; the caller then uses the model's own forward. Logits agree with the model's forward
to float32 rounding (``tests/inference/test_kv_decoder.py``); the in-process backend samples
from them and returns their log-softmax as it does with the model's forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["FUSE_BYTES", "KVDecoder", "decoder_problem"]

SERVED = ("llama", "mistral", "qwen2", "qwen3")
"""The ``config.model_type`` values served."""

FUSE_BYTES = 64 << 20
"""Most bytes of q/k/v and gate/up projection weights (all layers) concatenated per batch.
Below it a decode step is bound by per-call overhead and the copy costs less than one step;
above it the projections' arithmetic dominates and a copy would only add memory."""

_SEQUENCE_DEPENDENT_ROPE = ("dynamic", "longrope")
"""Rotary types whose angles depend on the sequence length (not served: no fixed table)."""


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
    rope = str(getattr(inner.rotary_emb, "rope_type", "default"))
    if any(name in rope for name in _SEQUENCE_DEPENDENT_ROPE):
        return f"rotary type {rope!r} depends on the sequence length"
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
        self.capacity = capacity
        attn = self.inner.layers[0].self_attn
        self.heads = int(self.config.num_attention_heads)
        self.kv_heads = int(self.config.num_key_value_heads)
        self.head_dim = int(attn.head_dim)
        self.fused = _fused_weights(self.inner.layers)
        self.cos = self.sin = torch.zeros(0)  # [capacity, head_dim]: angles per position
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
        shape = (rows, self.kv_heads, self.capacity, self.head_dim)
        dtype = self.inner.embed_tokens.weight.dtype
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.inner.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.inner.layers]
        # the model's own angles at every position a row can reach (elementwise in the
        # position: the same values as its per-call computation)
        every = torch.arange(self.capacity, device=device)[None]
        cos, sin = self.inner.rotary_emb(self.keys[0][:1, 0], every)
        self.cos, self.sin = cos[0], sin[0]
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
        rows, width = input_ids.shape
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]
        end = start + width
        h, kv = self.heads, self.kv_heads
        for i, layer in enumerate(self.inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = layer.input_layernorm(hidden)
            # q, k, v: [B, T, heads, head_dim]
            if self.fused is not None and not hasattr(attn, "q_norm"):
                qkv = F.linear(x, *self.fused[i][:2]).view(rows, width, -1, self.head_dim)
                qk = _rotate(qkv[:, :, : h + kv], cos, sin)  # query and key heads at once
                q, k, v = qk[:, :, :h], qk[:, :, h:], qkv[:, :, h + kv :]
            else:
                if self.fused is not None:
                    qkv = F.linear(x, *self.fused[i][:2]).view(rows, width, -1, self.head_dim)
                    q, k, v = qkv.split([h, kv, kv], dim=2)
                else:
                    shape = (rows, width, -1, self.head_dim)
                    q, k = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
                    v = attn.v_proj(x).view(shape)
                if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            self.keys[i][:, :, start:end] = k.transpose(1, 2)
            self.values[i][:, :, start:end] = v.transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                self.keys[i][:, :, :end],
                self.values[i][:, :, :end],
                attn_mask=mask,
                scale=attn.scaling,
                enable_gqa=h != kv,
            )
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(rows, width, -1))
            y = layer.post_attention_layernorm(hidden)
            if self.fused is not None:
                gate, up = F.linear(y, self.fused[i][2]).chunk(2, dim=-1)
                hidden = hidden + mlp.down_proj(mlp.act_fn(gate) * up)
            else:
                hidden = hidden + mlp(y)
        return self.lm_head(self.inner.norm(hidden))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[B, T, heads, D]`` at angles ``cos``/``sin``
    ``[B, T, 1, D]``: ``x cos + rotate_half(x) sin``, the served models' formula."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _fused_weights(
    layers: torch.nn.ModuleList,
) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] | None:
    """Per layer, the q/k/v projections' weight and bias concatenated, and the gate/up
    projections' weight, when every one is a plain ``torch.nn.Linear`` (not wrapped by an
    adapter), the MLP is ``down(act(gate(x)) * up(x))`` and they weigh at most
    :data:`FUSE_BYTES`; else None."""
    with torch.no_grad():
        return _concatenated(layers)


def _concatenated(
    layers: torch.nn.ModuleList,
) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] | None:
    fused = []
    total = 0
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return None
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        projections = (*qkv, mlp.gate_proj, mlp.up_proj)
        if not all(type(p) is torch.nn.Linear for p in projections):
            return None
        biases = [p.bias for p in qkv]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            return None
        if mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None:
            return None
        total += sum(p.weight.numel() * p.weight.element_size() for p in projections)
        if total > FUSE_BYTES:
            return None
        weight = torch.cat([p.weight for p in qkv])
        bias = None if biases[0] is None else torch.cat(biases)
        fused.append((weight, bias, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])))
    return fused
