"""``chunked_token_logprobs``: the output head a chunk at a time equals the whole-vocab
log-softmax in float64, values and gradients (to the hidden states, the head's weight and
bias), whichever outputs the loss uses and wherever the chunks split."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ludic.training.logprobs import (
    chunked_token_logprobs,
    default_chunk_tokens,
    full_vocab_logprobs,
)


def tensors(seed: int = 0, n: int = 37, h: int = 16, v: int = 101):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, bias, targets


@pytest.mark.parametrize("chunk", [1, 5, 37, 1000])
@pytest.mark.parametrize("uses", ["logp", "entropy", "both"])
@pytest.mark.parametrize("tempered", [False, True])
def test_values_and_gradients_equal_the_full_vocabulary(chunk, uses, tempered) -> None:
    """``tempered``: a per-token logit scale 1/T (the policy at temperature T), against
    the full log-softmax of the scaled logits."""
    hidden, weight, bias, targets = tensors()
    g = torch.linspace(-1, 2, targets.shape[0], dtype=torch.float64)
    scale = None
    if tempered:
        scale = 1.0 / torch.linspace(0.3, 2.5, targets.shape[0], dtype=torch.float64)

    def objective(logp, entropy):
        terms = {"logp": (logp * g).sum(), "entropy": (entropy * g.flip(0)).sum()}
        return sum(terms.values()) if uses == "both" else terms[uses]

    logp, entropy = chunked_token_logprobs(
        hidden,
        weight,
        targets,
        bias=bias,
        chunk_tokens=chunk,
        with_entropy=True,
        logit_scale=scale,
    )
    objective(logp, entropy).backward()
    got = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    logits = F.linear(hidden, weight, bias)
    if scale is not None:
        logits = logits * scale[:, None]
    ref_logp, ref_entropy = full_vocab_logprobs(logits, targets, with_entropy=True)
    objective(ref_logp, ref_entropy).backward()
    torch.testing.assert_close(logp, ref_logp, atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-12, rtol=0)
    for mine, t in zip(got, (hidden, weight, bias)):
        torch.testing.assert_close(mine, t.grad, atol=1e-12, rtol=0)


def test_a_frozen_head_gets_no_gradient_and_entropy_is_optional() -> None:
    hidden, weight, _, targets = tensors()
    weight.requires_grad_(False)
    logp, entropy = chunked_token_logprobs(hidden, weight, targets, chunk_tokens=4)
    assert entropy is None
    logp.sum().backward()
    assert hidden.grad is not None and weight.grad is None


def test_under_bf16_autocast_the_head_runs_in_bf16_and_the_softmax_in_float32() -> None:
    hidden, weight, _, targets = tensors()
    hidden32, weight32 = hidden.detach().float(), weight.detach().float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = chunked_token_logprobs(hidden32, weight32, targets, chunk_tokens=8)
        ref, _ = full_vocab_logprobs(F.linear(hidden32, weight32), targets)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, ref, atol=1e-5, rtol=0)  # the same bf16 logits
    exact, _ = full_vocab_logprobs(F.linear(hidden32, weight32), targets)
    assert (logp - exact).abs().max() > 1e-4  # and they are bf16's, not float32's


def test_bad_shapes_are_refused_and_the_default_chunk_fits_256_mib() -> None:
    hidden, weight, _, targets = tensors()
    with pytest.raises(ValueError, match=r"expected \[N, H\] and \[N\]"):
        chunked_token_logprobs(hidden, weight, targets[:-1])
    with pytest.raises(ValueError, match="does not map hidden size 16"):
        chunked_token_logprobs(hidden, weight.t(), targets)
    assert default_chunk_tokens(151_936) == 441
    assert default_chunk_tokens(151_936) * 151_936 * 4 <= 256 * 2**20
