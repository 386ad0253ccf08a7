"""An in-process ``RewardModelClient`` on a transformers one-label sequence classifier: the
embedded counterpart of a vLLM reward server (docs/design.md, "Reward models").

Inputs are scored in right-padded batches of at most ``max_batch_size`` rows, in eval mode
under ``torch.no_grad`` (the model's mode restored after); a score is the model's own pooled
logit ``s`` (HF pools at the last non-pad token), or ``sigmoid(s)`` with ``normalize``. The
forward runs in a worker thread so the event loop stays free; one lock serializes forwards
and weight syncs, so a request is never scored by half-copied weights.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ludic._async import on_compute_thread
from ludic.distributed.reward_weights import reward_sync_params
from ludic.inference.reward_client import (
    RewardModelClient,
    RewardModelTrainingMode,
    ScoringRequest,
    ScoringResponse,
)
from ludic.inference.transformers_client import _eval_mode


class TransformersRewardClient(RewardModelClient):
    """Scores texts (or token ids) with a local HF sequence-classification reward model.

    Args:
        model: a one-label sequence classifier whose ``config.pad_token_id`` is set (the
            padding id; HF needs it to pool a padded batch). Moved to ``device``.
        tokenizer: tokenizes string inputs (``add_special_tokens=True``, as HF and vLLM's
            pooling endpoints do by default); token-id inputs are scored as given.
        device: where the forward runs.
        max_batch_size: most sequences in one forward.
        model_name: the name a ``ScoringRequest.model`` may give (``None``: requests must
            leave ``model`` unset).
        model_version: the version reported until the first ``sync_weights``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        device: str | torch.device = "cpu",
        max_batch_size: int = 32,
        model_name: str | None = None,
        model_version: int = 0,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(
                f"TransformersRewardClient: max_batch_size must be >= 1, got {max_batch_size}"
            )
        config = getattr(model, "config", None)
        num_labels = getattr(config, "num_labels", None)
        if num_labels != 1:
            raise ValueError(
                f"TransformersRewardClient: the model has num_labels={num_labels!r}; a reward "
                "model is a sequence classifier with one label (config.num_labels = 1)"
            )
        pad = getattr(config, "pad_token_id", None)
        if pad is None:
            raise ValueError(
                "TransformersRewardClient: model.config.pad_token_id is None; HF sequence "
                "classifiers pool padded batches at the last non-pad token, so set "
                "model.config.pad_token_id = tokenizer.pad_token_id"
            )
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.tokenizer = tokenizer
        self.pad_token_id = int(pad)
        self.vocab_size = int(config.vocab_size)
        self.max_batch_size = max_batch_size
        self.model_name = model_name
        self.model_version = model_version
        self._lock = threading.Lock()

    # ---- RewardModelClient --------------------------------------------------------------
    async def score(self, request: ScoringRequest) -> tuple[ScoringResponse, dict[str, Any]]:
        """Score ``request.inputs``; ``info`` holds ``num_batches`` (forwards run)."""
        if request.pooling_type != "last":
            raise ValueError(
                f"TransformersRewardClient: ScoringRequest.pooling_type="
                f"{request.pooling_type!r}; the sequence classifier pools at the last token, "
                "use pooling_type='last'"
            )
        if request.model is not None and request.model != self.model_name:
            raise ValueError(
                f"TransformersRewardClient: ScoringRequest.model={request.model!r} but this "
                f"client serves model_name={self.model_name!r}"
            )
        rows = [self._token_ids(i, x) for i, x in enumerate(request.inputs)]
        scores, version, num_batches = await on_compute_thread(
            self._score_rows, rows, request.normalize
        )
        return ScoringResponse(scores=scores, model_version=version), {"num_batches": num_batches}

    def sync_weights(
        self,
        params: Mapping[str, torch.Tensor],
        *,
        version: int | None = None,
        training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
        timeout_s: float | None = None,
    ) -> str:
        """Copy ``params`` into the model in place.

        ``params`` are first normalized and checked for ``training_mode`` by
        :func:`~ludic.distributed.reward_weights.reward_sync_params`; then every name
        must be a model tensor of the same shape. Any failure raises before a single
        tensor is copied. ``version``: the new version (``None``: current + 1).
        ``timeout_s``: how long to wait for a running forward to release the model
        (``None``: no limit); ``TimeoutError`` past it, nothing changed.
        """
        mode = RewardModelTrainingMode.parse(training_mode)
        tensors = reward_sync_params(params, mode)
        own = self.model.state_dict(keep_vars=True)
        unknown = sorted(n for n in tensors if n not in own)
        if unknown:
            raise KeyError(
                f"TransformersRewardClient.sync_weights: {len(unknown)} name(s) not in the "
                f"served model, such as {unknown[:3]}; the model has e.g. {sorted(own)[:3]}"
            )
        for name, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"TransformersRewardClient.sync_weights: {name} is a "
                    f"{type(tensor).__name__}, not a torch.Tensor"
                )
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(
                    f"TransformersRewardClient.sync_weights: {name} has shape "
                    f"{tuple(tensor.shape)}, the served model expects {tuple(own[name].shape)}"
                )
        if not self._lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise TimeoutError(
                f"TransformersRewardClient.sync_weights: the model stayed busy for "
                f"timeout_s={timeout_s}; nothing was changed"
            )
        try:
            with torch.no_grad():
                for name, tensor in tensors.items():
                    own[name].copy_(tensor.to(own[name].device, own[name].dtype))
            self.model_version = self.model_version + 1 if version is None else version
            new_version = self.model_version
        finally:
            self._lock.release()
        return f"synced {len(tensors)} tensors ({mode.name}) as version {new_version}"

    async def get_model_version(self) -> int:
        """The version of the weights now served."""
        return self.model_version

    # ---- scoring ----------------------------------------------------------------------------
    def _token_ids(self, index: int, x: str | Sequence[int]) -> list[int]:
        """Input ``index`` as token ids, checked: non-empty, in the vocabulary, and not
        ending with the pad id (HF would pool at an earlier token)."""
        where = f"TransformersRewardClient: input {index}"
        if isinstance(x, str):
            ids = list(self.tokenizer(x, add_special_tokens=True)["input_ids"])
            if not ids:
                raise ValueError(f"{where} tokenizes to no tokens; nothing to score")
        else:
            ids = [int(t) for t in x]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"{where}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
                )
        if ids[-1] == self.pad_token_id:
            raise ValueError(
                f"{where} ends with the pad token id {self.pad_token_id}; HF sequence "
                "classifiers pool at the last non-pad token, so it would not be scored as "
                "given; remove the trailing pad token"
            )
        return ids

    def _score_rows(self, rows: list[list[int]], normalize: bool) -> tuple[list[float], int, int]:
        """Scores of ``rows`` (all under one lock, so one weight version), that version,
        and the number of forwards."""
        scores: list[float] = []
        with self._lock, torch.no_grad(), _eval_mode(self.model):
            version = self.model_version
            starts = range(0, len(rows), self.max_batch_size)
            for start in starts:
                scores.extend(self._forward(rows[start : start + self.max_batch_size]))
        if normalize:
            scores = torch.sigmoid(torch.tensor(scores, dtype=torch.float64)).tolist()
        return scores, version, len(starts)

    def _forward(self, rows: list[list[int]]) -> list[float]:
        """Raw pooled logits of ``rows`` in one right-padded forward."""
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # right padding: real tokens keep positions 0..len-1
            input_ids[i, : len(r)] = torch.tensor(r)
            attention[i, : len(r)] = 1
        out = self.model(
            input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device)
        )
        logits = out.logits.float().cpu()  # [B, 1]
        return logits[:, 0].tolist()
