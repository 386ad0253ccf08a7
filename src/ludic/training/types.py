"""Training-side pure data and contracts: SAW items, batch sources (and their optional
capabilities), credit assigners, and the algorithm the Trainer trains with.

Rollout requests and rollout hooks live in :mod:`ludic.rollouts` (re-exported here).

A ``SAWItem`` is one training sequence: **S**tate/**A**ction tokens, a mask saying which
tokens are the agent's own actions, and a scalar **W**eight from credit assignment.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ludic.rollouts.hooks import RolloutHook
from ludic.rollouts.requests import DataExhausted, EnvSpec, ProtocolSpec, RolloutRequest
from ludic.types import Rollout, check_logprob_temperature

if TYPE_CHECKING:
    from ludic.training.losses.base import Loss

__all__ = [
    "AcknowledgingBatchSource",
    "BatchSource",
    "ConcurrentBatchSource",
    "CreditAssigner",
    "DataExhausted",
    "EmptyBatchError",
    "EnvSpec",
    "ProtocolSpec",
    "RolloutHook",
    "RolloutRequest",
    "SAWBatch",
    "SAWItem",
    "StalenessBoundedSource",
    "TrainingAlgorithm",
    "check_batch_source",
]


@dataclass(frozen=True)
class SAWItem:
    """One training sequence.

    * ``input_ids``: state + action tokens, length T.
    * ``action_mask[t] == 1`` where ``input_ids[t]`` is a token the policy generated and
      should be trained on (prompt and tool-output tokens are 0).
    * ``weight``: the scalar from credit assignment (advantage / return / 1.0 for SFT).
    * ``old_logprobs[t]``: behaviour-policy logprob of ``input_ids[t]`` where
      ``action_mask[t] == 1`` (0.0 elsewhere); ``None`` if the backend gave none.
    * ``action_versions[k]``: policy version that sampled the k-th action token (in
      order; ``len == num_action_tokens``), or ``None`` when the backend gave none.
    * ``policy_version``: the oldest version among the actions (what staleness and
      ``max_staleness`` use); derived from ``action_versions`` when those are given.
    * ``version_end``: the newest version that may have sampled an action token, when a
      weight update landed mid-generation without a pause (``TokenTrace.version_end``:
      which tokens it reached is unknown); ``None`` when the versions above are exact.
      :attr:`version_span` counts it.
    * ``logprob_temperature``: ``T`` of the policy that sampled the action tokens,
      ``softmax(logits / T)`` (``TokenTrace.logprob_temperature``); ``old_logprobs`` are
      under it and the trainer scores the item under it (its logprobs, entropy, proximal
      and reference logprobs).
    """

    input_ids: tuple[int, ...]
    action_mask: tuple[int, ...]
    weight: float
    old_logprobs: tuple[float, ...] | None = None
    policy_version: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    action_versions: tuple[int, ...] | None = None
    version_end: int | None = None
    logprob_temperature: float = 1.0

    def __post_init__(self) -> None:
        check_logprob_temperature("SAWItem", self.logprob_temperature)
        object.__setattr__(self, "logprob_temperature", float(self.logprob_temperature))
        object.__setattr__(self, "input_ids", tuple(self.input_ids))
        object.__setattr__(self, "action_mask", tuple(self.action_mask))
        n = len(self.input_ids)
        if len(self.action_mask) != n:
            raise ValueError(
                f"SAWItem: action_mask has {len(self.action_mask)} entries for {n} tokens"
            )
        if not math.isfinite(self.weight):
            raise ValueError(
                f"SAWItem: weight is {self.weight!r} (rollout {self.meta.get('rollout_id')!r}); "
                "check the rewards and the credit assigner for NaN/inf"
            )
        if self.action_mask and self.action_mask[0] == 1:
            raise ValueError("SAWItem: the first token cannot be an action (nothing predicts it)")
        if not any(self.action_mask):
            raise ValueError(
                f"SAWItem: no action tokens (rollout {self.meta.get('rollout_id')!r}); "
                "an item must contain at least one generated token"
            )
        if self.old_logprobs is not None:
            object.__setattr__(self, "old_logprobs", tuple(self.old_logprobs))
            if len(self.old_logprobs) != n:
                raise ValueError(
                    f"SAWItem: old_logprobs has {len(self.old_logprobs)} entries for {n} tokens"
                )
        if self.action_versions is not None:
            versions = tuple(int(v) for v in self.action_versions)
            object.__setattr__(self, "action_versions", versions)
            if len(versions) != self.num_action_tokens:
                raise ValueError(
                    f"SAWItem: action_versions has {len(versions)} entries for "
                    f"{self.num_action_tokens} action tokens"
                )
            oldest = min(versions)
            if self.policy_version is None:
                object.__setattr__(self, "policy_version", oldest)
            elif self.policy_version != oldest:
                raise ValueError(
                    f"SAWItem: policy_version={self.policy_version} but the oldest action "
                    f"version is {oldest}; policy_version is the oldest"
                )
        if self.version_end is not None:
            object.__setattr__(self, "version_end", int(self.version_end))
            known = self.action_versions or (
                () if self.policy_version is None else (self.policy_version,)
            )
            if not known or self.version_end < max(known):
                raise ValueError(
                    f"SAWItem: version_end={self.version_end} needs known action versions "
                    "no newer than it; version_end is the newest version that may have "
                    "sampled an action token"
                )

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)

    @property
    def first_version(self) -> int | None:
        """Policy version of the first generated token (``None`` when unknown)."""
        if self.action_versions is not None:
            return self.action_versions[0]
        return self.policy_version

    @property
    def last_version(self) -> int | None:
        """Policy version of the last generated token (``None`` when unknown; the known
        one when ``version_end`` says it may be newer)."""
        if self.action_versions is not None:
            return self.action_versions[-1]
        return self.policy_version

    @property
    def newest_version(self) -> int | None:
        """The newest version that may have sampled an action token: ``version_end`` when
        set, else the last token's (``None`` when unknown)."""
        return self.version_end if self.version_end is not None else self.last_version

    @property
    def version_span(self) -> int:
        """How many weight updates the item's tokens may straddle (0: one version), from
        the oldest token's version to :attr:`newest_version`."""
        newest = self.newest_version
        return 0 if newest is None or self.policy_version is None else newest - self.policy_version


