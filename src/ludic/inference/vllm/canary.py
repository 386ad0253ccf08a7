"""The canary of a weight sync: a fixed token sequence scored by the server and by the
trainer after the sync; their logprobs must agree.

The checksums (``ludic.distributed.weight_transfer.verify``) prove every value arrived and
was loaded; they cannot see where a value went (a transposed or permuted tensor, a fused
layer assembled in the wrong order, requests served by another adapter). The canary sees
the model the server actually runs: ``POST /v1/completions`` with the canary's token ids as
the prompt and ``prompt_logprobs``, against the trainer's own forward pass of the same ids.

Tolerance, by the lower of the two precisions (:data:`TOLERANCE`): the largest difference
of one token's logprob. float32 servers on CPU match transformers to ~1e-5; bfloat16
kernels differ from the trainer's by a few hundredths. A sync that failed outright moves
logprobs by far more; one optimizer step of a small learning rate may move them by less,
which is what the checksums are for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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


class ModelCanary:
    """The trainer's side of the canary: its fixed token ids (inside ``model``'s
    vocabulary) and ``model``'s logprob of each one after the first, computed under
    ``torch.no_grad`` in eval mode (dropout off), softmax in float32."""

    def __init__(self, model: torch.nn.Module, length: int = CANARY_LENGTH) -> None:
        self.model = model
        config = getattr(model, "config", None)
        vocab = getattr(config, "vocab_size", None) or model.get_output_embeddings().weight.shape[0]
        self.ids = canary_ids(int(vocab), length)

    @property
    def dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def logprobs(self) -> list[float]:
        model, ids = self.model, self.ids
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
                logits = model(torch.tensor([ids], device=device)).logits[0, :-1]
        finally:
            torch.set_num_threads(threads)
            model.train(was_training)
        logp = torch.log_softmax(logits.float(), dim=-1)
        return logp.gather(-1, torch.tensor(ids[1:], device=device)[:, None])[:, 0].tolist()


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
) -> float:
    """Raise :class:`SyncVerificationError` naming the first token whose logprobs differ by
    more than the tolerance of the least precise of ``dtypes``; returns the largest
    difference."""
    tol = max(TOLERANCE.get(d, TOLERANCE["bfloat16"]) for d in dtypes)
    worst = 0.0
    for i, (a, b) in enumerate(zip(served, trained)):
        diff = abs(a - b)
        worst = max(worst, diff)
        if diff > tol:
            raise SyncVerificationError(
                f"server {server}, version {version}: the canary's token {i + 1} (id "
                f"{ids[i + 1]}) has logprob {a:.6f} on the server and {b:.6f} in the "
                f"trainer (|diff| {diff:.3g} > {tol:g} for {'/'.join(dtypes)}): the server "
                "does not run the trainer's weights"
            )
    return worst
