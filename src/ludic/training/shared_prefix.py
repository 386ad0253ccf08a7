"""A training forward pass that runs a prompt shared by several rows only once.

Rows are grouped by prefix, the tokens before the first action token
(:func:`plan_shared_prefixes`): the ``G`` distinct prefixes run once with a KV cache, expanded to
one entry per row, and each row's suffix runs on it; outputs are read at the scored positions
(:func:`shared_prefix_outputs`) or as the plain ``[B, T, D]`` (:func:`shared_prefix_forward`). A
Llama-shaped decoder runs through ``ludic.models.lean_layers.LeanLayers``; other models run their
own forward twice. Logits and gradients equal the plain forward's up to rounding, for ``G·P +
B·S`` tokens instead of ``B·(P + S)``. Needs a causal LM taking ``position_ids`` and a cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ludic.models.lean_layers import LeanLayers, training_problem

__all__ = [
    "SharedPrefixPlan",
    "plan_shared_prefixes",
    "shared_prefix_forward",
    "shared_prefix_logits",
    "shared_prefix_outputs",
]


@dataclass(frozen=True)
class SharedPrefixPlan:
    """How the rows of a micro-batch share prefixes.

    * ``prefix_ids`` / ``prefix_mask``: ``[G, P]`` the distinct prefixes, right-padded.
    * ``group``: ``[B]`` the prefix of each row.
    * ``prefix_lengths``: ``[B]`` the length of each row's prefix.
    * ``suffix_ids`` / ``suffix_mask``: ``[B, S]`` each row's remaining tokens.
    """

    prefix_ids: torch.Tensor
    prefix_mask: torch.Tensor
    group: torch.Tensor
    prefix_lengths: torch.Tensor
    suffix_ids: torch.Tensor
    suffix_mask: torch.Tensor

    @property
    def tokens_run(self) -> int:
        """Tokens the model runs (real ones, not padding)."""
        return int(self.prefix_mask.sum()) + int(self.suffix_mask.sum())

    @property
    def padded_tokens_run(self) -> int:
        """Positions the model runs, padding included: ``G * P + B * S``."""
        return int(self.prefix_ids.numel()) + int(self.suffix_ids.numel())


def plan_shared_prefixes(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor
) -> SharedPrefixPlan | None:
    """Group the rows of a right-padded batch by their prefix (the tokens before the first
    action token; ``action_mask[:, t]`` marks token ``t + 1``, as in ``CollatedBatch``).

    Returns ``None`` when no two rows share a prefix (nothing to save), or when a row has
    no action token.
    """
    lengths = attention_mask.sum(dim=1).tolist()
    has_action = action_mask.bool()
    if not bool(has_action.any(dim=1).all()):
        return None
    starts = (has_action.float().argmax(dim=1) + 1).tolist()  # first action token per row
    keys: dict[tuple[int, ...], int] = {}
    group = []
    rows = input_ids.tolist()
    for row, start in zip(rows, starts):
        group.append(keys.setdefault(tuple(row[:start]), len(keys)))
    if len(keys) == len(rows):
        return None
    prefixes = list(keys)
    width = max(len(p) for p in prefixes)
    prefix_ids = input_ids.new_zeros((len(prefixes), width))
    prefix_mask = attention_mask.new_zeros((len(prefixes), width))
    for g, prefix in enumerate(prefixes):
        prefix_ids[g, : len(prefix)] = torch.tensor(prefix, dtype=input_ids.dtype)
        prefix_mask[g, : len(prefix)] = 1
    suffix_width = max(n - s for n, s in zip(lengths, starts))
    suffix_ids = input_ids.new_zeros((len(rows), suffix_width))
    suffix_mask = attention_mask.new_zeros((len(rows), suffix_width))
    for i, (n, s) in enumerate(zip(lengths, starts)):
        suffix_ids[i, : n - s] = input_ids[i, s:n]
        suffix_mask[i, : n - s] = 1
    return SharedPrefixPlan(
        prefix_ids=prefix_ids,
        prefix_mask=prefix_mask,
        group=torch.tensor(group, device=input_ids.device),
        prefix_lengths=torch.tensor(starts, device=input_ids.device),
        suffix_ids=suffix_ids,
        suffix_mask=suffix_mask,
    )


def shared_prefix_logits(
    model: torch.nn.Module, plan: SharedPrefixPlan, seq_len: int
) -> torch.Tensor:
    """The logits ``[B, seq_len, V]`` of the plain forward pass, computed per ``plan``."""
    return shared_prefix_forward(model, plan, seq_len, output="logits")


def shared_prefix_forward(
    module: torch.nn.Module, plan: SharedPrefixPlan, seq_len: int, *, output: str = "logits"
) -> torch.Tensor:
    """``module``'s ``output`` ``[B, seq_len, D]`` (``"logits"`` of a causal LM, or
    ``"last_hidden_state"`` of its decoder) as the plain forward pass gives it, computed
    per ``plan``.

    Positions past a row's length (padding) hold copies of real outputs; the plain
    forward's padded positions are not meaningful either, and both are masked out of
    every loss.
    """
    rows = plan.group.shape[0]
    t = torch.arange(seq_len, device=plan.group.device)
    b_idx, t_idx = torch.arange(rows, device=t.device).repeat_interleave(seq_len), t.repeat(rows)
    out = shared_prefix_outputs(module, plan, b_idx, t_idx, output=output)
    return out.view(rows, seq_len, -1)


def shared_prefix_outputs(
    module: torch.nn.Module,
    plan: SharedPrefixPlan,
    b_idx: torch.Tensor,
    t_idx: torch.Tensor,
    *,
    output: str = "logits",
) -> torch.Tensor:
    """``module``'s ``output`` at positions ``(b_idx[n], t_idx[n])`` of the plain layout,
    ``[N, D]``, computed per ``plan``. A position past its row's length reads the row's
    last suffix slot or a later padding slot (a real output, never read by a loss)."""
    groups, width = plan.prefix_ids.shape
    rows, suffix_width = plan.suffix_ids.shape
    if output == "last_hidden_state" and training_problem(module) is None:
        flat = _lean_hidden_states(module, plan)
    else:
        before, after = _model_outputs(module, plan, output)  # [G, P, D], [B, S, D]
        flat = torch.cat(
            [before.reshape(groups * width, -1), after.reshape(rows * suffix_width, -1)]
        )
    starts = plan.prefix_lengths[b_idx]
    index = torch.where(
        t_idx < starts,
        plan.group[b_idx] * width + t_idx.clamp(max=width - 1),
        groups * width + b_idx * suffix_width + (t_idx - starts).clamp(0, suffix_width - 1),
    )
    return _Rows.apply(flat, index)


def _model_outputs(
    module: torch.nn.Module, plan: SharedPrefixPlan, output: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefixes' and the suffixes' ``output`` from the module's own forward: the
    prefixes with a KV cache, expanded to one entry per row, then the suffixes on it."""
    prefix = module(input_ids=plan.prefix_ids, attention_mask=plan.prefix_mask, use_cache=True)
    cache = prefix.past_key_values
    if cache is None:
        raise RuntimeError(
            "shared_prefix_forward: the model returned no KV cache (gradient checkpointing "
            "turns caching off in training); set TrainerConfig.shared_prefix=False"
        )
    _expand_cache(cache, plan.group)  # one cache entry per row
    steps = torch.arange(plan.suffix_ids.shape[1], device=plan.suffix_ids.device)
    suffix = module(
        input_ids=plan.suffix_ids,
        attention_mask=torch.cat([plan.prefix_mask[plan.group], plan.suffix_mask], dim=1),
        position_ids=plan.prefix_lengths[:, None] + steps,
        past_key_values=cache,
        use_cache=True,
    )
    return getattr(prefix, output), getattr(suffix, output)


