"""Padding-free packing: a micro-batch's sequences laid end to end in rows.

Padded, ``B`` sequences run ``B * T_max`` tokens. Packed (:func:`pack_rows`), they go first-fit,
longest first, into rows of at most ``row_len`` tokens, ``position_ids`` restarting at 0 per
sequence, no attention mask: Hugging Face models read the restart as a new sequence (varlen
attention per sequence, or a block-diagonal causal mask with sdpa/eager). ``row_len`` defaults
to the longest sequence, since a dense mask costs ``row_len^2`` per row; with attention per
sequence one row of the whole budget is best (the ``Trainer`` picks). Running the model on the
rows is :mod:`ludic.training.token_scores`'s; per-sequence sdpa is ``varlen_attention``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["PackedRows", "first_fit_rows", "pack_rows", "split_packed_microbatches"]


def first_fit_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Indices of ``lengths`` per row: each in the first row it fits (in the given order;
    longest first makes this first-fit decreasing). A length over ``row_len`` raises."""
    rows: list[list[int]] = []
    fill: list[int] = []
    for i, n in enumerate(lengths):
        if n > row_len:
            raise ValueError(f"a sequence of {n} tokens does not fit a row of {row_len}")
        for r, used in enumerate(fill):
            if used + n <= row_len:
                rows[r].append(i)
                fill[r] += n
                break
        else:
            rows.append([i])
            fill.append(n)
    return rows


@dataclass(frozen=True)
class PackedRows:
    """A micro-batch packed into rows.

    * ``input_ids`` / ``position_ids``: ``[R, L]``; a row's unused tail holds
      ``pad_token_id`` with positions restarting at 0 (a sequence of its own, never scored).
    * ``row`` / ``offset``: ``[B]`` where each sequence of the padded micro-batch starts:
      its token ``t`` sits at ``[row[b], offset[b] + t]``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    row: torch.Tensor
    offset: torch.Tensor

    @property
    def tokens_run(self) -> int:
        return int(self.input_ids.numel())


def pack_rows(
    input_ids: torch.Tensor,
    lengths: Sequence[int],
    *,
    row_len: int | None = None,
    pad_token_id: int = 0,
) -> PackedRows:
    """Pack the first ``lengths[b]`` tokens of each row of ``input_ids`` [B, T] into rows
    of at most ``row_len`` tokens (default: the longest sequence)."""
    lengths = [int(n) for n in lengths]
    row_len = row_len or max(lengths)
    order = sorted(range(len(lengths)), key=lambda b: -lengths[b])
    rows = first_fit_rows([lengths[b] for b in order], row_len)
    width = max(sum(lengths[order[i]] for i in members) for members in rows)
    ids = input_ids.new_full((len(rows), width), pad_token_id)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    row_of = [0] * len(lengths)
    offset_of = [0] * len(lengths)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            b = order[i]
            n = lengths[b]
            ids[r, at : at + n] = input_ids[b, :n]
            positions[r, at : at + n] = torch.arange(n)
            row_of[b], offset_of[b] = r, at
            at += n
        positions[r, at:] = torch.arange(width - at)
    device = input_ids.device
    return PackedRows(
        input_ids=ids,
        position_ids=positions.to(device),
        row=torch.tensor(row_of, device=device),
        offset=torch.tensor(offset_of, device=device),
    )


def split_packed_microbatches(
    lengths: Sequence[int], max_tokens: int, row_len: int | None = None
) -> list[list[int]]:
    """Indices of ``lengths`` per micro-batch, longest first, such that each packs into
    ``R`` rows of ``L`` tokens with ``R * L <= max_tokens`` (``L`` = ``row_len``, default
    the micro-batch's longest sequence): the packed counterpart of the padded
    ``B * T_max`` budget."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if lengths[i] > max_tokens:
            raise ValueError(
                f"a sequence of {lengths[i]} tokens exceeds the micro-batch budget of "
                f"{max_tokens} tokens"
            )
        trial = [*current, i]
        width = row_len or lengths[trial[0]]
        rows = first_fit_rows([lengths[j] for j in trial], width) if current else [[0]]
        if current and len(rows) * width > max_tokens:
            batches.append(current)
            trial = [i]
        current = trial
    if current:
        batches.append(current)
    return batches
