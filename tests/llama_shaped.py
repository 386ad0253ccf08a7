"""Small random models of each architecture the lean layers serve (``ludic.models.lean_layers``),
with grouped-query attention, for the tests of the sampler's KVDecoder and of the trainer's
shared-prefix forward."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention
    max_position_embeddings=64,
)


def llama_shaped(kind: str, **shape) -> torch.nn.Module:
    """A seeded random ``kind`` model (qwen2, qwen3, mistral or llama with attention bias)
    in eval mode; ``shape`` overrides :data:`SHAPE`."""
    torch.manual_seed(0)
    sizes = {**SHAPE, **shape}
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**sizes)).eval()
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**sizes, head_dim=8)).eval()
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(**sizes, sliding_window=None)).eval()
    return LlamaForCausalLM(LlamaConfig(**sizes, attention_bias=True)).eval()
