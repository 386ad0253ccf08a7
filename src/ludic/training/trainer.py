"""The Trainer: one optimisation loop for every algorithm.

An algorithm is ``RLAlgorithm`` = credit assigner (already applied by the batch source)
+ ``loss`` (+ optional ``preprocess``). Each :meth:`Trainer.train_step` runs, in order::

    batch   = await batch_source.next_batch()
    items   = preprocess, sample_filter, max_lag            (dropped counts are logged)
    for each micro-batch (<= max_tokens_per_microbatch padded tokens):
        logprobs = log_softmax(model(input_ids).logits)[next tokens]     [B, T-1], float32
        loss     = algorithm.loss(LossInputs(normalizers over the whole step))
        loss.backward()                     (micro-batch losses sum to the full-batch loss)
    check grads finite -> clip -> optimizer.step -> scheduler.step -> step += 1
    publish weights every publish_every steps (version = step) -> log -> checkpoint

``trainer.step`` counts optimizer steps and is the policy version.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import random
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ludic.distributed.interfaces import PolicyPublisher
from ludic.distributed.weights import policy_state_dict
from ludic.stats import Reducer, aggregate_stats
from ludic.training.checkpoint import CheckpointConfig
from ludic.training.collate import CollatedBatch, collate, split_microbatches
from ludic.training.config import TrainerConfig
from ludic.training.core import (  # noqa: F401 (NonFiniteError re-exported)
    HasTrainingCore,
    NonFiniteError,
    TrainingCore,
)
from ludic.training.filters import SampleFilter
from ludic.training.flat_parameters import flatten_parameters
from ludic.training.loggers import TrainingLogger
from ludic.training.losses.base import LossInputs
from ludic.training.types import BatchSource, DataExhausted, EmptyBatchError, SAWBatch, SAWItem


@dataclasses.dataclass(frozen=True)
class StepTotals:
    """Normalizers over the whole optimizer step (every micro-batch)."""

    num_sequences: int
    num_action_tokens: int


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits[:, t])[input_ids[:, t+1]]`` in float32: [B, T, V] -> [B, T-1]."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


class Trainer(HasTrainingCore):
    """Optimises ``model`` with ``algorithm.loss`` on batches from ``batch_source``.

    * ``model``: an HF-style causal LM (``model(input_ids=, attention_mask=).logits``),
      plain or peft; only parameters with ``requires_grad`` are optimised.
    * ``publisher``: receives ``policy_state_dict(model)`` every ``publish_every`` steps.
    * ``checkpoint``: where/how often to save; enables :meth:`resume`.
    * ``sample_filter``: ``SAWItem -> bool`` (True keeps), e.g. ``filters.drop_truncated()``.
    * ``reference_model``: frozen model for ``ref_logprobs``; required by losses with
      ``requires_ref_logprobs``.
    * ``metric_reducers``: ``stats.Reducer``s over the step's (kept) ``SAWItem``s, e.g.
      ``Reducer("success", "meta.reward", reduce="fraction", transform=lambda r: r > 0)``.

    The optimizer, schedule, step counter, checkpoints and loggers live in a
    :class:`~ludic.training.core.TrainingCore` (``trainer.core``) shared with the
    reward-model trainer; ``trainer.step``, ``.optimizer``, ``.checkpoints`` read through.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        algorithm: Any,
        batch_source: BatchSource,
        config: TrainerConfig,
        *,
        publisher: PolicyPublisher | None = None,
        checkpoint: CheckpointConfig | None = None,
        loggers: Iterable[TrainingLogger] = (),
        sample_filter: SampleFilter | None = None,
        reference_model: torch.nn.Module | None = None,
        metric_reducers: Sequence[Reducer] = (),
    ) -> None:
        if not callable(getattr(algorithm, "loss", None)):
            raise TypeError(
                f"Trainer(algorithm=) needs an object with a callable .loss, got "
                f"{type(algorithm).__name__}; pass an RLAlgorithm (e.g. make_grpo())"
            )
        self.config = config
        self.device = torch.device(config.device)
        _seed_everything(config.seed)
        self.model = model.to(self.device)
        if config.flat_parameters:
            flatten_parameters(self.model)
        self.algorithm = algorithm
        self.loss = algorithm.loss
        self.batch_source = batch_source
        self.publisher = publisher
        self.sample_filter = sample_filter
        self.reference_model = self._prepare_reference(reference_model)
        self.metric_reducers = tuple(metric_reducers)
        self.core = TrainingCore(
            self.model,
            config,
            owner="step",
            fix_hint="Check the model weights and batch for NaN/inf, lower TrainerConfig.lr, "
            "or set TrainerConfig.max_grad_norm",
            checkpoint=checkpoint,
            loggers=loggers,
        )

    # ---------------------------------------------------------------- the loop
    async def train_step(self) -> dict[str, float]:
        """One optimizer step; returns (and logs) its metrics."""
        t_start = time.perf_counter()
        batch = await self.batch_source.next_batch()
        t_batch = time.perf_counter()
        batch, dropped = self._select_items(batch)
        self._check_loss_inputs(batch.items)
        microbatches = split_microbatches(batch.items, self.config.max_tokens_per_microbatch)
        totals = StepTotals(
            num_sequences=len(batch.items),
            num_action_tokens=sum(item.num_action_tokens for item in batch.items),
        )
        loss, loss_stats = self._accumulate_gradients(microbatches, totals)
        lr = self.core.lr
        grad_norm = self.core.optimizer_step()
        t_compute = time.perf_counter()
        self.step += 1
        if self.publisher is not None and self.core.is_due(self.config.publish_every):
            self.publish_policy()
        timing = {
            "time/batch_wait_s": t_batch - t_start,
            "time/compute_s": t_compute - t_batch,
            "time/publish_s": time.perf_counter() - t_compute,
        }
        metrics = self._metrics(batch, loss, loss_stats, grad_norm, lr, dropped, timing)
        metrics["num_microbatches"] = len(microbatches)
        self.logger.log(self.step, metrics)
        # After the log: a checkpoint never gets ahead of its step's metrics line.
        self.core.maybe_checkpoint(self._checkpoint_extra)
        return metrics

    async def train(self, num_steps: int) -> list[dict[str, float]]:
        """Run ``num_steps`` optimizer steps, or fewer if the batch source raises
        :class:`DataExhausted`; returns each completed step's metrics."""
        history: list[dict[str, float]] = []
        for _ in range(num_steps):
            try:
                history.append(await self.train_step())
            except DataExhausted:
                break
        return history

    def train_sync(self, num_steps: int) -> list[dict[str, float]]:
        """:meth:`train` for scripts without an event loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.train(num_steps))
        raise RuntimeError(
            "Trainer.train_sync() was called inside a running event loop; use "
            "`await trainer.train(num_steps)` there"
        )

    # ---------------------------------------------------------------- stages
    def _select_items(self, batch: SAWBatch) -> tuple[SAWBatch, dict[str, int]]:
        """Drop filtered and stale items, then preprocess what is left (so a batch
        baseline is computed over exactly the items trained on); raise if none is left."""
        received = len(batch.items)
        kept = [i for i in batch.items if self.sample_filter is None or self.sample_filter(i)]
        fresh = [i for i in kept if not self._is_stale(i)]
        dropped = {"dropped/filter": received - len(kept), "dropped/stale": len(kept) - len(fresh)}
        if not fresh:
            raise EmptyBatchError(
                f"step {self.step + 1}: batch of {received} items is empty after "
                f"{dropped['dropped/filter']} dropped by sample_filter and "
                f"{dropped['dropped/stale']} stale (policy_version < {self.step} - max_lag="
                f"{self.config.max_lag}); loosen the filter, raise TrainerConfig.max_lag, or "
                "check the batch source"
            )
        batch = SAWBatch(items=fresh, meta=batch.meta)
        preprocess = getattr(self.algorithm, "preprocess", None)
        return (batch if preprocess is None else preprocess(batch)), dropped

    def _is_stale(self, item: SAWItem) -> bool:
        max_lag, version = self.config.max_lag, item.policy_version
        return max_lag is not None and version is not None and version < self.step - max_lag

    def _check_loss_inputs(self, items: Sequence[SAWItem]) -> None:
        if not getattr(self.loss, "requires_old_logprobs", False):
            return
        missing = [item for item in items if item.old_logprobs is None]
        if missing:
            rollout_ids = [item.meta.get("rollout_id") for item in missing[:3]]
            raise ValueError(
                f"{type(self.loss).__name__} requires old_logprobs, but {len(missing)} of "
                f"{len(items)} items have none (rollouts {rollout_ids}); request behaviour "
                "logprobs with InferenceSpec(returns=ReturnSpec.for_rl())"
            )

    def _accumulate_gradients(
        self, microbatches: list[list[SAWItem]], totals: StepTotals
    ) -> tuple[float, dict[str, float]]:
        """Forward + loss + backward per micro-batch.

        Returns the step loss (the sum over micro-batches, which equals the full-batch loss
        because the normalizers are global) and the loss stats, averaged over micro-batches
        with weights = their share of action tokens. A stat named ``"loss"`` is left out:
        the summed step loss is the authoritative value.
        """
        self.model.train()
        total_loss, stats = 0.0, dict[str, float]()
        for items in microbatches:
            mb = collate(items, self.config.pad_token_id, self.device)
            out = self.loss(self._loss_inputs(mb, totals))
            value = float(out.loss.detach())
            if not math.isfinite(value):
                self.core.abort_step(f"loss is {value}")
            out.loss.backward()
            total_loss += value
            share = mb.num_action_tokens / max(totals.num_action_tokens, 1)
            for key, stat in out.stats.items():
                if key != "loss":
                    stats[key] = stats.get(key, 0.0) + share * float(stat)
        return total_loss, stats

    def _loss_inputs(self, mb: CollatedBatch, totals: StepTotals) -> LossInputs:
        logits = self._forward(self.model, mb)  # [B, T, V]
        ref_logprobs = None
        if self.reference_model is not None and getattr(self.loss, "requires_ref_logprobs", False):
            with torch.no_grad():
                ref_logprobs = token_logprobs(self._forward(self.reference_model, mb), mb.input_ids)
        return LossInputs(
            logits=logits,
            logprobs=token_logprobs(logits, mb.input_ids),  # [B, T-1]
            action_mask=mb.action_mask,
            weights=mb.weights,
            num_sequences=totals.num_sequences,
            num_action_tokens=totals.num_action_tokens,
            old_logprobs=mb.old_logprobs,
            ref_logprobs=ref_logprobs,
        )

    def _forward(self, model: torch.nn.Module, mb: CollatedBatch) -> torch.Tensor:
        dtype = self.config.dtype
        autocast = (
            torch.autocast(device_type=self.device.type, dtype=getattr(torch, dtype))
            if dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            return model(
                input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False
            ).logits

    # ---------------------------------------------------------------- sync, save, log
    def publish_policy(self) -> None:
        """Publish the current weights as version ``step`` (also useful after resume)."""
        if self.publisher is None:
            raise ValueError("Trainer has no publisher; pass Trainer(publisher=...)")
        self.publisher.publish(policy_state_dict(self.model), version=self.step)

    def save_checkpoint(self) -> Path:
        return self.core.save_checkpoint(self._checkpoint_extra())

    def _checkpoint_extra(self) -> dict[str, Any]:
        return {
            "algorithm": getattr(self.algorithm, "name", type(self.algorithm).__name__),
            "config": dataclasses.asdict(self.config),
        }

    def resume(self, path: str | Path | None = None) -> int:
        """Restore model, optimizer, schedule, RNGs and ``step`` from ``path`` (default:
        the latest checkpoint). Returns the restored step."""
        return self.core.resume(path).step

    def _metrics(
        self,
        batch: SAWBatch,
        loss: float,
        loss_stats: Mapping[str, float],
        grad_norm: float,
        lr: float,
        dropped: Mapping[str, int],
        timing: Mapping[str, float],
    ) -> dict[str, float]:
        items = batch.items
        num_tokens = sum(item.num_tokens for item in items)
        metrics: dict[str, float] = {
            "loss": loss,
            **{f"loss/{key}": value for key, value in loss_stats.items()},
            "grad_norm": grad_norm,
            "lr": lr,
            "num_items": len(items),
            "num_tokens": num_tokens,
            "num_action_tokens": sum(item.num_action_tokens for item in items),
            "tokens_per_s": num_tokens / max(timing["time/compute_s"], 1e-9),
            **timing,
            **dropped,
            **_reward_stats(items),
            **{f"batch/{k}": float(v) for k, v in batch.meta.items() if _is_number(v)},
            "policy_version": self.step,
        }
        metrics.update(aggregate_stats(self.metric_reducers, items))
        return metrics

    def _prepare_reference(self, model: torch.nn.Module | None) -> torch.nn.Module | None:
        if model is None:
            if getattr(self.loss, "requires_ref_logprobs", False):
                raise ValueError(
                    f"{type(self.loss).__name__} requires ref_logprobs; pass "
                    "Trainer(reference_model=...) (a frozen copy of the initial policy)"
                )
            return None
        model = model.to(self.device).eval()
        model.requires_grad_(False)
        return model


def _reward_stats(items: Sequence[SAWItem]) -> dict[str, float]:
    rewards = [float(i.meta["reward"]) for i in items if _is_number(i.meta.get("reward"))]
    if not rewards:
        return {}
    return {
        "reward/mean": statistics.fmean(rewards),
        "reward/std": statistics.pstdev(rewards),
        "reward/min": min(rewards),
        "reward/max": max(rewards),
    }


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
