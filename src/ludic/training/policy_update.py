"""One trainer step's updates: mini-batches, micro-batches, loss, backward, optimizer.

For each of ``ppo_epochs`` x ``num_minibatches`` updates, every micro-batch (within
``max_tokens_per_microbatch``, padded or packed) is scored, its loss computed with the
mini-batch's normalizers and back-propagated; then the optimizer steps. pi_prox and the
reference model's logprobs are computed once per step when the loss needs them. With
``ranks`` each rank runs its share and pads to the busiest rank's forwards. It does not
choose the batch, publish, log or checkpoint (``training/trainer.py`` does).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ludic.training.collate import CollatedBatch, collate, require_fits, split_microbatches
from ludic.training.config import TrainerConfig
from ludic.training.core import TrainingCore
from ludic.training.data_parallel import ShardedScorer, TrainerRanks, all_reduce_sum, split_items
from ludic.training.losses.base import Loss, LossInputs
from ludic.training.packing import split_packed_microbatches
from ludic.training.token_scores import CausalLMParts, ScoringOptions, score_tokens
from ludic.training.types import SAWItem

__all__ = ["ENTROPY_STAT", "PolicyUpdate", "StepResult", "StepTotals"]

ENTROPY_STAT = "_token_entropy"
"""The update's own stat in a step's loss stats, logged as ``entropy``."""


@dataclasses.dataclass(frozen=True)
class StepTotals:
    """Normalizers over the whole optimizer step (every micro-batch)."""

    num_sequences: int
    num_action_tokens: int


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What the updates of one trainer step produced (means over its updates)."""

    loss: float
    loss_stats: dict[str, float]
    grad_norm: float
    lr: float
    num_updates: int
    num_microbatches: int
    tokens_run: int = 0
    """Positions the model ran (padding included), over every update."""