@dataclass
class SAWBatch:
    """Items for one optimizer step, plus batch-level metadata (e.g. rollout stats)."""

    items: list[SAWItem]
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.items)


class EmptyBatchError(RuntimeError):
    """A batch has no training item left: a batch source's retries all came back empty, or
    the trainer's sample filter and ``max_staleness`` dropped every item. One class for both, so
    ``except EmptyBatchError`` catches either."""


@runtime_checkable
class BatchSource(Protocol):
    """What the Trainer pulls from. Must not block forever: raise :class:`DataExhausted`
    when the data runs out, or an error on timeout.

    Optional capabilities are Protocols of their own, which the Trainer checks when it is
    built (:func:`check_batch_source`): :class:`StalenessBoundedSource`,
    :class:`ConcurrentBatchSource`, :class:`AcknowledgingBatchSource` and
    :class:`LedgerSource`."""

    async def next_batch(self) -> SAWBatch: ...


@runtime_checkable
class StalenessBoundedSource(BatchSource, Protocol):
    """A source whose items may come from older policy versions, at most
    ``max_staleness`` versions behind the trainer's (``None``: no bound). The Trainer drops
    an item whose oldest token version is older than ``step - min(max_staleness,
    TrainerConfig.max_staleness)`` (``PipelineBatchSource``)."""

    max_staleness: int | None


@runtime_checkable
class ConcurrentBatchSource(StalenessBoundedSource, Protocol):
    """A source that generates while the trainer trains (asynchronous RL,
    ``AsyncBatchSource``): the Trainer tells it each policy version the inference side
    serves (``on_policy_version``, after every publish) and closes it when
    ``Trainer.train_async`` ends (``aclose``)."""

    def on_policy_version(self, version: int) -> None: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class AcknowledgingBatchSource(BatchSource, Protocol):
    """A source that hears when each batch it handed out has been trained on: the Trainer
    calls ``mark_trained(batch)`` after the batch's optimizer step and its metrics line,
    never before (``PipelineBatchSource``: until then the batch stays in the learner's
    processing list, and a crash puts it back in the queue), and ``on_checkpoint(step)``
    after each checkpoint it writes."""

    def mark_trained(self, batch: SAWBatch) -> None: ...

    def reject(self, batch: SAWBatch, error: str) -> None:
        """``batch`` (one this source handed out) cannot be trained on, e.g. its items lack
        what the loss needs: set it aside with ``error`` (``PipelineBatchSource``: the
        dead list) so that no restart takes it again; the Trainer then asks for the next."""
        ...

    def on_checkpoint(self, step: int) -> None:
        """A checkpoint of ``step`` is written: what was trained up to it is durable
        (``PipelineBatchSource``: those batches are committed; until then a resume from an
        older checkpoint trains them again)."""
        ...


