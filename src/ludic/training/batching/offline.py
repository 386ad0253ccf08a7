"""Offline batches (SFT, offline RL) from rollouts stored as JSONL.

The JSONL format is one ``rollout_to_dict`` object per line: what ``RolloutEngine``
writes with ``jsonl_path`` and what :func:`write_rollouts_jsonl` writes. SFT is offline
RL with ``ConstantCredit(1.0)``: the REINFORCE loss then is the NLL of the action tokens.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ludic.inference.chat_template import ChatTemplate
from ludic.jsonl import iter_jsonl
from ludic.training.batching.saw import SampleFilter, build_saw_batch, check_retokenize_args
from ludic.training.types import CreditAssigner, DataExhausted, SAWBatch, SAWItem
from ludic.types import Rollout, rollout_from_dict, rollout_to_dict

RolloutFilter = Callable[[Rollout], bool]
"""Keeps a rollout when it returns ``True``."""


def write_rollouts_jsonl(
    rollouts: Iterable[Rollout], path: str | Path, *, append: bool = False
) -> Path:
    """Write ``rollouts`` one JSON object per line (``rollout_to_dict``). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a" if append else "w", encoding="utf-8") as f:
        for r in rollouts:
            f.write(json.dumps(rollout_to_dict(r), ensure_ascii=False, default=str) + "\n")
    return path


def read_rollouts_jsonl(path: str | Path) -> list[Rollout]:
    """Read rollouts written by :func:`write_rollouts_jsonl`; blank lines are skipped.

    A malformed line raises ``ValueError`` naming ``file:line``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"rollout file {str(path)!r} does not exist")
    rollouts: list[Rollout] = []
    for lineno, data in iter_jsonl(path):  # a line that is not JSON: JSONLError, file:line
        try:
            rollouts.append(rollout_from_dict(data))
        except (ValueError, TypeError, AttributeError) as e:
            raise ValueError(
                f"{path}:{lineno}: not a rollout ({type(e).__name__}: {e}); each line must "
                "be one rollout_to_dict object (see write_rollouts_jsonl)"
            ) from e
    return rollouts


class OfflineBatchSource:
    """Batches of ``SAWItem``s from stored rollouts, reshuffled every epoch.

    Rollouts are loaded, filtered with ``rollout_filter``, credit-assigned together (so
    group-based assigners see whole groups), converted to items and filtered with
    ``sample_filter`` at construction. Each epoch serves every item once in batches of
    ``batch_size`` (the last batch may be smaller unless ``drop_last``); the order is
    ``random.Random(f"{seed}:{epoch}")``, so it is the same on every run.

    ``epochs=None`` cycles forever; otherwise ``next_batch`` raises :class:`DataExhausted`
    after the last epoch (and ``async for`` stops).
    """

    def __init__(
        self,
        path_or_paths: str | Path | Sequence[str | Path],
        *,
        credit_assigner: CreditAssigner,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        retokenize: bool = False,
        chat_template: ChatTemplate | None = None,
        rollout_filter: RolloutFilter | None = None,
        sample_filter: SampleFilter | None = None,
        epochs: int | None = None,
        drop_last: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"OfflineBatchSource: batch_size must be >= 1, got {batch_size}")
        if epochs is not None and epochs < 1:
            raise ValueError(f"OfflineBatchSource: epochs must be >= 1 or None, got {epochs}")
        check_retokenize_args("OfflineBatchSource", retokenize, chat_template)
        paths = (
            [Path(path_or_paths)]
            if isinstance(path_or_paths, str | Path)
            else [Path(p) for p in path_or_paths]
        )
        if not paths:
            raise ValueError("OfflineBatchSource: no rollout files given")
        self.paths = paths
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epochs = epochs
        self.drop_last = drop_last
        self.rollouts = self._read_rollouts(rollout_filter)
        converted = build_saw_batch(
            self.rollouts,
            credit_assigner=credit_assigner,
            retokenize=retokenize,
            chat_template=chat_template,
            sample_filter=sample_filter,
        )
        self.items: list[SAWItem] = converted.items
        self._check_items(converted.meta)
        self.epoch = 0
        self._batch_index = 0
        self._start_epoch()

    def _read_rollouts(self, rollout_filter: RolloutFilter | None) -> list[Rollout]:
        """Every rollout of ``self.paths`` that ``rollout_filter`` keeps (at least one)."""
        loaded = [r for p in self.paths for r in read_rollouts_jsonl(p)]
        if not loaded:
            raise ValueError(f"OfflineBatchSource: no rollouts in {[str(p) for p in self.paths]}")
        kept = loaded if rollout_filter is None else [r for r in loaded if rollout_filter(r)]
        if not kept:
            raise ValueError(
                f"OfflineBatchSource: rollout_filter kept 0 of {len(loaded)} rollouts from "
                f"{[str(p) for p in self.paths]}; loosen the filter"
            )
        return kept

    def _check_items(self, meta: dict[str, Any]) -> None:
        """Raise when no item is left, or too few for one batch under ``drop_last``."""
        if not self.items:
            before = meta["num_items"] + meta["num_items_filtered"]
            raise ValueError(
                f"OfflineBatchSource: 0 training items left from {len(self.rollouts)} rollouts "
                f"({before} before sample_filter); loosen the filters or check the data"
            )
        if self.drop_last and len(self.items) < self.batch_size:
            raise ValueError(
                f"OfflineBatchSource: drop_last=True with batch_size={self.batch_size} but only "
                f"{len(self.items)} items; lower batch_size or set drop_last=False"
            )

    @property
    def batches_per_epoch(self) -> int:
        n = len(self.items)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _start_epoch(self) -> None:
        self._order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(f"{self.seed}:{self.epoch}").shuffle(self._order)
        self._pos = 0

    def _epoch_done(self) -> bool:
        left = len(self._order) - self._pos
        return left == 0 or (self.drop_last and left < self.batch_size)

    def skip(self, num_batches: int) -> None:
        """Advance past ``num_batches`` batches without building them, exactly as that many
        :meth:`next_batch` calls would (the order is a function of seed and epoch), so a
        resumed run continues with the batch an uninterrupted one would see next."""
        if num_batches < 0:
            raise ValueError(
                f"OfflineBatchSource.skip: num_batches must be >= 0, got {num_batches}"
            )
        for _ in range(num_batches):
            self._advance()

    def _advance(self) -> list[int]:
        if self._epoch_done():
            if self.epochs is not None and self.epoch + 1 >= self.epochs:
                raise DataExhausted(
                    f"OfflineBatchSource: all {self.epochs} epoch(s) served "
                    f"({self._batch_index} batches); set epochs=None to cycle forever"
                )
            self.epoch += 1
            self._start_epoch()
        idx = self._order[self._pos : self._pos + self.batch_size]
        self._pos += len(idx)
        self._batch_index += 1
        return idx

    async def next_batch(self) -> SAWBatch:
        items = [self.items[i] for i in self._advance()]
        meta: dict[str, Any] = {
            "source": "offline",
            "epoch": self.epoch,
            "batch_index": self._batch_index - 1,
            "num_items": len(items),
            "num_action_tokens": sum(it.num_action_tokens for it in items),
            "reward_mean": sum(float(it.meta.get("reward", 0.0)) for it in items) / len(items),
        }
        return SAWBatch(items=items, meta=meta)

    def __aiter__(self) -> OfflineBatchSource:
        return self

    async def __anext__(self) -> SAWBatch:
        try:
            return await self.next_batch()
        except DataExhausted:
            raise StopAsyncIteration from None
