"""The training step on a GPU: bf16 autocast + gradient checkpointing + packing, and
flash-attention's varlen kernel on packed rows against sdpa on padded ones. Skipped
without CUDA (and the flash-attention part without the flash-attn package)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from tests.training.test_memory_switches import mixed_length_items
from tests.training.test_shared_prefix import FixedSource

from ludic.models.tiny import build_tiny_causal_lm
from ludic.training.algorithm import make_reinforce
from ludic.training.collate import collate
from ludic.training.config import TrainerConfig
from ludic.training.token_scores import ScoringOptions, score_tokens
from ludic.training.trainer import Trainer
from ludic.training.types import SAWBatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


def test_bf16_checkpointed_packed_steps_on_the_gpu(tiny_tokenizer) -> None:
    model = build_tiny_causal_lm(tiny_tokenizer, seed=8)
    config = TrainerConfig(
        lr=1e-3,
        device="cuda",
        dtype="bfloat16",
        gradient_checkpointing=True,
        shared_prefix=False,
        pad_token_id=0,
    )
    trainer = Trainer(model, make_reinforce(), FixedSource(SAWBatch(mixed_length_items())), config)
    history = trainer.train_sync(3)
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in history)
    assert history[0]["num_tokens_run"] == history[0]["num_tokens"]  # varlen: no padding
    mb = collate(mixed_length_items(6), pad_token_id=0, device=CUDA)
    with torch.no_grad():
        chunked = score_tokens(trainer.model, mb, ScoringOptions(dtype="bfloat16"))
        full = score_tokens(trainer.model, mb, ScoringOptions(dtype="bfloat16", logprobs="full"))
    torch.testing.assert_close(chunked.logprobs, full.logprobs, atol=2e-2, rtol=0)


@pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is None, reason="needs the flash-attn package"
)
def test_flash_attention_packed_equals_sdpa_padded(tiny_tokenizer) -> None:
    sdpa = build_tiny_causal_lm(tiny_tokenizer, seed=8).to(CUDA, torch.bfloat16)
    flash = copy.deepcopy(sdpa)
    flash.set_attn_implementation("flash_attention_2")
    mb = collate(mixed_length_items(), pad_token_id=0, device=CUDA)
    with torch.no_grad():
        padded = score_tokens(sdpa, mb, ScoringOptions(packing=False, shared_prefix=False))
        packed = score_tokens(
            flash, mb, ScoringOptions(packing=True, shared_prefix=False, varlen=True)
        )
    assert packed.layout == "packed" and packed.tokens_run == int(mb.attention_mask.sum())
    torch.testing.assert_close(packed.logprobs, padded.logprobs, atol=5e-2, rtol=0)