def _lean_hidden_states(decoder: torch.nn.Module, plan: SharedPrefixPlan) -> torch.Tensor:
    """The decoder's last hidden states (final norm applied) ``[G·P + B·S, H]``: the
    prefixes' ``G x P`` positions, then the suffixes' ``B x S``."""
    lean = LeanLayers(decoder, decoder.config)
    groups, width = plan.prefix_ids.shape
    rows, suffix_width = plan.suffix_ids.shape
    device = plan.prefix_ids.device
    lean.build_angles(width + suffix_width)
    steps = torch.arange(suffix_width, device=device)
    positions = torch.cat(
        [
            torch.arange(width, device=device).repeat(groups),
            (plan.prefix_lengths[:, None] + steps).reshape(-1),
        ]
    )
    cos, sin = lean.angles(positions)
    hidden = lean.embed(torch.cat([plan.prefix_ids.reshape(-1), plan.suffix_ids.reshape(-1)]))
    # A prefix query sees the earlier real keys of its prefix (a padding query too, so no
    # softmax row is empty; its output is never read); a suffix query sees its prefix's
    # real keys and the earlier real keys of its own suffix.
    real = plan.prefix_mask.bool()
    prefix_mask = (
        torch.ones(width, width, dtype=torch.bool, device=device).tril() & real[:, None]
    )[:, None]
    own = torch.ones(suffix_width, suffix_width, dtype=torch.bool, device=device).tril()
    own = own & plan.suffix_mask.bool()[:, None]
    suffix_mask = torch.cat([real[plan.group][:, None].expand(-1, suffix_width, -1), own], dim=2)[
        :, None
    ]
    n = groups * width
    gqa = lean.heads != lean.kv_heads
    for i in range(lean.num_layers):
        q, k, v = lean.project(i, hidden, cos, sin)  # [N, heads, D]
        (qp, qs), (kp, ks), (vp, vs) = (
            _by_part(x, groups, width, rows, suffix_width, lean.head_dim) for x in (q, k, v)
        )
        scale = lean.scaling(i)
        out_p = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=prefix_mask, scale=scale, enable_gqa=gqa
        )
        keys = torch.cat([_Rows.apply(kp, plan.group), ks], dim=2)
        values = torch.cat([_Rows.apply(vp, plan.group), vs], dim=2)
        out_s = F.scaled_dot_product_attention(
            qs, keys, values, attn_mask=suffix_mask, scale=scale, enable_gqa=gqa
        )
        attended = torch.cat(
            [
                out_p.transpose(1, 2).reshape(n, -1),
                out_s.transpose(1, 2).reshape(rows * suffix_width, -1),
            ]
        )
        hidden = lean.finish(i, hidden, attended)
    return lean.final_norm(hidden)


