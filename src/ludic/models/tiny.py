"""Tiny models built locally: a byte-level tokenizer with a chat template and a small Qwen2
causal LM. Nothing is downloaded; both save to and load from an ordinary HF folder.

Sizes respect vLLM's CPU backend (attention head size 64), so the same folder serves on a
vLLM server.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Control tokens (skipped when decoding with ``skip_special_tokens``)."""

TEXT_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
"""Single-token markers that are ordinary text to the model and to parsers."""

CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system{{ '\\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}{{ '\\n' }}{% endif %}"
    "Tools:{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}"
    'Call a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
    "<|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if not (tools and loop.first and m['role'] == 'system') %}"
    "<|im_start|>{{ m['role'] }}{{ '\\n' }}{{ m['content'] }}<|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)
"""A ChatML template (Qwen-style). Tool schemas are listed in the system turn."""


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: 256 byte tokens, no merges, plus ChatML control tokens.

    Every string round-trips exactly; ids 0..255 are bytes.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
    hf.add_tokens(list(TEXT_TOKENS))
    hf.chat_template = CHAT_TEMPLATE
    return hf


def tiny_qwen2_config(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    max_position_embeddings: int = 1024,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> Qwen2Config:
    if hidden_size % num_heads != 0 or hidden_size // num_heads < 32:
        raise ValueError(
            f"hidden_size={hidden_size} with num_heads={num_heads} gives head size "
            f"{hidden_size // max(num_heads, 1)}; vLLM's CPU backend needs a head size >= 32 "
            "(e.g. hidden_size=128, num_heads=2)"
        )
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )


def build_tiny_causal_lm(
    tokenizer: PreTrainedTokenizerFast | None = None, *, seed: int = 0, **config_kwargs: int
) -> Qwen2ForCausalLM:
    """A randomly initialised tiny Qwen2 causal LM sized to ``tokenizer``."""
    tokenizer = tokenizer or build_tiny_tokenizer()
    config = tiny_qwen2_config(
        len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config_kwargs,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tiny_model(path: str | Path, *, seed: int = 0, **config_kwargs: int) -> Path:
    """Write a tiny model + tokenizer to ``path`` (an ordinary HF folder)."""
    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_causal_lm(tokenizer, seed=seed, **config_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_reward_model(
    tokenizer: PreTrainedTokenizerFast | None = None, *, seed: int = 0, **config_kwargs: int
) -> Qwen2ForSequenceClassification:
    """A randomly initialised tiny Qwen2 reward model: the backbone of
    :func:`build_tiny_causal_lm` plus a linear ``score`` head with one output (one label),
    read at the last token. Serves on ludic's vLLM reward server (``--runner pooling``)."""
    tokenizer = tokenizer or build_tiny_tokenizer()
    config = tiny_qwen2_config(
        len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config_kwargs,
    )
    config.num_labels = 1
    config.architectures = ["Qwen2ForSequenceClassification"]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config)
    return model


def save_tiny_reward_model(path: str | Path, *, seed: int = 0, **config_kwargs: int) -> Path:
    """Write a tiny reward model + tokenizer to ``path`` (an ordinary HF folder)."""
    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_reward_model(tokenizer, seed=seed, **config_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
