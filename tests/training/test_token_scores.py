"""The training forward pass (``ludic.training.token_scores``): every layout (padded,
shared prefix, packed) and both logprob modes (chunked head, full vocabulary) give the
same logprobs, entropies and gradients, in float64, as the plain forward pass."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from tests.training.test_shared_prefix import grpo_like_items

from ludic.models.tiny import build_tiny_causal_lm
from ludic.training.collate import collate
from ludic.training.logprobs import token_logprobs
from ludic.training.losses.base import masked_token_entropy
from ludic.training.token_scores import ScoringOptions, score_tokens, split_causal_lm
from ludic.training.varlen_attention import use_varlen_sdpa

CPU = torch.device("cpu")

LAYOUTS = {  # options -> the layout they must pick on grpo_like_items
    "padded": {"packing": False, "shared_prefix": False},
    "shared_prefix": {"packing": False, "shared_prefix": True},
    "packed": {"packing": True, "shared_prefix": False},
    "packed_varlen": {"packing": True, "shared_prefix": False, "varlen": True},
}


def reference(model, mb):
    """The plain forward: whole logits (divided by each row's temperature), log_softmax
    over the vocabulary; 0 off-mask."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    if mb.logprob_temperature is not None:
        logits = logits / mb.logprob_temperature.to(logits.dtype)[:, None, None]
    mask = mb.action_mask
    return token_logprobs(logits, mb.input_ids) * mask, masked_token_entropy(logits) * mask


def grads_of(model, logprobs, entropy, weights):
    model.zero_grad()
    ((logprobs * weights).sum() + (entropy * weights.flip(0)).sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def model64(tiny_tokenizer):
    return build_tiny_causal_lm(tiny_tokenizer, seed=11).double()


@pytest.mark.parametrize("mode", ["chunked", "full"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("tempered", [False, True])
def test_every_layout_and_mode_equals_the_plain_forward_in_float64(
    model64, mode, layout, tempered
) -> None:
    """``tempered``: items sampled at different temperatures, each scored under
    ``softmax(logits / T)``."""
    items = grpo_like_items()
    if tempered:
        items = [
            dataclasses.replace(item, logprob_temperature=(0.7, 1.0, 1.3)[i % 3])
            for i, item in enumerate(items)
        ]
    mb = collate(items, pad_token_id=0, device=CPU)
    assert (mb.logprob_temperature is not None) == tempered
    weights = torch.linspace(-1, 1, mb.action_mask.numel(), dtype=torch.float64)
    weights = weights.reshape(mb.action_mask.shape)
    ref_lp, ref_ent = reference(model64, mb)
    ref_grads = grads_of(model64, ref_lp, ref_ent, weights)
    model64.zero_grad()
    options = ScoringOptions(logprobs=mode, chunk_tokens=5, **LAYOUTS[layout])
    if options.varlen:  # one row, attention per sequence: ludic_varlen_sdpa
        model64 = copy.deepcopy(model64)
        assert use_varlen_sdpa(model64)
    scores = score_tokens(model64, mb, options, with_entropy=True)
    assert scores.layout == layout.removesuffix("_varlen")
    assert scores.logprobs.dtype == torch.float64
    torch.testing.assert_close(scores.logprobs, ref_lp, atol=1e-10, rtol=0)
    torch.testing.assert_close(scores.entropy, ref_ent, atol=1e-10, rtol=0)
    grads = grads_of(model64, scores.logprobs, scores.entropy, weights)
    assert set(grads) == set(ref_grads) and len(grads) > 10
    for name, grad in ref_grads.items():  # Qwen2's RMSNorm runs in float32: 1e-6, not 1e-12
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=0)
    if layout != "padded":
        assert scores.tokens_run < mb.input_ids.numel()
    if options.varlen:
        assert scores.tokens_run == int(mb.attention_mask.sum())  # no padding at all


def test_packing_rows_restart_positions_and_hold_every_token(model64) -> None:
    from ludic.training.packing import pack_rows

    mb = collate(grpo_like_items(), pad_token_id=0, device=CPU)
    lengths = mb.attention_mask.sum(1).tolist()
    packed = pack_rows(mb.input_ids, lengths, pad_token_id=0)
    assert packed.input_ids.shape[1] == max(lengths) and packed.tokens_run < mb.input_ids.numel()
    for b, n in enumerate(lengths):
        r, o = int(packed.row[b]), int(packed.offset[b])
        assert packed.input_ids[r, o : o + n].tolist() == mb.input_ids[b, :n].tolist()
        assert packed.position_ids[r, o : o + n].tolist() == list(range(n))
    spans = sorted((int(packed.row[b]), int(packed.offset[b]), n) for b, n in enumerate(lengths))
    for (r1, o1, n1), (r2, o2, _) in zip(spans, spans[1:]):
        assert r1 != r2 or o1 + n1 <= o2  # no two sequences overlap


def test_a_head_that_is_not_a_plain_linear_layer_is_refused(tiny_tokenizer) -> None:
    model = build_tiny_causal_lm(tiny_tokenizer, seed=0)
    split_causal_lm(model)  # a plain Qwen2: fine
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0.*logprobs='full'"):
        split_causal_lm(model)
    with pytest.raises(ValueError, match="not a Hugging Face causal LM"):
        split_causal_lm(torch.nn.Linear(2, 2))


def test_varlen_sdpa_without_sequence_bounds_is_plain_sdpa(model64) -> None:
    """Switched, a model's padded forward (masks, no bounds) is unchanged, and one that
    uses another implementation is left alone."""
    mb = collate(grpo_like_items(), pad_token_id=0, device=CPU)
    switched = copy.deepcopy(model64)
    assert use_varlen_sdpa(switched)
    with torch.no_grad():
        a = model64(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        b = switched(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    real = mb.attention_mask.bool()
    torch.testing.assert_close(a[real], b[real], atol=1e-12, rtol=0)
    eager = copy.deepcopy(model64)
    eager.set_attn_implementation("eager")
    assert not use_varlen_sdpa(eager) and eager.config._attn_implementation == "eager"