def _by_part(
    x: torch.Tensor, groups: int, width: int, rows: int, suffix_width: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[G·P + B·S, heads, D]`` as the prefixes' ``[G, heads, P, D]`` and the
    suffixes' ``[B, heads, S, D]`` (a split: one copy in the backward)."""
    prefix, suffix = x.split([groups * width, rows * suffix_width])
    return (
        prefix.view(groups, width, -1, head_dim).transpose(1, 2),
        suffix.view(rows, suffix_width, -1, head_dim).transpose(1, 2),
    )


def _expand_cache(cache, group: torch.Tensor) -> None:
    """``cache.reorder_cache(group)`` with :class:`_Rows` for a cache whose layers hold
    ``keys``/``values`` tensors (transformers' ``DynamicCache``); others reorder their own way."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(
        isinstance(getattr(layer, "keys", None), torch.Tensor)
        and isinstance(getattr(layer, "values", None), torch.Tensor)
        for layer in layers
    ):
        cache.reorder_cache(group)
        return
    for layer in layers:
        layer.keys = _Rows.apply(layer.keys, group)
        layer.values = _Rows.apply(layer.values, group)


class _Rows(torch.autograd.Function):
    """``x.index_select(0, index)``; the backward adds each row's gradient, made
    contiguous, into its source row (``index_add_``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(index)
        ctx.source_shape = x.shape
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (index,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.source_shape)
        return out.index_add_(0, index, grad.contiguous()), None
