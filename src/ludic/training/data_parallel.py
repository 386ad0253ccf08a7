"""Data-parallel training over torch.distributed ranks, the policy sharded with FSDP2.

One trainer process per rank (``torchrun``, or ``ludic train`` with ``trainer.world_size``), each
building the same ``Trainer`` with ``ranks=TrainerRanks.current()``. Rank 0 owns the batch
source, loggers and publisher and broadcasts each step's batch in the wire format
(:class:`BatchChannel`); :func:`split_items` deals the items; each rank's loss uses the whole
mini-batch's normalizers and FSDP2 sums the gradients; a rank with fewer micro-batches runs
padding ones (loss x 0). :func:`shard_policy` shards; rank 0 publishes :func:`gathered` weights.
Checkpoints are :mod:`ludic.training.checkpoint`'s; a reference model is not sharded (full copies).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ludic.distributed.weight_transfer.extractor import is_dtensor
from ludic.training.batching.wire import Producer, decode_batch, encode_batch
from ludic.training.collate import CollatedBatch
from ludic.training.token_scores import ScoringOptions, score_tokens, split_causal_lm
from ludic.training.types import DataExhausted, SAWBatch, SAWItem

__all__ = [
    "BatchChannel",
    "RemoteStepError",
    "ShardedScorer",
    "TrainerRanks",
    "shard_policy",
    "gathered",
    "split_items",
]


class RemoteStepError(RuntimeError):
    """Rank 0 could not produce the step's batch; the other ranks stop with this."""


@dataclasses.dataclass(frozen=True)
class TrainerRanks:
    """This process's place in the trainer group (torch.distributed's default group)."""

    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"TrainerRanks: rank {self.rank} of world size {self.world_size}")

    @property
    def is_main(self) -> bool:
        """Rank 0: the batch source, the loggers, the publisher and the checkpoint files."""
        return self.rank == 0

    @classmethod
    def current(cls) -> TrainerRanks:
        """The default process group's rank and size (raises when none is initialised:
        call ``torch.distributed.init_process_group`` first, or run under ``torchrun``)."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TrainerRanks.current(): torch.distributed is not initialised; call "
                "torch.distributed.init_process_group() (torchrun sets RANK / WORLD_SIZE) "
                "before building the Trainer"
            )
        return cls(dist.get_rank(), dist.get_world_size())

    @classmethod
    def from_env(cls) -> TrainerRanks | None:
        """From torchrun's ``RANK`` / ``WORLD_SIZE``; ``None`` outside torchrun."""
        if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
            return None
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


