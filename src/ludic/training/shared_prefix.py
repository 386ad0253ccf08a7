"""A training forward pass that runs a prompt shared by several rows only once.

A GRPO batch holds every prompt ``group_size`` times; a plain forward pass runs each copy
through the model. Here the rows are grouped by their prefix, the tokens before their
first action token (the prompt, the same for every sample of a group):

1. the distinct prefixes are run once, right-padded, with a KV cache;
2. the cache is expanded to one entry per row (``index_select``, differentiable);
3. each row's suffix (its completion, and any later turns) runs on top of its prefix's
   cache, with position ids continuing from the prefix's length;
4. the outputs (logits, or the decoder's hidden states) are laid back out as the plain
   forward's ``[B, T, D]``: a row's prefix
   positions from its prefix's logits, the rest from its suffix's.

Every logit equals the plain forward's up to float rounding, and so do the gradients:
the gradient of the shared prefix is the sum of what each row sends back through the
cache, as it is when the prefix is run once per row. The model runs ``G·P + B·S`` tokens
instead of ``B·(P + S)`` (G distinct prefixes of length P, B rows with suffixes of
length S): ``B / G`` times fewer on the prompt, the usual bulk of a GRPO batch.

Works with any Hugging Face causal LM that takes ``position_ids`` and a ``DynamicCache``
(``past_key_values``), as decoder-only models do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "SharedPrefixPlan",
    "plan_shared_prefixes",
    "shared_prefix_forward",
    "shared_prefix_logits",
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
    prefix = module(input_ids=plan.prefix_ids, attention_mask=plan.prefix_mask, use_cache=True)
    cache = prefix.past_key_values
    if cache is None:
        raise RuntimeError(
            "shared_prefix_forward: the model returned no KV cache (gradient checkpointing "
            "turns caching off in training); set TrainerConfig.shared_prefix=False"
        )
    cache.reorder_cache(plan.group)  # one cache entry per row
    width = plan.prefix_ids.shape[1]
    steps = torch.arange(plan.suffix_ids.shape[1], device=plan.suffix_ids.device)
    suffix = module(
        input_ids=plan.suffix_ids,
        attention_mask=torch.cat([plan.prefix_mask[plan.group], plan.suffix_mask], dim=1),
        position_ids=plan.prefix_lengths[:, None] + steps,
        past_key_values=cache,
        use_cache=True,
    )
    both = torch.cat([getattr(prefix, output)[plan.group], getattr(suffix, output)], dim=1)
    t = torch.arange(seq_len, device=both.device)[None, :]
    starts = plan.prefix_lengths[:, None]
    index = torch.where(t < starts, t, width + t - starts)  # prefix part, then suffix part
    index = index.clamp(max=both.shape[1] - 1)
    return both.gather(1, index[:, :, None].expand(-1, -1, both.shape[2]))
