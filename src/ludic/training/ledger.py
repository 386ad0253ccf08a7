"""The token ledger: where every generated completion token went, cumulative over a run::

    generated = trained + dropped_stale + dropped_filter + dropped_reward + aborted + in_flight

(each term: docs/async.md). A batch source writes what it generated for each batch in
``batch.meta`` (:data:`SOURCE_KEYS`: generated, and of it aborted and dropped by the source);
the Trainer accounts for the rest and checks the identity after every step
(:meth:`TokenLedger.check`: a :class:`LedgerError` naming the difference). A source that
generates ahead (``AsyncBatchSource``) reports its totals through ``types.LedgerSource``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = [
    "ABORTED",
    "DROPPED_FILTER",
    "DROPPED_STALE",
    "GENERATED",
    "GENERATE_S",
    "SOURCE_KEYS",
    "LedgerError",
    "TokenLedger",
    "batch_tokens",
]

GENERATED = "ledger_generated"
"""``batch.meta`` key: completion tokens sampled to make this batch (every attempt)."""
ABORTED = "ledger_aborted"
"""``batch.meta`` key: of those, thrown away by restarts before the batch was made."""
DROPPED_FILTER = "ledger_dropped_filter"
"""``batch.meta`` key: of those, in items the source's filter dropped or turns with no item."""
DROPPED_STALE = "ledger_dropped_stale"
"""``batch.meta`` key: of those, in items the source dropped as stale (a pipeline learner's)."""
SOURCE_KEYS = (GENERATED, ABORTED, DROPPED_FILTER, DROPPED_STALE)
GENERATE_S = "generate_s"
"""``batch.meta`` key: seconds its rollouts took to generate, every attempt (the Trainer
logs it as ``time/generate_s`` beside its own wait, train and sync times)."""


class LedgerError(RuntimeError):
    """The token ledger does not close: tokens were lost or counted twice."""


def batch_tokens(meta: Mapping[str, Any]) -> dict[str, int] | None:
    """What a source wrote in ``meta`` (:data:`SOURCE_KEYS` -> tokens), or ``None``."""
    if GENERATED not in meta:
        return None
    return {key: int(meta.get(key, 0)) for key in SOURCE_KEYS}


@dataclass
class TokenLedger:
    """Cumulative token counts (see the module docstring)."""

    generated: int = 0
    trained: int = 0
    dropped_stale: int = 0
    dropped_filter: int = 0
    dropped_reward: int = 0
    aborted: int = 0
    in_flight: int = 0

    def add_source_part(self, tokens: Mapping[str, int]) -> None:
        """What a source says it threw away of a batch it handed out (:func:`batch_tokens`)."""
        self.aborted += tokens[ABORTED]
        self.dropped_filter += tokens[DROPPED_FILTER]
        self.dropped_stale += tokens[DROPPED_STALE]

    def accounted(self) -> int:
        """Everything but ``generated``: what the identity sums."""
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "generated")

    def check(self, step: int) -> None:
        """Raise :class:`LedgerError` unless ``generated`` equals the sum of the rest."""
        difference = self.generated - self.accounted()
        if difference:
            raise LedgerError(
                f"step {step}: the token ledger does not close: generated {self.generated} "
                f"!= {self.accounted()} accounted for ({self.metrics()}); "
                f"{abs(difference)} tokens {'unaccounted for' if difference > 0 else 'too many'}"
            )

    def metrics(self) -> dict[str, float]:
        return {f"tokens/{name}": float(value) for name, value in asdict(self).items()}

    def state(self) -> dict[str, int]:
        """For a checkpoint."""
        return asdict(self)

    def settle(self) -> None:
        """The end of training: what is still in flight was made and will never be
        trained on, so it counts as aborted."""
        self.aborted += self.in_flight
        self.in_flight = 0

    @classmethod
    def resumed(cls, state: Mapping[str, int] | None, *, in_flight_kept: bool) -> TokenLedger:
        """The ledger of a checkpoint, as a resume continues it. ``in_flight_kept``: what
        was in flight then is still there (in a durable queue, counted again by its
        source); otherwise it died with the process that made it and counts as aborted."""
        if not state:
            return cls()
        ledger = cls(**{f.name: int(state.get(f.name, 0)) for f in fields(cls)})
        if not in_flight_kept:
            ledger.settle()
        return ledger