class ShardedScorer(torch.nn.Module):
    """The policy wrapped as FSDP2's root unit, whose forward is
    :func:`~ludic.training.token_scores.score_tokens`: the parameters outside the decoder
    layers (embeddings, final norm, output head) are gathered around the whole scoring,
    so chunked logprobs (which read the head's weight directly) and their backward see
    full tensors. Returns ``(logprobs, entropy, tokens_run)``."""

    def __init__(self, policy: torch.nn.Module, options: ScoringOptions) -> None:
        super().__init__()
        self.policy = policy
        self.options = options
        self.parts = split_causal_lm(policy) if options.logprobs == "chunked" else None

    def forward(
        self, mb: CollatedBatch, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        scores = score_tokens(
            self.policy, mb, self.options, with_entropy=with_entropy, parts=self.parts
        )
        return scores.logprobs, scores.entropy, scores.tokens_run


def shard_policy(
    model: torch.nn.Module, options: ScoringOptions, device_type: str = "cpu"
) -> ShardedScorer:
    """Shard ``model`` over the default group with FSDP2 (``fully_shard``): each decoder
    layer is its own unit (gathered for its forward, freed after), and a
    :class:`ShardedScorer` around the policy is the root unit (everything else). Gradients
    are *summed* over ranks, not averaged: each rank's loss is its share of the global
    loss. ``model`` is sharded in place (its parameters become ``DTensor`` s); a model
    sharded before keeps its units (its scorer takes the new ``options``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    existing = _SCORERS.get(model)
    if existing is not None:  # sharded by an earlier trainer (e.g. the warm start's)
        existing.options = options
        existing.parts = split_causal_lm(model) if options.logprobs == "chunked" else None
        return existing
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    scorer = ShardedScorer(model, options)
    fully_shard(scorer, mesh=mesh)
    for unit in [scorer, *decoder_layers(model)]:
        unit.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        # A plain SUM (gloo has no PREMUL_SUM, which a factor would otherwise use).
        unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    _SCORERS[model] = scorer
    return scorer


_SCORERS: weakref.WeakKeyDictionary[torch.nn.Module, ShardedScorer] = weakref.WeakKeyDictionary()
"""The root unit of each sharded policy: a later Trainer on the same policy reuses it."""


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of an HF causal LM (``model.layers`` of its decoder, a peft
    model looked through); raises for a model whose blocks it cannot find."""
    for path in ("model.layers", "base_model.model.model.layers", "layers"):
        holder: Any = model
        for attr in path.split("."):
            holder = getattr(holder, attr, None)
        if isinstance(holder, torch.nn.ModuleList) and len(holder) > 0:
            return list(holder)
    raise ValueError(
        f"shard_policy: cannot find the decoder layers of {type(model).__name__} (expected "
        "model.model.layers, as Hugging Face causal LMs have)"
    )


def split_items(items: Sequence[SAWItem], world_size: int) -> list[list[int]]:
    """Indices of ``items`` per rank: longest first, dealt in a snake (0, 1, ..., W-1,
    W-1, ..., 0, ...), so the ranks' token counts differ by less than one long item.
    Deterministic: every rank computes the same split."""
    order = sorted(range(len(items)), key=lambda i: (-items[i].num_tokens, i))
    out: list[list[int]] = [[] for _ in range(world_size)]
    for k, index in enumerate(order):
        lap, pos = divmod(k, world_size)
        out[pos if lap % 2 == 0 else world_size - 1 - pos].append(index)
    return [sorted(indices) for indices in out]


# ------------------------------------------------------------------------ batch channel
_BATCH, _EXHAUSTED, _FAILED = 0, 1, 2  # message kinds: 8 bytes, then the payload


class BatchChannel:
    """Rank 0 broadcasts each step's batch (or the reason there is none) to the other
    ranks over the default group. Payloads: :func:`~ludic.training.batching.wire.encode_batch`
    (a batch) or UTF-8 JSON (an error); nothing is unpickled."""

    def __init__(self, ranks: TrainerRanks) -> None:
        self.ranks = ranks

    def send(self, batch: SAWBatch) -> None:
        self.send_payload(self.encode(batch))

    @staticmethod
    def encode(batch: SAWBatch) -> bytes:
        """``batch`` in the wire format (raises ``WireFormatError`` on what it refuses)."""
        return encode_batch(batch, Producer(batch_id="step", actor_id="rank0", batch_index=0))

    def send_payload(self, payload: bytes) -> None:
        """A batch :meth:`encode` made."""
        self._broadcast(_BATCH, payload)

    def send_end(self, error: BaseException) -> None:
        """Tell the other ranks the step has no batch: the source ran out
        (``DataExhausted``) or failed (``error``)."""
        kind = _EXHAUSTED if isinstance(error, DataExhausted) else _FAILED
        text = json.dumps({"type": type(error).__name__, "message": str(error)})
        self._broadcast(kind, text.encode("utf-8"))

    def receive(self) -> SAWBatch:
        """The batch rank 0 sent; raises ``DataExhausted`` or :class:`RemoteStepError`
        when it sent an end instead."""
        kind, payload = self._broadcast(None, b"")
        if kind == _BATCH:
            return decode_batch(payload).batch
        error = json.loads(payload.decode("utf-8"))
        if kind == _EXHAUSTED:
            raise DataExhausted(error["message"])
        raise RemoteStepError(f"rank 0 stopped the step: {error['type']}: {error['message']}")

    def _broadcast(self, kind: int | None, payload: bytes) -> tuple[int, bytes]:
        data = struct.pack("<q", kind or 0) + payload if self.ranks.is_main else b""
        received = broadcast_bytes(data, self.ranks)
        return struct.unpack_from("<q", received)[0], received[8:]


def broadcast_bytes(data: bytes, ranks: TrainerRanks) -> bytes:
    """Rank 0's ``data`` on every rank (its length, then its bytes)."""
    import torch.distributed as dist

    size = torch.tensor([len(data) if ranks.is_main else 0], dtype=torch.int64)
    dist.broadcast(size, src=0)
    if not int(size.item()):
        return b""
    body = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if ranks.is_main
        else torch.empty(int(size.item()), dtype=torch.uint8)
    )
    dist.broadcast(body, src=0)
    return body.numpy().tobytes()


def broadcast_text(text: str | None, ranks: TrainerRanks) -> str:
    """Rank 0's ``text`` on every rank."""
    return broadcast_bytes((text or "").encode("utf-8"), ranks).decode("utf-8")


def gathered(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every ``DTensor`` gathered into a full tensor (a collective per
    tensor, in ``state``'s order: the other ranks call
    :func:`~ludic.distributed.weight_transfer.extractor.gather_full_tensors` on theirs)."""
    return {
        name: tensor.detach().full_tensor() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]
        for name, tensor in state.items()
    }


def all_reduce_sum(values: Sequence[float]) -> list[float]:
    """Element-wise sum of ``values`` over every rank (float64)."""
    import torch.distributed as dist

    tensor = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.tolist()


def broadcast_flag(flag: bool, ranks: TrainerRanks) -> bool:
    """Rank 0's ``flag`` on every rank."""
    import torch.distributed as dist

    tensor = torch.tensor([int(flag) if ranks.is_main else 0], dtype=torch.int64)
    dist.broadcast(tensor, src=0)
    return bool(tensor.item())
