"""The decoder layers of a Llama-shaped Hugging Face model, run without the model's forward.

A transformers forward wraps the math in masks, cache classes and output capturing, which on CPU
cost a small model as much as the arithmetic. :class:`LeanLayers` runs the model's own modules in
its forward's order, rotary angles from a table of its ``rotary_emb``, and leaves the attention to
the caller (:mod:`ludic.inference.kv_decoder`, :mod:`ludic.training.shared_prefix`). Up to
:data:`FUSE_BYTES` it fuses q/k/v and gate/up into one matmul each; a float32 RMSNorm is one
``F.rms_norm``, bit for bit; peft LoRA applies as in the model's forward (never fused). Served:
Llama, Mistral, Qwen2, Qwen3 (details: docs/pieces.md); :func:`decoder_problem` says why not.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = [
    "FUSE_BYTES",
    "Fused",
    "LeanLayers",
    "base_model",
    "decoder_problem",
    "training_problem",
]

SERVED = ("llama", "mistral", "qwen2", "qwen3")
"""The ``config.model_type`` values served."""

FUSE_BYTES = 64 << 20
"""Most bytes of q/k/v and gate/up projection weights (all layers) concatenated per call.
Below it a layer is bound by per-call overhead and the copy costs little; above it the
projections' arithmetic dominates and a copy would only add memory."""

_SEQUENCE_DEPENDENT_ROPE = ("dynamic", "longrope")
"""Rotary types whose angles depend on the sequence length (not served: no fixed table)."""

Fused = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]
"""A layer's q/k/v weight and bias, concatenated, and its gate/up weight."""

_PLAIN_RMS_NORMS = frozenset(
    f"transformers.models.{kind}.modeling_{kind}.{name}RMSNorm"
    for kind, name in (("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"))
) | {"transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm"}
"""The served models' RMSNorm classes (by qualified name: a subclass is called, not run
as :func:`_norm`): ``weight * (x * rsqrt(mean(x^2) + eps))`` computed in float32."""


@functools.cache
def _is_plain_rms_norm(kind: type) -> bool:
    return f"{kind.__module__}.{kind.__qualname__}" in _PLAIN_RMS_NORMS


