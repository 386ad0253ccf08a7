"""Vectorized next-token sampling: distribution, greedy, top-k / top-p masks and per-row
seeds, each checked against a direct computation."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ludic.inference.batch_sampling import RowNoise, RowSampling, sample_next_tokens
from ludic.inference.request import CompletionRequest, InferenceSpec, SamplingSpec
from ludic.inference.transformers_client import TransformersChatClient

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def draw(specs: list[SamplingSpec], logits: torch.Tensor | None = None) -> torch.Tensor:
    if logits is None:
        logits = LOGITS.expand(len(specs), -1)
    return sample_next_tokens(logits, RowSampling.from_specs(specs))[0]


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_frequencies_follow_the_tempered_softmax(temperature: float) -> None:
    torch.manual_seed(0)
    n = 40_000
    tokens = draw([SamplingSpec(temperature=temperature)] * n)
    expected = torch.softmax(LOGITS.double() / temperature, dim=-1)
    # 4 standard errors of a binomial proportion: a wrong distribution is far outside
    bound = 4 * torch.sqrt(expected * (1 - expected) / n) + 1e-4
    assert bool(((frequencies(tokens, 6) - expected).abs() <= bound).all())


def test_top_k_and_top_p_keep_exactly_the_expected_tokens() -> None:
    torch.manual_seed(1)
    n = 20_000
    probs = torch.softmax(LOGITS, dim=-1)  # 0.55, 0.20, 0.12, 0.07, 0.03, 0.003
    top_k = frequencies(draw([SamplingSpec(top_k=2)] * n), 6)
    assert bool((top_k[2:] == 0).all()) and bool((top_k[:2] > 0).all())
    torch.testing.assert_close(top_k[:2], (probs[:2] / probs[:2].sum()).double(), atol=0.02, rtol=0)
    # top_p = 0.7: 0.55 < 0.7 <= 0.55 + 0.20, so the two tokens crossing it are kept
    top_p = frequencies(draw([SamplingSpec(top_p=0.7)] * n), 6)
    assert bool((top_p[2:] == 0).all()) and bool((top_p[:2] > 0).all())
    # top_p below the largest probability keeps only that token
    assert bool((draw([SamplingSpec(top_p=0.1)] * 100) == 0).all())


def test_rows_with_different_settings_share_one_batch() -> None:
    torch.manual_seed(2)
    specs = [SamplingSpec(temperature=0.0), SamplingSpec(top_k=1), SamplingSpec(top_p=0.2)] * 50
    logits = LOGITS.expand(len(specs), -1).clone()
    logits[::3] = LOGITS.flip(0)  # the greedy rows see reversed logits: argmax is token 5
    tokens = draw(specs, logits)
    assert bool((tokens[::3] == 5).all())
    assert bool((tokens[1::3] == 0).all()) and bool((tokens[2::3] == 0).all())
    unrestricted = draw([SamplingSpec()] * 300)
    assert len(set(unrestricted.tolist())) >= 4  # the plain rows really sample


def test_logprobs_are_those_of_the_distribution_each_token_was_drawn_from() -> None:
    """vLLM's processed_logprobs: after temperature and the top-k / top-p masks; a greedy
    row's are of the raw logits (its top-k / top-p are ignored, as in vLLM)."""
    specs = [
        SamplingSpec(temperature=1.3),
        SamplingSpec(temperature=0.5, top_k=3),
        SamplingSpec(temperature=2.0, top_p=0.7),
        SamplingSpec(temperature=0.0, top_k=1, top_p=0.1),
    ] * 25
    logits = LOGITS.expand(len(specs), -1)
    tokens, logprobs = sample_next_tokens(logits, RowSampling.from_specs(specs))
    tempered = torch.log_softmax(LOGITS / 1.3, dim=-1)
    top3 = torch.log_softmax((LOGITS / 0.5)[:3], dim=-1)
    probs = torch.softmax(LOGITS / 2.0, dim=-1)  # 0.31, 0.19, 0.15, 0.11, 0.07, 0.03
    kept = int((probs.cumsum(0) - probs < 0.7).sum())
    nucleus = torch.log_softmax((LOGITS / 2.0)[:kept], dim=-1)
    raw = torch.log_softmax(LOGITS, dim=-1)
    for i, (token, logp) in enumerate(zip(tokens.tolist(), logprobs.tolist())):
        expected = (tempered, top3, nucleus, raw)[i % 4][token]
        assert logp == pytest.approx(float(expected), abs=1e-5), (i, token)
    assert set(tokens[3::4].tolist()) == {0}  # greedy
    assert len(set(tokens[0::4].tolist())) > 2  # the tempered rows really sample


