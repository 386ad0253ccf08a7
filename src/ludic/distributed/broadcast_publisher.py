"""``PolicyPublisher`` s built on the weight-transfer layer.

* :class:`BroadcastPolicyPublisher`: extract -> send -> wait until the servers applied it.
  Works with any :class:`WeightTransferSender` (broadcast or CUDA IPC).
* :class:`Rank0OnlyPublisher`: for multi-rank trainers; rank 0 publishes, the other ranks
  only take part in gathering sharded (FSDP2) weights.

``Trainer`` calls ``publisher.publish(policy_state_dict(model), version=step)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from ludic.distributed.interfaces import PolicyPublisher
from ludic.distributed.weight_transfer.base import ControlPlane, WeightChunk, WeightTransferSender
from ludic.distributed.weight_transfer.deadlines import SyncProgress, stage_deadline
from ludic.distributed.weight_transfer.extractor import (
    ModelWeightExtractor,
    gather_full_tensors,
    is_dtensor,
)
from ludic.distributed.weight_transfer.verify import SentChecksums
from ludic.distributed.weights import check_finite


class BroadcastPolicyPublisher:
    """Publishes a state dict through ``sender`` and ``control``.

    Refuses NaN/inf weights before announcing anything (weights that must first be
    gathered from shards are checked chunk by chunk, as they are gathered). Raises if the
    transfer fails or the servers do not apply it within ``apply_timeout_s``.

    With ``record_checksums`` on, the checksums of every tensor sent are kept in
    ``last_sent`` (``ludic.distributed.weight_transfer.verify``) for the caller to verify
    the sync. ``progress`` says which stage the publish is in and how many bytes went out
    (``ludic.distributed.weight_transfer.deadlines``); the servers get
    ``apply_timeout_s`` plus the time the sync's bytes take at the floor rate to load
    them.
    """

    def __init__(
        self,
        sender: WeightTransferSender,
        control: ControlPlane,
        extractor: ModelWeightExtractor | None = None,
        *,
        apply_timeout_s: float = 120.0,
    ) -> None:
        self.sender = sender
        self.control = control
        self.extractor = extractor if extractor is not None else ModelWeightExtractor()
        self.apply_timeout_s = apply_timeout_s
        self.last_version: int | None = None
        self.record_checksums = False
        self.last_sent = SentChecksums()
        self.progress = SyncProgress()  # of the publish in progress, or the last one

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        check_finite({name: t for name, t in state_dict.items() if not is_dtensor(t)})
        total = sum(t.numel() * t.element_size() for t in state_dict.values())
        self.progress = progress = SyncProgress(version=version, bytes_total=total)
        start = getattr(self.sender, "bytes_moved", None)  # a broadcast sender counts them
        if start is not None:
            progress.moved = lambda: self.sender.bytes_moved - start
        chunks = self.extractor.extract_state_dict(state_dict)
        if any(is_dtensor(t) for t in state_dict.values()):
            chunks = _checked(chunks)
        self.last_sent = SentChecksums()
        chunks = _counted(chunks, progress, self.last_sent if self.record_checksums else None)
        progress.enter("broadcast")
        self.sender.send(chunks, self.control, version=version)
        progress.enter("load")
        # the servers load what they received: the deadline grows with the bytes sent
        self.control.wait_until_applied(stage_deadline(self.apply_timeout_s, total))
        self.last_version = version


class Rank0OnlyPublisher:
    """Publishes through ``inner`` on rank 0 only.

    Other ranks return at once, except that they take part in gathering ``DTensor``
    weights (FSDP2): rank 0's extraction gathers each sharded tensor with a collective that
    every rank must join, in the same order. If rank 0's publish fails part-way, the other
    ranks still run their gathers and then block in their next collective until the
    training group's timeout; the run fails either way.
    """

    def __init__(self, inner: PolicyPublisher, rank: int) -> None:
        self.inner = inner
        self.rank = rank

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        if self.rank == 0:
            self.inner.publish(state_dict, version)
        else:
            gather_full_tensors(state_dict)


def _counted(
    chunks: Iterator[WeightChunk], progress: SyncProgress, sent: SentChecksums | None
) -> Iterator[WeightChunk]:
    """The chunks, counted into ``progress`` (and their checksums recorded into ``sent``)
    as the sender takes them."""
    for chunk in chunks:
        if sent is not None:
            sent.record(chunk.names, chunk.tensors)
        yield chunk
        progress.bytes_handed += chunk.total_size_bytes


def _checked(chunks: Iterator[WeightChunk]) -> Iterator[WeightChunk]:
    for chunk in chunks:
        check_finite(dict(zip(chunk.names, chunk.tensors)))
        yield chunk
