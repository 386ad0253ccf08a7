"""The Trainer: one optimisation loop for every algorithm.

An algorithm is ``RLAlgorithm`` = credit assigner (already applied by the batch source)
+ ``loss`` (+ optional ``preprocess``). :meth:`Trainer.train_step` runs named stages in
order: next batch -> select (``step_selection``: filter, staleness, preprocess) -> update
(``policy_update``: mini-batches, micro-batches, loss, backward, optimizer) -> publish
(every ``publish_every`` steps, version = ``trainer.step``) -> account (``step_books``:
token ledger, bias audit, metrics) -> log -> acknowledge (a Redis source's) -> checkpoint.
:meth:`train_async` keeps an asynchronous source generating while the step trains.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ludic._async import on_compute_thread
from ludic.distributed.interfaces import PolicyPublisher
from ludic.distributed.weight_transfer.extractor import gather_full_tensors
from ludic.distributed.weights import policy_state_dict
from ludic.stats import Reducer
from ludic.timing import timed
from ludic.training.checkpoint import CheckpointConfig
from ludic.training.config import TrainerConfig
from ludic.training.core import (  # noqa: F401 (NonFiniteError re-exported)
    HasTrainingCore,
    NonFiniteError,
    TrainingCore,
)
from ludic.training.data_parallel import (
    BatchChannel,
    TrainerRanks,
    broadcast_flag,
    gathered,
    shard_policy,
)
from ludic.training.filters import SampleFilter
from ludic.training.flat_parameters import flatten_parameters
from ludic.training.ledger import TokenLedger
from ludic.training.loggers import TrainingLogger
from ludic.training.logprobs import token_logprobs  # noqa: F401 (re-exported)
from ludic.training.losses.base import check_loss
from ludic.training.policy_update import PolicyUpdate, StepResult
from ludic.training.sample_audit import SampleAudit
from ludic.training.step_books import StepBooks
from ludic.training.step_selection import Selection, StepSelector
from ludic.training.token_scores import ScoringOptions, split_causal_lm
from ludic.training.types import (  # noqa: F401 (EmptyBatchError re-exported)
    AcknowledgingBatchSource,
    BatchSource,
    ConcurrentBatchSource,
    DataExhausted,
    EmptyBatchError,
    SAWBatch,
    TrainingAlgorithm,
    check_batch_source,
)
from ludic.training.varlen_attention import use_varlen_sdpa


class Trainer(HasTrainingCore):
    """Optimises ``model`` with ``algorithm.loss`` on batches from ``batch_source``.

    * ``model``: an HF-style causal LM (``model(input_ids=, attention_mask=).logits``),
      plain or peft; only parameters with ``requires_grad`` are optimised.
    * ``publisher``: receives ``published_weights(model)`` every ``publish_every`` steps:
      ``policy_state_dict`` (the default: a LoRA policy merged) or ``adapter_state_dict``
      (the adapter alone, for a vLLM server's LoRA support; ``ludic.distributed.weights``).
    * ``checkpoint``: where/how often to save; enables :meth:`resume`.
    * ``sample_filter``: ``SAWItem -> bool`` (True keeps), e.g. ``filters.drop_truncated()``.
    * ``reference_model``: frozen model for ``ref_logprobs``; required by losses with
      ``requires_ref_logprobs``.
    * ``metric_reducers``: ``stats.Reducer``s over the step's (kept) ``SAWItem``s, e.g.
      ``Reducer("success", "meta.reward", reduce="fraction", transform=lambda r: r > 0)``.
    * ``ranks``: data-parallel training over torch.distributed ranks, the policy sharded
      with FSDP2 (:mod:`ludic.training.data_parallel`): every rank builds the same
      Trainer with ``ranks=TrainerRanks.current()``; rank 0's batch source, publisher and
      loggers are the ones used (another rank's are ignored: its ``batch_source`` may be
      ``None``, its batches come from rank 0).

    The optimizer, schedule, step counter, checkpoints and loggers live in a
    :class:`~ludic.training.core.TrainingCore` (``trainer.core``) shared with the
    reward-model trainer; ``trainer.step``, ``.optimizer``, ``.checkpoints`` read through.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        algorithm: TrainingAlgorithm,
        batch_source: BatchSource | None,
        config: TrainerConfig,
        *,
        publisher: PolicyPublisher | None = None,
        checkpoint: CheckpointConfig | None = None,
        loggers: Iterable[TrainingLogger] = (),
        sample_filter: SampleFilter | None = None,
        reference_model: torch.nn.Module | None = None,
        metric_reducers: Sequence[Reducer] = (),
        ranks: TrainerRanks | None = None,
        published_weights: Callable[[torch.nn.Module], dict[str, torch.Tensor]] = (
            policy_state_dict
        ),
    ) -> None:
        _check_algorithm(algorithm)
        if batch_source is not None or ranks is None or ranks.is_main:
            check_batch_source(batch_source)
        self.config = config
        self.device = torch.device(config.device)
        _seed_everything(config.seed)
        self.model = _prepare_policy(model.to(self.device), config)
        self.algorithm = algorithm
        self.loss = algorithm.loss
        self.batch_source = batch_source
        self.published_weights = published_weights
        self.sample_filter = sample_filter
        self.reference_model = self._prepare_reference(reference_model)
        # a group of one shards too (FSDP2 over one process: the NCCL path on one GPU)
        self.ranks = ranks
        self.main = ranks is None or ranks.is_main
        """Whether this is the rank whose source, publisher and loggers are used."""
        models = self._models_to_score()  # shards the policy with ranks: before the optimizer
        self._channel = None if ranks is None else BatchChannel(ranks)
        # Rank 0 decides: whether weights are published, and the batch source's kind.
        self.publisher = publisher if self.main else None
        self._publishes = self._agreed(publisher is not None)
        concurrent = self._agreed(isinstance(batch_source, ConcurrentBatchSource))
        acknowledging = isinstance(batch_source, AcknowledgingBatchSource) and self.main
        self._acknowledging = batch_source if acknowledging else None  # a Redis learner's
        self.books = StepBooks(batch_source, metric_reducers)
        self.selector = StepSelector(
            batch_source, algorithm, self.books, sample_filter, config.max_staleness, concurrent
        )
        self.core = TrainingCore(  # after sharding: the optimizer holds the sharded tensors
            self.model,
            config,
            owner="step",
            fix_hint="Check the model weights and batch for NaN/inf, lower TrainerConfig.lr, "
            "or set TrainerConfig.max_grad_norm",
            checkpoint=checkpoint,
            loggers=loggers if self.main else (),  # rank 0 logs (metrics summed over ranks)
        )
        self.update = PolicyUpdate(loss=self.loss, config=config, core=self.core, **models)
        self._published_version = self.step  # the backend is assumed to serve these weights

    def _agreed(self, flag: bool) -> bool:
        """``flag`` as rank 0 has it (every rank follows rank 0's source and publisher)."""
        return flag if self.ranks is None else broadcast_flag(flag, self.ranks)

    def _models_to_score(self) -> dict[str, Any]:
        """The models a :class:`PolicyUpdate` scores, their decoder/head split for chunked
        logprobs (split here: an unsupported model fails now), and the scoring options;
        with ``ranks`` the policy sharded (FSDP2) and its scorer."""
        options, reference, ranks = self._scoring_options(), self.reference_model, self.ranks
        split = split_causal_lm if self.config.logprobs == "chunked" else (lambda _: None)
        parts = split(self.model)  # before sharding, as the sharded scorer splits its own
        scorer = None if ranks is None else shard_policy(self.model, options, self.device.type)
        return {
            "model": self.model,
            "scoring": options,
            "parts": parts,
            "reference": reference,
            "reference_parts": None if reference is None else split(reference),
            "ranks": ranks,
            "scorer": scorer,
        }

    def _scoring_options(self) -> ScoringOptions:
        config, ranks = self.config, self.ranks
        varlen = self._varlen_attention()
        return ScoringOptions(
            logprobs=config.logprobs,
            chunk_tokens=config.logprob_chunk_tokens,
            packing=config.packing,
            # one row of the whole budget when attention runs per sequence (varlen), else
            # rows as long as the longest sequence (eager's dense mask costs row_len^2)
            row_tokens=config.max_tokens_per_microbatch if varlen else None,
            # Sharded: a shared-prefix forward runs the decoder twice, a plain one once, and
            # every rank must run as many (gathering) forwards as the others.
            shared_prefix=config.shared_prefix and (ranks is None or ranks.world_size == 1),
            varlen=varlen,
            dtype=config.dtype,
            pad_token_id=config.pad_token_id,
        )

    @property
    def scoring(self) -> ScoringOptions:
        return self.update.scoring

    @property
    def audit(self) -> SampleAudit:
        """Trained against dropped items, cumulative (``ludic.training.sample_audit``)."""
        return self.books.audit

    @property
    def ledger(self) -> TokenLedger | None:
        """Where every generated token went (``ludic.training.ledger``); ``None`` until a
        batch says what was generated for it (a rollout source's do; an SFT one's not)."""
        return self.books.ledger

    @property
    def max_staleness(self) -> int | None:
        """The oldest token version trained on is ``step - max_staleness``."""
        return self.selector.max_staleness

    # ---------------------------------------------------------------- the step
    async def train_step(self) -> dict[str, float]:
        """One trainer step; returns (and logs) its metrics.

        Once its batch is in hand, the step runs to its end (log and checkpoint included)
        even if the caller is cancelled meanwhile (Ctrl-C): the cancellation is raised
        after it, so the weights never get ahead of the metrics and checkpoints."""
        self._announce_version()  # idempotent; the first call sets the source's base
        started = time.perf_counter()
        selection = await self._next_batch()
        finish = asyncio.ensure_future(
            self._finish_step(selection, started, time.perf_counter() - started)
        )
        try:
            return await asyncio.shield(finish)
        except asyncio.CancelledError:
            await asyncio.wait([finish])
            raise

    async def _finish_step(
        self, selection: Selection, started: float, waited: float
    ) -> dict[str, float]:
        t_update = time.perf_counter()
        result = await self._compute(self._update, selection)
        t_publish = time.perf_counter()
        self.step += 1
        await self._publish_if_due()
        train_s, sync_s = t_publish - t_update, time.perf_counter() - t_publish
        timing = self.books.timing(started, waited, train_s, sync_s, selection.raw_batches)
        metrics = self._account(selection, result, timing)
        self._log(metrics)
        self._acknowledge(selection.raw_batches)
        self._checkpoint_if_due()  # after the log: never ahead of its step's metrics line
        return metrics

    async def _next_batch(self) -> Selection:
        """The step's batch (:class:`StepSelector`). With ``ranks``, rank 0 selects it and
        broadcasts it; the other ranks receive it (and raise what rank 0's source raised)."""
        if self._channel is None:
            return await self.selector.select(self.step)
        if not self.main:
            batch = await asyncio.to_thread(self._channel.receive)
            return Selection(batch, [], {})
        try:
            selection = await self.selector.select(self.step)
            payload = self._channel.encode(selection.batch)  # a refused batch ends it too
        except BaseException as error:
            await asyncio.to_thread(self._channel.send_end, error)
            raise
        await asyncio.to_thread(self._channel.send_payload, payload)
        return selection

    async def _compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` off the event loop: in a worker thread when generation lives on the
        loop (asynchronous source), else on the one compute thread sampling shares."""
        if self.selector.concurrent:
            return await asyncio.to_thread(fn, *args)
        return await on_compute_thread(fn, *args)

    def _update(self, selection: Selection) -> StepResult:
        """The step's updates, with torch's threads at ``config.update_threads`` when the
        event loop waits for them (sync: bigger ops than sampling's gain from more)."""
        items = selection.batch.items
        threads = self.config.update_threads
        before = torch.get_num_threads()
        if self.selector.concurrent or threads is None or threads == before:
            return self.update.run(items, self.step)
        torch.set_num_threads(threads)
        try:
            return self.update.run(items, self.step)
        finally:
            torch.set_num_threads(before)

    async def _publish_if_due(self) -> None:
        """Publish the weights every ``publish_every`` steps, then tell an asynchronous
        source the version the inference side now serves."""
        if self._publishes and self.core.is_due(self.config.publish_every):
            await self._compute(self.publish_policy)
        self._announce_version()

    def _account(
        self, selection: Selection, result: StepResult, timing: dict[str, float]
    ) -> dict[str, float]:
        """The step's books: its items as trained (the rank that saw the batches closes the
        ledger), and its metrics."""
        self.books.trained(selection.batch.items, self.step, close_ledger=self.main)
        return self.books.metrics(self.step, selection.batch, result, selection.metrics, timing)

    def _log(self, metrics: dict[str, float]) -> None:
        with timed("logging"):
            self.logger.log(self.step, metrics)
        self.books.warn_once(self.step)

    def _acknowledge(self, raw_batches: Sequence[SAWBatch]) -> None:
        """Tell an acknowledging (Redis) source that its batches are trained."""
        if self._acknowledging is not None:
            for raw in raw_batches:
                self._acknowledging.mark_trained(raw)

    def _checkpoint_if_due(self) -> None:
        with timed("checkpoint"):
            checkpointed = self.core.maybe_checkpoint(self._checkpoint_extra) is not None
        if checkpointed:
            self._checkpointed()

    # ---------------------------------------------------------------- the loop
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

    async def train_async(self, num_steps: int) -> list[dict[str, float]]:
        """:meth:`train` with generation running concurrently (asynchronous RL).

        The batch source must be asynchronous, e.g.
        ``AsyncBatchSource(RolloutBatchSource(...), max_staleness=2)``; it is closed (its
        generation cancelled) when training ends, however it ends."""
        if not isinstance(self.batch_source, ConcurrentBatchSource):
            raise TypeError(
                f"Trainer.train_async needs an asynchronous batch source, got "
                f"{type(self.batch_source).__name__}; wrap it: AsyncBatchSource(source, "
                "max_staleness=N) (ludic.training.batching.async_source)"
            )
        try:
            history = await self.train(num_steps)
        finally:
            await self.close_source()
        self.settle_ledger()
        return history

    async def close_source(self) -> None:
        """Close an asynchronous batch source: its generation cancelled (what it made and
        did not hand out stays counted, for :meth:`settle_ledger`)."""
        if isinstance(self.batch_source, ConcurrentBatchSource):
            await self.batch_source.aclose()

    def settle_ledger(self) -> None:
        """The end of training, once nothing more is made: what was made and never handed
        out counts as aborted, and the ledger must still close (``StepBooks.settle``)."""
        if self.main:
            self.books.settle(self.step)

    def train_async_sync(self, num_steps: int) -> list[dict[str, float]]:
        """:meth:`train_async` for scripts without an event loop."""
        return _run_outside_loop(self.train_async(num_steps), "train_async_sync", "train_async")

    def train_sync(self, num_steps: int) -> list[dict[str, float]]:
        """:meth:`train` for scripts without an event loop."""
        return _run_outside_loop(self.train(num_steps), "train_sync", "train")

    # ---------------------------------------------------------------- sync, save, resume
    def publish_policy(self) -> None:
        """Publish the current weights as version ``step`` (also useful after resume).
        With ``ranks``, every rank must call it: the sharded weights are gathered on rank 0
        (one collective per tensor, every rank in the same order), which then publishes
        them like a single process (so a publisher may push to several servers at once)."""
        if not self._publishes:
            raise ValueError("Trainer has no publisher; pass Trainer(publisher=...)")
        state = self.published_weights(self.model)
        if self.ranks is None:
            assert self.publisher is not None
            self.publisher.publish(state, version=self.step)
        elif self.publisher is not None:  # rank 0: the full weights, then any publisher
            self.publisher.publish(gathered(state), version=self.step)
        else:  # another rank: join rank 0's gathers, in the same order
            gather_full_tensors(state)
        self._published_version = self.step

    def _announce_version(self) -> None:
        """Tell the batch source (``on_policy_version``) the newest version the inference
        side serves: the last published one (the step itself without a publisher)."""
        if isinstance(self.batch_source, ConcurrentBatchSource):
            version = self.step if not self._publishes else self._published_version
            self.batch_source.on_policy_version(version)

    def save_checkpoint(self) -> Path:
        with timed("checkpoint"):
            path = self.core.save_checkpoint(self._checkpoint_extra())
        self._checkpointed()
        return path

    def _checkpointed(self) -> None:
        """A checkpoint of this step is on disk: tell an acknowledging source."""
        if self._acknowledging is not None:
            self._acknowledging.on_checkpoint(self.step)

    def _checkpoint_extra(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm.name,
            "config": dataclasses.asdict(self.config),
            **self.books.state(),
        }

    def resume(self, path: str | Path | None = None) -> int:
        """Restore model, optimizer, schedule, RNGs, ``step`` and the books (sample audit,
        token ledger) from ``path`` (default: the latest checkpoint). Returns the step."""
        loaded = self.core.resume(path)
        self.books.restore(loaded.extra)
        return loaded.step

    # ---------------------------------------------------------------- models
    def _prepare_reference(self, model: torch.nn.Module | None) -> torch.nn.Module | None:
        if model is None:
            if self.loss.requires_ref_logprobs:
                raise ValueError(
                    f"{type(self.loss).__name__} requires ref_logprobs; pass "
                    "Trainer(reference_model=...) (a frozen copy of the initial policy)"
                )
            return None
        model = model.to(self.config.reference_device or self.device).eval()
        model.requires_grad_(False)
        return model

    def _varlen_attention(self) -> bool:
        """With packing: whether the policy's attention runs per sequence over one packed
        row (flash-attention's varlen kernel; sdpa, switched to
        :data:`~ludic.training.varlen_attention.VARLEN_SDPA`, which computes the same)."""
        if not self.config.packing:
            return False
        config = getattr(self.model, "config", None)
        implementation = str(getattr(config, "_attn_implementation", "") or "")
        if self.reference_model is not None:  # it runs the same packed rows
            use_varlen_sdpa(self.reference_model)
        return implementation.startswith("flash") or use_varlen_sdpa(self.model)


def _prepare_policy(model: torch.nn.Module, config: TrainerConfig) -> torch.nn.Module:
    if config.gradient_checkpointing:
        _enable_gradient_checkpointing(model)
    if config.flat_parameters:
        flatten_parameters(model)
    return model


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _run_outside_loop(coro: Any, name: str, async_name: str) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError(
        f"Trainer.{name}() was called inside a running event loop; use "
        f"`await trainer.{async_name}(num_steps)` there"
    )


def _enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError(
            f"TrainerConfig.gradient_checkpointing=True but {type(model).__name__} has no "
            "gradient_checkpointing_enable() (a Hugging Face model has); set it to False"
        )
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _check_algorithm(algorithm: object) -> None:
    """``algorithm`` is a :class:`TrainingAlgorithm` with a whole :class:`Loss`."""
    if not isinstance(algorithm, TrainingAlgorithm):
        raise TypeError(
            f"Trainer(algorithm=) needs name, loss and preprocess (a TrainingAlgorithm), got "
            f"{type(algorithm).__name__}; pass an RLAlgorithm (e.g. make_grpo())"
        )
    check_loss(algorithm.loss, "Trainer")
    if algorithm.preprocess is not None and not callable(algorithm.preprocess):
        raise TypeError(
            f"Trainer: algorithm {algorithm.name!r} has preprocess={algorithm.preprocess!r}, "
            "which is not callable; pass a function SAWBatch -> SAWBatch or None"
        )