def test_a_seeded_row_draws_the_same_token_whatever_its_neighbours() -> None:
    alone = [draw([SamplingSpec(seed=s)]).item() for s in range(40)]
    crowd = [
        SamplingSpec(temperature=0.7, seed=1000 + s) if s % 2 else SamplingSpec(seed=None)
        for s in range(7)
    ]
    for s in range(40):
        batch = draw([*crowd[: s % 7], SamplingSpec(seed=s), *crowd[s % 7 :]])
        assert batch[s % 7].item() == alone[s]
    assert len(set(alone)) > 1  # the seeds give different tokens, not one fixed token


def test_seeded_requests_reproduce_their_completion_in_any_batch(tiny_model, tiny_tokenizer):
    """Through the client: a seeded request's tokens do not depend on the other requests
    gathered into its batch (nor on their number)."""
    client = TransformersChatClient(tiny_model, tiny_tokenizer)
    prompt = tuple(tiny_tokenizer.encode("2+3=", add_special_tokens=False))

    def request(seed: int | None, p=prompt) -> CompletionRequest:
        return CompletionRequest(p, InferenceSpec(SamplingSpec(max_tokens=10, seed=seed)))

    async def gather(*requests: CompletionRequest):
        return await asyncio.gather(*(client.complete(r) for r in requests))

    (alone,) = asyncio.run(gather(request(7)))
    other = tuple(tiny_tokenizer.encode("9+9+9=", add_special_tokens=False))
    crowd = asyncio.run(gather(request(None), request(3, other), request(7), request(None)))
    assert crowd[2].trace.completion_token_ids == alone.trace.completion_token_ids
    again = asyncio.run(gather(request(8), request(7)))
    assert again[1].trace.completion_token_ids == alone.trace.completion_token_ids
    assert again[0].trace.completion_token_ids != alone.trace.completion_token_ids


@pytest.mark.parametrize("buffer", [1 << 22, 2 * 7])  # one chunk; a chunk per step
def test_row_noise_gives_each_seeded_row_its_generators_draw_per_step(monkeypatch, buffer):
    monkeypatch.setattr("ludic.inference.batch_sampling.NOISE_BUFFER", buffer)
    seeds = (3, None, 4)
    noise = RowNoise(
        tuple(None if s is None else torch.Generator().manual_seed(s) for s in seeds), 7, 5
    )
    steps = [noise.next() for _ in range(5)]
    for row, seed in enumerate(seeds):
        if seed is None:
            assert all((step[row] > 0).all() for step in steps)
            continue
        gen = torch.Generator().manual_seed(seed)
        for step in steps:  # what one draw of V values per step from the generator gives
            uniform = torch.empty(7, dtype=torch.float64).uniform_(generator=gen)
            assert torch.equal(step[row], (-torch.log1p(-uniform)).float())


def test_unseeded_noise_is_drawn_from_doubles() -> None:
    """A float32 uniform is 0 once in 2^24 draws, and its noise 0 makes any token win (about
    once a step in a row over a 150k vocabulary): the draw is in float64 (the seeded rows'
    too, in the test above)."""
    from ludic.inference.batch_sampling import _exponential_noise

    torch.manual_seed(5)
    want = (-torch.log1p(-torch.rand(3, 11, dtype=torch.float64))).float()
    torch.manual_seed(5)
    got = _exponential_noise(torch.Size([3, 11]), (None, None, None))
    assert got.dtype == torch.float32 and torch.equal(got, want)
