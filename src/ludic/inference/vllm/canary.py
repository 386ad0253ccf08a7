"""The canary of a weight sync: a fixed token sequence scored by the server and by the
trainer after the sync; their logprobs (a reward model: its score) must agree.

Checksums (``ludic.distributed.weight_transfer.verify``) prove every value arrived and was
loaded, not where it went (a transposed tensor, a fused layer in the wrong order, another
adapter); the canary sees the model the server runs. :class:`ModelCanary`: ``prompt_logprobs``
of ``POST /v1/completions`` against the trainer's forward; :class:`RewardCanary`: a reward
server's raw ``POST /score`` against the trainer's model. Tolerance by the lower precision
(:data:`TOLERANCE`); a change smaller than that (one small step) is left to the checksums.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ludic.distributed.weight_transfer.verify import SyncVerificationError

CANARY_LENGTH = 24
TOLERANCE: dict[str, float] = {"float64": 1e-3, "float32": 1e-3, "float16": 0.05, "bfloat16": 0.2}
"""Largest accepted |server logprob - trainer logprob| of one canary token, by dtype."""


def canary_ids(vocab_size: int, length: int = CANARY_LENGTH) -> list[int]:
    """A fixed pseudo-random token sequence (the same on every run) inside the vocabulary."""
    generator = torch.Generator().manual_seed(20261126)
    high = max(2, min(vocab_size, 32000))
    return torch.randint(0, high, (length,), generator=generator).tolist()


class Canary(Protocol):
    """What a weight-sync session checks after a sync (``WeightSyncSession.run_canary``)."""

    ids: list[int]
    """The fixed token ids both sides score."""
    what: str
    """What a value is, for errors: ``"logprob"`` or ``"score"``."""

    @property
    def dtype(self) -> str: ...

    def trained(self) -> list[float]:
        """The trainer's values."""
        ...

    def served(self, control: Any) -> list[float]:
        """The server's values (``control``: its ``VLLMControlPlane``)."""
        ...


class ModelCanary:
    """The trainer's side of the canary: its fixed token ids (inside ``model``'s
    vocabulary) and ``model``'s logprob of each one after the first, computed under
    ``torch.no_grad`` in eval mode (dropout off), softmax in float32."""

    def __init__(self, model: torch.nn.Module, length: int = CANARY_LENGTH) -> None:
        self.model = model
        config = getattr(model, "config", None)
        vocab = getattr(config, "vocab_size", None) or model.get_output_embeddings().weight.shape[0]
        self.ids = canary_ids(int(vocab), length)
        self.what = "logprob"

    @property
    def dtype(self) -> str:
        return _dtype(self.model)

    def trained(self) -> list[float]:
        return self.logprobs()

    def served(self, control: Any) -> list[float]:
        return server_canary(control, self.ids)

    def logprobs(self) -> list[float]:
        ids = self.ids
        logits = _forward(self.model, ids)[0, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1)
        index = torch.tensor(ids[1:], device=logits.device)[:, None]
        return logp.gather(-1, index)[:, 0].tolist()


class RewardCanary:
    """The canary of a reward model (a sequence classifier, ``logits[:, 0]`` its score):
    the trainer's raw score of the fixed ids against the server's ``POST /score`` of them
    (``normalize: false``)."""

    def __init__(self, model: torch.nn.Module, length: int = CANARY_LENGTH) -> None:
        self.model = model
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if vocab is None:
            vocab = model.get_input_embeddings().weight.shape[0]
        self.ids = canary_ids(int(vocab), length)
        self.what = "score"

    @property
    def dtype(self) -> str:
        return _dtype(self.model)

    def trained(self) -> list[float]:
        return [float(_forward(self.model, self.ids)[0, 0])]

    def served(self, control: Any) -> list[float]:
        reply = control.post("/score", {"input": [list(self.ids)], "normalize": False})
        data = reply.get("data") or []
        if len(data) != 1 or "score" not in data[0]:
            raise SyncVerificationError(
                f"{control.policy.base_url}/score returned no score for the canary; the "
                "server must be a ludic vLLM reward server"
            )
        return [float(data[0]["score"])]


def _dtype(model: torch.nn.Module) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def _forward(model: torch.nn.Module, ids: Sequence[int]) -> torch.Tensor:
    """``model(ids).logits`` under ``torch.no_grad`` in eval mode (dropout off)."""
    device = next(model.parameters()).device
    was_training = model.training
    threads = torch.get_num_threads()
    model.eval()
    try:
        if device.type == "cpu":
            # a few dozen tokens: one thread, so that a busy server sharing the cores
            # (vLLM's CPU workers spin after each request) cannot stall the others
            torch.set_num_threads(1)
        with torch.no_grad():
            return model(torch.tensor([list(ids)], device=device)).logits
    finally:
        torch.set_num_threads(threads)
        model.train(was_training)


def server_canary(control: Any, ids: Sequence[int], model: str | None = None) -> list[float]:
    """The server's logprob of each canary token after the first (``prompt_logprobs``)."""
    body: dict[str, Any] = {
        "prompt": list(ids),
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 0,
    }
    if model is not None:
        body["model"] = model
    reply = control.post("/v1/completions", body)
    rows = reply["choices"][0].get("prompt_logprobs")
    if not rows or len(rows) != len(ids):
        raise SyncVerificationError(
            f"{control.policy.base_url}/v1/completions returned no prompt_logprobs for the "
            "canary; the server must be a ludic vLLM policy server"
        )
    out = []
    for token, row in zip(ids[1:], rows[1:]):
        entry = row.get(str(token)) if row else None
        if entry is None:
            raise SyncVerificationError(
                f"{control.policy.base_url}: the canary's prompt_logprobs lack token {token}"
            )
        out.append(float(entry["logprob"]))
    return out


def check_canary(
    served: Sequence[float],
    trained: Sequence[float],
    ids: Sequence[int],
    *,
    dtypes: Sequence[str],
    server: str,
    version: int | None,
    what: str = "logprob",
) -> float:
    """Raise :class:`SyncVerificationError` naming the first value (a token's logprob, or
    the score) that differs by more than the tolerance of the least precise of ``dtypes``;
    returns the largest difference."""
    tol = max(TOLERANCE.get(d, TOLERANCE["bfloat16"]) for d in dtypes)
    worst = 0.0
    for i, (a, b) in enumerate(zip(served, trained)):
        diff = abs(a - b)
        worst = max(worst, diff)
        if diff > tol:
            which = (
                f"the canary's token {i + 1} (id {ids[i + 1]}) has logprob"
                if what == "logprob"
                else f"the canary's {len(ids)} tokens have {what}"
            )
            raise SyncVerificationError(
                f"server {server}, version {version}: {which} {a:.6f} on the server and "
                f"{b:.6f} in the trainer (|diff| {diff:.3g} > {tol:g} for "
                f"{'/'.join(dtypes)}): the server does not run the trainer's weights"
            )
    return worst
