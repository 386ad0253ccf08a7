"""The training forward pass (:func:`score_tokens`): the logprobs (and entropy) of a
micro-batch's action tokens, ``[B, T-1]`` as in ``LossInputs``, equal in every layout and mode.

1. Run the model on the layout that runs the fewest tokens: right-padded, a shared prompt once
   per group (:mod:`~ludic.training.shared_prefix`) or packed (:mod:`~ludic.training.packing`);
   ``logprobs="chunked"`` runs the decoder (hidden states), ``"full"`` the whole model (logits).
2. Gather the scored positions only (``action_mask``): prompt and padding never reach the head.
3. Score (:mod:`~ludic.training.logprobs` chunk by chunk, or ``log_softmax``) under
   ``softmax(logits / T)`` for an item sampled at ``T``; scatter back, 0.0 off the mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from ludic.training.collate import CollatedBatch
from ludic.training.config import LogprobsMode
from ludic.training.logprobs import chunked_token_logprobs, full_vocab_logprobs
from ludic.training.packing import PackedRows, pack_rows
from ludic.training.shared_prefix import (
    SharedPrefixPlan,
    plan_shared_prefixes,
    shared_prefix_outputs,
)

__all__ = [
    "CausalLMParts",
    "LogprobsMode",
    "ScoringOptions",
    "TokenScores",
    "score_tokens",
    "split_causal_lm",
]

Layout = Literal["padded", "shared_prefix", "packed"]

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")
"""Config fields of models that change the logits after the output head."""


@dataclass(frozen=True)
class CausalLMParts:
    """A Hugging Face causal LM split into the ``decoder`` (hidden states) and its output
    ``head`` (a linear layer: ``weight`` [V, H], ``bias`` [V] or None)."""

    decoder: torch.nn.Module
    head: torch.nn.Module

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.head, "bias", None)


def split_causal_lm(model: torch.nn.Module) -> CausalLMParts:
    """``model.get_decoder()`` and ``model.get_output_embeddings()`` (a peft model passes
    them through to its base model, LoRA layers included), or a ``ValueError`` saying why
    chunked logprobs cannot use this model."""
    fix = "set TrainerConfig.logprobs='full' (the whole [tokens, V] logits at once)"
    name = type(model).__name__
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        raise ValueError(
            f"chunked logprobs: {name} has no get_decoder()/get_output_embeddings() (not a "
            f"Hugging Face causal LM); {fix}"
        )
    decoder, head = get_decoder(), get_head()
    if decoder is None or decoder is model:
        raise ValueError(f"chunked logprobs: {name}.get_decoder() gives no separate decoder; {fix}")
    weight = getattr(head, "weight", None)
    if not isinstance(head, torch.nn.Linear):  # e.g. a LoRA-wrapped or tied-and-saved head
        raise ValueError(
            f"chunked logprobs: {name}'s output head is a {type(head).__name__}, not a plain "
            f"torch.nn.Linear (its forward may add to W h + b); {fix}"
        )
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"chunked logprobs: {name}'s output head has no [V, H] weight; {fix}")
    config = getattr(model, "config", None)
    for field in _LOGIT_TRANSFORMS:
        value = getattr(config, field, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"chunked logprobs: {name} transforms its logits after the head "
                f"(config.{field}={value}), which the chunked head does not reproduce; {fix}"
            )
    return CausalLMParts(decoder=decoder, head=head)


@dataclass(frozen=True)
class ScoringOptions:
    """How :func:`score_tokens` runs (the trainer builds it from ``TrainerConfig``)."""

    logprobs: LogprobsMode = "chunked"
    chunk_tokens: int | None = None
    """Tokens per head chunk; None: 256 MiB of float32 logits per chunk."""
    packing: bool = True
    row_tokens: int | None = None
    """Packed row length; None: the micro-batch's longest sequence."""
    shared_prefix: bool = True
    varlen: bool = False
    """Pack into one row and pass the sequences' boundaries (``cu_seq_lens_q``/``_k``)
    to the attention: for flash-attention and ``ludic_varlen_sdpa``, which attend per
    sequence (see :mod:`~ludic.training.varlen_attention`)."""
    dtype: str | None = None
    """Autocast dtype of the forward pass; None: the model's own."""
    pad_token_id: int = 0


