"""Sampling one next token for every row of a batch at once (the in-process backend's sampler).

Each row has its own temperature, top-k, top-p and optional seed; the work is tensor-wide over
``[B, V]``: the exponential race ``argmax_v p_v / E_v`` with ``E_v ~ Exp(1)`` (no normalization,
no ``multinomial`` per row). Only a seeded row's noise is drawn per row, from its own
``torch.Generator``, so it samples the same tokens whichever rows share its batch. A chosen
token's logprob is under the distribution it was drawn from (after temperature, top-k, top-p;
the raw logits for a greedy row): vLLM's ``processed_logprobs``, as ludic's server returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ludic.inference.request import SamplingSpec
from ludic.types import GREEDY_BELOW

__all__ = ["RowNoise", "RowSampling", "sample_next_tokens"]

NOISE_BUFFER = 1 << 22
"""Most noise values :class:`RowNoise` draws at once (16 MiB of float32, drawn as 32 MiB
of float64)."""


@dataclass(frozen=True)
class RowSampling:
    """The per-row sampling parameters of a batch as tensors ``[B, 1]``, plus generators.

    Built once per batch by :meth:`from_specs`; ``generators[i]`` is ``None`` for a row
    without a seed (its noise comes from the global RNG).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    greedy: torch.Tensor
    generators: tuple[torch.Generator | None, ...]
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def from_specs(cls, specs: Sequence[SamplingSpec]) -> RowSampling:
        temps = torch.tensor([float(s.temperature) for s in specs])[:, None]
        greedy = temps < GREEDY_BELOW
        generators = tuple(
            None if s.seed is None else torch.Generator().manual_seed(int(s.seed)) for s in specs
        )
        # a greedy row takes the argmax of the raw logits: no masks (as in vLLM)
        top_k = torch.tensor([int(s.top_k) for s in specs])[:, None].masked_fill(greedy, 0)
        top_p = torch.tensor([float(s.top_p) for s in specs])[:, None].masked_fill(greedy, 1.0)
        return cls(
            temperature=torch.where(greedy, torch.ones_like(temps), temps),
            top_k=top_k,
            top_p=top_p,
            greedy=greedy[:, 0],
            generators=generators,
            any_top_k=bool((top_k > 0).any()),
            any_top_p=bool((top_p < 1.0).any()),
        )


class RowNoise:
    """The ``Exp(1)`` noise of a batch's decoding steps, ``[B, V]`` per :meth:`next` call.

    Drawn several steps at a time (as many as fit in :data:`NOISE_BUFFER` values, at most
    ``steps``): one draw per seeded row per chunk, not per step. A generator fills a
    tensor from its stream in order, so a seeded row gets the same noise at each step as
    one draw of ``V`` values per step from its generator gives.
    """

    def __init__(
        self, generators: tuple[torch.Generator | None, ...], vocab: int, steps: int
    ) -> None:
        self.generators = generators
        self.vocab = vocab
        self.left = steps  # steps not yet drawn
        self.chunk = torch.empty(len(generators), 0, vocab)  # [B, steps, V]
        self.used = 0  # steps of the chunk handed out

    def next(self) -> torch.Tensor:
        if self.used == self.chunk.shape[1]:
            rows = len(self.generators)
            steps = max(1, min(self.left, NOISE_BUFFER // max(1, rows * self.vocab)))
            self.chunk = _exponential_noise(torch.Size([rows, steps, self.vocab]), self.generators)
            self.left -= steps
            self.used = 0
        self.used += 1
        return self.chunk[:, self.used - 1]


def sample_next_tokens(
    logits: torch.Tensor, rows: RowSampling, noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token id per row of ``logits`` ``[B, V]`` (float32) under each row's sampling,
    and its logprob under the distribution it was drawn from: ``(ids [B], logprobs [B])``.

    Greedy rows (temperature below ``GREEDY_BELOW``) take the argmax of the raw logits
    (logprob: of the raw logits). Others divide by the temperature, keep the ``top_k`` largest scores (when
    ``top_k > 0``) and the smallest set of tokens whose probability reaches ``top_p``
    (the token that crosses it is kept), then race exponential noise: ``noise`` ``[B, V]``
    (a :class:`RowNoise` step), else drawn here; the logprob is that of the processed
    scores, ``log softmax(masked(logits / T))``.
    """
    scores = logits / rows.temperature
    if rows.any_top_k:
        scores = _mask_top_k(scores, rows.top_k)
    if rows.any_top_p:
        scores = _mask_top_p(scores, rows.top_p)
    probs = torch.softmax(scores, dim=-1)
    if noise is None:
        noise = _exponential_noise(probs.shape, rows.generators)
    sampled = (probs / noise).argmax(dim=-1)
    if bool(rows.greedy.any()):  # their temperature is 1 and no mask applies
        sampled = torch.where(rows.greedy, logits.argmax(dim=-1), sampled)
    chosen = scores.gather(1, sampled[:, None])[:, 0] - torch.logsumexp(scores, dim=-1)
    return sampled, chosen


def _mask_top_k(scores: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = scores.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    ordered = torch.sort(scores, dim=-1, descending=True).values
    kth = ordered.gather(-1, k - 1)  # [B, 1]: the k-th largest score of each row
    return scores.masked_fill(scores < kth, float("-inf"))


def _mask_top_p(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    ordered, order = torch.sort(scores, dim=-1, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each one
    drop = before > top_p
    return scores.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))


def _exponential_noise(
    shape: torch.Size, generators: tuple[torch.Generator | None, ...]
) -> torch.Tensor:
    """``Exp(1)`` noise ``[B, ...]`` (float32) as ``-log(1 - U)`` of float64 uniform draws
    ``U``: seeded rows from their generator, the others from the global RNG in one draw.
    Float64, because a float32 uniform has 24 random bits: ``U = 0`` (noise 0, a token that
    wins the race whatever its probability) would come once in 2^24 draws, about once a
    step in a row over a 150k vocabulary. (Torch's ``exponential_`` draws doubles too, but
    costs several times the uniform draw and a log on CPU.)"""
    uniform = torch.empty(shape, dtype=torch.float64)
    unseeded = [i for i, gen in enumerate(generators) if gen is None]
    if len(unseeded) == len(generators):
        uniform.uniform_()
    elif unseeded:
        rows = torch.tensor(unseeded)
        drawn = torch.rand((len(unseeded), *shape[1:]), dtype=torch.float64)
        uniform.index_copy_(0, rows, drawn)
    for i, gen in enumerate(generators):
        if gen is not None:
            uniform[i].uniform_(generator=gen)
    noise = uniform.neg_().log1p_().neg_().float()  # -log(1 - U): U in [0, 1) gives [0, inf)
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # 0/0 would be NaN, and win