def _norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``: one ``F.rms_norm`` for a served model's RMSNorm on float32 input (the
    module's own forward is several ops: upcast, square, mean, rsqrt, two products)."""
    if _is_plain_rms_norm(type(norm)) and x.dtype == norm.weight.dtype == torch.float32:
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    return norm(x)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The ``*ForCausalLM`` under a peft wrapper (peft's ``get_base_model``), if any."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_problem(model: torch.nn.Module) -> str | None:
    """Why :class:`LeanLayers` cannot run the causal LM ``model`` (None: it can)."""
    base = base_model(model)
    kind = getattr(getattr(base, "config", None), "model_type", None)
    if kind not in SERVED:
        return f"model_type {kind!r} is not one of {sorted(SERVED)}"
    if not hasattr(base, "lm_head"):
        return f"{type(base).__name__} has no lm_head"
    inner = getattr(base, "model", None)
    if inner is None:
        return f"{type(base).__name__} has no .model (its decoder)"
    return _layers_problem(inner, getattr(base, "config", None))


def training_problem(decoder: torch.nn.Module) -> str | None:
    """Why :class:`LeanLayers` cannot run ``decoder`` (a causal LM's ``.model``, as
    ``get_decoder()`` gives it) in a training forward pass: besides :func:`decoder_problem`'s
    reasons, attention dropout (not applied here), activation checkpointing (not done
    here) and sharded parameters (FSDP gathers them in the layers' own forward)."""
    config = getattr(decoder, "config", None)
    problem = _layers_problem(decoder, config)
    if problem is not None:
        return problem
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0.0 and decoder.training:
        return f"attention_dropout={config.attention_dropout}"
    if getattr(decoder, "gradient_checkpointing", False):
        return "gradient checkpointing is on"
    odd = next((p for p in decoder.parameters() if type(p) is not torch.nn.Parameter), None)
    if odd is not None:  # e.g. FSDP2's DTensors (gathered in the layers' own forward)
        return f"a parameter is a {type(odd).__name__}, not a plain torch.nn.Parameter"
    return None


def _layers_problem(inner: torch.nn.Module, config) -> str | None:
    kind = getattr(config, "model_type", None)
    if kind not in SERVED:
        return f"model_type {kind!r} is not one of {sorted(SERVED)}"
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        return f"attention layer types {sorted(layer_types)} (only full attention is served)"
    if kind == "mistral" and getattr(config, "sliding_window", None) is not None:
        return f"mistral with sliding_window={config.sliding_window}"
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if not all(hasattr(inner, n) for n in needed):
        return f"{type(inner).__name__} lacks one of {', '.join(needed)}"
    rope = str(getattr(inner.rotary_emb, "rope_type", "default"))
    if any(name in rope for name in _SEQUENCE_DEPENDENT_ROPE):
        return f"rotary type {rope!r} depends on the sequence length"
    # the layers' own forward is bypassed: so would be hooks on it (accelerate's device
    # placement, a user's), and a model spread over devices
    for name, module in inner.named_modules():
        if module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"):
            return f"{name or type(inner).__name__} has forward hooks"
    devices = {p.device for p in inner.parameters()}
    if len(devices) > 1:
        return f"its parameters are on several devices ({sorted(map(str, devices))})"
    return None


class LeanLayers:
    """The decoder ``inner`` (a causal LM's ``.model``) layer by layer, the attention
    left to the caller::

        lean.build_angles(longest)                         # positions 0 .. longest - 1
        hidden = lean.embed(input_ids)
        cos, sin = lean.angles(positions)
        for i in range(lean.num_layers):
            q, k, v = lean.project(i, hidden, cos, sin)   # [..., T, heads, D], rotated
            attended = ...                                 # [..., T, heads * D]
            hidden = lean.finish(i, hidden, attended)
        hidden = lean.final_norm(hidden)

    Build one per forward pass (the fused weights are those of that moment)."""

    def __init__(self, inner: torch.nn.Module, config) -> None:
        self.inner = inner
        self.layers = inner.layers
        attn = self.layers[0].self_attn
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(attn.head_dim)
        self.num_layers = len(self.layers)
        self.fused = _fused_weights(self.layers)
        self._cos = self._sin = torch.zeros(0)  # [positions, D]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(input_ids)

    def build_angles(self, positions: int) -> None:
        """The rotary table for positions ``0 .. positions - 1``."""
        weight = self.inner.embed_tokens.weight
        every = torch.arange(positions, device=weight.device)[None]
        with torch.no_grad():
            cos, sin = self.inner.rotary_emb(weight[:1].detach()[None], every)
        first, second = sin[0].chunk(2, dim=-1)
        # rotate_half(x) sin = [-x2, x1] sin = [x2, x1] [-sin1, sin2]: no negation per call
        self._cos, self._sin = cos[0], torch.cat((-first, second), dim=-1)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[*positions.shape, 1, D]`` (broadcast over the heads) from
        the table of :meth:`build_angles` (``sin`` with its first half negated, as
        :func:`_rotate` takes it)."""
        return self._cos[positions].unsqueeze(-2), self._sin[positions].unsqueeze(-2)

    def project(
        self, i: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``i``'s queries, keys and values ``[..., T, heads, D]`` of ``hidden``
        ``[..., T, H]`` (normed here), the queries and keys rotated."""
        layer = self.layers[i]
        attn = layer.self_attn
        x = _norm(layer.input_layernorm, hidden)
        shape = (*x.shape[:-1], -1, self.head_dim)
        h, kv = self.heads, self.kv_heads
        # splits, not slices: one backward copy per split, not a zeroed tensor per slice
        if self.fused is not None:
            qkv = F.linear(x, *self.fused[i][:2]).view(shape)
            if not hasattr(attn, "q_norm"):
                qk, v = qkv.split([h + kv, kv], dim=-2)
                q, k = _rotate(qk, cos, sin).split([h, kv], dim=-2)  # all heads at once
                return q, k, v
            q, k, v = qkv.split([h, kv, kv], dim=-2)
        else:
            q, k = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
            v = attn.v_proj(x).view(shape)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head
            q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def finish(self, i: int, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of layer ``i``: output projection and residual, then the MLP block."""
        layer = self.layers[i]
        mlp = layer.mlp
        hidden = hidden + layer.self_attn.o_proj(attended)
        y = _norm(layer.post_attention_layernorm, hidden)
        if self.fused is None:
            return hidden + mlp(y)
        gate, up = F.linear(y, self.fused[i][2]).chunk(2, dim=-1)
        return hidden + mlp.down_proj(mlp.act_fn(gate) * up)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return _norm(self.inner.norm, hidden)

    def scaling(self, i: int) -> float:
        return float(self.layers[i].self_attn.scaling)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[..., heads, D]`` at angles ``cos``/``sin``
    ``[..., 1, D]``: ``x cos + rotate_half(x) sin``, the served models' formula, with
    ``rotate_half(x) = [-x2, x1]`` and ``signed_sin = [-sin1, sin2]`` (the same products:
    a sign flip is exact)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((second, first), dim=-1) * signed_sin


def _fused_weights(layers: torch.nn.ModuleList) -> list[Fused] | None:
    """Per layer, the q/k/v projections' weight and bias concatenated, and the gate/up
    projections' weight, when every one is a plain ``torch.nn.Linear`` (not wrapped by an
    adapter), the MLP is ``down(act(gate(x)) * up(x))`` and they weigh at most
    :data:`FUSE_BYTES`; else None."""
    fused: list[Fused] = []
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
        bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
        fused.append((weight, bias, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])))
    return fused