@runtime_checkable
class LedgerSource(BatchSource, Protocol):
    """A source that makes batches ahead of the Trainer (``AsyncBatchSource``, a pipeline
    learner's ``PipelineBatchSource``) and says so for the token ledger
    (:mod:`ludic.training.ledger`)."""

    ledger_run_wide: bool
    """True: :meth:`ledger_totals` counts the whole run, across restarts (a durable queue's
    producers); False: since this source was made (the Trainer adds what a resumed
    checkpoint had generated, and what was in flight then counts as aborted)."""

    ledger_committed_before: int
    """Run-wide sources: tokens that the checkpoints written before this source started
    have accounted for; a Trainer resumed from such a checkpoint holds them in its ledger,
    a Trainer without one leaves them out. 0 for the others."""

    def ledger_totals(self) -> tuple[int, int]:
        """(completion tokens generated, of them those in batches made but not yet handed
        out or accounted). After ``aclose`` the second are the batches it discarded."""
        ...


# capability -> (the member that says a source means to have it, every member it needs)
_CAPABILITIES: tuple[tuple[type, str, tuple[str, ...]], ...] = (
    (ConcurrentBatchSource, "on_policy_version", ("max_staleness", "on_policy_version", "aclose")),
    (AcknowledgingBatchSource, "mark_trained", ("mark_trained", "reject", "on_checkpoint")),
    (
        LedgerSource,
        "ledger_totals",
        ("ledger_totals", "ledger_run_wide", "ledger_committed_before"),
    ),
)


_ATTRIBUTES = ("max_staleness", "ledger_run_wide", "ledger_committed_before")
"""Capability members that are values, not methods."""


def check_batch_source(source: object, owner: str = "Trainer") -> None:
    """Raise ``TypeError`` unless ``source`` is a :class:`BatchSource` whose optional
    capabilities are whole: a source with ``on_policy_version`` is a
    :class:`ConcurrentBatchSource` (``max_staleness`` and ``aclose`` too), and the methods
    of each capability are callable. A half-declared capability would otherwise be passed
    over without a word."""
    name = type(source).__name__
    if not isinstance(source, BatchSource):
        raise TypeError(
            f"{owner}: batch_source={name} has no async next_batch() -> SAWBatch; pass a "
            "BatchSource (e.g. RolloutBatchSource, AsyncBatchSource, OfflineBatchSource)"
        )
    for capability, marker, members in _CAPABILITIES:
        if not hasattr(source, marker):
            continue
        missing = [m for m in members if not hasattr(source, m)]
        uncallable = [
            m
            for m in members
            if m not in _ATTRIBUTES and m not in missing and not callable(getattr(source, m))
        ]
        if missing or uncallable:
            problem = f"lacks {missing}" if missing else f"has non-callable {uncallable}"
            raise TypeError(
                f"{owner}: batch_source={name} has {marker} but {problem}; a "
                f"{capability.__name__} declares all of {list(members)}"
            )


@runtime_checkable
class CreditAssigner(Protocol):
    """Turns rewards into one scalar weight per turn.

    Returns ``weights[i][j]`` for turn ``j`` of ``rollouts[i].turns()``.
    """

    def compute(self, rollouts: Sequence[Rollout]) -> list[list[float]]: ...


@runtime_checkable
class TrainingAlgorithm(Protocol):
    """What the Trainer reads from an algorithm (``RLAlgorithm`` is one): its ``name``
    (logged, checkpointed), its ``loss`` and an optional ``preprocess`` that rewrites each
    optimizer step's batch before the loss (``None``: none)."""

    name: str
    loss: Loss
    preprocess: Any