@dataclasses.dataclass
class PolicyUpdate:
    """Runs a step's updates of ``model`` (and, as the loss needs, ``reference``)."""

    model: torch.nn.Module
    loss: Loss
    config: TrainerConfig
    core: TrainingCore
    scoring: ScoringOptions
    parts: CausalLMParts | None
    reference: torch.nn.Module | None = None
    reference_parts: CausalLMParts | None = None
    ranks: TrainerRanks | None = None
    scorer: ShardedScorer | None = None

    @property
    def device(self) -> torch.device:
        return torch.device(self.config.device)

    @property
    def rank(self) -> int:
        return 0 if self.ranks is None else self.ranks.rank

    def run(self, items: Sequence[SAWItem], step: int) -> StepResult:
        """Every update of trainer step ``step`` (0-based, it seeds the mini-batch order):
        ``ppo_epochs`` passes of ``num_minibatches`` mini-batches, each its own optimizer
        update with its own normalizers."""
        lr = self.core.lr
        passes = [self.minibatches(items, step, epoch) for epoch in range(self.config.ppo_epochs)]
        updates = [mb for minibatches in passes for mb in minibatches]
        shares = self.shares(items)
        mine = [item for item in items if id(item) in shares[self.rank]]
        filler = [items[0]]  # a padding micro-batch (every rank holds the batch)
        proximal = self.proximal_logprobs(items, shares) if len(updates) > 1 else None
        reference = self.reference_logprobs(mine)
        losses, norms, stats = [], [], dict[str, float]()
        num_microbatches = tokens_run = 0
        for u, update_items in enumerate(updates):
            totals = StepTotals(  # over the whole mini-batch, on every rank
                num_sequences=len(update_items),
                num_action_tokens=sum(item.num_action_tokens for item in update_items),
            )
            microbatches, padding = self.my_microbatches(update_items, shares)
            loss, loss_stats, run = self.accumulate_gradients(
                microbatches, totals, proximal, reference, padding=[filler] * padding
            )
            ran = len(microbatches)
            if self.ranks is not None:  # each rank ran its share: sum the shares
                loss, loss_stats, run, ran = _summed_over_ranks(loss, loss_stats, run, ran)
            norms.append(self.core.optimizer_step(schedule=u == len(updates) - 1))
            losses.append(loss)
            num_microbatches += ran
            tokens_run += run
            for key, value in loss_stats.items():
                stats[key] = stats.get(key, 0.0) + value / len(updates)
        return StepResult(
            loss=statistics.fmean(losses),
            loss_stats=stats,
            grad_norm=statistics.fmean(norms),
            lr=lr,
            num_updates=len(updates),
            num_microbatches=num_microbatches,
            tokens_run=tokens_run,
        )

    def accumulate_gradients(
        self,
        microbatches: list[list[SAWItem]],
        totals: StepTotals,
        proximal: Mapping[int, torch.Tensor] | None = None,
        reference: Mapping[int, torch.Tensor] | None = None,
        *,
        padding: Sequence[list[SAWItem]] = (),
    ) -> tuple[float, dict[str, float], int]:
        """Forward + loss + backward per micro-batch.

        Returns the update's loss (the sum over micro-batches, which equals the full-batch
        loss because the normalizers are global), the loss stats, averaged over
        micro-batches with weights = their share of action tokens (a stat named
        ``"loss"`` is left out: the summed loss is the authoritative value), and the
        positions the model ran. The ``padding`` micro-batches run last with their loss
        times 0: they add nothing but keep this rank's collectives in step with the
        busiest rank's (data-parallel training).
        """
        self.model.train()
        total_loss, stats, tokens_run = 0.0, dict[str, float](), 0
        runs = [(items, False) for items in microbatches] + [(i, True) for i in padding]
        for items, is_padding in runs:
            mb = collate(items, self.config.pad_token_id, self.device)
            logprobs, entropy, run = self.score(self.model, mb, self.parts, with_entropy=True)
            if is_padding:  # stand-ins for what only the item's own rank holds
                proximal_rows = reference_rows = logprobs.detach()
            else:
                proximal_rows = None if proximal is None else _rows(proximal, items, mb)
                reference_rows = None if reference is None else _rows(reference, items, mb)
            inputs = self._loss_inputs(mb, logprobs, entropy, totals, proximal_rows, reference_rows)
            out = self.loss(inputs)
            value = float(out.loss.detach())
            if not math.isfinite(value):
                self.core.abort_step(f"loss is {value}")
            share = 0.0 if is_padding else mb.num_action_tokens / max(totals.num_action_tokens, 1)
            (out.loss * 0.0 if is_padding else out.loss).backward()
            total_loss += 0.0 if is_padding else value
            tokens_run += 0 if is_padding else run
            for key, stat in out.stats.items():
                if key != "loss":
                    stats[key] = stats.get(key, 0.0) + share * float(stat)
            assert entropy is not None
            mean_entropy = float(entropy.detach().sum()) / max(mb.num_action_tokens, 1)
            stats[ENTROPY_STAT] = stats.get(ENTROPY_STAT, 0.0) + share * mean_entropy
        return total_loss, stats, tokens_run

    def _loss_inputs(
        self,
        mb: CollatedBatch,
        logprobs: torch.Tensor,
        entropy: torch.Tensor | None,
        totals: StepTotals,
        proximal: torch.Tensor | None = None,
        reference: torch.Tensor | None = None,
    ) -> LossInputs:
        """``logprobs`` [B, T-1] (0.0 off the action mask) and, as the loss needs them,
        pi_prox (``proximal``, laid out as ``logprobs``), the reference's logprobs and the
        entropy."""
        extra: dict[str, Any] = {}
        if self.loss.requires_proximal_logprobs:
            # One update per step: the weights at its start are the ones of this forward.
            extra["proximal_logprobs"] = logprobs.detach() if proximal is None else proximal
        if reference is not None and self.loss.requires_ref_logprobs:
            extra["ref_logprobs"] = reference
        if self.loss.requires_entropy:
            extra["entropy"] = entropy
        return LossInputs(
            logprobs=logprobs,
            action_mask=mb.action_mask,
            weights=mb.weights,
            num_sequences=totals.num_sequences,
            num_action_tokens=totals.num_action_tokens,
            old_logprobs=mb.old_logprobs,
            action_versions=mb.action_versions,
            **extra,
        )

    def score(
        self,
        model: torch.nn.Module,
        mb: CollatedBatch,
        parts: CausalLMParts | None,
        *,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """``(logprobs, entropy, tokens_run)`` of ``mb`` under ``model`` (the policy through
        its FSDP2 root unit when sharded)."""
        if model is self.model and self.scorer is not None:
            return self.scorer(mb, with_entropy)
        scores = score_tokens(model, mb, self.scoring, with_entropy=with_entropy, parts=parts)
        return scores.logprobs, scores.entropy, scores.tokens_run

    # ---------------------------------------------------------------- how a step is split
    def shares(self, items: Sequence[SAWItem]) -> list[set[int]]:
        """``id`` s of the step's items each rank trains on (every item on one rank without
        ``ranks``); the same split on every rank, fixed for the whole step."""
        if self.ranks is None:
            return [{id(item) for item in items}]
        split = split_items(items, self.ranks.world_size)
        return [{id(items[i]) for i in share} for share in split]

    def my_microbatches(
        self, items: Sequence[SAWItem], shares: Sequence[set[int]]
    ) -> tuple[list[list[SAWItem]], int]:
        """This rank's micro-batches of the mini-batch ``items``, and how many *padding*
        micro-batches it must run after them so that every rank runs as many as the
        busiest (FSDP2 gathers weights in every forward: a collective)."""
        per_rank = [self.microbatches([i for i in items if id(i) in share]) for share in shares]
        local = per_rank[self.rank]
        return local, max(len(m) for m in per_rank) - len(local)

    def microbatches(self, items: Sequence[SAWItem]) -> list[list[SAWItem]]:
        """Padded micro-batches (``B * T_max`` within the budget), or with ``packing``
        packed ones (``R * L`` within it)."""
        budget = self.config.max_tokens_per_microbatch
        if not self.config.packing:
            return split_microbatches(items, budget)
        require_fits(items, budget)
        lengths = [item.num_tokens for item in items]
        groups = split_packed_microbatches(lengths, budget, self.scoring.row_tokens)
        return [[items[i] for i in group] for group in groups]

    def minibatches(self, items: Sequence[SAWItem], step: int, epoch: int) -> list[list[SAWItem]]:
        n = min(self.config.num_minibatches, len(items))
        if n <= 1:
            return [list(items)]
        gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step * 1009 + epoch)
        order = torch.randperm(len(items), generator=gen).tolist()
        return [[items[i] for i in order[k::n]] for k in range(n)]

    # ---------------------------------------------------------------- logprobs without grad
    def proximal_logprobs(
        self, items: Sequence[SAWItem], shares: Sequence[set[int]] | None = None
    ) -> dict[int, torch.Tensor] | None:
        """pi_prox: each item's next-token logprobs [T-1] under the weights at the start of
        the step (no grad), for losses with ``requires_proximal_logprobs`` (decoupled PPO,
        truncated importance sampling) when the step makes several updates (with one, the
        update's own forward gives them); keyed by ``id(item)``. With ``ranks``, for this
        rank's share of ``items`` only (``shares``), padded to the busiest rank's forwards."""
        if not self.loss.requires_proximal_logprobs:
            return None
        self.model.train()  # the mode of the gradient forward (dropout alike)
        shares = shares or self.shares(items)
        local, missing = self.my_microbatches(items, shares)
        mine = [item for mb in local for item in mb]
        padding = [[items[0]]] * missing
        return self._logprobs_without_grad(
            self.model, self.parts, mine, self.device, padding=padding
        )

    def reference_logprobs(self, items: Sequence[SAWItem]) -> dict[int, torch.Tensor] | None:
        """The reference model's next-token logprobs [T-1] per item (no grad, on
        ``reference_device``), once per step for every update; keyed by ``id(item)``."""
        if self.reference is None or not self.loss.requires_ref_logprobs:
            return None
        device = torch.device(self.config.reference_device or self.config.device)
        return self._logprobs_without_grad(self.reference, self.reference_parts, items, device)

    def _logprobs_without_grad(
        self,
        model: torch.nn.Module,
        parts: CausalLMParts | None,
        items: Sequence[SAWItem],
        device: torch.device,
        *,
        padding: Sequence[list[SAWItem]] = (),
    ) -> dict[int, torch.Tensor]:
        """Next-token logprobs per item (keyed by ``id``); then forwards of the ``padding``
        micro-batches, whose results are dropped (while another rank's items keep the
        sharded policy busy)."""
        out: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for mb_items in self.microbatches(items):
                mb = collate(mb_items, self.config.pad_token_id, device)
                logprobs = self.score(model, mb, parts)[0].to(self.device)
                for row, item in enumerate(mb_items):
                    out[id(item)] = logprobs[row, : item.num_tokens - 1]
            for mb_items in padding:
                self.score(model, collate(mb_items, self.config.pad_token_id, device), parts)
        return out


def _summed_over_ranks(
    loss: float, stats: Mapping[str, float], tokens_run: int, microbatches: int
) -> tuple[float, dict[str, float], int, int]:
    """The update's loss, stats, positions run and (real) micro-batches, summed over ranks
    (a collective)."""
    keys = sorted(stats)  # the same on every rank: padding micro-batches add their keys
    counts = [loss, float(tokens_run), float(microbatches)]
    total = all_reduce_sum([*counts, *(stats[k] for k in keys)])
    stats_sum = dict(zip(keys, total[3:], strict=True))
    return total[0], stats_sum, int(total[1]), int(total[2])


def _rows(
    values: Mapping[int, torch.Tensor], items: Sequence[SAWItem], mb: CollatedBatch
) -> torch.Tensor:
    """Per-item logprobs [T_i - 1] (keyed by ``id(item)``) laid out as ``[B, T-1]``, 0.0
    off the action mask (as ``old_logprobs``)."""
    dtype = next(iter(values.values())).dtype if values else mb.action_mask.dtype
    rows = mb.action_mask.new_zeros(mb.action_mask.shape, dtype=dtype)
    for row, item in enumerate(items):
        value = values[id(item)]
        rows[row, : value.shape[0]] = value
    return rows * mb.action_mask
