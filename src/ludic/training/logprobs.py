"""Next-token logprobs and entropy from a causal LM's hidden states, a chunk of tokens at
a time, so the ``[tokens, vocab]`` float32 logits never exist in full.

Logits ``z_n = s_n (W h_n + b)`` (``s_n``: ``logit_scale``, ``1 / T``), ``logp_n = z_n[y_n] -
lse_n``, entropy ``H_n = lse_n - sum_v p_nv z_nv``. :func:`chunked_token_logprobs` keeps ``h``,
``lse``, ``H``; its backward recomputes each chunk's logits for the exact ``dL/dz_n = g_n
(onehot(y_n) - p_n) - e_n p_n (log p_n + H_n)`` (``g_n``, ``e_n``: upstream gradients of
``logp_n``, ``H_n``), times ``s_n`` on to ``h``, ``W``, ``b``: one more head matmul, as in Liger's
fused linear cross-entropy. Autocast: head in the autocast dtype, softmax in float32 (or float64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "chunked_token_logprobs",
    "default_chunk_tokens",
    "full_vocab_logprobs",
    "token_logprobs",
]

DEFAULT_CHUNK_ELEMENTS = 1 << 26
"""Logits per chunk by default: 256 MiB in float32 (V = 151,936: 441 tokens)."""


def default_chunk_tokens(vocab_size: int, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    """Tokens per chunk that keep one chunk's logits at ``chunk_elements``."""
    return max(1, chunk_elements // max(vocab_size, 1))


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def full_vocab_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, *, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The plain computation: ``log_softmax`` over whole logits [..., V] in float32
    (float64 stays float64); returns ``logp`` [...] of ``targets`` and the entropy."""
    logp_all = torch.log_softmax(logits.to(_accumulation_dtype(logits.dtype)), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1) if with_entropy else None
    return logp, entropy


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits[:, t])[input_ids[:, t+1]]``: [B, T, V] -> [B, T-1], in float32
    (float64 for float64 logits), over the whole vocabulary at once (the reference)."""
    return full_vocab_logprobs(logits[:, :-1], input_ids[:, 1:])[0]


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    with_entropy: bool = False,
    logit_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logp`` [N] of ``targets`` [N] (and the entropy [N] with ``with_entropy``) under
    the head ``weight`` [V, H] (+ ``bias`` [V]) applied to ``hidden`` [N, H], its logits
    multiplied by ``logit_scale`` [N] when given (``1 / T`` per token), computed
    ``chunk_tokens`` rows at a time (default :func:`default_chunk_tokens`); exact,
    gradients included, to ``hidden``, ``weight`` and ``bias`` (see the module
    docstring)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"chunked_token_logprobs: hidden {tuple(hidden.shape)} and targets "
            f"{tuple(targets.shape)}; expected [N, H] and [N]"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"chunked_token_logprobs: weight {tuple(weight.shape)} does not map hidden size "
            f"{hidden.shape[1]} to a vocabulary ([V, H])"
        )
    if logit_scale is not None and logit_scale.shape != targets.shape:
        raise ValueError(
            f"chunked_token_logprobs: logit_scale {tuple(logit_scale.shape)}; expected one "
            f"scale per token, {tuple(targets.shape)}"
        )
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    if chunk < 1:
        raise ValueError(f"chunked_token_logprobs: chunk_tokens={chunk_tokens}; expected >= 1")
    device_type = hidden.device.type
    compute = torch.result_type(hidden, weight)
    if torch.is_autocast_enabled(device_type) and hidden.is_floating_point():
        compute = torch.get_autocast_dtype(device_type)
    logp, entropy = _ChunkedHead.apply(
        hidden, weight, bias, targets, logit_scale, chunk, with_entropy, compute
    )
    return logp, (entropy if with_entropy else None)


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        scale: torch.Tensor | None,
        chunk: int,
        with_entropy: bool,
        compute: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        acc = _accumulation_dtype(compute)
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=acc)
        lse = hidden.new_empty(n, dtype=acc)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=acc)
        w, b = _cast_head(weight, bias, compute)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, chunk):
                rows = slice(start, start + chunk)
                z = F.linear(hidden[rows].to(compute), w, b).to(acc)  # [c, V]
                if scale is not None:
                    z.mul_(scale[rows, None].to(acc))
                lse[rows] = torch.logsumexp(z, dim=-1)
                logp[rows] = z.gather(1, targets[rows, None]).squeeze(1) - lse[rows]
                if with_entropy:
                    p = torch.exp(z - lse[rows, None])
                    entropy[rows] = lse[rows] - _rowwise_dot(p, z)
        ctx.save_for_backward(hidden, weight, bias, targets, scale, lse, entropy)
        ctx.chunk, ctx.compute = chunk, compute
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        grad_logp: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, scale, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        compute: torch.dtype = ctx.compute
        acc = lse.dtype
        n = hidden.shape[0]
        use_entropy = grad_entropy is not None and entropy.numel() > 0
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        w, b = _cast_head(weight, bias, compute)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, ctx.chunk):
                rows = slice(start, start + ctx.chunk)
                h = hidden[rows].to(compute)
                z = F.linear(h, w, b).to(acc)  # [c, V]
                if scale is not None:
                    z.mul_(scale[rows, None].to(acc))
                log_p = z.sub_(lse[rows, None])  # in place
                g = (
                    grad_logp[rows].to(acc)
                    if grad_logp is not None
                    else log_p.new_zeros(log_p.shape[0])
                )
                if use_entropy:  # -p (log p + H) e, reusing log_p's memory
                    e = grad_entropy[rows].to(acc)  # type: ignore[index]
                    p = log_p.exp()
                    dz = p * -g[:, None]
                    dz.sub_(log_p.add_(entropy[rows, None]).mul_(p).mul_(e[:, None]))
                    del p
                else:  # -p g, computed in log_p's memory
                    dz = log_p.exp_().mul_(-g[:, None])
                dz.scatter_add_(1, targets[rows, None], g[:, None])
                if scale is not None:  # through z = s (W h + b)
                    dz.mul_(scale[rows, None].to(acc))
                if grad_b is not None:
                    grad_b += dz.sum(dim=0)
                dz_c = dz.to(compute)
                if grad_h is not None:
                    grad_h[rows] = (dz_c @ w).to(hidden.dtype)
                if grad_w is not None:
                    grad_w += (dz_c.t() @ h).to(acc)
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _rowwise_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` for [c, V] rows, as a batched matrix-vector product (no [c, V]
    temporary)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).reshape(a.shape[0])


def _cast_head(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return weight.to(dtype), (None if bias is None else bias.to(dtype))
