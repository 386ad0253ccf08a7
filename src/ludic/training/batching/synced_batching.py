"""Synchronous on-policy batches: the trainer waits while rollouts are generated.

Each ``next_batch`` call: ``requests_fn()`` -> request strategy (e.g. GRPO groups) ->
``RolloutEngine.generate_rollouts`` -> rollout hooks (e.g. reward-model scoring) -> credit
-> ``SAWItem``s -> ``sample_filter``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ludic.inference.chat_template import ChatTemplate
from ludic.rollouts.engine import RolloutEngine
from ludic.rollouts.hooks import check_rollout_hooks, run_rollout_hooks
from ludic.rollouts.strategies import RequestStrategy
from ludic.timing import timed
from ludic.training.batching.saw import SampleFilter, build_saw_batch, check_retokenize_args
from ludic.training.ledger import ABORTED, DROPPED_FILTER, GENERATE_S, GENERATED
from ludic.training.types import (
    CreditAssigner,
    EmptyBatchError,
    RolloutHook,
    RolloutRequest,
    SAWBatch,
)
from ludic.types import Rollout

if TYPE_CHECKING:
    from ludic.training.algorithm import RLAlgorithm


class RolloutBatchSource:
    """A ``BatchSource`` that generates fresh rollouts for every batch.

    If ``sample_filter`` (or empty completions) leaves no item, the batch is regenerated
    with a new ``requests_fn()`` call; after ``max_empty_batches`` consecutive empty
    attempts ``next_batch`` raises :class:`EmptyBatchError` instead of looping forever.

    ``rollout_hooks`` run in order on every generated list of rollouts, before credit
    assignment (each attempt's); they annotate the rollouts in place (``rollout.meta``).
    Pass ``RLAlgorithm.rollout_hooks`` here with ``RLAlgorithm.credit_assigner``, or build
    the source with :meth:`from_algorithm`, which takes the whole algorithm.

    ``last_rollouts`` holds the rollouts behind the latest batch (for logging/inspection).
    ``batch.meta`` holds the rollout statistics (see ``summarize_rollouts``) plus
    ``attempts`` (generation rounds this batch took).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        requests_fn: Callable[[], list[RolloutRequest]],
        credit_assigner: CreditAssigner,
        *,
        request_strategy: RequestStrategy | None = None,
        retokenize: bool = False,
        chat_template: ChatTemplate | None = None,
        sample_filter: SampleFilter | None = None,
        max_empty_batches: int = 3,
        rollout_hooks: Sequence[RolloutHook] = (),
    ) -> None:
        if max_empty_batches < 1:
            raise ValueError(
                f"RolloutBatchSource: max_empty_batches must be >= 1, got {max_empty_batches}"
            )
        check_retokenize_args("RolloutBatchSource", retokenize, chat_template)
        self.engine = engine
        self.requests_fn = requests_fn
        self.credit_assigner = credit_assigner
        self.request_strategy = request_strategy
        self.retokenize = retokenize
        self.chat_template = chat_template
        self.sample_filter = sample_filter
        self.max_empty_batches = max_empty_batches
        self.rollout_hooks = check_rollout_hooks("RolloutBatchSource", rollout_hooks)
        self.last_rollouts: list[Rollout] = []

    @classmethod
    def from_algorithm(
        cls,
        engine: RolloutEngine,
        requests_fn: Callable[[], list[RolloutRequest]],
        algorithm: RLAlgorithm,
        **options: Any,
    ) -> RolloutBatchSource:
        """A source generating for ``algorithm``, handed over in one piece: its credit
        assigner, rollout hooks and request strategy (``options``: the other keyword
        arguments, e.g. ``sample_filter``)."""
        return cls(
            engine,
            requests_fn,
            algorithm.credit_assigner,
            request_strategy=algorithm.request_strategy,
            rollout_hooks=algorithm.rollout_hooks,
            **options,
        )

    def _requests(self) -> list[RolloutRequest]:
        requests = list(self.requests_fn())
        if not requests:
            raise ValueError(
                "RolloutBatchSource: requests_fn() returned no requests; it must return at "
                "least one RolloutRequest per call (raise DataExhausted to end training)"
            )
        if self.request_strategy is not None:
            requests = self.request_strategy.expand(requests)
        return requests

    async def next_batch(self) -> SAWBatch:
        last_meta: dict[str, object] = {}
        # the token ledger: what attempts that made no item generated (and restarts threw
        # away), carried into the batch returned
        empty_generated = empty_aborted = 0
        started = time.perf_counter()
        for attempt in range(1, self.max_empty_batches + 1):
            rollouts = await self.engine.generate_rollouts(self._requests())
            await run_rollout_hooks(self.rollout_hooks, rollouts)
            # Set after the last await: batches generated concurrently (AsyncBatchSource)
            # read it right after next_batch returns.
            self.last_rollouts = rollouts
            with timed("credit"):
                batch = build_saw_batch(
                    rollouts,
                    credit_assigner=self.credit_assigner,
                    retokenize=self.retokenize,
                    chat_template=self.chat_template,
                    sample_filter=self.sample_filter,
                )
            if batch.items:
                batch.meta["attempts"] = attempt
                batch.meta[GENERATE_S] = time.perf_counter() - started  # every attempt
                batch.meta[GENERATED] += empty_generated
                batch.meta[ABORTED] += empty_aborted
                batch.meta[DROPPED_FILTER] += empty_generated - empty_aborted
                return batch
            last_meta = batch.meta
            empty_generated += batch.meta[GENERATED]
            empty_aborted += batch.meta[ABORTED]
        raise EmptyBatchError(
            f"RolloutBatchSource: {self.max_empty_batches} consecutive batches had no training "
            f"items (last: {last_meta.get('num_rollouts')} rollouts, "
            f"{last_meta.get('num_items_filtered')} items dropped by sample_filter); loosen "
            "sample_filter, check that completions are non-empty, or raise max_empty_batches"
        )
