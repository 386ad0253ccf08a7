"""``SAWItem`` lists -> dense, right-padded tensors, and packing items into micro-batches.

Shapes (``B`` items, ``T`` = longest item): ``input_ids`` / ``attention_mask`` are
``[B, T]``; everything scored per token is shifted to the ``T-1`` next-token positions,
where position ``t`` refers to ``input_ids[:, t+1]`` (the ``LossInputs`` convention).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ludic.training.types import SAWItem


@dataclass
class CollatedBatch:
    """Tensors for one micro-batch.

    * ``input_ids``: [B, T] long, right-padded with ``pad_token_id``.
    * ``attention_mask``: [B, T] long, 1 on real tokens.
    * ``action_mask``: [B, T-1] float, ``action_mask[:, t] = item.action_mask[t+1]``.
    * ``weights``: [B] float32.
    * ``old_logprobs``: [B, T-1] float32 shifted like ``action_mask`` (0 off-mask), or
      ``None`` if any item lacks them.
    * ``policy_versions``: one entry per item (``None`` where unknown).
    * ``action_versions``: [B, T-1] long, the policy version that sampled each action
      token, shifted like ``action_mask`` (-1 off-mask), or ``None`` if any item's
      versions are unknown. An item without per-token versions has its
      ``policy_version`` (the oldest) on every action token.
    * ``logprob_temperature``: [B] float32, each item's ``logprob_temperature`` (the
      trainer scores row ``b`` under ``softmax(logits / T_b)``), or ``None`` when every
      item's is 1.0.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    weights: torch.Tensor
    old_logprobs: torch.Tensor | None
    policy_versions: tuple[int | None, ...]
    action_versions: torch.Tensor | None = None
    logprob_temperature: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_action_tokens(self) -> int:
        return int(self.action_mask.sum().item())

    @property
    def num_tokens(self) -> int:
        """Real (non-pad) tokens."""
        return int(self.attention_mask.sum().item())


def collate(
    items: Sequence[SAWItem], pad_token_id: int, device: str | torch.device = "cpu"
) -> CollatedBatch:
    """Right-pad ``items`` to the longest one and shift per-token fields to ``[B, T-1]``."""
    if not items:
        raise ValueError("collate: got no items; a micro-batch needs at least one SAWItem")
    lengths = [item.num_tokens for item in items]
    t_max = max(lengths)
    input_ids = _padded([item.input_ids for item in items], t_max, pad_token_id, torch.long)
    attention_mask = (torch.arange(t_max) < torch.tensor(lengths)[:, None]).long()
    action_mask = _padded([item.action_mask for item in items], t_max, 0, torch.float32)
    olds = [item.old_logprobs for item in items]
    has_old = all(old is not None for old in olds)
    old_logprobs = None
    if has_old:  # 0.0 off-mask, always
        old_logprobs = action_mask * _padded(olds, t_max, 0.0, torch.float32)  # type: ignore[arg-type]
    has_versions = all(item.policy_version is not None for item in items)
    versions = None
    if has_versions:  # a boolean mask takes the action positions row by row, in order
        versions = torch.full(action_mask.shape, -1, dtype=torch.long)
        flat = [v for item in items for v in _token_versions(item)]
        versions[action_mask.bool()] = torch.tensor(flat, dtype=torch.long)
    return CollatedBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        action_mask=action_mask[:, 1:].to(device),
        weights=torch.tensor([item.weight for item in items], dtype=torch.float32).to(device),
        old_logprobs=None if old_logprobs is None else old_logprobs[:, 1:].to(device),
        policy_versions=tuple(item.policy_version for item in items),
        action_versions=None if versions is None else versions[:, 1:].to(device),
        logprob_temperature=_temperatures(items, device),
    )


def _padded(
    rows: Sequence[tuple[int, ...] | tuple[float, ...]], t_max: int, fill: float, dtype: torch.dtype
) -> torch.Tensor:
    """``[B, t_max]`` of ``rows`` right-padded with ``fill``: one tensor from Python rows
    (a copy per row costs more on a small batch)."""
    return torch.tensor([(*row, *(fill,) * (t_max - len(row))) for row in rows], dtype=dtype)


def _temperatures(items: Sequence[SAWItem], device: str | torch.device) -> torch.Tensor | None:
    temps = [item.logprob_temperature for item in items]
    if all(t == 1.0 for t in temps):
        return None
    return torch.tensor(temps, dtype=torch.float32, device=device)


def _token_versions(item: SAWItem) -> tuple[int, ...]:
    """The version of each action token of ``item`` (its ``policy_version`` on each when it
    has no per-token versions)."""
    if item.action_versions is not None:
        return item.action_versions
    assert item.policy_version is not None
    return (item.policy_version,) * item.num_action_tokens


def split_microbatches(
    items: Sequence[SAWItem], max_tokens_per_microbatch: int
) -> list[list[SAWItem]]:
    """Pack ``items`` into micro-batches whose padded size ``B * T_max`` fits the budget.

    Items are sorted by length (longest first, stable) before greedy packing, so items of
    similar length share a micro-batch and little compute is spent on padding. The order
    of items therefore changes; the loss does not depend on it because normalizers count
    the whole optimizer step.
    """
    require_fits(items, max_tokens_per_microbatch)
    ordered = sorted(items, key=lambda item: item.num_tokens, reverse=True)
    microbatches: list[list[SAWItem]] = []
    current: list[SAWItem] = []
    for item in ordered:
        # Sorted longest first, so the current micro-batch's T_max is its first item's length.
        t_max = current[0].num_tokens if current else item.num_tokens
        if current and (len(current) + 1) * t_max > max_tokens_per_microbatch:
            microbatches.append(current)
            current = []
        current.append(item)
    if current:
        microbatches.append(current)
    return microbatches


def require_fits(items: Sequence[SAWItem], max_tokens_per_microbatch: int) -> None:
    """A ``ValueError`` naming the first item longer than the micro-batch budget."""
    for item in items:
        if item.num_tokens > max_tokens_per_microbatch:
            raise ValueError(
                f"SAWItem of {item.num_tokens} tokens (rollout "
                f"{item.meta.get('rollout_id')!r}) exceeds max_tokens_per_microbatch="
                f"{max_tokens_per_microbatch}; raise TrainerConfig.max_tokens_per_microbatch "
                "to at least the longest sequence, or cap the generation length"
            )
