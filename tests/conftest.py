"""Shared fixtures: a tiny byte-level tokenizer and a tiny Qwen2 model built locally."""

from __future__ import annotations

import pytest

from ludic.models.tiny import build_tiny_causal_lm, build_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def tiny_model(tiny_tokenizer):
    """A fresh randomly initialised tiny Qwen2 causal LM (seed 0) per test."""
    return build_tiny_causal_lm(tiny_tokenizer, seed=0)