@dataclass
class TokenScores:
    """``logprobs`` / ``entropy``: ``[B, T-1]``, 0.0 off the action mask (entropy only when
    asked for). ``layout``: how the model ran; ``tokens_run``: positions it ran."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    layout: Layout
    tokens_run: int


def score_tokens(
    model: torch.nn.Module,
    mb: CollatedBatch,
    options: ScoringOptions = ScoringOptions(),
    *,
    with_entropy: bool = False,
    parts: CausalLMParts | None = None,
) -> TokenScores:
    """The action tokens' logprobs (and entropy) of ``mb`` under ``model`` (see the
    module docstring). Gradients flow when grad mode is on; ``parts`` caches
    :func:`split_causal_lm` for ``logprobs="chunked"``."""
    chunked = options.logprobs == "chunked"
    if chunked and parts is None:
        parts = split_causal_lm(model)
    module = parts.decoder if chunked and parts is not None else model
    output = "last_hidden_state" if chunked else "logits"
    b_idx, t_idx = mb.action_mask.nonzero(as_tuple=True)
    targets = mb.input_ids[b_idx, t_idx + 1]
    temps = mb.logprob_temperature
    inverse_t = None if temps is None else temps.double().reciprocal()[b_idx]
    with _autocast(mb.input_ids.device, options.dtype):
        layout, run, states = _run(module, output, mb, options, b_idx, t_idx)
        if chunked and parts is not None:
            logp, entropy = chunked_token_logprobs(
                states,
                parts.weight,
                targets,
                bias=parts.bias,
                chunk_tokens=options.chunk_tokens,
                with_entropy=with_entropy,
                logit_scale=inverse_t,
            )
        else:
            if inverse_t is not None:  # in float32 at least, as full_vocab_logprobs
                dtype = torch.promote_types(states.dtype, torch.float32)
                states = states.to(dtype) * inverse_t[:, None].to(dtype)
            logp, entropy = full_vocab_logprobs(states, targets, with_entropy=with_entropy)
    return TokenScores(
        logprobs=_scatter(logp, mb, b_idx, t_idx),
        entropy=None if entropy is None else _scatter(entropy, mb, b_idx, t_idx),
        layout=layout,
        tokens_run=run,
    )


def _run(
    module: torch.nn.Module,
    output: str,
    mb: CollatedBatch,
    options: ScoringOptions,
    b_idx: torch.Tensor,
    t_idx: torch.Tensor,
) -> tuple[Layout, int, torch.Tensor]:
    """Run ``module`` on the cheapest layout; its ``output`` at the scored positions."""
    plan = _shared_prefix_plan(mb, options)
    padded = int(mb.input_ids.numel())
    costs: dict[Layout, int] = {"padded": padded}
    if plan is not None:
        costs["shared_prefix"] = plan.padded_tokens_run
    # packing runs every real token at least: no cheaper than a shared prefix that runs fewer
    real = int(mb.attention_mask.sum())
    packed = None if plan is not None and costs["shared_prefix"] <= real else _packed(mb, options)
    if packed is not None:
        costs["packed"] = packed.tokens_run
    layout = min(costs, key=lambda k: (costs[k], k != "shared_prefix"))
    if layout == "shared_prefix" and plan is not None:
        out = shared_prefix_outputs(module, plan, b_idx, t_idx, output=output)
        return layout, costs[layout], out
    if layout == "packed" and packed is not None:
        extra = _sequence_bounds(mb, packed) if options.varlen else {}
        out = getattr(
            module(
                input_ids=packed.input_ids,
                position_ids=packed.position_ids,
                use_cache=False,
                **extra,
            ),
            output,
        )
        return layout, costs[layout], out[packed.row[b_idx], packed.offset[b_idx] + t_idx]
    out = getattr(
        module(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False), output
    )
    return "padded", padded, out[b_idx, t_idx]


def _shared_prefix_plan(mb: CollatedBatch, options: ScoringOptions) -> SharedPrefixPlan | None:
    if not options.shared_prefix:
        return None
    return plan_shared_prefixes(mb.input_ids, mb.attention_mask, mb.action_mask)


def _packed(mb: CollatedBatch, options: ScoringOptions) -> PackedRows | None:
    if not options.packing or mb.num_sequences < 2:
        return None
    lengths = mb.attention_mask.sum(dim=1).tolist()
    row_len = sum(lengths) if options.varlen else options.row_tokens
    return pack_rows(mb.input_ids, lengths, row_len=row_len, pad_token_id=options.pad_token_id)


def _sequence_bounds(mb: CollatedBatch, packed: PackedRows) -> dict[str, torch.Tensor | int]:
    """flash-attention's varlen keywords for one packed row: cumulative sequence
    lengths ``[0, L_1, L_1 + L_2, ...]`` (int32) and the longest."""
    lengths = mb.attention_mask.sum(dim=1)
    order = torch.argsort(packed.offset)
    cu = torch.zeros(len(order) + 1, dtype=torch.int32, device=mb.input_ids.device)
    cu[1:] = torch.cumsum(lengths[order], dim=0)
    longest = int(lengths.max())
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def _scatter(
    values: torch.Tensor, mb: CollatedBatch, b_idx: torch.Tensor, t_idx: torch.Tensor
) -> torch.Tensor:
    out = values.new_zeros(mb.action_mask.shape)
    return out.index_put((b_idx, t_idx), values)


@contextlib.contextmanager
def _autocast(device: torch.device, dtype: str | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=getattr(torch, dtype)):
        yield
